"""``--emit-launch ENGINE``: a planned layout as the launch command of the engine people run.

Usage::

    modelcarve plan --goal serve-latency --model qwen3-32b --cluster 2xH100 --emit-launch vllm
    modelcarve plan --goal train --model llama-3.1-8b --cluster 8xH100 --global-batch 256 \\
        --emit-launch megatron --out launch/
    modelcarve plan ... --engine vllm      # rank only the layouts vLLM can express

One mapping table per engine, as data: ``engines/<engine>.json`` names the engine version it was
written for, the command, the ordered flags (each a layout quantity of ``context()`` in the
engine's vocabulary through the table's ``maps``), and the ``rules`` the engine imposes. The
rule kinds are implemented once here (``_CHECKS``); ``express`` is the one "can ENGINE express
this layout" answer, used by the emitter and by ``plan --engine``'s filter. A refused layout
gets one line naming the nearest layout the engine can express and its rank in the plan.
"""

from __future__ import annotations

import json
import shlex
from functools import lru_cache
from pathlib import Path

from modelcarve.spec.errors import ModelcarveError
from modelcarve.spec.layout import Layout, recompute_modules

ENGINES = ("vllm", "sglang", "trtllm", "torchtitan", "megatron", "modelcarve")
_TABLES = Path(__file__).parent / "engines"


class EngineRefusal(ModelcarveError):
    """The engine cannot express the layout (printed as one line, exit 2)."""


@lru_cache(maxsize=None)
def table(engine: str) -> dict:
    """The mapping table of ``engine`` (engines/<engine>.json)."""
    if engine not in ENGINES:
        raise ModelcarveError(f"unknown engine {engine!r}; choose one of: {', '.join(ENGINES)}")
    return json.loads((_TABLES / f"{engine}.json").read_text())


def title(engine: str) -> str:
    t = table(engine)
    return f"{t['name']} {t['version']}"


# --- the layout's quantities, named once --------------------------------------------------------
def context(layout: Layout, model=None, *, serving: bool = False, max_batch: int | None = None) -> dict:
    """Every quantity a table may name: the layout's fields and the derived ones."""
    c = layout.to_dict()
    shard = layout.shard_group
    c.update(
        expert_tp=layout.expert_tp if layout.ep > 1 else layout.tp,
        global_batch=layout.global_batch,
        local_batch=layout.global_batch // layout.dp,
        world=layout.world_size,
        dp_shard=shard if layout.zero == 3 else 1,
        dp_replicate=layout.dp // shard if layout.zero in (1, 3) else layout.dp,
        zero_kind=str(layout.zero),
        recompute_kind=layout.recompute if layout.recompute in ("none", "selective", "full", "ops") else "modules",
        recompute_modules=layout.recompute not in ("none", "selective", "full", "ops"),
        recompute_list=sorted(recompute_modules(layout.recompute)) if layout.recompute not in ("none", "full", "ops") else [],
        fp8=layout.param_dtype in ("fp8", "mxfp8"),
        fp8_recipe="mxfp8" if layout.param_dtype == "mxfp8" else layout.fp8_scaling,
        moe=bool(model is not None and model.is_moe) or layout.ep > 1,
        redundant_experts=layout.redundant_experts,
        eplb_config=json.dumps({"num_redundant_experts": layout.redundant_experts}) if layout.redundant_experts else None,
        serving=serving,
        max_batch=max_batch,
        one=1,
        always=True,
    )
    if model is not None:
        c["layers_per_stage"] = model.num_layers // (layout.pp * layout.virtual_stages)
    # attention DP (SGLang --enable-dp-attention, TensorRT-LLM enable_attention_dp): the experts
    # span all TP x DP ranks of a stage, so the engine's TP group is tp x dp.
    c["dp_attention"] = layout.ep > 1 and layout.dp > 1 and layout.ep * c["expert_tp"] == layout.tp * layout.dp
    c["engine_tp"] = layout.tp * layout.dp if c["dp_attention"] else layout.tp
    return c


