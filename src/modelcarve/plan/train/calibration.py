"""Published training runs the cost model is calibrated and checked against, as ready-to-estimate cases.

Usage::

    from modelcarve.plan.train.calibration import megatron_table1, moe_cases
    for case in megatron_table1():
        result = TrainCostModel(case.model, case.cluster, case.options).estimate(case.layout)
        result["time"]["tflops_per_device"], case.published_tflops

Data (package files under ``plan/data/``, each citing its source in its header):

* ``megatron_table1.csv``: the ten rows of Table 1 of Narayanan et al. 2021 (GPT 1.7B-1T on
  32-3072 A100-80GB), with the micro-batch size, virtual stages and DDP flavour of each row from
  the authors' run script. Reproduced as run: fp16, full recomputation, materialised attention
  with dropout (2021 Megatron had no flash attention), interleaved schedule where the script
  sets virtual stages, gradient all-reduce overlapped only with torch DDP, pipeline sends not
  overlapped (Megatron-Core's p2p overlap came later).
* ``moe_training.csv``: published MoE runs (Mixtral 8x7B on 64 H100, Megatron-Core), a held-out
  check: nothing is fitted to it.
* ``korthikanti2022.csv``: the 530B GPT on 2240 A100 with full recomputation (42.1% MFU) and with
  sequence parallelism + selective recomputation (54.2% MFU), Korthikanti et al. 2022; held out,
  with the layout details the abstract does not state taken from Table 1's 530B run (see file).
"""

from __future__ import annotations

import csv
import dataclasses
import io
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from modelcarve.plan.train.model import TrainOptions
from modelcarve.spec.catalog import get_model
from modelcarve.spec.errors import SpecError
from modelcarve.spec.hardware import ClusterSpec, get_device, parse_cluster
from modelcarve.spec.hf_config import spec_from_hf_config
from modelcarve.spec.errors import LayoutError
from modelcarve.spec.layout import Layout
from modelcarve.spec.model import ModelSpec


@dataclass(frozen=True, kw_only=True)
class Case:
    """One published run: what ran, where, how, and the throughput it reported."""

    name: str
    model: ModelSpec
    cluster: ClusterSpec
    layout: Layout
    options: TrainOptions
    published_tflops: float = 0.0
    """Published TFLOP/s per GPU (Narayanan et al. Eq. 3 counting for Table 1); 0 if not published."""
    published_mfu: float = 0.0
    """Published model FLOPs utilisation (no recomputation counted); 0 if not published."""
    published_tokens_per_device: float = 0.0
    """Published tokens/s per GPU; 0 if not published."""
    source: str
    unanswered: str = ""
    """Why the planner cannot answer this row (unknown model type, device...); empty if it can."""
    recompute_inferred: bool = False
    """Whether the layout's recomputation is the least that fits (``least_recompute``: the row's
    ``recompute`` column says 'infer') rather than what the recipe states."""
    unmodelled: tuple[str, ...] = ()
    """Recipe features the row states that the cost model does not price (the optional ``cuda_graph``,
    ``cutedsl_mlp`` and ``fp8_attention`` columns of ``data/training_published.csv``); notes only."""


def _rows(name: str) -> list[dict]:
    text = resources.files("modelcarve.plan").joinpath("data", name).read_text()
    return list(csv.DictReader(io.StringIO("\n".join(l for l in text.splitlines() if not l.startswith("#")))))


def megatron_gpt(hidden: int, layers: int, heads: int, name: str = "") -> ModelSpec:
    """The GPT of Narayanan et al. 2021: GELU MLP 4h, LayerNorm, learned positions, tied
    embeddings, vocab 51200, seq 2048."""
    config = {
        "model_type": "gpt2", "vocab_size": 51200, "n_embd": hidden, "n_layer": layers, "n_head": heads,
        "n_positions": 2048, "activation_function": "gelu", "tie_word_embeddings": True,
    }
    return spec_from_hf_config(config, name=name or f"megatron-gpt-h{hidden}-l{layers}",
                               source="Narayanan et al. 2021, Table 1")


