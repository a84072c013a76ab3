"""The loss side's memory per logit, measured on torch itself: the bytes the planner prices for
torch's cross entropy (``loss="torch"``) and for DTensor's ``loss_parallel`` (``"torch-parallel"``)
are the peak that torch's own ``MemTracker`` sees, over a forward and backward written as
torchtitan's train step writes it (``loss = cross_entropy(pred.flatten(0, 1).float(), labels)``,
``del pred``, ``loss.backward()``).

The logits come from a bf16 matmul of two tracked leaves (hidden states ``T x H``, head ``V x H``),
so the peak holds those leaves (``2 (T H + V H)`` bytes) and the loss's tensors; what else a step
allocates are per-row vectors (the max and sum of each row: fp32, ``T`` long) and scalars, each at
most 8 bytes a row: the tolerance is ``64 T`` bytes, against ``12 T V`` (T = 1,024, V = 4,096:
0.13% of the figure). One process, a one-rank gloo group for the DTensor mesh.

Megatron-Core's unfused loss (``"materialized"``) is measured the same way with Megatron-Core
itself, in its own venv (tests/engine_venvs.py; benchmarks/megatron_loss_memory.py holds the step)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402

from modelcarve.plan.train.profile import LOSS_BYTES_PER_LOGIT  # noqa: E402

T, H, V = 1024, 64, 4096


def _peak(step) -> int:
    """Peak bytes MemTracker sees on the CPU during ``step(h, w, labels)``, less the two leaves."""
    torch.manual_seed(0)
    h = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, V, (T,))
    tracker = MemTracker()
    tracker.track_external(h, w)
    with tracker:
        step(h, w, labels)
    snap = tracker.get_tracker_snapshot("peak")
    (device,) = [d for d in snap if d.type == "cpu"]
    return snap[device]["Total"] - 2 * (T * H + V * H)


def _torch_step(h, w, labels):
    pred = h @ w.t()
    loss = F.cross_entropy(pred.float(), labels)
    del pred  # torchtitan frees the bf16 logits before backward
    loss.backward()


def test_torch_cross_entropy_peaks_at_twelve_bytes_per_logit():
    peak = _peak(_torch_step)
    priced = LOSS_BYTES_PER_LOGIT["torch"] * T * V
    assert priced <= peak <= priced + 64 * T, (peak / (T * V), LOSS_BYTES_PER_LOGIT["torch"])


def test_loss_parallel_peaks_at_sixteen_bytes_per_local_logit(tmp_path):
    from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def step(h, w, labels):
            pred = DTensor.from_local(h @ w.t(), mesh, [Shard(1)], run_check=False)  # vocab-sharded logits
            with loss_parallel():
                loss = F.cross_entropy(pred.float(), DTensor.from_local(labels, mesh, [Replicate()], run_check=False))
                del pred
                loss.backward()

        peak = _peak(step)
    finally:
        dist.destroy_process_group()
    priced = LOSS_BYTES_PER_LOGIT["torch-parallel"] * T * V
    assert priced <= peak <= priced + 64 * T, (peak / (T * V), LOSS_BYTES_PER_LOGIT["torch-parallel"])


def test_megatron_unfused_cross_entropy_peaks_at_six_bytes_per_logit():
    """Megatron-Core 0.15's own ``vocab_parallel_cross_entropy`` (the planner's ``"materialized"``),
    in its venv (tests/engine_venvs.py), through benchmarks/megatron_loss_memory.py's quick
    measurement: the step as ``LanguageModule.compute_language_model_loss`` runs it on ``[s, b, v]``
    bf16 logits. The fp32 copy (``.float()``) is where the max is subtracted, exponentiated and
    normalised in place, so it is also the softmax saved for backward and, in place again, the
    gradient: 4 bytes beside the bf16 logits in the forward (6), beside the gradient's bf16 cast
    in the backward (6). The per-token vectors (the labels' contiguous copy and masked targets,
    int64; arange, int64; mask, max, predicted logit, sum, loss, fp32 or bool) hold under 64 bytes
    a token at either peak, as in the torch tests. Megatron-Core's native fused path
    (``cross_entropy_fusion_impl="native"``), run eagerly (MemTracker keeps Dynamo from compiling its
    ``jit_fuser``), is the same arithmetic and peak; compiled it is 10 on the CPU (the benchmark)."""
    import json
    from pathlib import Path

    from engine_venvs import engine_python, engine_run  # tests/, on the path by conftest.py

    python, why = engine_python("megatron-core")
    if python is None:
        pytest.skip(why)
    script = (Path(__file__).resolve().parents[2] / "benchmarks" / "megatron_loss_memory.py").read_text()
    run = engine_run(python, script, "--measure", "--quick", timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    t, v = got["shape"]["s"] * got["shape"]["b"], got["shape"]["v"]
    priced = LOSS_BYTES_PER_LOGIT["materialized"] * t * v
    for key in ("unfused_memtracker", "native_fused_eager_memtracker"):
        peak = got[key] * t * v
        assert priced <= peak <= priced + 64 * t, (key, got[key], LOSS_BYTES_PER_LOGIT["materialized"])


def test_torchtitan_chunked_loss_peaks_as_priced():
    """torchtitan 0.3.0's own ``ChunkedLossWrapper`` (the planner's ``"chunked"``), in its venv
    (tests/engine_venvs.py), through benchmarks/torchtitan_chunked_loss_memory.py: for each measured
    shape the peak, less the tracked leaves and the head's weight gradient, is what the planner
    prices for one chunk and the hidden states, ``CHUNKED_BYTES_PER_LOGIT c v +
    CHUNKED_BYTES_PER_TOKEN_HIDDEN T h`` (``c`` tokens a chunk), plus the per-token vectors: at most
    64 bytes a token, as in the tests above. The shapes differ in ``h`` and ``v`` so that a wrong
    split between the two terms fails on one of them."""
    import json
    from pathlib import Path

    from engine_venvs import engine_python, engine_run  # tests/, on the path by conftest.py

    from modelcarve.plan.train.profile import CHUNKED_BYTES_PER_LOGIT, CHUNKED_BYTES_PER_TOKEN_HIDDEN

    python, why = engine_python("torchtitan")
    if python is None:
        pytest.skip(why)
    script = (Path(__file__).resolve().parents[2] / "benchmarks" / "torchtitan_chunked_loss_memory.py").read_text()
    run = engine_run(python, script, "--measure", timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert len({(r["h"], r["v"]) for r in got["shapes"]}) >= 2
    for r in got["shapes"]:
        priced = CHUNKED_BYTES_PER_LOGIT * r["chunk_tokens"] * r["v"] + CHUNKED_BYTES_PER_TOKEN_HIDDEN * r["tokens"] * r["h"]
        assert priced <= r["extra_bytes"] <= priced + 64 * r["tokens"], (r, priced)
