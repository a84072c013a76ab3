"""Checks ``run`` and ``verify`` make in the launching process, before any rank starts (seconds).

``commands/run.py`` calls three hooks, in order:

* ``check_inputs(args)``: ``--model`` as a directory (safetensors headers, index, weight_map,
  ``.bin``-only or config-only directories unless ``--init random``) and ``--data`` (exists,
  readable, long enough), from listings and headers only.
* ``derive(args, layout, spec)``: what is clear need not be asked for. A layout without ``gbs``
  whose pipeline schedule needs more micro-batches (1F1B needs >= pp) gets the smallest global
  batch the schedule accepts; a layout without ``seq`` on a model trained for fewer positions than
  the default gets ``max_position_embeddings``. Each is said on one line. A ``seq`` the layout
  gives above ``max_position_embeddings`` is refused.
* ``check_launch(args, layout, spec, per_node)``: the checkpoint's tensors against the model (a
  config with fewer layers than the checkpoint, tensors the model does not use, integer or bool
  weights), and the planner's predicted memory per rank against the device's (on CPU: available
  RAM / ranks per node), refused with both numbers and the layouts of the same ranks that fit.

Tensor contents (NaN/Inf) are checked in the ranks as they read them (runtime/checkpoint/hf_load.py).
"""

from __future__ import annotations

import os
import re
import sys

from modelcarve.spec import files
from modelcarve.spec.checkpoint_files import integer_tensors, list_checkpoint, no_weights_message
from modelcarve.spec.errors import LayoutError, ModelcarveError, SpecError
from modelcarve.spec.layout import Layout

_KEY_ALIASES = {"global_batch": "gbs", "batch": "gbs"}
# tensors older checkpoints hold that no model computes with (rotary caches, gpt2's causal masks)
_HARMLESS = re.compile(r".*(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")
_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


_NOTES: list[str] = []
"""What derive() filled in, said once every check has passed (so a refusal stays one line)."""


def _note(text: str) -> None:
    _NOTES.append(text)


def _say_notes() -> None:
    for text in _NOTES:
        sys.stderr.write(f"modelcarve: note: {text}\n")
    _NOTES.clear()


# --- inputs: the checkpoint directory and the data file ------------------------------------------


def check_inputs(args) -> None:
    model = args.model
    init = getattr(args, "init", "checkpoint")
    if _is_directory_model(model):
        listing = list_checkpoint(model)
        if not listing.has_config:
            raise SpecError(f"{model} has no config.json; a checkpoint directory needs the model's config.json "
                            f"beside its safetensors weights")
        if listing.has_weights and init == "random":
            raise SpecError(f"{model} holds safetensors weights but --init random was given; drop --init random to "
                            f"load them, or give the config.json file alone to start from random weights")
        if not listing.has_weights and init != "random":
            raise SpecError(no_weights_message(listing))
        bad = integer_tensors(listing)
        if bad:
            raise SpecError(f"{model}: tensor {bad[0]} is not floating point ({len(bad)} such); model weights are "
                            f"floating point (F32, F16, BF16, F8), so this is not a model checkpoint or it is quantised "
                            f"in a format modelcarve does not read")
    data = getattr(args, "data", None)  # serve has no --data
    if data and data != "synthetic":
        _check_data(data)


def _is_directory_model(model: str) -> bool:
    """``--model`` names a directory (a catalogue name wins, as in spec.catalog.get_model)."""
    from modelcarve.spec.catalog import catalog_entry

    try:
        catalog_entry(model)
        return False
    except SpecError:
        return files.path_problem(model) is None and files.is_dir(model)


def _check_data(data: str) -> None:
    path = files.user_path(data, "--data")
    if not files.is_file(path):
        what = "is a directory, not a token file" if files.is_dir(path) else "does not exist"
        raise SpecError(f"--data {data} {what}; give a .npy, .bin (uint16) or text file, or leave --data out for "
                        f"synthetic tokens")
    if not os.access(path, os.R_OK):
        raise SpecError(f"--data {data} is not readable")
    if path.suffix == ".npy":
        import numpy as np

        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as err:
            raise SpecError(f"--data {data} is not a readable .npy array ({' '.join(str(err).split())[:120]})") from None
        if not np.issubdtype(array.dtype, np.integer):
            raise SpecError(f"--data {data} holds {array.dtype} values; token ids must be integers")


