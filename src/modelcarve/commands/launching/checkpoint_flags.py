"""``modelcarve run``'s checkpoint and restart flags, checked before any rank starts.

    modelcarve run --model tiny-llama --layout "tp=2,pp=2,gbs=8" --steps 100 --checkpoint-dir ckpt --save-every 10 --keep 3
    modelcarve run --model tiny-llama --layout "dp=4,gbs=8" --steps 100 --resume ckpt        # another layout: resharded
    modelcarve run ... --checkpoint-dir ckpt --save-every 10 --max-restarts 2                # torchrun restarts, resumes

The ranks do the work (runtime/checkpoint/resume.py); this module only parses the flags, refuses bad
combinations in one line, checks a ``--resume`` target's integrity (runtime/checkpoint/commit.py, no
torch) and builds the worker's ``checkpoint`` argument.
"""

from __future__ import annotations

from pathlib import Path

from modelcarve.spec.errors import ModelcarveError


def add_checkpoint_flags(p) -> None:
    p.add_argument("--checkpoint-dir", default=None, help="save training checkpoints (DCP) under this directory")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (needs --checkpoint-dir); "
                   "SIGTERM also saves before stopping")
    p.add_argument("--keep", type=int, default=0, help="keep only the newest K saved steps (default: all)")
    p.add_argument("--resume", default=None, help="a checkpoint directory (its newest intact step) or one step "
                   "directory; --steps stays the total to end at; the layout may differ (resharded)")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts after a rank dies; with "
                   "--checkpoint-dir each restart resumes from the last saved step")


def checkpoint_payload(args) -> dict:
    """The worker's ``checkpoint`` argument ({} when no checkpoint flag is given)."""
    root, every, keep, resume = args.checkpoint_dir, args.save_every, args.keep, args.resume
    for name, value in (("--save-every", every), ("--keep", keep), ("--max-restarts", args.max_restarts)):
        if value < 0:
            raise ModelcarveError(f"{name} {value} is negative; give a count >= 0")
    if (every or keep) and not root:
        raise ModelcarveError("--save-every/--keep need --checkpoint-dir DIR (where to save)")
    if root and Path(root).exists() and not Path(root).is_dir():
        raise ModelcarveError(f"--checkpoint-dir {root} is a file, not a directory")
    if resume:
        from modelcarve.runtime.checkpoint.commit import choose_step

        choose_step(resume)  # refuses a damaged step directory or a directory without an intact step
    if not (root or resume):
        return {}
    return dict(checkpoint=dict(checkpoint_dir=root, save_every=every, keep=keep, resume=resume))