def megatron_table1() -> list[Case]:
    """The ten rows of Table 1, each with its published layout."""
    cases = []
    for row in _rows("megatron_table1.csv"):
        tp, pp, gpus, v = int(row["tp"]), int(row["pp"]), int(row["gpus"]), int(row["virtual_stages"])
        model = megatron_gpt(int(row["hidden"]), int(row["layers"]), int(row["heads"]), name=f"gpt-{row['params_b']}b")
        layout = Layout(
            tp=tp, pp=pp, dp=gpus // (tp * pp), mbs=int(row["mbs"]), gbs=int(row["gbs"]), seq=2048,
            recompute="full", schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v,
            param_dtype="fp16",
        )
        options = TrainOptions(
            global_batch=int(row["gbs"]), seq=2048, attention="materialized", dropout=True,
            overlap_grad_reduce=row["ddp"] == "torch", overlap_param_gather=False, overlap_p2p=False,
        )
        cases.append(Case(
            name=f"GPT {row['params_b']}B", model=model, cluster=parse_cluster(f"{gpus // 8}x8xA100-80GB"),
            layout=layout, options=options, published_tflops=float(row["tflops_per_gpu"]),
            source="Narayanan et al. 2021, Table 1",
        ))
    return cases


def moe_cases() -> list[Case]:
    """Published MoE training runs with their layouts (held-out checks)."""
    cases = []
    for row in _rows("moe_training.csv"):
        layout = Layout(
            tp=int(row["tp"]), ep=int(row["ep"]), pp=int(row["pp"]),
            dp=parse_cluster(row["cluster"]).num_devices // (int(row["tp"]) * int(row["pp"])),
            virtual_stages=int(row["virtual_stages"]),
            schedule="interleaved-1f1b" if int(row["virtual_stages"]) > 1 else "1f1b",
            mbs=int(row["mbs"]), gbs=int(row["gbs"]), seq=int(row["seq"]), zero=int(row["zero"]),
            recompute=row["recompute"],
        )
        options = TrainOptions(global_batch=int(row["gbs"]), seq=int(row["seq"]), attention="flash", dropout=False,
                               moe_probs_on_combine=True)  # MCore v0.9: the unpermute weighs the outputs
        cases.append(Case(
            name=f"{row['model']} on {row['cluster']}", model=get_model(row["model"]), cluster=parse_cluster(row["cluster"]),
            layout=layout, options=options, published_tflops=float(row["tflops_per_gpu"]), source=row["source"],
        ))
    return cases


def korthikanti2022() -> list[Case]:
    """The 530B GPT with full recomputation and with SP + selective recomputation (held out)."""
    cases = []
    for row in _rows("korthikanti2022.csv"):
        tp, pp, gpus, v = int(row["tp"]), int(row["pp"]), int(row["gpus"]), int(row["virtual_stages"])
        layout = Layout(
            tp=tp, pp=pp, dp=gpus // (tp * pp), mbs=int(row["mbs"]), gbs=int(row["gbs"]), seq=2048,
            recompute=row["recompute"], sp=row["sp"] == "true", schedule="interleaved-1f1b" if v > 1 else "1f1b",
            virtual_stages=v, param_dtype="fp16",
        )
        options = TrainOptions(global_batch=int(row["gbs"]), seq=2048, attention="materialized", dropout=True,
                               overlap_grad_reduce=False, overlap_param_gather=False, overlap_p2p=False)
        cases.append(Case(
            name=row["name"], model=megatron_gpt(int(row["hidden"]), int(row["layers"]), int(row["heads"]), name="gpt-530b"),
            cluster=parse_cluster(f"{gpus // 8}x8xA100-80GB"), layout=layout, options=options,
            published_mfu=float(row["mfu"]), source="Korthikanti et al. 2022, abstract",
        ))
    return cases


REPO_DATA = Path(__file__).resolve().parents[4] / "data"
"""The repository's data folder (published figures with their sources in each file's header)."""

MODERN = dict(attention="flash", dropout=False, overlap_grad_reduce=True, overlap_param_gather=True,
              overlap_p2p=True, loss="fused", memory_headroom=0.0)
