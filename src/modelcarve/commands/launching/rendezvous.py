"""Checks of torchrun's rendezvous flags before any rank starts, one line each.

    check_rendezvous(master_addr="127.0.0.1", master_port=29500, node_rank=0)

An empty ``--master-addr``, a port outside 1..65535, or a ``--master-port`` already in use on
this machine (checked where the store will listen: node 0) would otherwise surface as a torch
traceback from every rank after their start-up time, or as a hang.

    route_interface("10.0.0.1")   # -> ("eth0", "10.0.0.2"): this machine's interface towards node 0

On several nodes the ranks' gloo (and NCCL's bootstrap) sockets bind to the address the machine's
host name resolves to unless ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` say otherwise; where
the host name resolves to a loopback address (``127.0.1.1 host`` in /etc/hosts is the Debian
default) every rank advertises 127.0.0.1 and the other node's ranks fail "connection refused"
after the collective timeout. ``route_interface`` finds the interface the kernel would route to
``--master-addr`` through, so the launcher can name it (torchrun.py).
"""

from __future__ import annotations

import errno
import socket
import struct

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


_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def _interface_address(sock: socket.socket, name: str) -> str | None:
    import fcntl

    try:
        packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None  # no IPv4 address on it
    return socket.inet_ntoa(packed[20:24])


def route_interface(master_addr: str) -> tuple[str, str] | None:
    """``(interface name, local IPv4 address)`` this machine reaches ``master_addr`` through, or None
    when it cannot tell (an unresolvable name, no route, IPv6 only, not Linux). No packet is sent: a
    UDP socket's ``connect`` only asks the kernel for the route."""
    try:
        master_ip = socket.getaddrinfo(master_addr, None, socket.AF_INET)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master_ip, 9))
            local = probe.getsockname()[0]
            for _, name in socket.if_nameindex():
                if _interface_address(probe, name) == local:
                    return name, local
    except (OSError, ImportError, IndexError):
        return None
    return None