def _cond(text, c: dict) -> bool:
    """A table's ``when``: ``name``, ``!name``, ``name>N``, ``name==V``, ``name!=V``, or a list of
    them that must all hold."""
    if isinstance(text, list):
        return all(_cond(part, c) for part in text)
    for op in ("==", "!=", ">"):
        if op in text:
            name, value = text.split(op, 1)
            have = c.get(name)
            if op == ">":
                return have is not None and have > int(value)
            same = str(have).lower() == value.lower()
            return same if op == "==" else not same
    if text.startswith("!"):
        return not c.get(text[1:])
    return bool(c.get(text))


def _value(arg: dict, c: dict, t: dict):
    value = c.get(arg["value"])
    if "map" in arg:
        value = t["maps"][arg["map"]].get(str(value).lower())
    return value


# --- can the engine express it -----------------------------------------------------------------
def _check_kind(t, layout, c, rule, want):
    if t["kind"] in ("both", want):
        return None
    other = "serving" if want == "serve" else "training"
    engines = [e for e in ENGINES if table(e)["kind"] in ("both", want)]
    return (f"{t['name']} is a {'serving' if t['kind'] == 'serve' else 'training'} engine and this is a {other} layout; "
            f"use {', '.join(engines)}", None)


def _check_max(t, layout, c, rule, _want):
    field = rule["field"]
    if c[field] <= rule["max"]:
        return None
    if field == "cp":
        nearest = layout.replace(dp=layout.dp * layout.cp, cp=1)
    elif field == "zero":
        nearest = layout.replace(zero=0, dp_shard=0)
    else:
        nearest = layout.replace(**{field: rule["max"]})
    return f"{rule['why']}, not {field}={c[field]}", nearest


def _check_in_map(t, layout, c, rule, _want):
    field = rule["field"]
    value = str(c[field]).lower()
    if value in t["maps"][rule["map"]]:
        return None
    target = rule.get("nearest", {}).get(value)
    nearest = None
    if target is not None:
        if field == "zero_kind":
            nearest = layout.replace(zero=int(target))
        elif field == "recompute_kind":
            nearest = layout.replace(recompute=target)
        else:
            nearest = layout.replace(**{field: target})
    return f"{rule['why']}, not {field.replace('_kind', '')}={c[field] if field != 'recompute_kind' else layout.recompute}", nearest


def _span(name: str, c: dict) -> int:
    out = 1
    for part in name.split("*"):
        out *= c[part]
    return out


def _check_ep_span(t, layout, c, rule, _want):
    if layout.ep == 1:
        return None
    spans = rule["spans"]
    titan = spans == ["dp_shard*cp*tp"]
    for name in spans:
        width = _span(name, c)
        if titan and c["expert_tp"] == 1 and width % layout.ep == 0:
            return None
        if t["engine"] == "vllm" and layout.ep == width:
            return None
        if not titan and t["engine"] != "vllm" and layout.ep * c["expert_tp"] == width:
            return None
    name = spans[-1]
    width = _span(name, c)
    if titan:
        base = layout if layout.zero == 3 else layout.replace(zero=3, dp_shard=0)
        width = _span(name, context(base))
        ep = max(d for d in range(1, layout.ep + 1) if width % d == 0 and layout.ep % d == 0)
        nearest = base.replace(ep=ep, etp=1)
    else:
        nearest = layout.replace(ep=width, etp=1)
    over = "x".join(part.upper() for part in name.split("*"))
    return (f"{rule['why']} ({over} = {width}), not ep={layout.ep}" + (f" with etp={c['expert_tp']}" if c["expert_tp"] != 1 else ""),
            nearest)