"""Software options of the NeMo / Megatron-Bridge recipes (Megatron-Core with Transformer Engine):
flash attention, no dropout, gradient-reduce / parameter-gather / pipeline-send overlap, the fused
vocab-parallel cross entropy; published runs did run, so they are checked against the whole device."""
BRIDGE_RECIPE = dict(fp8_param_gather=True, moe_probs_on_combine=False)
"""What Megatron-Bridge's performance presets (25.11: v0.2.1, 26.02.01: v0.3.1, 26.04.01: v0.4.2, 26.06: v0.5.0,
26.08: v0.6.0) run beyond ``MODERN``,
and the layout's ``grad_dtype=bf16`` beside it: every FP8 precision preset sets ``fp8_param_gather``
(src/megatron/bridge/training/mixed_precision.py ``bf16_with_fp8_current_scaling_mixed`` /
``bf16_with_mxfp8_mixed``, taken by scripts/performance/utils ``get_precision_config``), every
model's performance script sets ``grad_reduce_in_fp32 = False`` (scripts/performance/configs/*/
*_llm_pretrain.py), and their Megatron-Core (0.15+) weighs the expert activation, not the combine."""
BRIDGE_MODEL_RECIPE = {"deepseek-v3": dict(mtp_layers=1, split_embedding=False)}
"""What Megatron-Bridge's recipe of a model runs beyond ``BRIDGE_RECIPE``. DeepSeek-V3: one multi-token
prediction depth (src/megatron/bridge/recipes/deepseek/deepseek_v3.py: ``mtp_num_layers = 1`` at v0.2.1,
v0.3.1 and v0.4.2; no performance preset turns it off) on the last stage, in the recipe's pipeline layouts
(``set_deepseek_v3_pipeline_model_parallel_layout``: its layout_map for (pp, vp) = (4, 1), (8, 1), (4, 2),
(16, 1), (8, 2), (4, 4), and the presets' ``Et*4|(t*4|)*14tmL`` for 16 stages), which put the embedding
beside a full stage and give the MTP depth and the loss three layers' room: the split
``split_embedding=False`` with one MTP depth prices, exactly (tests/plan/test_mtp.py). Rows at other (pp, vp)
(25.11's pp=2 x 4 and pp=8 x 4) ran layouts not established here; the same rule stands for them."""
BF16_GRAD_SOURCES = ("NEMO-25.04", "NEMO-25.02")
"""NeMo 2 releases whose FP8 performance scripts reduce gradients in bf16 (scripts/performance/llm/*.py: with
``--fp8``, ``recipe.trainer.plugins.grad_reduce_in_fp32 = False``; every row of theirs here is FP8). NeMo 24.07's
setting was not checked: Megatron's default (fp32) stands."""
NEMO2_RECIPE = dict(fp8_param_gather=False, moe_probs_on_combine=True)
"""NeMo releases 24.07-25.04 (Megatron-Core 0.8-0.12, before MR !2668 moved the router's weights
into the expert activation): the combine keeps the experts' outputs; whether their FP8 recipes hold FP8
weights was not checked, so Megatron's default (bf16 weights beside the FP8 copies) stands. Gradients:
``BF16_GRAD_SOURCES``."""
TP_COMM_OVERLAP = 0.25
"""Fraction of TP traffic the recipes' Transformer Engine comm-GEMM overlap hides (``tp_comm_overlap``,
on for TP > 1 in the recipes); fitted with the other framework constants to all NeMo / Megatron-Bridge
rows (grid 0 / 0.25 / 0.5 / 0.75; it was 0.75 fitted to the publisher-corrected 25.11 rows alone, 0.5 to
their draft), see benchmarks/calibrate_training.py ``shipped_fit``."""
_PRECISION = {"bf16": ("bf16", "delayed"), "fp8-cs": ("fp8", "current"), "fp8-ds": ("fp8", "delayed"),
              "mxfp8": ("mxfp8", "delayed")}


def _published_model(name: str) -> ModelSpec:
    """A catalogue model, or for the rows whose model the catalogue lacks (yet), its published
    dimensions (config.json of the checkpoint named in ``source``)."""
    try:
        return get_model(name)
    except SpecError:
        pass
    if name in _FALLBACK:
        return _FALLBACK[name]()
    raise SpecError(f"model {name!r} is neither in the catalogue nor a known published configuration")


