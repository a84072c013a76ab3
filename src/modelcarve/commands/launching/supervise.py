"""The launching process's watch over torchrun: forward signals to it, bring stragglers down, reap.

    code, ours, tail, signals, killed_after = supervise(cmd, env, timeout_s=30, restarts=0)

commands/launching/torchrun.py builds ``cmd`` and calls this; nothing else starts torchrun.

torchrun runs in its own session (so a terminal's Ctrl-C reaches only this process, which
forwards it once) and starts its workers in new sessions too, so nothing but this module's
forwarding reaches them:

* SIGTERM / SIGINT / SIGHUP to ``modelcarve run``: forwarded to torchrun, which sends it to every
  worker (the ranks stop after the current step, save a checkpoint when they have a checkpoint
  directory: runtime/distributed/signals.py) and waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (set here to the
  collective timeout + 10 s, enough to save) before it kills them. A second signal kills the
  whole tree at once.
* A rank failure (a ``modelcarve: rank N: ...`` line) without restarts left: the job is lost;
  after ``FAIL_GRACE_S`` for the other ranks to print their own line, every worker still alive
  (e.g. a stalled rank that never answers SIGTERM) is killed. A stalled rank therefore brings the
  run down in about the collective timeout (the peers' failure) plus FAIL_GRACE_S, not in
  torchrun's own extra 30 s shutdown wait.
* ``serve`` (``rank0_pid``): the first signal goes as SIGTERM to rank 0 alone, which drains and
  then releases the other ranks (serve/server.py); before rank 0 has written its pid it goes to
  torchrun as above. With ``stop_within_s``, ranks still running that long after the first
  signal are killed (``killed_after`` says when).
* Reaping: the worker pids are tracked while torchrun lives (its children); whatever survives
  torchrun is killed at the end, so no rank is left behind. The workers also watch this process
  (``MODELCARVE_LAUNCHER_PID``) and exit if it is killed outright.

Needs no torch: it only walks ``/proc`` (Linux; elsewhere the tracking is skipped).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

FAIL_GRACE_S = 0.5
"""After the first rank failure (and no restarts left): how long the others get to print and exit."""


def children_of(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc; empty where there is none)."""
    parents: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _start_time(pid: int) -> str | None:
    """The process's start time (guards against pid reuse); None once it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Supervisor:
    def __init__(self, cmd: list[str], env: dict, timeout_s: float, restarts: int, relay: tuple[str, ...] = ("modelcarve:",),
                 rank0_pid=None, stop_within_s: float | None = None):
        env = dict(env)
        env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(timeout_s) + 10))
        env["MODELCARVE_LAUNCHER_PID"] = str(os.getpid())
        self.restarts = restarts
        self.relay, self.rank0_pid, self.stop_within_s = relay, rank0_pid, stop_within_s
        self.first_signal_at: float | None = None
        self.killed_after: float | None = None
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.workers: dict[int, str | None] = {}
        self.signals: list[int] = []
        self.failed_at: float | None = None
        self.tail: list[str] = []
        self.ours: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            if line.startswith(self.relay):
                self.ours.append(line)
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
                if line.startswith("modelcarve: rank") and " stopped by " not in line and self.failed_at is None:
                    self.failed_at = time.monotonic()
            else:
                self.tail = (self.tail + [line])[-200:]

    def on_signal(self, signum, frame) -> None:
        self.signals.append(signum)
        if len(self.signals) == 1:
            self.first_signal_at = time.monotonic()
            rank0 = self.rank0_pid() if self.rank0_pid is not None else None
            if rank0:
                _kill(rank0, signal.SIGTERM)  # serve: rank 0 drains, then releases the others
            else:
                _kill(self.proc.pid, signum)
        else:
            self.kill_all()

    def track(self) -> None:
        for pid in children_of(self.proc.pid):
            if pid not in self.workers:
                self.workers[pid] = _start_time(pid)

    def kill_all(self) -> None:
        self.track()
        for pid in list(self.workers):
            if self.workers[pid] is not None and _start_time(pid) == self.workers[pid]:
                _kill(pid, signal.SIGKILL)
        _kill(self.proc.pid, signal.SIGKILL)

    def reap(self) -> None:
        """Kill whatever of the tracked workers outlived torchrun (pid reuse guarded by start time)."""
        alive = [pid for pid, t in self.workers.items() if t is not None and _start_time(pid) == t]
        for pid in alive:
            _kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 3
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [pid for pid in alive if _start_time(pid) == self.workers[pid]]
        for pid in alive:
            _kill(pid, signal.SIGKILL)

    def wait(self) -> int:
        while True:
            try:
                code = self.proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            self.track()
            if self.failed_at is not None and not self.restarts and time.monotonic() - self.failed_at > FAIL_GRACE_S:
                self.kill_all()
            since = time.monotonic() - self.first_signal_at if self.first_signal_at is not None else None
            if since is not None and self.stop_within_s is not None and since > self.stop_within_s and self.killed_after is None:
                self.killed_after = since
                self.kill_all()
        self.reader.join(timeout=5)
        self.reap()
        return code


def supervise(cmd: list[str], env: dict, timeout_s: float, restarts: int = 0, relay: tuple[str, ...] = ("modelcarve:",),
              rank0_pid=None, stop_within_s: float | None = None):
    """Run torchrun ``cmd``; (exit code, our stderr lines, the rest's tail, signals received, killed after s or None).

    Stderr lines starting with one of ``relay`` are passed through live; ``rank0_pid()`` (serve)
    gives the pid the first signal goes to, None until there is one."""
    sup = _Supervisor(cmd, env, timeout_s, restarts, relay, rank0_pid, stop_within_s)
    old = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            old[signum] = signal.signal(signum, sup.on_signal)
    try:
        code = sup.wait()
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)
    return code, sup.ours, sup.tail, sup.signals, sup.killed_after
