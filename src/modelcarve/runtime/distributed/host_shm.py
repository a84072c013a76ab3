"""Collectives through shared memory for the ranks of one group that sit on one host.

What it owns: the sum all-reduce and the all-gather of *small* CPU tensors between the ranks of
one process group whose members all run on this machine, without gloo. gloo moves even a 3 KB
all-reduce through loopback TCP sockets: on a small VM one call costs 0.6-1.9 ms of socket
wake-ups, and a tensor-parallel decode step makes two a layer (measured: 28 a token at tp=2 on a
12-layer llama, more time than the halved weight read saves). vLLM's CPU backend keeps these in
shared memory for the same reason. Here one call is a copy in, a flag, a wait, a sum.

How: ``attach(group)`` (a collective over ``group``) maps one file in ``/dev/shm`` into every
member: a flag word per rank (each in its own 64-byte line) and two sets ("parities") of one
slot per rank of ``SLOT_BYTES``. Collective number ``s`` (every member counts its calls; they
call in the same order, as gloo already requires) uses parity ``s % 2``: a rank copies its tensor
into its slot, stores ``s`` in its flag, waits until every flag reads ``>= s``, then reads all
slots. Two parities suffice: a rank writes parity ``s % 2`` again only at ``s + 2``, after it saw
every flag reach ``s + 1``, i.e. after every member finished reading collective ``s``. Every
member sums the slots in group-rank order, so all hold the same bits. The file is unlinked as
soon as all members mapped it (nothing is left in /dev/shm if a rank dies); its pages are reserved
at creation (``posix_fallocate``), so a /dev/shm too small for it declines instead of faulting.

The order argument relies on stores becoming visible in program order (x86's TSO): ``attach``
declines on other architectures, and where the members are not on one host (hostname and boot
id), the group is not gloo's, or ``MODELCARVE_SHM_COLLECTIVES=0``. Declined, or a tensor over
``SLOT_BYTES``, or a tensor that needs autograd: gloo as before (callers ask ``lookup(group)``
and fall back). A waiting rank spins, then yields its core, then naps, and raises after the
process's collective timeout (a member that died), instead of hanging.

Only the generation engine attaches (runtime/engine/model_runner.py, its TP group): its
collectives are then not seen by ``CommLog`` (collectives.py), which counts training's.
"""

from __future__ import annotations

import mmap
import os
import platform
import socket
import time
import uuid

import torch
import torch.distributed as dist

SLOT_BYTES = 4 << 20
"""One rank's slot per parity (a tp=2 prefill of ~1,300 tokens at hidden 768 in fp32 fits)."""

LINE = 64
"""Bytes between two ranks' flags (one cache line each)."""

_GROUPS: dict = {}
"""group name -> HostGroup, for the groups ``attach`` accepted in this process."""


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def _key(group) -> str:
    return group.group_name if group is not None else dist.group.WORLD.group_name