def _nemotron(name: str, hidden: int, layers: int, heads: int, ffn: int, source: str) -> ModelSpec:
    # Nemotron-4: squared-ReLU two-matrix MLP, LayerNorm, RoPE, GQA with 8 KV heads, 256k vocabulary, untied
    return ModelSpec(name=name, family="nemotron", vocab_size=256000, hidden_size=hidden, num_layers=layers,
                     num_heads=heads, num_kv_heads=8, head_dim=hidden // heads, ffn_kind="gelu", activation="relu2",
                     ffn_size=ffn, norm_kind="layernorm", tied_embeddings=False, position_kind="rope",
                     max_position=4096, source=source)


def _gpt_oss_120b() -> ModelSpec:
    fields = {f.name for f in dataclasses.fields(ModelSpec)}
    # config.json layer_types: sliding_attention on the even layers, window 128 (attention sinks are
    # not a cost term: one extra logit per head and query)
    extra = dict(sliding_layers=tuple(range(0, 36, 2)), sliding_window=128)
    extra = {k: v for k, v in extra.items() if k in fields}
    return ModelSpec(name="gpt-oss-120b", family="gpt_oss", vocab_size=201088, hidden_size=2880, num_layers=36,
                     num_heads=64, num_kv_heads=8, head_dim=64, ffn_size=2880, qkv_bias=True, o_bias=True,
                     mlp_bias=True, num_experts=128, top_k=4, expert_ffn_size=2880, moe_layers=tuple(range(36)),
                     max_position=131072, source="https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json",
                     **extra)


def _qwen3_30b_a3b() -> ModelSpec:
    config = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
              "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
              "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "decoder_sparse_step": 1,
              "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False, "rope_theta": 1e6,
              "max_position_embeddings": 40960, "rms_norm_eps": 1e-6}
    return spec_from_hf_config(config, name="qwen3-30b-a3b",
                               source="https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json")


_FALLBACK = {
    "nemotron-4-340b": lambda: _nemotron("nemotron-4-340b", 18432, 96, 96, 73728,
                                         "https://huggingface.co/nvidia/Nemotron-4-340B-Base (model_config.yaml)"),
    "nemotron-4-15b": lambda: _nemotron("nemotron-4-15b", 6144, 32, 48, 24576, "Parmar et al. 2024, Nemotron-4 15B, Table 1"),
    "gpt-oss-120b": _gpt_oss_120b,
    "qwen3-30b-a3b": _qwen3_30b_a3b,
}


RECOMPUTE_LADDER = ("none", "core_attn", "core_attn+layernorm+mlp_act", "core_attn+layernorm+mlp", "full")
"""Recomputation tried, cheapest first, for a published run that does not state its own."""


def least_recompute(model: ModelSpec, cluster: ClusterSpec, layout: Layout, options: TrainOptions) -> Layout:
    """The published layout with the least recomputation (``RECOMPUTE_LADDER``) the memory model
    says it needs to fit the device: the summaries give every parallel degree but not the
    recipes' ``--recompute-modules``; a run that ran fitted, so it recomputed at least that much.
    The layout as given when none of them fits (the row then shows fits = NO)."""
    from modelcarve.plan.train.model import TrainCostModel

    cost = TrainCostModel(model, cluster, options)
    for mode in RECOMPUTE_LADDER:
        candidate = layout.replace(recompute=mode)
        if cost.estimate(candidate)["fits"]:
            return candidate
    return layout


