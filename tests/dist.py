"""Shared multi-process test harness: run a function in N real gloo processes.

    from dist import run_distributed
    results = run_distributed(worker, 4, arg1, arg2, timeout=120)   # one result per rank

Each rank is a fresh process (forked from multiprocessing's fork server, see ``_context``) with
torchrun's environment (MASTER_ADDR=127.0.0.1,
a free MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, OMP_NUM_THREADS=1); the process group is
initialised (gloo, ``collective_s`` timeout on every group) before ``fn(*args)`` runs, unless
``init=False``. ``fn`` must be a module-level function of an importable module (a test file is
fine: spawn re-imports it). Results must be picklable. If any rank raises, ``DistError`` carries
every failing rank's traceback; ranks still running after the first failure get ``grace_s``
to finish (they usually fail on their own collective timeout) and are then killed, so a test
never hangs past ``timeout``.

Starting a rank used to cost seconds (every spawned rank imported torch, the package and the test
module anew: 6.5 s for a 4-rank world on the 2 shared cores). The ranks now fork from one fork
server per test session that imported torch and the runtime once (``PRELOAD``), before any
tensor op or thread: a 4-rank world starts in ~0.1-0.4 s. Still run one group per world size and
loop over many cases inside it (see ``cases`` helpers in tests/runtime/test_runtime_layouts.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback


class DistError(RuntimeError):
    """One or more ranks failed; the message holds each rank's error text."""

    def __init__(self, message: str, errors: dict[int, str]):
        super().__init__(message)
        self.errors = errors


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, args, rank, world_size, port, out, init, collective_s, env):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    os.environ.update(env or {})
    try:
        import torch

        torch.set_num_threads(1)
        if init:
            from datetime import timedelta

            import torch.distributed as dist

            from modelcarve.runtime.distributed.mesh import init_distributed

            # Joining waits up to JOIN_S for the other ranks, whatever collective_s is: on a
            # loaded machine importing torch can take one rank many seconds longer than another,
            # and a test of a 5 s collective timeout must not fail at the rendezvous instead.
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                                  timeout=timedelta(seconds=max(JOIN_S, collective_s)))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=collective_s))
            init_distributed(timeout_s=collective_s)  # already joined: sets the sub-groups' timeout
        result = fn(*args)
        out.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        out.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


PRELOAD = ["torch", "torch.distributed", "modelcarve.runtime.train.launch", "modelcarve.verify.reference",
           "modelcarve.verify.against_plan", "modelcarve.runtime.engine.engine", "transformers", "torch._dynamo"]
"""Imported once by the fork server (only imports: no tensor op, no thread, no process group runs
there), so a rank's fork starts with them loaded. ``torch._dynamo`` is imported by torch itself on
the first optimiser or checkpoint a rank builds (``torch._compile._disable_dynamo``): 0.5 s a rank,
every world, when it was left to the ranks. Each rank still sets its own environment,
threads (``torch.set_num_threads(1)``) and process group. The fork server inherits this
process's environment when it starts (OMP_NUM_THREADS=1 under ``make test``)."""
_CTX = None


def _context():
    """multiprocessing's fork-server context, started once (at the first world) with ``PRELOAD``."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


_PORT_TAKEN = ("EADDRINUSE", "address already in use")
JOIN_S = 300.0
"""How long a rank waits at start-up for the others to join (not a collective timeout)."""


def run_distributed(
    fn,
    world_size: int,
    *args,
    timeout: float = 180.0,
    collective_s: float = 60.0,
    init: bool = True,
    grace_s: float | None = None,
    env: dict | None = None,
) -> list:
    """Run ``fn(*args)`` on ``world_size`` ranks; return the list of results by rank.

    The free port is picked before the ranks start, so another process on this shared machine
    can take it meanwhile: that (and only that) failure is retried with a new port."""
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, timeout, collective_s, init, grace_s, env)
        except DistError as err:
            if attempt == 2 or not any(k in text for text in err.errors.values() for k in _PORT_TAKEN):
                raise
    raise AssertionError("unreachable")


def _run_once(fn, world_size, args, timeout, collective_s, init, grace_s, env) -> list:
    ctx = _context()
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, args, r, world_size, port, out, init, collective_s, env), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    grace = collective_s + 15 if grace_s is None else grace_s
    first_error: float | None = None
    try:
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            if first_error is not None:
                deadline = min(deadline, first_error + grace)
            if now > deadline:
                break
            try:
                rank, status, value = out.get(timeout=0.5)
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(procs)
                    if not p.is_alive() and r not in results and r not in errors and p.exitcode not in (0, None)
                ]
                for r in dead:
                    time.sleep(0.5)  # a late queue message may still be in flight
                    try:
                        while True:
                            rr, status, value = out.get_nowait()
                            (results if status == "ok" else errors)[rr] = value
                    except queue.Empty:
                        pass
                    if r not in results and r not in errors:
                        errors[r] = f"rank {r} died with exit code {procs[r].exitcode} and no traceback"
                if errors and first_error is None:
                    first_error = time.monotonic()
                continue
            if status == "ok":
                results[rank] = value
            else:
                errors[rank] = value
                if first_error is None:
                    first_error = time.monotonic()
    finally:
        for p in procs:
            p.join(timeout=5 if not errors and len(results) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    missing = [r for r in range(world_size) if r not in results and r not in errors]
    for r in missing:
        errors[r] = f"rank {r} did not finish within {timeout:.0f}s (killed)"
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
        raise DistError(f"{len(errors)} of {world_size} ranks failed:\n{text}", errors)
    return [results[r] for r in range(world_size)]