# --- derived layout fields -------------------------------------------------------------------------


def _given_keys(text: str) -> set[str]:
    """Layout fields the user's layout string or file names explicitly."""
    text = text.strip()
    raw = None
    if text.startswith("{"):
        raw = files.loads_json(text, "layout JSON")
    elif text.endswith(".json"):
        raw = files.read_json(text, "layout file")
    if raw is not None:
        raw = raw.get("layout", raw) if isinstance(raw, dict) and isinstance(raw.get("layout"), dict) else raw
        return {k for k, v in raw.items() if not (k == "gbs" and v == 0)} if isinstance(raw, dict) else set()
    keys = {item.partition("=")[0].strip().lower().replace("-", "_") for item in text.split(",")}
    return {_KEY_ALIASES.get(k, k) for k in keys}


def derive(args, layout: Layout, spec) -> Layout:
    """``layout`` with gbs / seq filled in where the answer is clear (said on stderr); refuses a seq
    beyond the model's positions. Sets ``args.layout`` to the layout the ranks will run."""
    _NOTES.clear()
    if getattr(args, "command", None) not in ("run", "verify"):
        return layout  # serve: no training batch to derive
    given = _given_keys(args.layout)
    changes = {}
    if "gbs" not in given and not layout.gbs and layout.pp > 1 and layout.schedule != "gpipe" \
            and layout.num_microbatches < layout.pp:
        gbs = layout.pp * layout.mbs * layout.dp
        changes["gbs"] = gbs
        _note(f"the layout gives no gbs; using gbs={gbs}, the smallest global batch schedule {layout.schedule} "
              f"accepts with pp={layout.pp} (pp micro-batches of mbs={layout.mbs} per replica, dp={layout.dp}); "
              f"add gbs=N to choose")
    if "seq" not in given and layout.seq > spec.max_position:
        changes["seq"] = spec.max_position
        _note(f"the layout gives no seq; using seq={spec.max_position}, the model's max_position_embeddings "
              f"(the default {layout.seq} is longer); add seq=N to choose")
    elif layout.seq > spec.max_position and spec.position_kind != "learned":  # learned: spec/support.py says it
        raise LayoutError(f"seq={layout.seq} is longer than the {spec.max_position} positions {spec.name} was "
                          f"trained for (max_position_embeddings); use seq <= {spec.max_position}")
    if changes:
        layout = layout.replace(**changes)
        layout.check()
        args.layout = layout.to_json()
    return layout


# --- the checkpoint against the model, and memory ------------------------------------------------


def check_launch(args, layout: Layout, spec, per_node: int) -> None:
    from modelcarve.runtime.checkpoint.hf_load import is_checkpoint

    if is_checkpoint(args.model):
        _check_unused(args.model, spec)
    if getattr(args, "command", None) in ("run", "verify"):  # the training prediction; serve keeps no optimiser
        check_memory(layout, spec, per_node, nnodes=getattr(args, "nnodes", 1))
    _say_notes()


def expected_names(spec) -> set[str]:
    """The checkpoint tensor names our model of ``spec`` reads (NAME_RULES of runtime/checkpoint/hf_load.py)."""
    import torch

    from modelcarve.runtime.checkpoint.hf_load import hf_name
    from modelcarve.runtime.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(spec)
    saved = set(model.state_dict(keep_vars=True))
    fqns = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers() if n in saved]
    names = set()
    for fqn in fqns:
        name = hf_name(spec.family, fqn).split("@", 1)[0]
        experts = range(spec.num_experts) if "{e}" in name else [None]
        names.update(name.replace("{e}", str(e)) if e is not None else name for e in experts)
    return names


def _check_unused(path: str, spec) -> None:
    listing = list_checkpoint(path)
    expected = expected_names(spec)
    unused = sorted(n for n in listing.tensors if n not in expected and not _HARMLESS.match(n)
                    and not (spec.tied_embeddings and n == "lm_head.weight"))
    if not unused:
        return
    layers = sorted({int(m.group(1)) for n in listing.tensors if (m := _LAYER.search(n))})
    if layers and layers[-1] >= spec.num_layers:
        raise SpecError(f"{path}: the checkpoint holds {layers[-1] + 1} layers (e.g. {unused[0]!r}) but config.json "
                        f"has {spec.num_layers}; fix num_hidden_layers in config.json or use the matching checkpoint")
    more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
    raise SpecError(f"{path}: the checkpoint holds tensors the model of its config.json does not use: "
                    f"{', '.join(repr(n) for n in unused[:3])}{more}; check config.json (model_type, experts, "
                    f"biases, tie_word_embeddings) matches the weights")


