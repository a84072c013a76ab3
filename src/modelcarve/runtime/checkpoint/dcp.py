"""Save and load a training state with torch.distributed.checkpoint, keyed by the FULL model's names.

Every tensor a rank holds is a rectangular box of one tensor of the unsplit model: TP/EP slices
(shards.py's records), FSDP2's DTensor shard inside that, the pipeline stage's own layers (chunk
FQNs equal the full model's), the tied LM head's copy (saved under the embedding's name),
vocabulary padding cut off at the true size (shards.py's ``padding_of``). ``entries(chunks)``
lists those boxes, with checkpoint.py's ``_slices_for`` (the same arithmetic the safetensors
loader uses). The planners below hand DCP each box as a chunk ``(offsets, sizes)`` of a tensor of
the full size, so the checkpoint on disk does not depend on the layout that wrote it: DCP's
resharding reads any other layout's boxes from it (tp2 x pp2 written, dp4 or FSDP read).

Keys: ``model.<fqn>`` (parameters and persistent buffers), ``optim.<fqn>.{exp_avg,exp_avg_sq,
step}`` (AdamW, ZeRO-1's partition included: a rank saves and loads the state of the parameters
its optimiser owns), ``rng.rank<r>`` (each rank's torch generator). Everything else a resume needs
(step, data position, learning rate) is JSON in the manifest (ckpt_commit.py), not pickled.

Loading reads ``.metadata`` through a restricted unpickler (DCP writes it with pickle) that only
rebuilds DCP's own metadata classes; the tensors themselves are read by DCP with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from modelcarve.runtime.checkpoint.hf_load import _saved_tensors, _slices_for
from modelcarve.runtime.distributed.shards import tied_copy_names
from modelcarve.spec.errors import ModelcarveError


@dataclass
class Box:
    """This rank's ``local`` tensor is ``full[offsets : offsets + local.shape]`` of a tensor of ``size``."""

    local: torch.Tensor
    offsets: tuple[int, ...]
    size: tuple[int, ...]


def full_shapes(spec) -> dict[str, tuple[int, ...]]:
    from modelcarve.runtime.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(spec)
    return {fqn: tuple(t.shape) for fqn, t in _saved_tensors(model)}


def model_hash(spec) -> str:
    """Names, full shapes and family of the model: a checkpoint only resumes into the same model."""
    import hashlib

    text = repr((spec.family, sorted(full_shapes(spec).items())))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _box(chunk: nn.Module, fqn: str, tensor: torch.Tensor, param, shape: tuple[int, ...]) -> Box | None:
    from modelcarve.runtime.distributed.shards import padding_of

    shape = list(shape)
    pad = padding_of(chunk).get(fqn)
    if pad:
        shape[pad[0]] = pad[2]
    start, length = _slices_for(chunk, fqn, param, shape)
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if pad:  # the rows past the true vocabulary are padding: not part of the model
        d, true = pad[0], pad[1]
        keep = max(0, min(start[d] + length[d], true) - start[d])
        if keep == 0:
            return None
        local = local.narrow(d, 0, keep)
        shape[d] = true
    return Box(local, tuple(start), tuple(shape))


def model_entries(chunks: list[nn.Module], spec, optimizer=None) -> tuple[dict[str, Box], dict[int, tuple[str, nn.Module, str]]]:
    """``{key: Box}`` of every saved tensor on this rank, and ``{id(param): (fqn key, chunk, local fqn)}``.
    With ``optimizer`` holding fp32 master weights of low-precision parameters (mixed-precision
    ZeRO: ``master_params()``), the masters are saved / loaded in their place: a checkpoint is
    always the full-precision state (call the optimiser's ``after_load`` after a load)."""
    masters = getattr(optimizer, "master_params", dict)()
    shapes = full_shapes(spec)
    boxes: dict[str, Box] = {}
    owners: dict[int, tuple[str, nn.Module, str]] = {}
    for chunk in chunks:
        tied = tied_copy_names(chunk)
        for fqn, t in _saved_tensors(chunk):
            name = tied.get(fqn, fqn)
            if name not in shapes:
                raise ModelcarveError(f"{fqn}: not a tensor of the full {spec.name} model; cannot checkpoint it")
            box = _box(chunk, fqn, masters.get(id(t), t), t, shapes[name])
            owners[id(t)] = (name, chunk, fqn)
            if box is not None:
                boxes[f"model.{name}"] = box
    return boxes, owners


def base_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The AdamW instances that hold state: ZeRO-1/2's per-parameter view (zero_optimizer.py), each of several."""
    if hasattr(optimizer, "checkpoint_view"):
        return [optimizer.checkpoint_view()]
    if hasattr(optimizer, "optimizers"):
        return [o for sub in optimizer.optimizers for o in base_optimizers(sub)]
    return [getattr(optimizer, "optim", optimizer)]


