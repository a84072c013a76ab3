"""A training checkpoint (DCP, any layout) -> a Hugging Face directory transformers loads.

    export_checkpoint("ckpt", "hf-out", max_shard_bytes=2 << 30)

Reads the step (``ckpt_commit.choose_step``: a step directory, or the newest intact step of a
checkpoint directory) in ONE process, no process group: DCP assembles every ``model.<fqn>``
tensor at its full size from whichever layout's boxes were saved (dcp_checkpoint.py's load
planner with a box covering the whole tensor). Names go back to Hugging Face's through
checkpoint.py's ``NAME_RULES`` (stacked experts split per expert, gpt2's transposed / fused
views rebuilt). Written: ``config.json`` (the manifest's copy of the trained model's config),
``model-0000i-of-0000n.safetensors`` shards of at most ``max_shard_bytes`` and
``model.safetensors.index.json``. The vocabulary is the model's true size: padding for tensor
parallelism is never saved.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from modelcarve.runtime.checkpoint import commit
from modelcarve.runtime.checkpoint import dcp as dcpk
from modelcarve.runtime.checkpoint.hf_load import _view, hf_name
from modelcarve.spec.errors import ModelcarveError


def full_model_state(step_dir: Path) -> dict[str, torch.Tensor]:
    """``{our fqn: full tensor}`` of the checkpoint's model (single process)."""
    metadata = dcpk._SafeReader(str(step_dir)).read_metadata()
    boxes = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(md, "size"):
            t = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            boxes[key] = dcpk.Box(t, (0,) * t.dim(), tuple(t.shape))
    import warnings

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcpk.load_state(step_dir, boxes)
    return {key.removeprefix("model."): box.local for key, box in boxes.items()}


def to_hf_names(family: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, tuple[int, torch.Tensor]]] = {}
    for fqn, t in state.items():
        base, transpose, part = _view(hf_name(family, fqn))
        if "{e}" in base:
            for e in range(t.shape[0]):
                out[base.replace("{e}", str(e))] = t[e].contiguous()
            continue
        x = t.t() if transpose else t
        if part is None:
            out[base] = x.contiguous()
        else:
            parts.setdefault(base, {})[part[0]] = (part[1], x)
    for base, pieces in parts.items():
        n = next(iter(pieces.values()))[0]
        if sorted(pieces) != list(range(n)):
            raise ModelcarveError(f"{base}: only parts {sorted(pieces)} of {n} are in the checkpoint")
        out[base] = torch.cat([pieces[i][1] for i in range(n)], dim=-1).contiguous()
    return out


def export_checkpoint(checkpoint: str | Path, out: str | Path, max_shard_bytes: int = 2 << 30) -> dict:
    """Write the Hugging Face directory; returns a summary (step, files, tensors, bytes)."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelcarveError(f"--out {out} exists and is not empty; name a new directory")
    choice = commit.choose_step(checkpoint)
    manifest = choice.manifest
    config = manifest.get("hf_config")
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelcarveError(f"checkpoint {choice.step_dir} does not record its model's config.json; export needs it")
    from modelcarve.spec.hf_config import spec_from_hf_config

    spec = spec_from_hf_config(config)
    if dcpk.model_hash(spec) != manifest["model_hash"]:
        raise ModelcarveError(f"checkpoint {choice.step_dir}: its recorded config.json does not describe the saved model")
    tensors = to_hf_names(spec.family, full_model_state(choice.step_dir))
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = dict(metadata=dict(total_size=total), weight_map=dict(sorted(weight_map.items())))
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config | {"torch_dtype": dtype}, indent=2, sort_keys=True))
    return dict(step=choice.step, step_dir=str(choice.step_dir), out=str(out), files=len(shards),
                tensors=len(tensors), bytes=total, skipped=choice.skipped)
