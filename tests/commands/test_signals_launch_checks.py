"""Rendezvous flags refused in one line before any rank starts; `modelcarve --version`."""

import os
import socket
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _cli(*argv):
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-m", "modelcarve.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=300)


RUN = ("run", "--model", "tiny-llama", "--layout", "dp=2,gbs=4,seq=16", "--steps", "2")


def test_master_port_in_use_and_empty_addr():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = _cli(*RUN, "--master-port", str(port))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--master-port {port} is in use" in lines[0], proc.stderr
    assert "starting" not in proc.stderr  # refused before torchrun was started
    proc = _cli(*RUN, "--master-addr", "")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "--master-addr" in proc.stderr
    proc = _cli(*RUN, "--master-port", "70000")
    assert proc.returncode == 2 and "--master-port" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_version():
    from modelcarve import __version__

    proc = _cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"modelcarve {__version__}"
