"""The model catalogue: real models as JSON facts (their published config.json plus a source).

Each ``models/NAME.json`` holds ``name``, ``family``, ``source`` (where the dimensions come
from), ``config`` (the Hugging Face config.json fields, read by spec.hf_config) and, where the
authors state one, the ``published`` parameter count. Lookup accepts a catalogue name, a
config.json path or a checkpoint directory.
"""

from __future__ import annotations

import functools
import json
from importlib import resources

from modelcarve.spec.errors import SpecError
from modelcarve.spec.hf_config import load_hf_config, spec_from_hf_config
from modelcarve.spec.model import ModelSpec


@functools.cache
def _entries() -> dict[str, dict]:
    folder = resources.files("modelcarve.spec.catalog").joinpath("models")
    entries = {}
    for item in sorted(folder.iterdir(), key=lambda p: p.name):
        if item.name.endswith(".json"):
            entry = json.loads(item.read_text())
            entries[entry["name"]] = entry
    return entries


def model_names() -> list[str]:
    return list(_entries())


def catalog_entry(name: str) -> dict:
    """The raw JSON fact sheet of a catalogued model."""
    key = _resolve(name)
    if key is None:
        raise SpecError(f"unknown model {name!r}; known: {', '.join(model_names())} (or a config.json path)")
    return _entries()[key]


def _resolve(name: str) -> str | None:
    wanted = name.lower().replace("_", "-")
    for key in _entries():
        if key == wanted or key.replace(".", "") == wanted.replace(".", ""):
            return key
    return None


def get_model(name: str) -> ModelSpec:
    """A catalogued model by name, or a model read from a config.json file or checkpoint dir."""
    import modelcarve.spec.files as files

    if not isinstance(name, str):
        raise SpecError(f"a model must be a catalogue name or a path, got {name!r}")
    if _resolve(name) is None and files.path_problem(name):
        files.user_path(name, "model")  # raises: no file can have this name
    if _resolve(name) is None and (files.exists(name) or name.endswith(".json") or "/" in name):
        return load_hf_config(name)
    entry = catalog_entry(name)
    return spec_from_hf_config(
        entry["config"], name=entry["name"], source=entry["source"], extra={"published": entry.get("published", {})}
    )