def available_bytes_per_rank(per_node: int) -> tuple[int, str]:
    """Memory one rank may use: the GPU's, or on CPU this machine's available RAM shared by its ranks."""
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        return total, f"{torch.cuda.get_device_name(0)} memory"
    avail = _mem_available()
    return avail // max(1, per_node), f"available RAM {avail / 2**30:.1f} GiB / {per_node} ranks on this node"


def meminfo_bytes(field: str) -> int | None:
    """``/proc/meminfo``'s ``field`` (``MemAvailable``, ``MemTotal``) in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _mem_available() -> int:
    avail = meminfo_bytes("MemAvailable")
    return avail if avail is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def predicted_bytes(layout: Layout, spec, on_gpu: bool) -> int:
    """The planner's peak memory per rank for ``layout`` (without the CUDA/NCCL reserve on CPU)."""
    from dataclasses import replace

    from modelcarve.plan.goals import get_goal
    from modelcarve.spec.hardware import ClusterSpec, get_device, get_link

    device = replace(get_device("H100"), name="this-machine", memory_bytes=2**62)  # memory is all that is read
    cluster = ClusterSpec(nodes=1, devices_per_node=layout.world_size, device=device, intra_link=get_link("pcie5"),
                          inter_link=get_link("eth-100g"), nics_per_node=1)
    dtype = layout.param_dtype if layout.param_dtype in ("fp32", "bf16", "fp16") else "bf16"
    memory = get_goal("train").evaluate(spec, cluster, layout.replace(param_dtype=dtype))["memory"]
    reserve = 0 if on_gpu else memory["breakdown"].get("reserved_runtime", 0)
    return int(memory["peak_bytes"] - reserve)


def _alternatives(layout: Layout, spec, limit: int, on_gpu: bool) -> list[tuple[int, str]]:
    """Layouts of the same ranks the runtime runs whose predicted memory fits in ``limit``."""
    from modelcarve.plan.factors import divisors
    from modelcarve.spec.support import check_training

    world, found = layout.world_size, {}
    for tp in divisors(world):
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            for zero in ((0, 1, 3) if dp > 1 else (0,)):
                for recompute in ("none", "full"):
                    cand = layout.replace(tp=tp, pp=pp, dp=dp, cp=1, ep=1, etp=0, sp=False, zero=zero, dp_shard=0,
                                          recompute=recompute, virtual_stages=1, schedule="1f1b",
                                          gbs=max(layout.global_batch, pp * layout.mbs * dp) // (layout.mbs * dp)
                                          * layout.mbs * dp)
                    try:
                        check_training(cand, spec, world_size=world)
                        need = predicted_bytes(cand, spec, on_gpu)
                    except ModelcarveError:
                        continue
                    if need <= limit:
                        found.setdefault(cand.short() + (f" recompute={recompute}" if recompute != "none" else ""),
                                         need)
    return sorted(((need, name) for name, need in found.items()), key=lambda x: ("recompute" in x[1], x[0]))


def check_memory(layout: Layout, spec, per_node: int, nnodes: int = 1) -> None:
    import torch

    on_gpu = torch.cuda.is_available()
    limit, where = available_bytes_per_rank(per_node)
    try:
        need = predicted_bytes(layout, spec, on_gpu)
    except ModelcarveError:
        return  # the planner cannot cost this layout; the runtime checks already passed
    if need <= limit:
        return
    gib = 2**30
    fits = _alternatives(layout, spec, limit, on_gpu)
    hint = ("layouts of the same ranks that fit: " + ", ".join(f"{name} ({need / gib:.2f} GiB)"
                                                              for need, name in fits[:6])
            if fits else "no layout of these ranks fits; use more ranks (--nnodes) or a smaller model")
    raise LayoutError(f"{layout.short()} needs {need / gib:.2f} GiB per rank (the planner's prediction for "
                      f"{spec.name}) but a rank has {limit / gib:.2f} GiB ({where}); {hint}")
