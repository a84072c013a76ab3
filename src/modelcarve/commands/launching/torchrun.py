"""The one place a torchrun command is built and run: ``run``, ``verify``, ``generate`` and ``serve`` start their ranks here.

    ranks = Torchrun(nproc_per_node=2, nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=None)
    code = launch(ranks, "modelcarve.commands.launching.worker", ["run", json.dumps(payload)], timeout_s=120)

``Torchrun.command`` is the command line (``python -m torch.distributed.run --nproc-per-node ...
--max-restarts ... -m MODULE ARGS``; the master port, when not given, is a free one on one node
and 29500 on several); ``environment`` the ranks' environment (OMP_NUM_THREADS=1 and torchrun's
own failure summary off unless the caller's environment says otherwise). ``launch`` runs it under
commands/launching/supervise.py, which forwards this process's signals (to torchrun, or with
``rank0_pidfile`` to rank 0 alone: serve's drain), passes our ranks' ``modelcarve:`` lines through
live, brings the ranks down after a rank failure and reaps them. When torchrun exits non-zero and
no rank printed its own error (a rank crashed in C++, was killed, torchrun itself failed) or a rank
crashed (its peers then print only that they lost contact), one line says so, followed by what
the ranks printed last (a crash's stacks from the first line of it) and the end of torchrun's
report (its root cause: which rank, which exit code or signal).

Exit code: torchrun's; without ``rank0_pidfile`` a signal makes it 128 + the signal number, as a
shell reports one (``modelcarve: stopped by SIGTERM``).
"""

from __future__ import annotations

import os
import re
import signal
import sys
from dataclasses import dataclass

TORCHRUN = "torch.distributed.run"
"""torchrun's module; tests/commands/test_launcher.py checks that no other module of src/ names it."""


def free_port() -> int:
    """A TCP port nobody listens on now (for the rendezvous store on one node)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Torchrun:
    """torchrun's flags: how many ranks, on which node, where the rendezvous is, how many restarts."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    max_restarts: int = 0

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def port(self) -> int:
        """``--master-port``, else a free port on one node and 29500 (every node must agree) on several."""
        return self.master_port or (free_port() if self.nnodes == 1 else 29500)

    def command(self, module: str, argv: list[str], port: int | None = None) -> list[str]:
        """``python -m torch.distributed.run <flags> -m module argv...``."""
        return [
            sys.executable, "-m", TORCHRUN,
            f"--nproc-per-node={self.nproc_per_node}", f"--nnodes={self.nnodes}", f"--node-rank={self.node_rank}",
            f"--master-addr={self.master_addr}", f"--master-port={self.port() if port is None else port}",
            f"--max-restarts={self.max_restarts}",
            "-m", module, *argv,
        ]


