"""commands/launching/torchrun.py is the one launcher: the command it builds, and that nothing else builds one.

No processes are started here: the command line and environment are checked as data, and
src/ is read with ``ast`` (a string constant naming torchrun outside the launcher, other than
a docstring or comment-like bare string, is a second launcher).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from modelcarve.commands.launching.torchrun import TORCHRUN, Torchrun, environment

SRC = Path(__file__).resolve().parents[2] / "src"
LAUNCHER = SRC / "modelcarve" / "commands" / "launching" / "torchrun.py"


def _prose(tree: ast.AST) -> set[int]:
    """ids of the string constants that are statements of their own (docstrings, attribute notes)."""
    return {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}


def _torchrun_mentions(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    prose = _prose(tree)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            text = node.value.strip()
            if "torch.distributed.run" in text or text == "torchrun":  # the module, or the console script
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch.distributed.run", "torch.distributed.elastic.multiprocessing"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed" and any(a.name == "run" for a in node.names):
            lines.append(node.lineno)
    return lines


def test_only_the_launcher_builds_a_torchrun_command():
    offenders = {}
    for path in sorted((SRC / "modelcarve").rglob("*.py")):
        if path == LAUNCHER:
            continue
        found = _torchrun_mentions(path)
        if found:
            offenders[str(path.relative_to(SRC))] = found
    assert not offenders, f"torchrun command built outside commands/launching/torchrun.py: {offenders}"
    assert _torchrun_mentions(LAUNCHER), "the check no longer sees the launcher's own command"


def test_the_command_for_given_flags():
    ranks = Torchrun(nproc_per_node=4, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29600, max_restarts=3)
    cmd = ranks.command("modelcarve.commands.launching.worker", ["run", '{"steps": 2}'])
    assert cmd == [
        sys.executable, "-m", TORCHRUN,
        "--nproc-per-node=4", "--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=29600",
        "--max-restarts=3", "-m", "modelcarve.commands.launching.worker", "run", '{"steps": 2}',
    ]
    assert ranks.world_size == 8 and TORCHRUN == "torch.distributed.run"


def test_the_master_port_when_not_given():
    several = Torchrun(nproc_per_node=2, nnodes=2)
    assert several.port() == 29500  # every node must agree on it
    one = Torchrun(nproc_per_node=2)
    port = one.port()
    assert 0 < port < 65536  # a free one, whatever the OS picks
    cmd = one.command("m", [])
    assert sum(a.startswith("--master-port=") for a in cmd) == 1 and "--nnodes=1" in cmd and "--max-restarts=0" in cmd
    assert one.command("m", [], port=1234)[7] == "--master-port=1234"


def test_environment_defaults_and_what_the_caller_sets():
    env = environment({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR", "TORCHELASTIC_ERROR_FILE": ""}
    assert environment({"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "8"
