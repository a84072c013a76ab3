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

What serving needs beside the weights: ``config.json`` always names its ``architectures`` (vLLM
and SGLang pick the model class from it; a catalogue model's config has none), the class
transformers maps the ``model_type`` to (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; ``ARCHITECTURES``
holds the runtime's types when transformers is absent). The tokenizer and generation files
(``SERVING_FILES``: tokenizer.json, tokenizer_config.json, special_tokens_map.json,
generation_config.json, chat_template.jinja, ...) are copied from the checkpoint directory the
run started from: the manifest's ``model`` (a path for a checkpoint; relative paths are read from
the current directory) when its config.json is the recorded one, or ``tokenizer_from``.
"""

from __future__ import annotations

import json
import shutil
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


ARCHITECTURES = {
    "deepseek_v3": "DeepseekV3ForCausalLM", "gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
}
"""transformers' causal-LM class per model_type the runtime trains (tests check it against transformers)."""

SERVING_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                 "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def architecture(model_type: str) -> str | None:
    """The transformers class for a model_type (its auto mapping when installed, else ARCHITECTURES)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names
    except ImportError:
        names = {}
    return names.get(model_type) or ARCHITECTURES.get(model_type)


def serving_source(manifest: dict, config: dict, tokenizer_from: str | Path | None = None) -> tuple[Path | None, str]:
    """The directory to copy SERVING_FILES from and where it came from, or None and why none."""
    if tokenizer_from is not None:
        path = Path(tokenizer_from)
        if not path.is_dir():
            raise ModelcarveError(f"--tokenizer-from {path} is not a directory")
        return path, f"from {path}"
    model = manifest.get("model")
    path = Path(model) if isinstance(model, str) else None
    if path is None or not path.exists():
        from modelcarve.spec.catalog import catalog_entry

        try:
            catalog_entry(str(model))
            return None, f"{model} is a catalogue model: no tokenizer to copy"
        except ModelcarveError:
            return None, f"the model it was trained from, {model}, is not found from here; give --tokenizer-from DIR"
    file = path if path.is_file() else path / "config.json"
    try:
        same = json.loads(file.read_text()) == config
    except (OSError, ValueError):
        same = False
    if not same:
        return None, f"{file} is no longer the trained model's config; give --tokenizer-from DIR"
    path = path.parent if path.is_file() else path
    return path, f"from {path}"


def export_checkpoint(checkpoint: str | Path, out: str | Path, max_shard_bytes: int = 2 << 30,
                      tokenizer_from: str | Path | None = None) -> dict:
    """Write the Hugging Face directory; returns a summary (step, files, tensors, bytes, the
    serving files copied and from where)."""
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
    source, source_note = serving_source(manifest, config, tokenizer_from)
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
    config = config | {"torch_dtype": dtype}
    if not config.get("architectures") and architecture(config["model_type"]):
        config["architectures"] = [architecture(config["model_type"])]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    copied = []
    for name in SERVING_FILES if source is not None else ():
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
            copied.append(name)
    return dict(step=choice.step, step_dir=str(choice.step_dir), out=str(out), files=len(shards),
                tensors=len(tensors), bytes=total, skipped=choice.skipped, copied=copied,
                copied_note=source_note if copied or source is None else f"{source_note}: it holds none of them")