def init_optimizer_state(optimizer) -> None:
    """AdamW's lazily created state, made now (zeros) so that a load has tensors to fill."""
    for opt in base_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state.get(p):
                    # fp32 moments also beside bf16 parameters (mixed-precision ZeRO's view)
                    opt.state[p] = dict(step=torch.tensor(0.0, dtype=torch.float32),
                                        exp_avg=torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format),
                                        exp_avg_sq=torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format))


def optimizer_entries(optimizer, owners, spec) -> dict[str, Box]:
    shapes = full_shapes(spec)
    boxes: dict[str, Box] = {}
    for opt in base_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                name, chunk, fqn = owners[id(p)]
                for kind, value in opt.state.get(p, {}).items():
                    if kind == "step":
                        boxes[f"optim.{name}.step"] = Box(value.reshape(()), (), ())
                    elif isinstance(value, torch.Tensor) and value.shape == p.shape:
                        box = _box(chunk, fqn, value, p, shapes[name])
                        if box is not None:
                            boxes[f"optim.{name}.{kind}"] = box
    return boxes


def rng_entries(load: bool) -> dict[str, Box]:
    state = torch.get_rng_state()
    return {f"rng.rank{dist.get_rank()}": Box(torch.empty_like(state) if load else state, (0,), tuple(state.shape))}


# --- planners: a Box is a chunk of the full tensor --------------------------------------


class _BoxSavePlanner(DefaultSavePlanner):
    def __init__(self, boxes: dict[str, Box]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, box in self.boxes.items():
            offsets = torch.Size(box.offsets)
            items.append(WriteItem(
                index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=box.local.shape),
                                            properties=TensorProperties.create_from_tensor(box.local),
                                            size=torch.Size(box.size))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        return self.boxes[index.fqn].local


class _BoxLoadPlanner(DefaultLoadPlanner):
    def __init__(self, boxes: dict[str, Box], step_dir: Path):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes, self.step_dir = boxes, step_dir

    def create_local_plan(self) -> LoadPlan:
        items = []
        stored = self.metadata.state_dict_metadata
        for key, box in self.boxes.items():
            md = stored.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise ModelcarveError(f"checkpoint {self.step_dir} has no tensor {key!r}; it was saved for "
                                      f"another model or another optimiser")
            if tuple(md.size) != tuple(box.size):
                raise ModelcarveError(f"checkpoint {self.step_dir}: {key} has shape {tuple(md.size)}, the model "
                                      f"{tuple(box.size)}")
            chunk = ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=box.local.shape)
            items += create_read_items_for_chunk_list(key, md, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.boxes[index.fqn].local


_ALLOWED = {("torch", "Size"), ("torch", "float32"), ("torch", "float64"), ("torch", "bfloat16"), ("torch", "float16"),
            ("torch", "uint8"), ("torch", "int64"), ("torch", "int32"), ("torch", "bool"), ("torch", "strided"),
            ("torch", "contiguous_format"), ("torch", "preserve_format"), ("collections", "OrderedDict"),
            ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
            ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("builtins", "set"), ("builtins", "frozenset")}


class _MetadataUnpickler(pickle.Unpickler):
    """Only DCP's own metadata dataclasses and the torch enums they hold: nothing that runs code."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        data = (Path(self.path) / ".metadata").read_bytes()
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except Exception as err:  # noqa: BLE001 - any failure is a damaged file
            raise ModelcarveError(f"checkpoint {self.path}: .metadata is not readable DCP metadata ({err})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        if metadata.planner_data is None:
            metadata.planner_data = {}
        return metadata


def save_state(path: Path, boxes: dict[str, Box]) -> None:
    """Every rank writes its boxes into ``path`` (collective; DCP de-duplicates replicas)."""
    boxes = {k: Box(b.local.detach().contiguous().clone() if b.local.data_ptr() and not _whole(b.local) else b.local.detach(),
                    b.offsets, b.size) for k, b in boxes.items()}
    dcp.save({k: b.local for k, b in boxes.items()}, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True),
             planner=_BoxSavePlanner(boxes))


def _whole(t: torch.Tensor) -> bool:
    """The tensor owns all of its storage (torch.save would otherwise write the whole storage)."""
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


@torch.no_grad()
def load_state(path: Path, boxes: dict[str, Box]) -> None:
    """Fill every box from ``path`` in place (collective)."""
    dcp.load({k: b.local for k, b in boxes.items()}, storage_reader=_SafeReader(str(path)),
             planner=_BoxLoadPlanner(boxes, path))


def stored_keys(path: Path) -> set[str]:
    return set(_SafeReader(str(path)).read_metadata().state_dict_metadata)