def nemo_cases(path: Path | str | None = None, tp_comm_overlap: float | None = None) -> list[Case]:
    """The NeMo / Megatron-Bridge performance-summary rows (``data/training_published.csv``), each
    with its published layout; rows the planner cannot express carry ``unanswered``."""
    path = Path(path) if path else REPO_DATA / "training_published.csv"
    text = path.read_text()
    rows = list(csv.DictReader(io.StringIO("\n".join(l for l in text.splitlines() if not l.startswith("#")))))
    overlap = TP_COMM_OVERLAP if tp_comm_overlap is None else tp_comm_overlap
    cases: list[Case] = []
    recipes: dict[tuple, list[int]] = {}
    for row in rows:
        gpus, system = int(row["gpus"]), row["system"]
        tp, pp, cp, vp, ep = (int(row[k]) for k in ("tp", "pp", "cp", "vp", "ep"))
        gbs, mbs, seq = int(row["gbs"]), int(row["mbs"]), int(row["seq"])
        name = f"{row['model']} {row['precision']} {gpus}x{system} ({row['source']})"
        dtype, scaling = _PRECISION[row["precision"]]
        bridge = row["source"].startswith("MB-")  # Megatron-Bridge's presets (BRIDGE_RECIPE); NeMo's: MCore < 0.13
        bf16_grads = bridge or row["source"] in BF16_GRAD_SOURCES
        try:
            model = _published_model(row["model"])
            dpn = get_device(system).devices_per_node
            cluster = parse_cluster(f"{gpus // dpn}x{dpn}x{system}")
            layout = Layout(
                tp=tp, pp=pp, cp=cp, dp=gpus // (tp * pp * cp), ep=ep, mbs=mbs, gbs=gbs, seq=seq,
                zero=3 if row["fsdp"] == "1" else 1, sp=tp > 1, recompute="none",
                schedule="interleaved-1f1b" if vp > 1 else "1f1b", virtual_stages=vp,
                param_dtype=dtype, fp8_scaling=scaling, grad_dtype="bf16" if bf16_grads else "fp32",
            )
            layout.validate(model, cluster)
            unanswered = ""
        except (SpecError, LayoutError) as err:
            model, cluster, layout, unanswered = None, None, None, str(err)
        options = TrainOptions(global_batch=gbs, seq=seq, tp_overlap=overlap if tp > 1 else 0.0,
                               load_imbalance=1.0 if bridge else 1.25,
                               moe_dispatcher=row.get("dispatcher") or "fused",
                               offload_layers=int(row.get("offload_layers") or 0),
                               moe_a2a_overlap=(row.get("a2a_overlap") or "") == "1",
                               moe_fused_mlp=(row.get("cutedsl_mlp") or "").strip() == "1",
                               cuda_graph=_cuda_graph(row),
                               **(BRIDGE_RECIPE if bridge else NEMO2_RECIPE), **MODERN,
                               **(BRIDGE_MODEL_RECIPE.get(row["model"], {}) if bridge else {}))
        stated = row.get("recompute") or "infer"
        if layout is not None:
            layout = least_recompute(model, cluster, layout, options) if stated == "infer" else layout.replace(recompute=stated)
        if stated == "infer" and layout is not None:
            recipes.setdefault(_recipe_key(row), []).append(len(cases))
        cases.append(Case(
            name=name, model=model, cluster=cluster, layout=layout, options=options,
            published_tflops=float(row["tflops_per_gpu"]), published_tokens_per_device=float(row["tokens_per_gpu"]),
            source=row["source"], unanswered=unanswered, recompute_inferred=stated == "infer" and layout is not None,
            unmodelled=_unmodelled(row),
        ))
    # one recipe, one recomputation: the rows of a release that run the same model, precision and
    # layout on different systems use the recompute the tightest of them needed
    for members in recipes.values():
        heaviest = max((cases[i].layout.recompute for i in members), key=RECOMPUTE_LADDER.index)
        for i in members:
            cases[i] = dataclasses.replace(cases[i], layout=cases[i].layout.replace(recompute=heaviest))
    # a release that publishes the same run at two global batches (DeepSeek-V3 MXFP8 on 256 GB300 in 26.06: GBS
    # 4096 and 15360) names each by its batch, so every row has its own name in the per-row tables
    counts: dict[str, int] = {}
    for c in cases:
        counts[c.name] = counts.get(c.name, 0) + 1
    return [dataclasses.replace(c, name=f"{c.name[:-1]}, GBS {c.layout.global_batch})")
            if counts[c.name] > 1 and c.layout is not None else c for c in cases]


