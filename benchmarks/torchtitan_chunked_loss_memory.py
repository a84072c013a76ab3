"""Peak memory of torchtitan's chunked loss (``ChunkedLossWrapper``), measured with torchtitan
itself on the CPU (a benchmark; tests/plan/test_loss_memory.py runs it against the planner's
``CHUNKED_BYTES_PER_LOGIT`` and ``CHUNKED_BYTES_PER_TOKEN_HIDDEN``).

Usage::

    python benchmarks/torchtitan_chunked_loss_memory.py [--out benchmarks/results/torchtitan_chunked_loss_memory.json]

creates (or reuses) the torchtitan venv of tests/engine_venvs.py and runs itself there with
``--measure``.

The step is the wrapper's as torchtitan 0.3.0's trainer runs it: the decoder's output hidden
states ``[b, s, h]`` (here a tracked bf16 leaf) go to ``ChunkedLossWrapper`` with its default
inner loss (``CrossEntropyLoss``: torch's cross entropy on the chunk's logits cast to fp32), which
splits them along the sequence into ``num_chunks`` contiguous copies, and for each chunk runs the
output projection (here ``chunk @ w.T``, ``w`` a tracked bf16 ``[v, h]`` leaf), the loss and at
once its backward, copying the chunk's hidden-state gradient into an fp32 accumulator the size of
the hidden states; then ``loss.backward()`` sends the accumulated gradient (cast to bf16) into the
decoder. The peak is inside a chunk's backward.

torch's ``MemTracker`` gives the peak bytes of live tensors; the two leaves and the head's weight
gradient (``2 v h`` bytes: a parameter gradient, which the planner counts with the gradients) are
subtracted. Several shapes are measured so that the per-logit and the per-token-and-hidden parts
can be told apart (``fit``: least squares of ``a c v + b T h`` over the shapes, ``c = T / chunks``
tokens a chunk); the per-token vectors (labels' chunks, per-row max / sum, loss) add at most 64
bytes a token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SHAPES = ((2, 512, 64, 4096), (2, 512, 512, 1024), (2, 512, 256, 2048))
"""(micro-batch, sequence, hidden, vocabulary) of the measured steps (T = 1,024 tokens)."""
CHUNKS = 8
"""torchtitan's default ``ChunkedLossWrapper.Config.num_chunks``."""


def measure() -> dict:
    """Run inside the torchtitan venv: the figures as a dict."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    import torchtitan
    from torchtitan.components.loss import ChunkedLossWrapper

    rows = []
    for b, s, h, v in SHAPES:
        torch.manual_seed(0)
        hidden = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(v, h, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, v, (b, s))
        wrap = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=CHUNKS))
        # A plain callable, not an nn.Module: MemTracker refuses a module called more than once a step.
        wrap.set_lm_head(lambda x, w=w: x @ w.t())
        tracker = MemTracker()
        tracker.track_external(hidden, w)
        with tracker:
            loss, _ = wrap(hidden, labels)
            loss.backward()
        snap = tracker.get_tracker_snapshot("peak")
        (device,) = [d for d in snap if d.type == "cpu"]
        T = b * s
        extra = snap[device]["Total"] - 2 * (T * h + v * h) - 2 * v * h
        rows.append({"b": b, "s": s, "h": h, "v": v, "tokens": T, "chunk_tokens": T // CHUNKS, "extra_bytes": extra})
    # least squares of extra = a c v + b T h over the shapes
    xs = [(r["chunk_tokens"] * r["v"], r["tokens"] * r["h"]) for r in rows]
    ys = [r["extra_bytes"] for r in rows]
    s11 = sum(x[0] * x[0] for x in xs)
    s12 = sum(x[0] * x[1] for x in xs)
    s22 = sum(x[1] * x[1] for x in xs)
    t1 = sum(x[0] * y for x, y in zip(xs, ys))
    t2 = sum(x[1] * y for x, y in zip(xs, ys))
    det = s11 * s22 - s12 * s12
    a = (t1 * s22 - t2 * s12) / det
    bb = (s11 * t2 - s12 * t1) / det
    residual = max(abs(y - a * x[0] - bb * x[1]) / r["tokens"] for x, y, r in zip(xs, ys, rows))
    return {"torchtitan": torchtitan.__version__ if hasattr(torchtitan, "__version__") else "0.3.0",
            "torch": torch.__version__, "num_chunks": CHUNKS, "shapes": rows,
            "fit": {"bytes_per_chunk_logit": a, "bytes_per_token_hidden": bb, "max_residual_bytes_per_token": residual}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", action="store_true", help="measure in this interpreter (the torchtitan venv)")
    ap.add_argument("--out", help="default: benchmarks/results/torchtitan_chunked_loss_memory.json")
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure()))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from engine_venvs import measure_in

    out = measure_in("torchtitan", __file__)
    dest = Path(args.out or Path(__file__).parent / "results" / "torchtitan_chunked_loss_memory.json")
    dest.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
