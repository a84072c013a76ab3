"""What a checkpoint directory holds, read from its listing and safetensors headers only (no torch).

``list_checkpoint(path)`` is what ``run``/``verify`` check before any rank starts: which weight
files there are, the index (``model.safetensors.index.json``) and where its ``weight_map`` points,
and every safetensors header (8-byte little-endian length, then a JSON table of tensor name ->
dtype, shape, byte offsets). Each problem is one SpecError naming the file: a truncated or garbage
file, a shard the index names that is missing, an index without ``weight_map``, a ``weight_map``
entry pointing outside the directory (``../x.safetensors``), a directory that holds only
``pytorch_model*.bin`` (pickles: never loaded, on purpose) or only ``config.json``. Tensor contents
(NaN/Inf) are checked where they are read, in the ranks (runtime/checkpoint/hf_load.py).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import modelcarve.spec.files as files
from modelcarve.spec.errors import SpecError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 2**20
"""The safetensors format's own limit on the JSON header."""
FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
OTHER_DTYPES = {"I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class TensorEntry:
    file: str
    """File name inside the checkpoint directory."""
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Listing:
    """A checkpoint directory's weights, or why it has none."""

    path: Path
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    bin_files: list[str] = field(default_factory=list)
    has_config: bool = False

    @property
    def has_weights(self) -> bool:
        return bool(self.tensors)


def read_header(file: Path, label: str | None = None) -> dict[str, TensorEntry]:
    """The tensor table of one safetensors file, checked against the file's size."""
    label = label or str(file)
    bad = f"{label} is not a valid safetensors file"
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SpecError(f"{bad}: {size} bytes, shorter than its 8-byte header length (truncated?)")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise SpecError(f"{bad}: its header claims {length:,} bytes but the file has {size:,} "
                                f"(truncated or not safetensors)")
            header_bytes = f.read(length)
    except OSError as err:
        raise SpecError(f"{label}: cannot read ({err.strerror or err})") from None
    header = files.loads_json(files.decode(header_bytes, bad), bad)
    if not isinstance(header, dict):
        raise SpecError(f"{bad}: its header is not a JSON object")
    data_bytes = size - 8 - length
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not isinstance(info.get("dtype"), str) \
                or not isinstance(info.get("shape"), list) or not isinstance(info.get("data_offsets"), list):
            raise SpecError(f"{bad}: entry {name[:80]!r} lacks dtype, shape or data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        itemsize = FLOAT_DTYPES.get(dtype) or OTHER_DTYPES.get(dtype)
        if itemsize is None:
            raise SpecError(f"{bad}: tensor {name[:80]!r} has unknown dtype {dtype[:20]!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape) or len(shape) > 8:
            raise SpecError(f"{bad}: tensor {name[:80]!r} has a malformed shape {shape!r:.60}")
        if len(offsets) != 2 or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets):
            raise SpecError(f"{bad}: tensor {name[:80]!r} has malformed data_offsets")
        begin, end = offsets
        if not 0 <= begin <= end or end - begin != math.prod(shape) * itemsize:
            raise SpecError(f"{bad}: tensor {name[:80]!r}: data_offsets {offsets} do not hold "
                            f"{'x'.join(map(str, shape)) or 'a scalar'} {dtype}")
        if end > data_bytes:
            raise SpecError(f"{label} is truncated: tensor {name[:80]!r} ends at byte {8 + length + end:,} but the "
                            f"file has {size:,} bytes")
        out[name] = TensorEntry(file=file.name, dtype=dtype, shape=tuple(shape))
    return out


def _shard_path(root: Path, entry, index_label: str) -> Path:
    """A weight_map file name, refused unless it names a file directly inside the directory."""
    if not isinstance(entry, str) or not entry:
        raise SpecError(f"{index_label}: weight_map values must be file names, got {entry!r:.60}")
    candidate = root / entry
    if os.path.isabs(entry) or ".." in Path(entry).parts or Path(entry).name != entry:
        raise SpecError(f"{index_label}: weight_map points outside the checkpoint directory ({entry[:80]!r}); "
                        f"shards must be files inside {root}")
    try:
        inside = candidate.resolve().parent == root.resolve()
    except (OSError, RuntimeError):
        inside = False
    if not inside:
        raise SpecError(f"{index_label}: weight_map entry {entry[:80]!r} resolves outside the checkpoint directory "
                        f"(a symbolic link?); shards must be files inside {root}")
    return candidate


def list_checkpoint(path: str | Path) -> Listing:
    """The weights of checkpoint directory ``path`` (empty ``tensors`` when it holds none)."""
    root = files.user_path(path, "checkpoint directory")
    listing = Listing(path=root)
    try:
        names = sorted(os.listdir(root))
    except OSError as err:
        raise SpecError(f"checkpoint directory {root}: cannot list ({err.strerror or err})") from None
    listing.has_config = "config.json" in names
    listing.bin_files = [n for n in names if n.startswith("pytorch_model") and n.endswith(".bin")]
    if INDEX in names:
        label = str(root / INDEX)
        index = files.read_json(root / INDEX, "checkpoint index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise SpecError(f"{label} has no weight_map (an object of tensor name -> shard file); "
                            f"re-save the checkpoint with save_pretrained")
        headers: dict[str, dict[str, TensorEntry]] = {}
        for name, entry in weight_map.items():
            shard = _shard_path(root, entry, label)
            if entry not in headers:
                if not files.is_file(shard):
                    raise SpecError(f"{label} names shard {entry!r}, which is missing from {root}")
                headers[entry] = read_header(shard)
            if name not in headers[entry]:
                raise SpecError(f"{label} says tensor {name[:80]!r} is in {entry!r}, but that shard has no such "
                                f"tensor")
            listing.tensors[name] = headers[entry][name]
    elif SINGLE in names:
        listing.tensors = read_header(root / SINGLE)
    return listing


def no_weights_message(listing: Listing) -> str:
    """Why a directory without safetensors weights is not trained from random weights silently."""
    where = str(listing.path)
    if listing.bin_files:
        return (f"{where} holds no safetensors weights, only {', '.join(listing.bin_files[:3])}: .bin files are "
                f"pickles and are not loaded, on purpose (unpickling runs code); convert them to safetensors "
                f"(transformers: from_pretrained, then save_pretrained(..., safe_serialization=True)), or pass "
                f"--init random to train from scratch")
    return (f"{where} holds config.json but no weights (no {SINGLE} or {INDEX}); pass --init random to train "
            f"this architecture from random weights, or point --model at a directory with safetensors weights")


def integer_tensors(listing: Listing) -> list[str]:
    """Names of tensors stored with an integer or bool dtype (a model's weights are floating point)."""
    return [f"{name} ({entry.dtype} in {entry.file})" for name, entry in listing.tensors.items()
            if entry.dtype not in FLOAT_DTYPES]