class HostGroup:
    """One group's mapped file and this rank's collective counter (see module doc)."""

    def __init__(self, mm: mmap.mmap, rank: int, size: int, timeout_s: float):
        self.mm, self.rank, self.size, self.timeout_s = mm, rank, size, timeout_s
        self.flags = memoryview(mm).cast("q")
        self.stride = LINE // 8
        self.data = torch.frombuffer(mm, dtype=torch.uint8)
        self.base = LINE * size
        self.seq = 0
        """Collectives this rank ran through the segment (each member's count is the same)."""

    def fits(self, x: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and not x.requires_grad and x.numel() * x.element_size() <= SLOT_BYTES)

    def _slot(self, parity: int, r: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        start = self.base + (parity * self.size + r) * SLOT_BYTES
        return self.data[start:start + n * dtype.itemsize].view(dtype)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Write ``x`` into this rank's slot, wait for every member's, return their slots (views
        valid until this rank's next-but-one collective)."""
        self.seq += 1
        s, parity, n = self.seq, self.seq & 1, x.numel()
        self._slot(parity, self.rank, x.dtype, n).copy_(x.reshape(-1))
        self.flags[self.rank * self.stride] = s
        for r in range(self.size):
            if r != self.rank:
                self._wait(r, s)
        return [self._slot(parity, r, x.dtype, n) for r in range(self.size)]

    def _wait(self, r: int, s: int) -> None:
        flags, at = self.flags, r * self.stride
        spins = 0
        deadline = None
        while flags[at] < s:
            spins += 1
            if spins < 200:
                continue
            if spins < 20000:
                os.sched_yield()
                continue
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s
            elif time.monotonic() > deadline:
                raise RuntimeError(f"shared-memory collective #{s}: group rank {r} did not arrive within "
                                   f"{self.timeout_s:.0f} s (did it exit?)")
            time.sleep(0.0002)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every member's ``x`` (contiguous), in group-rank order, written into ``x``."""
        slots = self._exchange(x)
        flat = x.view(-1)
        if self.size == 2:
            torch.add(slots[0], slots[1], out=flat)
        else:
            flat.copy_(slots[0])
            for part in slots[1:]:
                flat.add_(part)
        return x

    def gather_cat(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every member's ``x`` (same shape) concatenated along ``dim`` in group-rank order (a new tensor)."""
        slots = self._exchange(x)
        return torch.cat([part.view(x.shape) for part in slots], dim=dim)

    def close(self) -> None:
        """Drop this process's views. The mapping is not closed here: ``torch.frombuffer`` keeps a
        reference to the mmap but no buffer export, so ``mm.close()`` would unmap the memory under
        any slot view still alive; it is unmapped when the last object holding it goes."""
        self.data = None
        self.flags.release()
        self.mm = None


def lookup(group) -> HostGroup | None:
    """The attached HostGroup of ``group`` (None: not attached; use gloo)."""
    if not _GROUPS:
        return None
    return _GROUPS.get(_key(group))


def _declined(group) -> str | None:
    if os.environ.get("MODELCARVE_SHM_COLLECTIVES", "1") == "0":
        return "MODELCARVE_SHM_COLLECTIVES=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} (the flags' ordering is argued for x86 only)"
    if dist.get_backend(group) != "gloo":
        return f"backend {dist.get_backend(group)}"
    if not os.path.isdir("/dev/shm"):
        return "no /dev/shm"
    return None


def attach(group, timeout_s: float) -> str | None:
    """Map a shared segment for ``group`` on every member (a collective over ``group``). Returns
    None when attached, else why not (every member gets the same answer)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    reason = _declined(group)
    path = None
    if rank == 0 and reason is None:
        path = f"/dev/shm/modelcarve-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:  # reserved now, not on first touch: a full /dev/shm (a container's 64 MiB) declines here
                os.posix_fallocate(fd, 0, LINE * size + 2 * size * SLOT_BYTES)  # instead of a SIGBUS later
            finally:
                os.close(fd)
        except OSError as e:
            if os.path.exists(path):
                os.unlink(path)
            reason, path = f"cannot reserve {path}: {e}", None
    said = [None] * size
    dist.all_gather_object(said, (_host_id(), reason, path), group=group)
    reason = next((why for _, why, _ in said if why), None)
    if reason is None and len({host for host, _, _ in said}) > 1:
        reason = "members on more than one host"
    mm = None
    if reason is None:
        try:
            fd = os.open(said[0][2], os.O_RDWR)
            try:
                mm = mmap.mmap(fd, 0)
            finally:
                os.close(fd)
        except OSError as e:
            reason = f"cannot map {said[0][2]}: {e}"
    ok = torch.tensor([0 if reason else 1], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every member mapped it (or one failed)
    if rank == 0 and path:
        os.unlink(path)
    if int(ok[0]) == 0:
        if mm is not None:
            mm.close()
        return reason or "a member could not map the segment"
    detach(group)
    _GROUPS[_key(group)] = HostGroup(mm, rank, size, timeout_s)
    return None


def detach(group) -> None:
    """Unmap ``group``'s segment (its collectives go through gloo again)."""
    host = _GROUPS.pop(_key(group), None)
    if host is not None:
        host.close()


def detach_all() -> None:
    """Unmap every segment (the process group is going away: a later group may reuse a name)."""
    while _GROUPS:
        _GROUPS.popitem()[1].close()