def _check_hsdp(t, layout, c, rule, _want):
    if layout.zero == 0 or not layout.dp_shard or layout.dp_shard == layout.dp or layout.zero in rule["zero"]:
        return None
    return f"{rule['why']}, not zero={layout.zero} over dp_shard={layout.dp_shard} of dp={layout.dp}", layout.replace(dp_shard=0)


_CHECKS = {
    "serving": lambda t, l, c, r, w: _check_kind(t, l, c, r, "serve") if w == "serve" else _check_kind(t, l, c, r, "train"),
    "training": lambda t, l, c, r, w: _check_kind(t, l, c, r, "train") if w == "train" else _check_kind(t, l, c, r, "serve"),
    "max": _check_max,
    "in_map": _check_in_map,
    "ep_span": _check_ep_span,
    "hsdp": _check_hsdp,
}


def problem(engine: str, layout: Layout, model=None, *, serving: bool) -> tuple[str, Layout | None] | None:
    """Why ``engine`` cannot express ``layout`` and a nearer layout (one step), or None if it can."""
    t = table(engine)
    c = context(layout, model, serving=serving)
    for rule in t["rules"]:
        found = _CHECKS[rule["check"]](t, layout, c, rule, "serve" if serving else "train")
        if found:
            return found
    if t.get("training_checks") and not serving and model is not None:
        # an engine that is our own runtime: its one check of "can this layout run", not a copy of it
        from modelcarve.spec.support import training_problems

        problems = training_problems(layout, model)
        if problems:
            return problems[0], None
    return None


def can_express(engine: str, layout: Layout, model=None, *, serving: bool) -> bool:
    """The one answer to "can ENGINE express this layout" (emit and ``plan --engine`` both ask it)."""
    return problem(engine, layout, model, serving=serving) is None


def nearest(engine: str, layout: Layout, model=None, *, serving: bool) -> Layout | None:
    """The layout ``engine`` can express reached by repairing each refusal in turn, or None."""
    current = layout
    for _ in range(8):
        found = problem(engine, current, model, serving=serving)
        if found is None:
            if model is not None:
                try:
                    current.validate(model)
                except ModelcarveError:
                    return None
            return current
        current = found[1]
        if current is None:
            return None
    return None


_KEYS = ("tp", "pp", "dp", "cp", "ep", "expert_tp", "sp", "zero", "dp_shard", "schedule", "virtual_stages", "mbs",
         "global_batch", "seq", "recompute", "param_dtype", "weight_dtype", "kv_dtype")


def _key(layout: Layout) -> tuple:
    c = context(layout)
    return tuple(c[k] for k in _KEYS)


def _diff(old: Layout, new: Layout) -> str:
    a, b = context(old), context(new)
    names = {"expert_tp": "etp", "dp_shard": "dp_shard"}
    return ",".join(f"{names.get(k, k)}={b[k]}" for k in _KEYS if a[k] != b[k])


def rank_in(layout: Layout, ranking: list[Layout] | None) -> str:
    if ranking is None:
        return "estimate ranks nothing: run plan with --engine to rank what it can run"
    for i, other in enumerate(ranking, 1):
        if _key(other) == _key(layout):
            return f"rank {i} in this plan"
    return f"not in this plan's top {len(ranking)}"


def refusal(engine: str, layout: Layout, model=None, *, serving: bool, ranking: list[Layout] | None = None) -> str | None:
    """The one-line refusal for ``layout``, or None if ``engine`` can express it."""
    found = problem(engine, layout, model, serving=serving)
    if found is None:
        return None
    why, _ = found
    near = nearest(engine, layout, model, serving=serving)
    if near is None:
        kind = table(engine)["kind"]
        return f"{title(engine)}: {why}" + ("" if kind != "both" and "engine and this is" in why else "; no nearby layout it can express")
    line = f"{title(engine)}: {why}: nearest expressible is {_diff(layout, near)} ({near.short()}; {rank_in(near, ranking)})"
    if ranking:
        best = next((i for i, other in enumerate(ranking, 1) if can_express(engine, other, model, serving=serving)), None)
        if best and rank_in(near, ranking) != f"rank {best} in this plan":
            line += f"; the best it can express here is rank {best} ({ranking[best - 1].short()})"
    return line


