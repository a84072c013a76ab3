"""Layout parsing, serialisation and validation (pure Python)."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelcarve.spec.catalog import get_model
from modelcarve.spec.errors import LayoutError
from modelcarve.spec.hardware import parse_cluster
from modelcarve.spec.layout import Layout

LLAMA8 = get_model("llama-3.1-8b")
KIMI = get_model("kimi-k2")


def test_parse_string_and_roundtrip_json():
    layout = Layout.parse("tp=8,pp=4,dp=2,zero=1,mbs=1,gbs=64,seq=4096,recompute=selective,sp")
    assert (layout.tp, layout.pp, layout.dp, layout.zero, layout.mbs, layout.sp) == (8, 4, 2, 1, 1, True)
    assert layout.num_microbatches == 32 and layout.world_size == 64
    assert Layout.parse(layout.to_json()) == layout
    assert Layout.from_dict(json.loads(layout.to_json())) == layout
    assert layout.short() == "TP8-SP-PP4-DP2-Z1"


def test_aliases_fsdp_hsdp_schedule():
    assert Layout.parse("dp=8,fsdp").zero == 3
    hsdp = Layout.parse("dp=8,hsdp=2")
    assert (hsdp.zero, hsdp.dp_shard, hsdp.shard_group) == (3, 4, 4)
    assert hsdp.short() == "DP8-HSDP2x4"
    inter = Layout.parse("pp=4,schedule=interleaved,virtual=2,gbs=8")
    assert inter.schedule == "interleaved-1f1b" and inter.virtual_stages == 2


def test_layout_file(tmp_path):
    path = tmp_path / "layout.json"
    path.write_text(Layout.parse("tp=2,pp=2").to_json())
    assert Layout.parse(str(path)) == Layout(tp=2, pp=2)
    # a plan's JSON entry ({"layout": {...}, ...}) is accepted as well
    path.write_text(json.dumps({"layout": {"tp": 2}, "fits": True}))
    assert Layout.parse(str(path)).tp == 2


@pytest.mark.parametrize(
    "text, message",
    [
        ("tp=2,tp=4", "given twice"),
        ("tq=2", "unknown layout field 'tq'"),
        ("tp=two", "not an integer"),
        ("tp=0", "at least 1"),
        ("zero=4", "not a ZeRO stage"),
        ("sp", "needs tp > 1"),
        ("schedule=zigzag", "schedule='zigzag' is not one of"),
        ("dp=3,gbs=10", "not a multiple of mbs x dp"),
        ("virtual=2", "needs schedule=interleaved-1f1b"),
        ("dp=4,hsdp=3", "do not divide dp=4"),
        ("tp", "is not key=value"),
        ("", "empty layout"),
        ("{bad json", "malformed"),
    ],
)
def test_bad_layout_strings(text, message):
    with pytest.raises(LayoutError, match=message):
        Layout.parse(text)


def test_validate_names_every_factor_that_disagrees():
    cluster = parse_cluster("8x8xH100")
    with pytest.raises(LayoutError) as err:
        Layout.parse("tp=3,dp=16").validate(LLAMA8, cluster)
    text = str(err.value)
    assert "tp=3 does not divide 32 attention heads; valid tp: 1, 2, 4, 8, 16, 32" in text
    assert "dp x cp x tp x pp = 16 x 1 x 3 x 1 = 48 but the cluster 8x8xH100 has 64 devices" in text
    Layout.parse("tp=8,pp=2,dp=4").validate(LLAMA8, cluster)


def test_validate_pipeline_and_context():
    with pytest.raises(LayoutError, match=r"64 stages but the model has 32 layers.*at most 34"):
        Layout.parse("pp=16,schedule=interleaved-1f1b,virtual=4,gbs=16").validate(LLAMA8, world_size=16)
    with pytest.raises(LayoutError, match=r"seq/cp = 12 tokens per rank divisible by tp=8"):
        Layout.parse("cp=2,tp=8,sp,seq=24").validate(LLAMA8, world_size=16)
    Layout.parse("cp=2,tp=4,sp,seq=24").validate(LLAMA8, world_size=8)
    with pytest.raises(LayoutError, match=r"multiple of 2 x cp = 8"):
        Layout.parse("cp=4,seq=1001").validate(LLAMA8, world_size=4)


def test_expert_parallel_folds_into_dp_times_cp():
    # EP adds no ranks: 384 experts over ep=32 ranks carved from dp x cp = 16 x 2 = 32.
    layout = Layout.parse("tp=8,dp=16,cp=2,ep=32")
    layout.validate(KIMI, world_size=256)
    assert layout.world_size == 256 and layout.expert_dp == 1
    assert Layout.parse("tp=8,dp=16,ep=8").expert_dp == 2
    # ep=32 > dp x cp = 16 folds over the tensor-parallel ranks (issue 14): etp defaults to 1
    folded = Layout.parse("tp=8,dp=16,ep=32")
    folded.validate(KIMI, world_size=128)
    assert (folded.expert_tp, folded.expert_dp, folded.folded) == (1, 4, True)
    with pytest.raises(LayoutError, match=r"etp x ep = 8 x 32 must divide tp x cp x dp = 128"):
        Layout.parse("tp=8,dp=16,ep=32,etp=8").validate(KIMI, world_size=128)
    with pytest.raises(LayoutError, match="does not divide 384 experts"):
        Layout.parse("dp=7,ep=7").validate(KIMI, world_size=7)
    with pytest.raises(LayoutError, match="has no experts"):
        Layout.parse("dp=2,ep=2").validate(LLAMA8, world_size=2)


_keys = st.sampled_from(
    ["tp", "pp", "dp", "cp", "ep", "zero", "mbs", "gbs", "seq", "schedule", "virtual", "recompute", "sp", "fsdp",
     "hsdp", "param_dtype", "kv_dtype", "weight_dtype", "bogus", "", "=", "tp=", "=2"]
)
_values = st.one_of(st.integers(-3, 70).map(str), st.sampled_from(["", "x", "1f1b", "bf16", "int4", "full", "1.5", "true"]))
_items = st.tuples(_keys, st.booleans(), _values).map(lambda t: f"{t[0]}={t[2]}" if t[1] else t[0])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.lists(_items, max_size=6).map(",".join), st.text(max_size=40)))
def test_any_string_parses_or_raises_layout_error(text):
    try:
        layout = Layout.parse(text)
    except LayoutError as err:
        assert str(err) and "\n" not in str(err)
    else:
        assert Layout.parse(layout.to_json()) == layout
        try:
            layout.validate(KIMI, world_size=layout.world_size)
        except LayoutError:
            pass


def test_moe_parallel_folding_and_precision_fields():
    # Megatron-Core's folded mesh: attention TP2 x DP16, experts EP32 x ETP1 over the same 32 ranks
    layout = Layout.parse("tp=2,dp=16,ep=32,etp=1")
    layout.validate(KIMI, world_size=32)
    assert (layout.expert_tp, layout.expert_dp) == (1, 1) and layout.short() == "TP2-DP16-EP32-ETP1"
    assert Layout.parse("tp=2,dp=4,ep=8").expert_tp == 1          # folded by default
    assert Layout.parse("tp=2,dp=8,ep=8").expert_tp == 2          # unfolded: expert TP = TP
    assert Layout.from_dict(layout.to_dict()) == layout
    fp8 = Layout.parse("precision=fp8-cs")
    assert (fp8.param_dtype, fp8.fp8_scaling) == ("fp8", "current")
    assert Layout.parse("param_dtype=mxfp8").short().endswith("MXFP8")
    assert Layout.parse("recompute=moe_act+core_attn").recompute == "core_attn+mlp_act"
    with pytest.raises(LayoutError, match="param_dtype=mxfp8 needs Blackwell"):
        Layout.parse("param_dtype=mxfp8").validate(LLAMA8, parse_cluster("H100"))
    with pytest.raises(LayoutError, match="'\\+'-joined list of modules"):
        Layout.parse("recompute=attn")


def test_redundant_experts_round_trip_and_label():
    # R=0: to_dict, JSON and the short label are what they were before the field existed.
    plain = Layout.parse("tp=1,dp=64,ep=64")
    assert "redundant_experts" not in plain.to_dict() and "redundant" not in plain.to_json()
    assert plain.short() == "DP64-EP64"
    eplb = Layout.parse("tp=1,dp=72,ep=72,redundant_experts=32")
    assert Layout.parse("dp=72,ep=72,eplb=32") == eplb == Layout.parse("dp=72,ep=72,num_redundant_experts=32")
    assert eplb.to_dict()["redundant_experts"] == 32 and eplb.short() == "DP72-EP72-EPLB32"
    assert Layout.parse(eplb.to_json()) == eplb and Layout.from_dict(json.loads(eplb.to_json())) == eplb
    assert (eplb.physical_experts(256), eplb.experts_per_rank(256)) == (288, 4)


def test_redundant_experts_let_ep_divide_experts_plus_replicas():
    deepseek = get_model("deepseek-v3")  # 256 routed experts
    Layout.parse("dp=72,ep=72,redundant_experts=32").validate(deepseek, world_size=72)  # 288 / 72 = 4
    with pytest.raises(LayoutError) as err:
        Layout.parse("dp=72,ep=72,redundant_experts=31").validate(deepseek, world_size=72)
    message = str(err.value)
    assert "\n" not in message
    assert "ep=72 does not divide 256 + 31 = 287 physical experts" in message
    assert "valid redundant_experts: 32, 104, 176, 248" in message
    with pytest.raises(LayoutError, match=r"does not divide 256 experts; .*redundant_experts=32 \(EPLB\)"):
        Layout.parse("dp=72,ep=72").validate(deepseek, world_size=72)
    with pytest.raises(LayoutError, match="needs expert parallelism"):
        Layout.parse("dp=8,redundant_experts=8")
    with pytest.raises(LayoutError, match=r"exceeds the model's 256 experts .*valid: 0..256"):
        Layout.parse("dp=64,ep=64,redundant_experts=320").validate(deepseek, world_size=64)
    with pytest.raises(LayoutError, match="must be 0"):
        Layout.parse("dp=8,ep=8,redundant_experts=-1")
