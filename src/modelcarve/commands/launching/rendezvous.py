"""Checks of torchrun's rendezvous flags before any rank starts, one line each.

    check_rendezvous(master_addr="127.0.0.1", master_port=29500, node_rank=0)

An empty ``--master-addr``, a port outside 1..65535, or a ``--master-port`` already in use on
this machine (checked where the store will listen: node 0) would otherwise surface as a torch
traceback from every rank after their start-up time, or as a hang.
"""

from __future__ import annotations

import errno
import socket

from modelcarve.spec.errors import ModelcarveError


def check_rendezvous(master_addr: str, master_port: int | None, node_rank: int = 0) -> None:
    if not master_addr or not master_addr.strip():
        raise ModelcarveError('--master-addr "" is empty; give the host name or IP of node 0 (127.0.0.1 on one machine)')
    if master_port is None:
        return
    if not 1 <= master_port <= 65535:
        raise ModelcarveError(f"--master-port {master_port} is not a TCP port; use 1..65535 or omit it for a free one")
    if node_rank != 0:
        return  # the store listens on node 0: only there can we test the port
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("" if master_addr not in ("127.0.0.1", "localhost") else "127.0.0.1", master_port))
    except OSError as err:
        if err.errno in (errno.EADDRINUSE, errno.EACCES):
            why = "is in use (another run or service holds it)" if err.errno == errno.EADDRINUSE else "needs privileges"
            raise ModelcarveError(f"--master-port {master_port} {why}; pick another port or omit --master-port "
                                  f"for a free one") from None
