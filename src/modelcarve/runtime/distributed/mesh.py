"""Process groups and the device mesh: the only place ranks are mapped to parallel axes.

``init_distributed(timeout_s)`` starts torch.distributed from torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT): gloo on CPU, NCCL on CUDA, with a timeout.
``build_mesh(layout)`` returns a ``DeviceMesh`` with dims ``("pp", "dp", "cp", "tp")``: TP
innermost (neighbouring ranks, one node), PP outermost, so
``rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i`` exactly as spec/layout.py states.

Every group carries the collective timeout: DeviceMesh would otherwise create its sub-groups
with torch's 30-minute default, and a dead rank would hang the others for half an hour. Groups
made outside the mesh (e.g. an expert-parallel group) should come from ``new_group`` below for
the same reason.

Accessors (``axis_group``, ``axis_rank``, ``axis_size``) take an axis name; merged groups
(``"dp_cp"``: all ranks that hold the same weights) and the HSDP 2-D mesh come from
``merged_mesh``, built once and cached.

Usage (under torchrun)::

    init_distributed(timeout_s=60)
    mesh = build_mesh(Layout.parse("tp=2,dp=2"))
    tp_group = axis_group(mesh, "tp")
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from modelcarve.runtime.distributed import host_shm
from modelcarve.spec.errors import LayoutError, ModelcarveError
from modelcarve.spec.layout import Layout
from modelcarve.spec.ranks import MESH_AXES

AXES = MESH_AXES
DEFAULT_TIMEOUT_S = 120.0

_state: dict = {"timeout": timedelta(seconds=DEFAULT_TIMEOUT_S), "merged": {}, "sealed": False}


def backend_name() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def collective_timeout() -> timedelta:
    """The timeout every group of this process uses."""
    return _state["timeout"]


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the process group described by torchrun's environment; returns (rank, world_size).

    Idempotent: a second call only returns the rank and size."""
    _state["timeout"] = timedelta(seconds=float(timeout_s))
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ModelcarveError(
            f"not started by torchrun: {', '.join(missing)} unset; launch with "
            "`modelcarve run ...` or `torchrun --nproc-per-node N -m modelcarve.commands.launching.worker run ...`"
        )
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's static rendezvous keeps ONE store across --max-restarts and torch adds no
        # per-attempt prefix, so restarted ranks would read the dead ranks' addresses: add it.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=_state["timeout"])
        store = dist.PrefixStore(f"modelcarve/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend=backend_name(), store=store, rank=rank, world_size=world,
                                timeout=_state["timeout"])
    else:
        dist.init_process_group(backend=backend_name(), timeout=_state["timeout"])
    return dist.get_rank(), dist.get_world_size()


def _options():
    """Backend options carrying our timeout (DeviceMesh sub-groups otherwise default to 30 min)."""
    if backend_name() == "gloo":
        opts = dist.ProcessGroupGloo._Options()
    else:  # pragma: no cover - needs CUDA
        opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = _state["timeout"]
    return opts


def is_fake() -> bool:
    """This process runs under torch's ``fake`` process group (runtime/dryrun), for every device
    type it names (``fake``, or ``cpu:fake,meta:fake`` where meta tensors are played too)."""
    return {part.split(":")[-1] for part in str(dist.get_backend()).split(",")} == {"fake"}


