"""A rank's life under torchrun: join the group, run one worker, fail in one line; and the run worker.

    torchrun --nproc-per-node 4 -m modelcarve.commands.launching.worker run '{"model": "tiny-llama", "layout": "tp=2,dp=2", "steps": 10}'

``main(argv, workers)`` runs the worker named by ``argv[0]`` with the JSON arguments of
``argv[1]``; this module's own worker is ``run`` (``run_worker``: build the parallel model, train,
report). ``modelcarve run/verify`` (commands/run.py) validate the layout, then start torchrun
(commands/launching/torchrun.py) on commands/launching/worker.py, which adds the ``verify``
worker (verify/reference.py sits above the runtime, so this module never imports it) and the
run's ``printer``. The worker records; rank 0 hands the header, each step and the result, as plain
dicts, to that printer (report/run.py's: the runtime imports no rich, nor report/) and writes the
JSON report (``report`` key). A failure on any rank prints one line naming the rank and the error
and exits 1; a rank that dies makes the others fail at their next collective within the
collective timeout (``timeout_s``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist


def _rank0() -> bool:
    return dist.get_rank() == 0


def run_worker(model: str, layout: str, steps: int = 10, seed: int = 0, data: str | None = None,
               lr: float = 1e-3, dtype: str | None = None, report: str | None = None, quiet: bool = False,
               moe: dict | None = None, checkpoint: dict | None = None, timeline: bool = False,
               printer=None) -> dict | None:
    """Train ``steps`` steps of ``model`` split as ``layout``; rank 0 returns the result record (others None).

    ``printer`` (rank 0, unless ``quiet``): what shows the run as it goes, given plain records:
    ``begin(head)``, ``step(row)`` per step, ``end()``, ``summary(result)``; commands/launching/worker.py
    passes report/run.py's ``RunPrinter`` (the runtime imports no presentation). None: print nothing."""
    from modelcarve.runtime.measure.memory_report import measure_step
    from modelcarve.runtime.measure.metrics import CommCounter, StepTimer, memory_stats
    from modelcarve.runtime.train.trainer import TrainConfig, Trainer, make_data, seed_everything
    from modelcarve.spec.layout import Layout

    lay = Layout.parse(layout)
    if dtype:
        lay = lay.replace(param_dtype=dtype)
    seed_everything(seed)
    started = _startup_line(f"{dist.get_world_size()} ranks joined; building {model} as {lay.short()}", quiet)
    from modelcarve.runtime.distributed.mesh import build_mesh, device_type
    from modelcarve.runtime.build import build_chunks

    mesh = build_mesh(lay)
    chunks, spec = build_chunks(model, lay, mesh, seed=seed, device=device_type())  # a checkpoint: slice by slice
    _startup_line(f"model ready in {_startup_line('', True) - started:.1f}s", quiet)
    trainer = Trainer(chunks, lay, mesh, TrainConfig(lr=lr, seed=seed, **(moe or {})))
    source = make_data(data, spec.vocab_size, seed)
    from modelcarve.runtime.checkpoint.resume import Checkpointing  # --checkpoint-dir / --save-every / --resume

    ckpt = Checkpointing(model=model, **(checkpoint or {}))
    start = ckpt.restore(chunks, trainer, spec, lay, dict(source=data or "synthetic", seed=seed))
    timer = StepTimer(lay.global_batch * lay.seq)
    history = []
    progress = printer if _rank0() and not quiet else None
    if progress:
        progress.begin(dict(model=spec.name, layout=lay.short(), world_size=dist.get_world_size(), steps=steps,
                            global_batch=lay.global_batch, seq=lay.seq, param_dtype=lay.param_dtype))
    comm, categories = CommCounter(lay), {}
    try:
        for step in range(start, steps):
            tokens, targets = source.batch(step, lay.global_batch, lay.seq)
            timed = True
            if step == steps - 1:  # the counted step: collectives and memory by category (its
                # dispatch-mode and saved-tensor hooks slow it down: timed only when it is the only one)
                timed = steps - start == 1
                with (timer if timed else contextlib.nullcontext()):
                    out, categories = measure_step(trainer, tokens, targets)
                comm.log = out.pop("comm")
            else:
                with timer:
                    out = trainer.step(tokens, targets)
            if timeline and trainer.runner is not None and step >= steps - 2:  # the last step not slowed by measure_step
                from modelcarve.runtime.measure.timeline import local_records

                timeline = local_records(trainer.runner) if step == steps - 2 or steps - start == 1 else timeline
            # the counted step is not timed: None, not the previous step's figure again
            history.append(dict(step=step, loss=out["loss"], grad_norm=out["grad_norm"],
                                tokens_per_s=timer.last_tokens_per_s if timed else None))
            if progress:
                progress.step(history[-1])
            if ckpt.after_step(step + 1):  # True: a signal asked every rank to stop (saved first)
                break
    finally:
        if progress:
            progress.end()
    if comm.log is not None:
        comm.count(comm.log)
    mem = memory_stats(chunks, trainer.optimizer) | dict(categories=categories, comm_bytes_per_step=comm.total, comm_calls_per_step=sum(comm.calls.values()),
                                                      comm_wire_bytes_per_step=comm.log.wire if comm.log else 0.0,
                                                      comm_table=comm.log.table() if comm.log else {})
    mems = [None] * dist.get_world_size()
    dist.all_gather_object(mems, mem)
    if isinstance(timeline, dict):  # --timeline: rank 0 gets its pipeline's records (runtime/measure/timeline.py)
        from modelcarve.runtime.measure.timeline import gather_records

        timeline = gather_records(timeline, trainer.runner)
    if not _rank0():
        return None
    result = dict(model=spec.name, layout=lay.short(), layout_fields=lay.to_dict(), world_size=dist.get_world_size(),
                  steps=steps, history=history, tokens_per_s=timer.tokens_per_s(), memory=mems,
                  params=spec.total_params, moe=out.get("moe") if history else None) | ckpt.summary() | (
                      dict(timeline=timeline) if isinstance(timeline, list) else {})
    if progress:
        progress.summary(result)
    if report:
        with open(report, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _startup_line(text: str, quiet: bool) -> float:
    """Start-up is visible: rank 0 says what it is doing before the first step (stderr; when the
    launcher's stderr is a terminal, or MODELCARVE_PROGRESS=1, so that scripts still get one-line errors)."""
    import time

    if _rank0() and not quiet and text and os.environ.get("MODELCARVE_PROGRESS") == "1":
        sys.stderr.write(f"modelcarve: {text}\n")
        sys.stderr.flush()
    return time.monotonic()


def _lost_peer(err: Exception) -> bool:
    """A collective failed because a peer is gone or silent (not a bug on this rank)."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err).lower()
    return any(k in text for k in ("connection closed", "connection reset", "timed out", "timeout", "broken pipe", "gloo"))


def main(argv: list[str] | None = None, workers: dict | None = None, prog: str = "modelcarve.runtime.train.launch") -> int:
    """Run ``workers[argv[0]](args)`` on this rank (default: ``{"run": run_worker}``); 0, or 1 on failure."""
    from modelcarve.runtime.distributed.mesh import destroy, init_distributed

    workers = workers or {"run": lambda args: run_worker(**args)}
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in workers:
        sys.stderr.write(f"usage: python -m {prog} {{{'|'.join(workers)}}} '<json arguments>'\n")
        return 2
    command, args = argv[0], json.loads(argv[1])
    timeout_s = float(args.pop("timeout_s", 120))
    from modelcarve.runtime.distributed.collectives import configure

    configure(ranks_per_node=args.pop("ranks_per_node", None))  # how CommLog assigns link tiers
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    code = 0
    from modelcarve.runtime.distributed.signals import install

    install(grace_s=timeout_s + 5, watch_parent="TORCHELASTIC_RUN_ID" in os.environ)  # stop together, save first
    try:
        init_distributed(timeout_s)
        workers[command](args)
    except Exception as err:  # one line per failing rank; the full trace only with MODELCARVE_DEBUG
        rank = os.environ.get("RANK", "?")
        text = " ".join(str(err).split())
        if _lost_peer(err):
            text = (f"lost contact with another rank (it died or stalled; collective timeout {timeout_s:g}s), "
                    f"see the other ranks' errors; detail: {text[:300]}")
        else:
            text = f"{type(err).__name__}: {text[:600]}"
        sys.stderr.write(f"modelcarve: rank {rank}: {text}\n")
        if os.environ.get("MODELCARVE_DEBUG"):
            traceback.print_exc()
        code = 1
    if code:  # peers may be gone: tearing the group down could wait on them, so leave now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    destroy()
    return code


if __name__ == "__main__":
    sys.exit(main())
