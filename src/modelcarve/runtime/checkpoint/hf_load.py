"""Hugging Face safetensors checkpoints -> our model, whole or one rank's slices only.

Reads one ``model.safetensors`` or a sharded set described by ``model.safetensors.index.json``.
Parameter names are translated by a table of regular expressions per ``model_type``
(``NAME_RULES``): each rule maps one of OUR fully-qualified names (runtime/model/transformer.py) to the
Hugging Face name. A family is a list of rules; MoE families extend the llama list (add
``NAME_RULES["mixtral"] = NAME_RULES["llama"] + [...]`` in a line). No tensor is ever
unpickled: safetensors only.

Two ways in:

* ``load_model(name_or_dir, seed)``: the full reference model (catalogue name: random weights
  from ``build_model(spec, seed)``; a checkpoint directory: its weights).
* ``load_sharded(chunks, ckpt_dir)``: after ``parallelize`` of a model built on the ``meta``
  device, materialise this rank's parameters and fill each with exactly its slice of the
  checkpoint (``safe_open(...).get_slice``), from the shard registry (TP/EP slices) and FSDP2's
  DTensor placements. ``bytes_read`` counts what this rank read; no rank reads or holds the full
  model unless its layout holds the full model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from modelcarve.spec.errors import ModelcarveError

# our FQN (regex, full match) -> Hugging Face name (re.expand template)
_LLAMA = [
    (r"tok_embeddings\.weight", r"model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attention\.wq\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"layers\.(\d+)\.attention\.wk\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"layers\.(\d+)\.attention\.wv\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"layers\.(\d+)\.attention\.wo\.(weight|bias)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"layers\.(\d+)\.attention\.q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"layers\.(\d+)\.attention\.k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.(weight|bias)", r"model.layers.\1.mlp.gate_proj.\2"),
    (r"layers\.(\d+)\.feed_forward\.w3\.(weight|bias)", r"model.layers.\1.mlp.up_proj.\2"),
    (r"layers\.(\d+)\.feed_forward\.w2\.(weight|bias)", r"model.layers.\1.mlp.down_proj.\2"),
    (r"layers\.(\d+)\.attention_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"norm\.weight", r"model.norm.weight"),
    (r"output\.weight", r"lm_head.weight"),
]

# MoE blocks (moe.py). ``{e}`` in a name: our tensor stacks the checkpoint's per-expert tensors
# along dim 0 (expert e is the name with {e} replaced by e), as Hugging Face saves them on disk.
_MOE = r"layers\.(\d+)\.feed_forward\."
_QWEN3_MOE = [
    (_MOE + r"router\.weight", r"model.layers.\1.mlp.gate.weight"),
    (_MOE + r"experts\.w1", r"model.layers.\1.mlp.experts.{e}.gate_proj.weight"),
    (_MOE + r"experts\.w3", r"model.layers.\1.mlp.experts.{e}.up_proj.weight"),
    (_MOE + r"experts\.w2", r"model.layers.\1.mlp.experts.{e}.down_proj.weight"),
]
_MIXTRAL = [
    (_MOE + r"router\.weight", r"model.layers.\1.block_sparse_moe.gate.weight"),
    (_MOE + r"experts\.(w1|w2|w3)", r"model.layers.\1.block_sparse_moe.experts.{e}.\2.weight"),
]
_DEEPSEEK_V3 = [  # MLA attention, shared experts, the router's balancing bias; before _LLAMA (q_norm differs)
    (r"layers\.(\d+)\.attention\.wq_a\.(weight|bias)", r"model.layers.\1.self_attn.q_a_proj.\2"),
    (r"layers\.(\d+)\.attention\.q_norm\.weight", r"model.layers.\1.self_attn.q_a_layernorm.weight"),
    (r"layers\.(\d+)\.attention\.wq_b\.weight", r"model.layers.\1.self_attn.q_b_proj.weight"),
    (r"layers\.(\d+)\.attention\.wkv_a\.(weight|bias)", r"model.layers.\1.self_attn.kv_a_proj_with_mqa.\2"),
    (r"layers\.(\d+)\.attention\.kv_norm\.weight", r"model.layers.\1.self_attn.kv_a_layernorm.weight"),
    (r"layers\.(\d+)\.attention\.wkv_b\.weight", r"model.layers.\1.self_attn.kv_b_proj.weight"),
    (_MOE + r"router\.e_score_correction_bias", r"model.layers.\1.mlp.gate.e_score_correction_bias"),
    (_MOE + r"shared_experts\.w1\.weight", r"model.layers.\1.mlp.shared_experts.gate_proj.weight"),
    (_MOE + r"shared_experts\.w3\.weight", r"model.layers.\1.mlp.shared_experts.up_proj.weight"),
    (_MOE + r"shared_experts\.w2\.weight", r"model.layers.\1.mlp.shared_experts.down_proj.weight"),
]

# gpt2's Conv1D stores weights [in, out] (nn.Linear's transposed) and c_attn holds q|k|v side by side.
# A template may end in "@T" (our tensor is the checkpoint's transposed) and/or ":i/n" (part i of n
# along the checkpoint's last dim); CheckpointReader reads only the slice a rank needs either way.
_H = r"transformer.h.\1."
_GPT2 = [
    (r"tok_embeddings\.weight", r"transformer.wte.weight"),
    (r"pos_embeddings\.weight", r"transformer.wpe.weight"),
    (r"layers\.(\d+)\.attention_norm\.(weight|bias)", _H + r"ln_1.\2"),
    (r"layers\.(\d+)\.ffn_norm\.(weight|bias)", _H + r"ln_2.\2"),
    *[(rf"layers\.(\d+)\.attention\.w{w}\.weight", _H + f"attn.c_attn.weight@T:{i}/3") for i, w in enumerate("qkv")],
    *[(rf"layers\.(\d+)\.attention\.w{w}\.bias", _H + f"attn.c_attn.bias@:{i}/3") for i, w in enumerate("qkv")],
    (r"layers\.(\d+)\.attention\.wo\.weight", _H + r"attn.c_proj.weight@T"),
    (r"layers\.(\d+)\.attention\.wo\.bias", _H + r"attn.c_proj.bias"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", _H + r"mlp.c_fc.weight@T"),
    (r"layers\.(\d+)\.feed_forward\.w1\.bias", _H + r"mlp.c_fc.bias"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", _H + r"mlp.c_proj.weight@T"),
    (r"layers\.(\d+)\.feed_forward\.w2\.bias", _H + r"mlp.c_proj.bias"),
    (r"norm\.(weight|bias)", r"transformer.ln_f.\1"),
    (r"output\.weight", r"lm_head.weight"),
]

NAME_RULES: dict[str, list[tuple[str, str]]] = {
    "gpt2": _GPT2,
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "mixtral": _MIXTRAL + _LLAMA,
    "qwen3_moe": _QWEN3_MOE + _LLAMA,
    "deepseek_v3": _DEEPSEEK_V3 + _QWEN3_MOE + _LLAMA,
    "deepseek_v2": _DEEPSEEK_V3 + _QWEN3_MOE + _LLAMA,  # the same names (no e_score_correction_bias: softmax router)
}


def hf_name(family: str, fqn: str) -> str:
    rules = NAME_RULES.get(family)
    if rules is None:
        raise ModelcarveError(
            f"loading {family!r} checkpoints is not supported; supported: {', '.join(sorted(NAME_RULES))}"
        )
    for pattern, template in rules:
        match = re.fullmatch(pattern, fqn)
        if match:
            return match.expand(template)
    raise ModelcarveError(f"no Hugging Face name for parameter {fqn!r} of a {family} model (add a rule to NAME_RULES)")


def _view(name: str) -> tuple[str, bool, tuple[int, int] | None]:
    """(stored name, transposed?, (part i, of n) along the stored last dim) of a NAME_RULES name."""
    if "@" not in name:
        return name, False, None
    base, how = name.split("@", 1)
    transpose, _, part = how.partition(":")
    return base, transpose == "T", tuple(int(x) for x in part.split("/")) if part else None


class CheckpointReader:
    """Lazily opened safetensors files of one checkpoint directory; counts the bytes read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            self.files = {name: self.path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
        elif single.is_file():
            from safetensors import safe_open

            with safe_open(single, framework="pt") as f:
                self.files = {name: single for name in f.keys()}
        else:
            raise ModelcarveError(f"{self.path}: no model.safetensors or model.safetensors.index.json")
        self._open: dict[Path, object] = {}
        self.bytes_read = 0

    def _handle(self, file: Path):
        if file not in self._open:
            from safetensors import safe_open

            self._open[file] = safe_open(file, framework="pt")
        return self._open[file]

    def has(self, name: str) -> bool:
        return _view(name)[0].replace("{e}", "0") in self.files

    def _num_stacked(self, name: str) -> int:
        count = 0
        while name.replace("{e}", str(count)) in self.files:
            count += 1
        return count

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor ``name``, or only ``index`` of it (one slice per leading dim)."""
        base, transpose, part = _view(name)
        if base != name:  # a transposed and/or partial view of a stored tensor (gpt2's Conv1D)
            index = tuple(index or ()) + (slice(None),) * (len(self.shape(name)) - len(index or ()))
            if part is not None:
                i, n = part
                size = self.shape(base)[-1] // n
                mine = index[0] if transpose or len(index) == 1 else index[-1]
                start, stop, _ = mine.indices(size)
                mine = slice(i * size + start, i * size + stop)
                index = (mine,) + index[1:] if transpose or len(index) == 1 else index[:-1] + (mine,)
            t = self.read(base, tuple(reversed(index)) if transpose else index)
            return t.t().contiguous() if transpose else t
        if "{e}" in name:  # per-expert tensors stacked on dim 0; read only the experts asked for
            experts = range(self._num_stacked(name))[index[0]] if index else range(self._num_stacked(name))
            return torch.stack([self.read(name.replace("{e}", str(e)), index[1:] if index else None) for e in experts])
        if name not in self.files:
            raise ModelcarveError(f"{self.path}: checkpoint has no tensor {name!r}")
        sl = self._handle(self.files[name]).get_slice(name)
        t = sl[index] if index else sl[:]
        self.bytes_read += t.numel() * t.element_size()
        if t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) and not bool(torch.isfinite(t).all()):
            raise ModelcarveError(f"{self.files[name]}: tensor {name!r} holds NaN or Inf values; the checkpoint is "
                                  f"damaged or diverged, use an earlier one")
        return t

    def shape(self, name: str) -> list[int]:
        base, transpose, part = _view(name)
        if base != name:
            shape = self.shape(base)
            if part is not None:
                shape[-1] //= part[1]
            return shape[::-1] if transpose else shape
        if "{e}" in name:
            return [self._num_stacked(name)] + self.shape(name.replace("{e}", "0"))
        return list(self._handle(self.files[name]).get_slice(name).get_shape())


def _source_name(family: str, fqn: str, reader: CheckpointReader, tied: dict[str, str]) -> str:
    name = hf_name(family, tied.get(fqn, fqn))
    if not reader.has(name) and fqn.endswith("output.weight"):
        name = hf_name(family, "tok_embeddings.weight")  # tied checkpoints store the embedding only
    return name


def _saved_tensors(module: nn.Module):
    """Parameters, then the persistent buffers (e.g. DeepSeek's router bias) a checkpoint holds."""
    yield from module.named_parameters()
    saved = set(module.state_dict(keep_vars=True))
    yield from ((fqn, b) for fqn, b in module.named_buffers() if fqn in saved)


@torch.no_grad()
def load_full(model: nn.Module, path: str | Path) -> CheckpointReader:
    """Copy every parameter of the (unsplit) model from the checkpoint."""
    reader = CheckpointReader(path)
    family = model.spec.family
    for fqn, p in _saved_tensors(model):
        t = reader.read(_source_name(family, fqn, reader, {}))
        if tuple(t.shape) != tuple(p.shape):
            raise ModelcarveError(f"{fqn}: checkpoint shape {tuple(t.shape)} != model shape {tuple(p.shape)}")
        p.copy_(t.to(p.dtype))
    return reader


def check_checkpoint(path: str | Path, spec) -> None:
    """Refuse, from the safetensors headers alone (before any rank starts), a checkpoint whose
    family has no name rules or that lacks a tensor the model needs or holds it in another shape."""
    from modelcarve.runtime.model.transformer import Transformer

    if spec.family not in NAME_RULES:
        raise ModelcarveError(f"loading {spec.family!r} checkpoints is not supported; supported: "
                              f"{', '.join(sorted(NAME_RULES))}")
    reader = CheckpointReader(path)
    with torch.device("meta"):
        model = Transformer(spec)
    problems = []
    for fqn, p in _saved_tensors(model):
        name = _source_name(spec.family, fqn, reader, {})
        if not reader.has(name):
            problems.append(f"no tensor {_view(name)[0]!r} (for {fqn})")
        elif reader.shape(name) != list(p.shape):
            problems.append(f"{fqn}: checkpoint shape {tuple(reader.shape(name))} != model shape {tuple(p.shape)}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ModelcarveError(f"{path}: checkpoint does not fit its config.json: {'; '.join(problems[:3])}{more}")


def is_checkpoint(name: str) -> bool:
    path = Path(name)
    return path.is_dir() and (
        (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    )


def model_spec(name: str):
    from modelcarve.spec.catalog import get_model

    return get_model(name)


def load_model(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(model, spec): a catalogue model with seeded random weights, or a checkpoint's weights."""
    from modelcarve.runtime.model.transformer import build_model

    spec = model_spec(name)
    if device == "meta":
        with torch.device("meta"):
            from modelcarve.runtime.model.transformer import Transformer

            return Transformer(spec).to(dtype), spec
    model = build_model(spec, dtype=dtype, seed=seed, device=device)
    if is_checkpoint(name):
        load_full(model, name)
    return model, spec


def _slices_for(chunk: nn.Module, fqn: str, param: torch.Tensor, full_shape: list[int]):
    """Per-dim (start, length) of this rank's piece of the full tensor ``fqn``."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from modelcarve.runtime.distributed.shards import shards_of

    start = [0] * len(full_shape)
    length = list(full_shape)
    for group, dim in shards_of(chunk).get(fqn, []):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if length[dim] % size:
            raise ModelcarveError(f"{fqn}: dim {dim} of size {length[dim]} does not split over {size} ranks")
        length[dim] //= size
        start[dim] += rank * length[dim]
    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, offset = compute_local_shape_and_global_offset(tuple(length), param.device_mesh, param.placements)
        start = [s + o for s, o in zip(start, offset)]
        length = list(local_shape)
    return start, length


def _to_empty_keeping_ties(chunk: nn.Module, device) -> None:
    """``to_empty`` converts each module's parameters separately, so a tied LM head would get its
    own storage; re-point every alias at the first name's new parameter."""
    names: dict[int, list[str]] = {}
    for name, p in chunk.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    chunk.to_empty(device=device)
    for group in names.values():
        keep = chunk.get_parameter(group[0])
        for alias in group[1:]:
            owner, _, leaf = alias.rpartition(".")
            setattr(chunk.get_submodule(owner) if owner else chunk, leaf, keep)


@torch.no_grad()
def load_sharded(chunks: list[nn.Module], path: str | Path, device: str = "cpu") -> CheckpointReader:
    """Materialise ``chunks`` (parallelized on the meta device) with this rank's checkpoint slices."""
    from torch.distributed.tensor import DTensor

    reader = CheckpointReader(path)
    for chunk in chunks:
        _to_empty_keeping_ties(chunk, device)
        for mod in chunk.modules():  # buffers the checkpoint does not hold (MoE counters) start clean
            if hasattr(mod, "init_buffers"):
                mod.init_buffers()
        try:
            from modelcarve.runtime.distributed.shards import tied_copy_names

            tied = tied_copy_names(chunk)
        except ImportError:
            tied = {}
        family = chunk.spec.family
        from modelcarve.runtime.distributed.shards import padding_of

        padding = padding_of(chunk)
        for fqn, p in _saved_tensors(chunk):
            name = _source_name(family, fqn, reader, tied)
            shape = reader.shape(name)
            pad = padding.get(fqn)  # vocabulary padding: split the padded size, read up to the true one
            if pad:
                shape[pad[0]] = pad[2]
            start, length = _slices_for(chunk, fqn, p, shape)
            index = tuple(slice(min(s, pad[1]), min(s + n, pad[1])) if pad and d == pad[0] else slice(s, s + n)
                          for d, (s, n) in enumerate(zip(start, length)))
            t = reader.read(name, index)
            if pad and t.shape[pad[0]] < length[pad[0]]:
                zeros = list(t.shape)
                zeros[pad[0]] = length[pad[0]] - t.shape[pad[0]]
                t = torch.cat([t, t.new_zeros(zeros)], dim=pad[0])
            local = p.to_local() if isinstance(p, DTensor) else p
            if tuple(t.shape) != tuple(local.shape):
                raise ModelcarveError(f"{fqn}: checkpoint slice {tuple(t.shape)} != local shard {tuple(local.shape)}")
            local.copy_(t.to(local.dtype))
    return reader