# --- rendering --------------------------------------------------------------------------------
def model_ref(model) -> str:
    """What the engine loads: the Hugging Face repository of a catalogued model, else its name."""
    source = getattr(model, "source", "") or ""
    if source.startswith("https://huggingface.co/"):
        parts = source[len("https://huggingface.co/"):].split("/")
        if len(parts) >= 2:
            return f"{parts[0]}/{parts[1]}"
    return model.name


def argv(engine: str, layout: Layout, model, cluster, *, serving: bool, max_batch: int | None = None,
         node_rank: int = 0, master_addr: str = "$MASTER_ADDR", master_port: int = 29500,
         options_file: str | None = None, planner_options: dict | None = None) -> list[str]:
    """The engine's command line for ``layout`` (its table's flags, in order); a flag naming a planner
    ``option`` (Megatron's ``--fp8-param-gather``; with ``equals``, its loss flags for ``loss="fused"``)
    is written when the plan was priced with it so and its ``when`` holds (which may name the priced
    options too: Megatron's ``--overlap-param-gather`` needs ``--overlap-grad-reduce``).
    ``planner_options``: the options the plan was priced with; an option it does not name was priced
    at ``TrainOptions``' default (``overlap_grad_reduce=True``: Megatron's ``--overlap-grad-reduce``)."""
    t = table(engine)
    priced = _priced(planner_options)
    c = context(layout, model, serving=serving, max_batch=max_batch)
    nodes = max(1, -(-layout.world_size // cluster.devices_per_node))
    c.update(model=model_ref(model) if engine != "modelcarve" else model.name, nnodes=nodes,
             nproc_per_node=min(layout.world_size, cluster.devices_per_node), node_rank=node_rank,
             master_addr=master_addr, master_port=master_port, verb="serve" if serving else "run",
             options_file=options_file, titan_module=_titan_module(model), titan_config=f"{_titan_module(model)}_custom")
    out = [part.format(**c) for part in t["command"]]
    if layout.pp > 1 and model is not None:  # the stages the plan priced, as Megatron's layout string
        from modelcarve.spec.stages import planned_layout

        c["pipeline_layout"] = planned_layout(
            model.num_layers, layout.pp, layout.virtual_stages if layout.schedule == "interleaved-1f1b" else 1,
            layout=priced.get("pipeline_layout") or "", first=int(priced.get("first_stage_layers") or 0),
            last=int(priced.get("last_stage_layers") or 0), split_embedding=priced.get("split_embedding", True),
            mtp_layers=int(priced.get("mtp_layers") or 0))
    for arg in t["args"]:
        if "comment" in arg or arg.get("emit") is False:  # e.g. a flag read but superseded in a launch
            continue
        if "option" in arg and arg.get("text"):  # a word the plan's stages give (Megatron's pipeline layout)
            if c.get(arg["option"]) and ("when" not in arg or _cond(arg["when"], c)):
                out += [arg["flag"], c[arg["option"]]]
            continue
        if "option" in arg and arg.get("number"):  # a count the plan was priced with, when not 0
            if priced.get(arg["option"]):
                out += [arg["flag"], str(priced[arg["option"]])]
            continue
        if "option" in arg and not _priced_with(arg, priced):  # priced without it
            continue
        if "when" in arg and not _cond(arg["when"], {**c, **priced} if "option" in arg else c):
            continue
        if "word" in arg:  # a fixed value, e.g. Megatron's --cross-entropy-fusion-impl te
            out += [arg["flag"], arg["word"]]
            continue
        if "value" not in arg:
            out.append(arg["flag"])
            continue
        value = _value(arg, c, t)
        if value is None or value is False:
            continue
        if "positional" in arg:
            out.append(arg["positional"].format(value))
        elif arg.get("nargs"):
            out += [arg["flag"], *map(str, value)]
        else:
            out += [arg["flag"], str(value)]
    return out


def _priced(planner_options: dict | None) -> dict:
    """The training planner's options a plan was priced with: ``TrainOptions``' defaults, then the ones
    ``planner_options`` names (None: not said, the default)."""
    from dataclasses import fields

    from modelcarve.plan.train.options import TrainOptions

    said = {k: v for k, v in (planner_options or {}).items() if v is not None}
    return {**{f.name: f.default for f in fields(TrainOptions)}, **said}


def _priced_with(arg: dict, planner_options: dict | None) -> bool:
    """Whether a flag naming a planner ``option`` belongs to the plan: the option is on, or, for an
    arg with ``equals``, has that value (Megatron's loss flags: ``loss == "fused"``)."""
    have = (planner_options or {}).get(arg["option"])
    return have == arg["equals"] if "equals" in arg else bool(have)


def _titan_module(model) -> str:
    family = getattr(model, "family", "llama")
    return {"llama": "llama3", "qwen3": "qwen3", "qwen3_moe": "qwen3", "deepseek_v3": "deepseek_v3",
            "gpt_oss": "gpt_oss"}.get(family, family)


def options(engine: str, layout: Layout, model=None, *, serving: bool, planner_options: dict | None = None) -> dict:
    """The engine's options file (TensorRT-LLM's --extra_llm_api_options YAML), as nested keys; a key
    naming a planner ``option`` (the KV-cache memory fraction) is written when the plan was priced with one."""
    t = table(engine)
    c = context(layout, model, serving=serving)
    out: dict = {}
    for item in t.get("options", []):
        if "when" in item and not _cond(item["when"], c):
            continue
        if "option" in item:
            value = (planner_options or {}).get(item["option"])
            if value is None:
                continue
        else:
            value = _value(item, c, t)
        node = out
        *parents, leaf = item["key"].split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _yaml(tree: dict, indent: int = 0) -> str:
    lines = []
    for key, value in tree.items():
        if isinstance(value, dict):
            lines.append(" " * indent + f"{key}:")
            lines.append(_yaml(value, indent + 2))
        else:
            lines.append(" " * indent + f"{key}: {json.dumps(value)}")
    return "\n".join(lines)


def render(engine: str, layout: Layout, model, cluster, *, serving: bool, max_batch: int | None = None,
           label: str = "", planner_options: dict | None = None) -> dict[str, str]:
    """The files of ``--emit-launch ENGINE``: {file name: text}; ``launch.sh`` always
    (``planner_options``: the options the plan was priced with, see ``argv``)."""
    t = table(engine)
    head = [
        "#!/usr/bin/env bash",
        f"# modelcarve --emit-launch {engine}: {label or layout.short()} for {model.name} on {cluster.name}",
        f"# mapping: {title(engine)} (engines/{engine}.json; checked against {t['checked_against'].split(':')[0]})",
        f"# layout: {layout.short()} tp={layout.tp} pp={layout.pp} dp={layout.dp} cp={layout.cp} ep={layout.ep} "
        f"seq={layout.seq}" + (f" max_batch={max_batch}" if max_batch else ""),
    ]
    c = context(layout, model, serving=serving, max_batch=max_batch)
    for arg in t["args"]:
        if "comment" in arg and ("when" not in arg or _cond(arg["when"], c)):
            head.append("# " + arg["comment"].format(_value(arg, c, t)))
    files: dict[str, str] = {}
    if engine == "modelcarve":
        files["layout.json"] = layout.to_json() + "\n"
        nodes = max(1, -(-layout.world_size // cluster.devices_per_node))
        if nodes == 1:
            body = [_join(argv(engine, layout, model, cluster, serving=serving, max_batch=max_batch, node_rank=0))]
        else:  # one script for every node: its rank the argument, node 0's address in MASTER_ADDR
            body = [f"# on each of the {nodes} nodes: MASTER_ADDR=<node 0's address> bash launch.sh NODE_RANK",
                    f'NODE_RANK=${{1:?usage: MASTER_ADDR=<node 0 address> bash launch.sh NODE_RANK (0..{nodes - 1})}}',
                    ': "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"',
                    _join(argv(engine, layout, model, cluster, serving=serving, max_batch=max_batch,
                               node_rank="$NODE_RANK"))]
        files["launch.sh"] = "\n".join(head + body) + "\n"
        files["launch.slurm"] = _slurm(engine, layout, model, cluster, serving=serving, max_batch=max_batch, nodes=nodes)
        return files
    extra = options(engine, layout, model, serving=serving, planner_options=planner_options)
    opts = "extra_llm_api_options.yaml" if extra else None
    if extra:
        files[opts] = f"# {title(engine)} --extra_llm_api_options\n" + _yaml(extra) + "\n"
    cmd = argv(engine, layout, model, cluster, serving=serving, max_batch=max_batch, options_file=opts,
               planner_options=planner_options)
    if engine == "trtllm" and layout.dp > 1 and not context(layout)["dp_attention"]:
        head.append(f"# {t['replicas']}: {layout.dp} replicas, ports 8000..{8000 + layout.dp - 1}")
        body = [f"CUDA_VISIBLE_DEVICES={','.join(str(r * layout.tp * layout.pp + i) for i in range(layout.tp * layout.pp))} "
                + _join(cmd + ["--port", str(8000 + r)]) + " &" for r in range(layout.dp)] + ["wait"]
    elif engine == "torchtitan":
        head.append(f"# {model.name}: --module {_titan_module(model)} --config names a config_registry function of yours "
                    f"(torchtitan 0.3.0 has no TOML); the flags below override its parallelism/training keys")
        body = [_join(cmd)]
    else:
        body = [_join(cmd)]
    files["launch.sh"] = "\n".join(head + body) + "\n"
    return files


def _join(cmd: list[str]) -> str:
    """One line per flag with its values (the command and its positionals first)."""
    lines: list[list[str]] = [[]]
    for a in cmd:
        if a.startswith("--") or (":" in a and not a.startswith("$") and lines[0] and lines[-1] is not lines[0]):
            lines.append([])
        lines[-1].append(a if a.startswith("$") else shlex.quote(a))
    return " \\\n  ".join(" ".join(line) for line in lines)


def _slurm(engine, layout, model, cluster, *, serving, max_batch, nodes) -> str:
    per_node = min(layout.world_size, cluster.devices_per_node)
    cmd = argv(engine, layout, model, cluster, serving=serving, max_batch=max_batch, node_rank=0,
               master_addr="$MASTER_ADDR", master_port=29500)
    i = cmd.index("--node-rank")
    cmd[i + 1] = "$SLURM_NODEID"
    return "\n".join([
        "#!/usr/bin/env bash",
        f"#SBATCH --job-name=modelcarve-{layout.short()}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={per_node}",
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "srun bash -c '" + " ".join(a if a.startswith("$") else shlex.quote(a) for a in cmd) + "'",
    ]) + "\n"


def write(files: dict[str, str], out: str | None) -> list[str]:
    """Write ``files`` under ``out`` (created), or return their text for stdout when ``out`` is None."""
    if out is None:
        return [text if name == "launch.sh" else f"# --- {name} ---\n{text}" for name, text in files.items()]
    from modelcarve.spec import files as spec_files

    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ModelcarveError(f"--out {out}: exists and is not a directory")
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        path = str(folder / name)
        spec_files.write_text(path, text, "--out")
        if name.endswith(".sh") or name.endswith(".slurm"):
            Path(path).chmod(0o755)
        written.append(path)
    return written
