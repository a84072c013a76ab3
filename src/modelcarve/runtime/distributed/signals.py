"""A rank's answer to signals and to losing its launcher: stop together, save first, never linger.

``install(grace_s)`` (launch.main, under torchrun) does three things:

* SIGTERM / SIGINT set a stop flag. The training loop asks ``stop_agreed()`` after every step: one
  all-reduce (MAX) of the flag over the world, so every rank stops after the SAME step, saves a
  checkpoint there when ``--checkpoint-dir`` is set (preemption), and exits. The flag is also
  raised from a watcher thread fed by ``signal.set_wakeup_fd``, which fires even while the main
  thread is blocked inside a collective (Python runs signal handlers only between bytecodes):
  if the rank has not exited ``grace_s`` (the collective timeout) after the signal, the watcher
  ends the process; a second signal ends it at once.
* Parent watch: torchrun starts its workers in new sessions, so when torchrun itself is killed
  (SIGKILL) nothing reaches them. The watcher thread polls the parent pid; once the rank has
  been re-parented it prints one line and exits. It also watches ``modelcarve run``'s own pid
  (``MODELCARVE_LAUNCHER_PID``, set by commands/launching/supervise.py), so killing the launcher with
  SIGKILL ends the ranks too (and torchrun, which then sees them fail).
* Exit codes: 128 + the signal number, as a shell reports a signal.
* A fatal signal (SIGABRT from a C++ ``std::terminate``, SIGSEGV, ...) prints every thread's Python
  stack (``faulthandler``) before the rank dies: the launcher's failure report
  (commands/launching/torchrun.py ``failure_text``) keeps it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

_state = {"installed": False, "signal": 0, "since": 0.0}
_flag = threading.Event()


def installed() -> bool:
    return _state["installed"]


def stop_requested() -> int:
    """The signal number that asked this rank to stop (0: none)."""
    return _state["signal"] if _flag.is_set() else 0


def _on_signal(signum, frame) -> None:  # runs in the main thread between bytecodes
    _raise(signum)


def _raise(signum: int) -> None:
    if _flag.is_set() and signum:
        if time.monotonic() - _state["since"] > 0.5:  # a second, separate signal: leave now
            _exit(signum, "a second signal")
        return
    _state["signal"], _state["since"] = signum, time.monotonic()
    _flag.set()


def _exit(signum: int, why: str) -> None:
    rank = os.environ.get("RANK", "?")
    try:
        sys.stderr.write(f"modelcarve: rank {rank}: stopped by {signal.Signals(signum).name} ({why})\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(128 + signum)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch(read_fd: int, grace_s: float, parent: int, launcher: int) -> None:
    import select

    while True:
        ready, _, _ = select.select([read_fd], [], [], 0.5)
        if ready:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                data = b""
            for signum in data:
                if signum in (signal.SIGTERM, signal.SIGINT):
                    _raise(signum)
        if _flag.is_set() and time.monotonic() - _state["since"] > grace_s:
            _exit(_state["signal"], f"did not reach the end of a step within {grace_s:g}s")
        gone = parent if parent and os.getppid() != parent else launcher if launcher and not _alive(launcher) else 0
        if gone:
            rank = os.environ.get("RANK", "?")
            sys.stderr.write(f"modelcarve: rank {rank}: its launcher (pid {gone}) is gone; exiting\n")
            sys.stderr.flush()
            os._exit(1)


def install(grace_s: float, watch_parent: bool = True) -> None:
    """Handle SIGTERM/SIGINT and watch the parent (main thread only; once per process)."""
    if _state["installed"] or threading.current_thread() is not threading.main_thread():
        return
    import faulthandler

    try:  # a fatal signal (SIGABRT of a C++ terminate, SIGSEGV) prints every thread's stack
        faulthandler.enable(all_threads=True)
    except (AttributeError, RuntimeError, ValueError, OSError):  # no stderr file descriptor to write it to
        pass
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _on_signal)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    parent = os.getppid() if watch_parent else 0
    launcher = int(os.environ.get("MODELCARVE_LAUNCHER_PID", "0") or 0) if watch_parent else 0
    threading.Thread(target=_watch, args=(read_fd, grace_s, parent, launcher), daemon=True, name="modelcarve-signals").start()
    _state["installed"] = True


def stop_agreed() -> int:
    """Collective: the signal any rank received (0: carry on). Every rank returns the same value."""
    if not _state["installed"]:
        return 0
    import torch
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([stop_requested()], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())
