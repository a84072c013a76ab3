"""Checkpoint and resume inside the run worker: when to save, what the manifest records, what a
resume restores and refuses.

    ck = Checkpointing(checkpoint_dir="ckpt", save_every=2, keep=3, resume="ckpt")
    start = ck.restore(chunks, trainer, spec, layout, data_info)   # 0 without resume
    for step in range(start, steps):
        ...train step...
        ck.after_step(step + 1)                    # saves when (step + 1) % save_every == 0

A saved step holds (dcp_checkpoint.py) the model, AdamW state, every rank's torch RNG state, and
in the manifest (ckpt_commit.py) the step, the layout it was written by, the model hash, the
learning rate of each parameter group (the runtime's LR is constant: no schedule to store
beyond it) and the data position: the next step index and the samples and tokens consumed. The
data sources (train.py) draw batch ``k`` from ``(seed, k)`` alone, so resuming at step ``k``
continues the exact sample sequence in any layout as long as ``gbs``, ``seq``, the data source and
its seed are those of the checkpoint; a resume that changes them is refused (it would repeat or
skip samples). Resuming into another layout (other tp/pp/dp/ep/fsdp) is DCP resharding.

Under ``torchrun --max-restarts`` (TORCHELASTIC_RESTART_COUNT > 0) a worker with a checkpoint
directory resumes from its newest intact step by itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from modelcarve.runtime.checkpoint import commit
from modelcarve.runtime.checkpoint import dcp as dcpk
from modelcarve.spec.errors import ModelcarveError


def _rank0() -> bool:
    return dist.get_rank() == 0


def _say(text: str) -> None:
    if _rank0():
        sys.stderr.write(f"modelcarve: {text}\n")
        sys.stderr.flush()


class Checkpointing:
    def __init__(self, checkpoint_dir: str | None = None, save_every: int = 0, keep: int = 0,
                 resume: str | None = None, model: str | None = None):
        self.model_arg = model
        self.root = Path(checkpoint_dir) if checkpoint_dir else None
        self.save_every, self.keep = int(save_every or 0), int(keep or 0)
        self.resume, self.fallback = resume, None
        self.auto = self.root is not None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        if self.auto:  # a restarted job picks up where its last save left it (else where --resume said)
            self.resume, self.fallback = str(self.root), resume
        self.saved: list[int] = []
        self.resumed_from: dict | None = None
        self.stopped_by: str | None = None

    @property
    def enabled(self) -> bool:
        return self.root is not None

    # --- resume ----------------------------------------------------------------------

    def restore(self, chunks, trainer, spec, layout, data_info: dict) -> int:
        """Load the chosen step into the model, optimiser and RNG; returns the step to continue at."""
        self.context = (chunks, trainer, spec, layout, data_info)
        if not self.resume:
            return 0
        choice = None
        if _rank0():
            try:
                choice = commit.latest_intact(self.resume) if self.auto else commit.choose_step(self.resume)
                if choice is None and self.fallback:
                    choice = commit.choose_step(self.fallback)
                problem = None if choice is None else _mismatch(choice.manifest, spec, layout, data_info)
            except ModelcarveError as err:
                problem = str(err)
            box = [None if choice is None else (str(choice.step_dir), choice.manifest, choice.skipped), problem]
        else:
            box = [None, None]
        dist.broadcast_object_list(box, src=0)
        picked, problem = box
        if problem:
            raise ModelcarveError(problem)
        if picked is None:  # auto-resume after a restart before the first save: start over
            _say("restarted before any checkpoint was saved: starting from step 0")
            return 0
        step_dir, manifest, skipped = Path(picked[0]), picked[1], picked[2]
        _say(commit.Choice(step_dir, manifest, skipped).describe())
        boxes, owners = dcpk.model_entries(chunks, spec, trainer.optimizer)
        dcpk.init_optimizer_state(trainer.optimizer)
        boxes |= dcpk.optimizer_entries(trainer.optimizer, owners, spec)
        rng = dcpk.rng_entries(load=True)
        have_rng = set(rng) <= set(manifest["state"].get("rng_keys", []))
        if have_rng:
            boxes |= rng
        dcpk.load_state(step_dir, boxes)
        getattr(trainer.optimizer, "after_load", lambda: None)()  # mixed precision: masters -> parameters
        if have_rng:
            torch.set_rng_state(next(iter(rng.values())).local)
        lrs = manifest["state"].get("lr")
        for group, lr in zip(trainer.optimizer.param_groups, lrs or []):
            group["lr"] = lr
        self.resumed_from = dict(path=str(step_dir), step=manifest["step"], layout=manifest["layout"]["short"],
                                 skipped=skipped)
        return int(manifest["state"]["data"]["next_step"])

    # --- save ------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.enabled and self.save_every > 0 and step % self.save_every == 0

    def after_step(self, step: int) -> bool:
        """Save when due; True when a signal asked the ranks to stop (a checkpoint is saved first)."""
        import signal as _signal

        from modelcarve.runtime.distributed.signals import stop_agreed

        signum = stop_agreed()
        path = self.save(step) if self.due(step) or (signum and self.enabled) else None
        if signum:
            self.stopped_by = _signal.Signals(signum).name
            saved = f"; saved {self.root / commit.step_dir_name(step)}" if self.enabled else " (no --checkpoint-dir: nothing saved)"
            _say(f"stopped by {self.stopped_by} after step {step}{saved}")
        return bool(signum)

    def summary(self) -> dict:
        if not self.enabled and not self.resumed_from:
            return {}
        return dict(checkpoint=dict(dir=str(self.root) if self.root else None, saved_steps=self.saved,
                                    resumed_from=self.resumed_from, stopped_by=self.stopped_by))

    def save(self, step: int) -> Path | None:
        """Write step ``step`` (the number of steps done) atomically (collective)."""
        if not self.enabled or step in self.saved:
            return None
        chunks, trainer, spec, layout, data_info = self.context
        boxes, owners = dcpk.model_entries(chunks, spec, trainer.optimizer)
        boxes |= dcpk.optimizer_entries(trainer.optimizer, owners, spec)
        boxes |= dcpk.rng_entries(load=False)
        rng_keys = [None] * dist.get_world_size()
        dist.all_gather_object(rng_keys, next(k for k in boxes if k.startswith("rng.")))
        tmp = self.root / (commit.step_dir_name(step) + ".tmp")
        if _rank0():
            commit.prepare_tmp(self.root, step)
        dist.barrier()
        dcpk.save_state(tmp, boxes)
        dist.barrier()
        final = self.root / commit.step_dir_name(step)
        if _rank0():
            gbs, seq = layout.global_batch, layout.seq
            state = dict(data=dict(data_info, next_step=step, samples_seen=step * gbs, tokens_seen=step * gbs * seq),
                         lr=[g["lr"] for g in trainer.optimizer.param_groups], rng_keys=rng_keys,
                         world_size=dist.get_world_size())
            info = dict(layout=dict(short=layout.short(), fields=layout.to_dict(), global_batch=gbs, seq=seq), model=spec.name,
                        model_hash=dcpk.model_hash(spec), state=state, hf_config=hf_config_of(self.model_arg))
            final = commit.commit(tmp, step, info)
            commit.prune(self.root, self.keep)
        dist.barrier()
        self.saved.append(step)
        return final


def hf_config_of(model: str | None) -> dict | None:
    """The Hugging Face config.json of the model trained (``export`` writes it back out)."""
    import json

    from modelcarve.spec.catalog import catalog_entry

    if not model:
        return None
    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text())
    if path.is_file() and path.suffix == ".json":
        return json.loads(path.read_text())
    try:
        return dict(catalog_entry(model)["config"])
    except ModelcarveError:
        return None


def _mismatch(manifest: dict, spec, layout, data_info: dict) -> str | None:
    """Why this checkpoint cannot continue this run (None when it can)."""
    from modelcarve.runtime.checkpoint.dcp import model_hash

    fields = manifest["layout"]
    where = manifest.get("model", "?")
    if manifest["model_hash"] != model_hash(spec):
        return (f"checkpoint holds another model ({where}, hash {manifest['model_hash']}) than {spec.name} "
                f"(hash {model_hash(spec)}); resume with the model it was trained from")
    for name, now in (("global_batch", layout.global_batch), ("seq", layout.seq)):
        if name in fields and fields[name] != now:
            return (f"the checkpoint was trained with {name}={fields[name]}, this run has {now}: the data position "
                    f"is counted in batches of gbs x seq, so changing it would repeat or skip samples; keep "
                    f"{name}={fields[name]} in the layout")
    saved = manifest["state"]["data"]
    for key in ("source", "seed"):
        if saved.get(key) != data_info.get(key):
            return (f"the checkpoint's data {key} is {saved.get(key)!r}, this run's {data_info.get(key)!r}; "
                    f"resume with the same --data and --seed (the sample order depends on them)")
    return None