def environment(base: dict | None = None) -> dict:
    """The ranks' environment: ``base`` (default: ours) with one thread per rank and torchrun quiet,
    unless ``base`` sets them (torchrun's own failure summary is long; our ranks print one line each)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("LOGLEVEL", "ERROR")
    env.setdefault("TORCHELASTIC_ERROR_FILE", "")
    return env


def _name_interface(env: dict, master_addr: str) -> None:
    """Several nodes: the ranks' sockets on the interface that routes to node 0 (rendezvous.py's
    ``route_interface``), unless the caller named one (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``)."""
    from modelcarve.commands.launching.rendezvous import route_interface

    if "GLOO_SOCKET_IFNAME" in env and "NCCL_SOCKET_IFNAME" in env:
        return
    found = route_interface(master_addr)
    if found is None:
        return
    env.setdefault("GLOO_SOCKET_IFNAME", found[0])
    env.setdefault("NCCL_SOCKET_IFNAME", found[0])
    if env.get("MODELCARVE_PROGRESS") == "1" or sys.stderr.isatty():
        sys.stderr.write(f"modelcarve: this node's ranks talk over {found[0]} ({found[1]}), the route to "
                         f"--master-addr {master_addr}\n")


def _read_pid(path: str) -> int | None:
    try:
        return int(open(path).read().strip())
    except (OSError, ValueError):
        return None


def launch(ranks: Torchrun, module: str, argv: list[str], *, timeout_s: float, relay: tuple[str, ...] = ("modelcarve:",),
           rank0_pidfile: str | None = None, stop_within_s: float | None = None) -> int:
    """Start torchrun on ``module argv`` and supervise it to the end; its exit code (see the module docstring).

    ``timeout_s``: the ranks' collective timeout (torchrun's shutdown wait is set from it).
    ``relay``: stderr line prefixes passed through live (the rest is kept for a failure report).
    ``rank0_pidfile``: where rank 0 writes its pid; the first signal goes there alone (serve).
    ``stop_within_s``: ranks still running that long after the first signal are killed."""
    from modelcarve.commands.launching.supervise import supervise

    env = environment()
    if ranks.nnodes > 1:
        _name_interface(env, ranks.master_addr)
    if sys.stderr.isatty() or os.environ.get("MODELCARVE_PROGRESS") == "1":  # start-up lines for a person watching
        env["MODELCARVE_PROGRESS"] = "1"
        sys.stderr.write(f"modelcarve: starting {ranks.world_size} ranks with torchrun "
                         f"({ranks.nproc_per_node} on this node)\n")
    rank0 = (lambda: _read_pid(rank0_pidfile)) if rank0_pidfile else None
    code, ours, tail, signals, killed_after = supervise(
        ranks.command(module, argv), env, timeout_s=timeout_s, restarts=ranks.max_restarts, relay=relay,
        rank0_pid=rank0, stop_within_s=stop_within_s)
    if killed_after is not None:
        sys.stderr.write(f"modelcarve: the ranks were still running {killed_after:.0f} s after the signal; killed them\n")
        return code or 1
    if signals and rank0_pidfile is None:
        sys.stderr.write(f"modelcarve: stopped by {signal.Signals(signals[0]).name}\n")
        return 128 + signals[0]
    crashed = any(map(is_crash_line, tail))  # its peers' "lost contact" lines are not why
    if code and (crashed or not any(line.startswith("modelcarve: rank") for line in ours)) and (not signals or rank0_pidfile):
        report_failure(code, tail)  # serve: a drain that ended in a failed rank says so too
    return code


TORCHRUN_BLOCK = re.compile(r"^[EWI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ .*torch/distributed/elastic/")
"""The first line of torchrun's own failure report (its logger's ``E1206 20:21:57.644000 6850 .../elastic/...``)."""


def report_failure(code: int, tail: list[str]) -> None:
    """No rank said why (a crash in C++, a killed rank, torchrun itself), or a rank crashed (its peers said
    only that they lost contact): one line, then the ranks' last output (what a rank printed before it
    died: ``terminate called ...``, ``Fatal Python error ...``) and the end of torchrun's report (its
    root cause: which rank, which exit code or signal).

    torchrun's report follows the ranks' output and is about 40 lines of its own traceback, so a
    plain tail would show only that."""
    sys.stderr.write(f"modelcarve: the ranks' launcher (torchrun) exited with code {code}; its last output:\n")
    sys.stderr.write(failure_text(tail))


CRASH_START = ("terminate called", "Fatal Python error")
"""How a rank's own crash report begins (C++'s std::terminate, Python's fatal error; the latter followed by
faulthandler's stacks of every thread, which signals.install enables on every rank)."""


def is_crash_line(line: str) -> bool:
    return line.lstrip().startswith(CRASH_START)


def failure_text(tail: list[str]) -> str:
    """The ranks' last output before torchrun's report, then the report's last 12 lines (see ``report_failure``).

    The ranks' part starts at the first crash line (``CRASH_START``) of their last 120 lines, so every
    thread's stack that faulthandler printed is kept (at most 120 lines, 8,000 characters); without one,
    their last 30 lines."""
    lines = [line for line in tail if not line.startswith("modelcarve:")]
    start = next((i for i, line in enumerate(lines) if TORCHRUN_BLOCK.match(line)), len(lines))
    ranks, torchrun = lines[:start][-120:], lines[start:][-12:]
    crash = next((i for i, line in enumerate(ranks) if is_crash_line(line)), None)
    ranks = ranks[crash:] if crash is not None else ranks[-30:]
    parts = []
    if ranks:
        parts.append("\n".join(ranks)[-8000:])
    if torchrun:
        parts.append(("...\n" if len(lines) - start > 12 else "") + "\n".join(torchrun)[-2000:])
    return "".join(part + "\n" for part in parts)