def device_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A DeviceMesh over every rank, ``arange(world).reshape(shape)`` (spec/ranks.py's order), with our timeout."""
    ranks = torch.arange(dist.get_world_size(), dtype=torch.int).reshape(shape)
    if is_fake():  # runtime/dryrun: torch's fake process group, no timeout to carry
        return DeviceMesh(device_type(), ranks, mesh_dim_names=names)
    override = tuple((backend_name(), _options()) for _ in names)
    return DeviceMesh(device_type(), ranks, mesh_dim_names=names, backend_override=override)


def check_world(layout: Layout, world_size: int) -> None:
    if layout.world_size != world_size:
        raise LayoutError(
            f"layout {layout.short()} needs dp x cp x tp x pp = {layout.dp} x {layout.cp} x {layout.tp} x "
            f"{layout.pp} = {layout.world_size} ranks but {world_size} were started; start "
            f"{layout.world_size} ranks (--nproc-per-node) or change the layout"
        )


def build_mesh(layout: Layout) -> DeviceMesh:
    """The ("pp", "dp", "cp", "tp") mesh of ``layout`` over all started ranks (TP innermost)."""
    if not dist.is_initialized():
        raise ModelcarveError("build_mesh needs init_distributed() first")
    check_world(layout, dist.get_world_size())
    _state["merged"], _state["sealed"] = {}, False
    mesh = device_mesh((layout.pp, layout.dp, layout.cp, layout.tp), AXES)
    _state["layout"] = layout
    return mesh


def axis_group(mesh: DeviceMesh, axis: str) -> dist.ProcessGroup:
    if axis in AXES:
        return mesh.get_group(axis)
    return merged_mesh(mesh, axis).get_group(0)


def axis_rank(mesh: DeviceMesh, axis: str) -> int:
    if axis in AXES:
        return mesh.get_local_rank(axis)
    return merged_mesh(mesh, axis).get_local_rank(0)


def axis_size(mesh: DeviceMesh, axis: str) -> int:
    if axis in AXES:
        return mesh.size(AXES.index(axis))
    return merged_mesh(mesh, axis).size(0)


def merged_mesh(mesh: DeviceMesh, name: str, hsdp_shard: int | None = None) -> DeviceMesh:
    """A mesh whose first dim merges adjacent axes, built once per name.

    ``name`` is axes joined by ``_`` in mesh order (``"dp_cp"``: the ranks holding the same
    weights). With ``hsdp_shard`` the merged axis is split into ``("replicate", "shard")``
    of sizes (merged / hsdp_shard, hsdp_shard) for HSDP; the result is then 2-D."""
    key = (name, hsdp_shard)
    if key in _state["merged"]:
        return _state["merged"][key]
    _check_open(f"the merged mesh {name!r}")
    parts = name.split("_")
    idx = [AXES.index(p) for p in parts]
    if idx != list(range(idx[0], idx[0] + len(idx))):
        raise ValueError(f"merged axes {parts} must be adjacent in mesh order {AXES}")
    sizes = list(mesh.shape)
    merged = 1
    for i in idx:
        merged *= sizes[i]
    before, after = sizes[: idx[0]], sizes[idx[-1] + 1 :]
    names_before, names_after = list(AXES[: idx[0]]), list(AXES[idx[-1] + 1 :])
    if hsdp_shard:
        mid, mid_names = [merged // hsdp_shard, hsdp_shard], [f"{name}_replicate", f"{name}_shard"]
    else:
        mid, mid_names = [merged], [name]
    # other dims get distinct names so the root mesh is valid; only the merged dims are sliced
    full = device_mesh(
        tuple(before + mid + after),
        tuple(f"_{n}" for n in names_before) + tuple(mid_names) + tuple(f"_{n}" for n in names_after),
    )
    sub = full[tuple(mid_names)] if len(mid_names) > 1 else full[mid_names[0]]
    _state["merged"][key] = sub
    return sub


def new_group(ranks: list[int]) -> dist.ProcessGroup:
    """A process group with the collective timeout (every rank must call this, in the same order)."""
    _check_open(f"a group of ranks {list(ranks)[:8]}")
    return dist.new_group(ranks, timeout=_state["timeout"])


def seal_groups(mesh: DeviceMesh) -> None:
    """Every group of this mesh exists (parallelize.create_groups made them all, eagerly, in one
    order): from now on asking for a new one is a bug, raised at once on the rank that asks,
    rather than a hang of the ranks that do not (new_group is a collective over the world).
    ``build_mesh`` opens a new mesh again."""
    _state["sealed"] = True


def _check_open(what: str) -> None:
    if _state["sealed"]:
        raise ModelcarveError(f"{what} was asked for after parallelize.create_groups sealed the mesh: create it "
                              "there, on every rank (a group made lazily by some ranks hangs the others)")


def destroy() -> None:
    host_shm.detach_all()
    if dist.is_initialized():
        dist.destroy_process_group()
    _state["merged"], _state["sealed"] = {}, False
