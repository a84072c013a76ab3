"""Communication bytes counted by metrics.CommCounter against hand-derived figures per step."""

from dist import run_distributed


def _runs(cases):
    from modelcarve.runtime.train.launch import run_worker

    return [run_worker(model="tiny-llama", layout=layout, steps=2, quiet=True) for layout in cases]


def test_comm_bytes_per_step_match_hand_count():
    from modelcarve.spec.catalog import get_model

    spec = get_model("tiny-llama")
    p = spec.total_params * 4  # fp32 bytes
    root = (2 * spec.vocab_size * spec.hidden_size + spec.hidden_size) * 4  # embedding, LM head, final norm
    cases = ["dp=2,seq=16,gbs=2,param_dtype=fp32", "dp=2,fsdp,seq=16,gbs=2,param_dtype=fp32"]
    plain, fsdp = run_distributed(_runs, 2, cases, timeout=300)[0]
    scalars = 4 + 8  # the loss (fp32) and the squared gradient norm (fp64) all-reduces
    # plain DP: one all-reduce of every gradient
    assert plain["memory"][0]["comm_bytes_per_step"] == p + scalars
    # FSDP2: all-gather every unit forward, all but the root unit again backward, reduce-scatter all
    assert fsdp["memory"][0]["comm_bytes_per_step"] == 3 * p - root + scalars
    assert fsdp["memory"][0]["param_bytes"] * 2 == p