def _cuda_graph(row: dict) -> str:
    """``TrainOptions.cuda_graph`` of a row: its ``cuda_graph`` column, the preset's ``cuda_graph_impl``
    ('full_iteration' where the preset captures the whole iteration; 'transformer_engine' / 'local' with
    layer-wise scopes are 'partial'); absent or empty: none."""
    graph = (row.get("cuda_graph") or "").strip()
    return "none" if graph in ("", "none") else "full_iteration" if graph == "full_iteration" else "partial"


def _unmodelled(row: dict) -> tuple[str, ...]:
    """The recipe features a row states that are not all priced (columns absent or empty: none): partial
    CUDA graphs (``cuda_graph`` 'transformer_engine' / 'local': the layer-wise scopes' own launch time is not
    priced, the experts' host-issue bound is, ``TrainOptions.cuda_graph``) and FP8 attention
    (``fp8_attention`` 1: the flash core is priced at its HBM roofline, the same in either precision).
    Full-iteration CUDA graphs and the CuTeDSL fused grouped MLP (``cutedsl_mlp`` 1) are priced:
    ``TrainOptions.cuda_graph`` and ``moe_fused_mlp``."""
    out = []
    if _cuda_graph(row) == "partial":
        out.append(f"cuda_graph={row['cuda_graph'].strip()}")
    if (row.get("fp8_attention") or "").strip() == "1":
        out.append("fp8_dot_product_attention")
    return tuple(out)


def _recipe_key(row: dict) -> tuple:
    """What makes two summary rows one recipe: release, model, precision and every layout column."""
    return tuple(row[k] for k in ("source", "model", "precision", "gpus", "gbs", "mbs", "seq", "fsdp", "tp", "pp",
                                  "cp", "vp", "ep"))


@dataclass(frozen=True, kw_only=True)
class MemoryCase:
    """One published peak-memory reading with the layout that produced it."""

    name: str
    model: ModelSpec
    cluster: ClusterSpec
    layout: Layout
    options: TrainOptions
    published_bytes: float
    fitted: bool
    source: str


def torchtitan_memory_cases(path: Path | str | None = None) -> list[MemoryCase]:
    """torchtitan's published reserved memory of Llama 3.1 8B runs (``data/training_memory_published.csv``)
    on its 96 GB HBM2e H100s, with PyTorch's default allocator (``FRAGMENTATION_FIXED_SEGMENTS``)."""
    from modelcarve.plan.train.states import FRAGMENTATION_FIXED_SEGMENTS
    from modelcarve.spec.hardware import DeviceSpec, get_link

    path = Path(path) if path else REPO_DATA / "training_memory_published.csv"
    text = path.read_text()
    rows = list(csv.DictReader(io.StringIO("\n".join(l for l in text.splitlines() if not l.startswith("#")))))
    h100 = get_device("H100")
    # Grand Teton's H100: the SXM die with 96 GB HBM2e at 2.4 TB/s (the benchmark's hardware section)
    device = DeviceSpec(name="H100-96GB-HBM2e", memory_bytes=96 * 2**30, hbm_bytes_per_s=2.4e12,
                        peak_flops=dict(h100.peak_flops), intra_link="nvlink4", inter_link="ib-ndr",
                        source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Hardware")
    cases = []
    for row in rows:
        gpus = int(row["gpus"])
        cluster = ClusterSpec(nodes=gpus // 8, devices_per_node=8, device=device, intra_link=get_link("nvlink4"),
                              inter_link=get_link("ib-ndr"), nics_per_node=8)
        layout = Layout.parse(row["layout"])
        model = get_model(row["model"])
        layout.validate(model, cluster)
        options = TrainOptions(global_batch=layout.global_batch, seq=layout.seq, attention="flash", dropout=False,
                               loss="torch",  # torchtitan's cross entropy (with TP, DTensor's loss_parallel)
                               memory_headroom=0.0, fragmentation=FRAGMENTATION_FIXED_SEGMENTS,
                               param_policy="torch")  # FSDP2 MixedPrecisionPolicy: fp32 parameters, bf16 compute
        cases.append(MemoryCase(name=f"{row['model']} {row['table']} on {gpus} H100", model=model, cluster=cluster,
                                layout=layout, options=options, published_bytes=float(row["published_gib"]) * 2**30,
                                fitted=row["fitted"] == "1", source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md"))
    return cases
