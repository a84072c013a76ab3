"""Peak memory per logit of Megatron-Core's cross entropy, measured with Megatron-Core itself on the
CPU (a benchmark; tests/plan/test_loss_memory.py runs its quick part against the planner's
``LOSS_BYTES_PER_LOGIT["materialized"]``).

Usage::

    python benchmarks/megatron_loss_memory.py [--out benchmarks/results/megatron_loss_memory.json]

creates (or reuses) the Megatron-Core venv of tests/engine_venvs.py and runs itself there with
``--measure`` (add ``--quick`` to skip the torch.compile'd path, which compiles for ~10 s).

The step is written as Megatron-Core's GPT model runs it: logits ``[s, b, v]`` straight from the
bf16 output layer (here a bf16 matmul of two leaves, hidden states ``[s, b, h]`` and head
``[v, h]``), labels ``[b, s]`` transposed and made contiguous, the loss by
``LanguageModule.compute_language_model_loss`` (unfused: ``tensor_parallel.vocab_parallel_cross_entropy``;
``cross_entropy_loss_fusion`` with ``cross_entropy_fusion_impl="native"``:
``fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy``), the loss transposed back,
the logits dropped when the model's forward returns, then backward. One-rank gloo group,
``parallel_state.initialize_model_parallel(1)``.

Two meters:

* torch's ``MemTracker`` (the one tests/plan/test_loss_memory.py uses for torch's loss): peak
  bytes of live tensors, less the two leaves. It is a TorchDispatchMode, under which Dynamo does
  not compile: the native fused path's ``jit_fuser`` (``torch.compile`` on torch >= 2.2) runs
  eagerly under it.
* the profiler's allocation events (``torch.profiler``, ``profile_memory=True``): the running sum
  of CPU allocations and frees inside the step, which also sees the buffers of compiled code;
  it counts from zero at the step's start (the leaves exist before it), so nothing is subtracted.

Figures are bytes per logit (``T = s b`` tokens, ``V`` vocabulary); the per-token vectors add at
most 64 bytes a token (0.016 bytes a logit at V = 4,096).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

S, B, H, V = 512, 2, 64, 4096
"""Sequence, micro-batch, hidden and vocabulary sizes of the measured step (T = 1,024 tokens)."""


def measure(quick: bool) -> dict:
    """Run inside the Megatron-Core venv: the figures as a dict."""
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.profiler import ProfilerActivity, profile

    import megatron.core
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    T = S * B

    def leaves():
        torch.manual_seed(0)
        h = torch.randn(S, B, H, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(V, H, dtype=torch.bfloat16, requires_grad=True)
        return h, w, torch.randint(0, V, (B, S))

    def step(loss_fn, h, w, labels):
        logits = h @ w.t()  # [s, b, v] bf16, as the output layer returns it
        loss = loss_fn(logits, labels.transpose(0, 1).contiguous())  # compute_language_model_loss
        loss = loss.transpose(0, 1).contiguous()
        del logits  # the GPT model's forward returns the loss alone
        loss.float().sum().backward()

    def tracker_peak(loss_fn):
        h, w, labels = leaves()
        tracker = MemTracker()
        tracker.track_external(h, w)
        with tracker:
            step(loss_fn, h, w, labels)
        snap = tracker.get_tracker_snapshot("peak")
        (device,) = [d for d in snap if d.type == "cpu"]
        return (snap[device]["Total"] - 2 * (T * H + V * H)) / (T * V)

    def profiler_peak(loss_fn):
        h, w, labels = leaves()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step(loss_fn, h, w, labels)
        events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns())
        now = peak = 0
        for e in events:
            now += e.nbytes()
            peak = max(peak, now)
        return peak / (T * V)

    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1)
        tp = parallel_state.get_tensor_model_parallel_group()
        unfused = lambda lg, lab: tensor_parallel.vocab_parallel_cross_entropy(lg, lab)  # noqa: E731
        native = lambda lg, lab: fused_vocab_parallel_cross_entropy(lg, lab, tp)  # noqa: E731
        out = {"megatron_core": megatron.core.__version__, "torch": torch.__version__,
               "shape": {"s": S, "b": B, "h": H, "v": V}}
        if not quick:  # first: once a function ran under MemTracker, Dynamo no longer compiles it
            from torch._dynamo.utils import counters

            t0 = time.monotonic()
            step(native, *leaves())  # compiles the four jit_fuser functions (inductor, CPU)
            out["native_fused_compile_s"] = round(time.monotonic() - t0, 1)
            out["native_fused_compiled_graphs"] = counters["stats"]["unique_graphs"]
            out["native_fused_compiled_profiler"] = profiler_peak(native)
        with torch.compiler.set_stance("force_eager"):
            out["unfused_memtracker"] = tracker_peak(unfused)
            out["native_fused_eager_memtracker"] = tracker_peak(native)
            if not quick:
                out["unfused_profiler"] = profiler_peak(unfused)
                out["native_fused_eager_profiler"] = profiler_peak(native)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", action="store_true", help="measure in this interpreter (the Megatron-Core venv)")
    ap.add_argument("--quick", action="store_true", help="skip the torch.compile'd native path")
    ap.add_argument("--out", help="default: benchmarks/results/megatron_loss_memory.json")
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.quick)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from engine_venvs import measure_in

    out = measure_in("megatron-core", __file__, *(["--quick"] if args.quick else []))
    dest = Path(args.out or Path(__file__).parent / "results" / "megatron_loss_memory.json")
    dest.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
