"""Rank 0 of ``modelcarve serve`` holds its HTTP port from before the engine is built.

The engine's collectives open ephemeral ports (gloo's pairs, torchrun's store) while it loads; a
port the caller had found free could be taken by one of them before uvicorn bound it (CI once saw
``could not listen on 127.0.0.1:42725`` after ``engine ready on 2 rank(s)``). These checks stand in
for the engine with one that records whether the port could still be bound while it was built."""

from __future__ import annotations

import errno
import socket

import pytest

import modelcarve.runtime.engine.engine as engine_mod
from modelcarve.serve import server
from modelcarve.spec.errors import ModelcarveError


class _Built(Exception):
    pass


def _probe_engine(seen: dict):
    class FakeEngine:
        def __init__(self, cfg):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", seen["port"]))
                    seen["bound_by_other"] = True
                except OSError as err:
                    seen["bound_by_other"] = err.errno != errno.EADDRINUSE
            raise _Built

    return FakeEngine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("rank, held", [("0", True), ("1", False)])
def test_rank0_holds_the_port_while_the_engine_builds(monkeypatch, rank, held):
    seen = {"port": _free_port()}
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(engine_mod, "Engine", _probe_engine(seen))
    with pytest.raises(_Built):
        server.serve_worker(model="unused", layout="tp=1", port=seen["port"])
    assert seen["bound_by_other"] is (not held)


def test_taken_port_refused_in_one_line_before_the_engine(monkeypatch):
    seen = {"port": 0}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(engine_mod, "Engine", _probe_engine(seen))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ModelcarveError, match=f"port {port} on 127.0.0.1 is already in use"):
            server.serve_worker(model="unused", layout="tp=1", port=port)
    assert "bound_by_other" not in seen  # the engine was never built


def test_bind_listener_reports_the_port_it_holds():
    sock = server.bind_listener("127.0.0.1", 0)
    try:
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()
