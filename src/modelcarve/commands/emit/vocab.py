"""A layout described in a framework's own words, read into modelcarve's: ``estimate --framework``.

    text, notes = read_layout("torchtitan", "tp=2,recompute=selective", devices=8)
    # "tp=2,recompute=ops"; notes: torchtitan's recompute=selective is op-level SAC
    text, notes = read_layout("megatron", "--tensor-model-parallel-size 8 --sequence-parallel "
                              "--use-distributed-optimizer --recompute-granularity selective", devices=64)
    # "tp=8,sp,zero=1,recompute=selective,dp=8"

The words are the ones ``--emit-launch`` writes (``engines/<engine>.json``), read backwards, so
one table per engine serves both directions. Two forms:

* **our keys, their values** (``key=value,...``): a value is read through the engine's map for that
  key (``recompute``, ``schedule``, ``param_dtype``, ``weight_dtype``, ``kv_dtype``): torchtitan's
  ``selective`` is op-level selective activation checkpointing (our ``ops``), Megatron's
  ``selective`` its attention-core recompute (our ``selective``);
* **their flags** (text starting with ``--``): each flag the table emits, read back into the
  layout field it came from (degrees, batch, sequence, schedule, recompute, ZeRO / distributed
  optimiser / FSDP, FP8); data parallelism Megatron leaves implicit is ``devices / (tp pp cp)``,
  torchtitan's is its replicate x shard degrees (shard > 1: FSDP, with replicas HSDP).

Two frameworks without a launch table have readers of their own: DeepSpeed's config
(deepspeed_vocab.py) and Megatron-Bridge's recipe overrides (bridge_vocab.py: ``model.*`` /
``ddp.*`` / ``train.*`` fields are Megatron-Core's, so they are translated into Megatron-LM's flags
and read by the Megatron reader here).

Every translation that changed a word is returned as a note (``estimate`` prints them), so the
user sees which meaning was used; a flag the table does not know is refused in one line.

**Communication overlap** (Megatron-LM's own flags, read at its core_v0.19.0 tag: the table names
0.19.2, the mirror's newest 0.19 tag is 0.19.0). Megatron-LM's defaults are not the planner's, and an
estimate of Megatron's flags prices what Megatron runs:

* ``--overlap-grad-reduce`` / ``--overlap-param-gather`` are ``store_true`` with ``default=False``
  (megatron/training/arguments.py:2968, :2989): absent, Megatron reduces the gradients after the
  backward and gathers the parameters before the forward, so an absent flag reads as
  ``overlap_grad_reduce=False`` / ``overlap_param_gather=False`` (the table's ``absent``) and the
  estimate says so in a note. This changed existing estimates: before these flags were read, every
  ``--framework megatron`` estimate priced both overlapped (the planner's default); with dp x cp > 1
  and no ``--overlap-grad-reduce`` it now shows more exposed data-parallel time. Chosen over "read only
  the given flags" because an estimate of a Megatron command should price that command, and only a few
  tests (their ``read_options`` dicts) had to learn the two new keys. Megatron asserts that the gather
  overlap comes with the distributed optimizer or Megatron-FSDP and with ``--overlap-grad-reduce``
  (arguments.py:990-995): refused here in one line too.
* ``--tp-comm-overlap`` (``ModelParallelConfig.tp_comm_overlap = False``, model_parallel_config.py:265,
  a ``store_true`` flag through training/argument_utils.py's ``ArgumentGroupFactory``) is Transformer
  Engine's comm-GEMM overlap over userbuffers (training/initialize.py:157 ``_initialize_tp_communicators``,
  TE's ``initialize_ub``); Megatron asserts sequence parallelism (arguments.py:1401), which it turns off at
  TP 1 (:1393), so without ``--sequence-parallel`` and TP > 1 it is refused. Read as
  ``tp_overlap = calibration.TP_COMM_OVERLAP`` (the fraction of TP traffic hidden, fitted to the
  Megatron-Bridge recipes that run it); absent, 0 (Megatron's default and the planner's).
* ``--no-overlap-p2p-communication`` (``store_false``, ``dest=overlap_p2p_comm``, arguments.py:2965): the
  pipeline sends overlap by default, and only the interleaved schedule overlaps them (:966-984), which is
  the planner's ``overlap_p2p=True`` (priced with virtual stages only); the flag reads as
  ``overlap_p2p=False``. There is no ``--overlap-p2p-communication`` flag.
* ``--overlap-moe-expert-parallel-comm``: ``moe_a2a_overlap`` (default off in both).
* ``--use-transformer-engine-op-fuser`` (``TransformerConfig.use_transformer_engine_op_fuser = False``, a
  ``store_true`` flag through ``ArgumentGroupFactory``): ``moe_fused_mlp``. The op fuser is Transformer
  Engine's; of what it fuses the planner prices the MoE grouped MLP (moe/experts.py ``_make_fused_ops``: the
  activation and its quantisation in the GEMM epilogues), which Megatron-Bridge's ``cutedsl_fused_grouped_mlp``
  presets turn on (26.06+). Default off in both.
* ``--cuda-graph-impl full_iteration`` (``TransformerConfig.cuda_graph_impl``, a Literal of none / local /
  transformer_engine / full_iteration at core_v0.19.0): ``cuda_graph="full_iteration"``, the whole step replayed, so
  the host issues no expert kernel (plan/train/layer.py ``expert_kernel_sets``). The layer-wise impls read as the
  planner's default: for dropless MoE their scopes leave the experts eager, which is what the planner prices.

``--emit-launch megatron`` writes each of them when the plan was priced so (commands/emit ``argv``: an
option the plan did not state was priced at the planner's default, so a default plan's launch carries
``--overlap-grad-reduce`` and, with the distributed optimizer, ``--overlap-param-gather``), and the
launch reads back to the same options.
"""

from __future__ import annotations

import shlex

from modelcarve.commands.emit import table, title
from modelcarve.spec.errors import LayoutError, ModelcarveError

MEANING = {
    "none": "no recomputation",
    "selective": "Megatron's selective recompute (the attention core: softmax, dropout, scores)",
    "full": "whole-layer recompute",
    "ops": "op-level selective activation checkpointing (matmul outputs saved, the rest recomputed)",
}
"""What each of our ``recompute`` values means, for the notes."""

_FIELDS = {"global_batch": "gbs", "expert_tp": "etp"}
"""A table's context name -> the layout field it is (the rest are the field's own name)."""
_IGNORED = {"layers_per_stage", "one", "local_batch"}
"""Context names a table emits that follow from the others (checked by --emit-launch, not read)."""


def _inverse(mapping: dict, word: str) -> str | None:
    """Our value for the engine's ``word`` (the first of ours the table writes that way)."""
    for ours, theirs in mapping.items():
        if theirs is not None and str(theirs).lower() == str(word).lower():
            return ours
    return None


def _note(engine: str, key: str, word: str, ours: str) -> str:
    meaning = f": {MEANING[ours]}" if key == "recompute" and ours in MEANING else ""
    return f"{title(engine)}'s {key}={word} read as {key}={ours}{meaning}"


def _words(engine: str, text: str) -> tuple[str, list[str]]:
    maps, out, notes = table(engine)["maps"], [], []
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        key, sep, word = part.partition("=")
        key = key.strip().lower().replace("-", "_")
        if sep and key in maps:
            ours = _inverse(maps[key], word.strip())
            if ours is None:
                known = sorted({str(v) for v in maps[key].values() if v is not None})
                raise ModelcarveError(f"{title(engine)} has no {key}={word.strip()}; its words: {', '.join(known)}")
            if ours != word.strip() or key == "recompute":  # recompute: the meaning, even where the word is ours
                notes.append(_note(engine, key, word.strip(), ours))
            part = f"{key}={ours}"
        out.append(part)
    return ",".join(out), notes


def _flags(engine: str, text: str, devices: int | None) -> tuple[str, list[str]]:
    t = table(engine)
    by_flag = {arg["flag"]: arg for arg in t["args"] if "flag" in arg}
    positional = [arg for arg in t["args"] if "positional" in arg]  # e.g. torchtitan's activation-checkpoint:<mode>
    tokens = shlex.split(text)
    fields: dict = {}
    floors: dict = {}
    modules = None
    notes: list[str] = []
    i = 0
    while i < len(tokens):
        flag = tokens[i]
        arg = by_flag.get(flag)
        if arg is None and not flag.startswith("-"):
            for pos in positional:
                head = pos["positional"].split("{}")[0]
                if flag.startswith(head):
                    arg, flag = pos, head.rstrip(":")
                    tokens.insert(i + 1, tokens[i][len(head):])
                    break
        if arg is None:
            raise ModelcarveError(f"{title(engine)}: {flag} is not a flag modelcarve reads; it reads "
                                  f"{', '.join(sorted(by_flag))}")
        if "option" in arg and arg.get("text"):  # Megatron's --pipeline-model-parallel-layout: the stages stated
            from modelcarve.spec.stages import parse_megatron_layout

            if i + 1 >= len(tokens):
                raise ModelcarveError(f"{title(engine)}: {flag} needs a layout, e.g. {flag} 'Et*4|t*4|t*3mL'")
            pp = int(_word_after(tokens, "--pipeline-model-parallel-size", "1"))
            try:
                counts, named = parse_megatron_layout(tokens[i + 1], pp)
            except LayoutError as err:
                raise ModelcarveError(f"{title(engine)}: {flag}: {err}") from None
            if len(counts) // pp > 1:  # the layout gives the virtual stages (Megatron refuses both flags)
                fields["virtual_stages"] = len(counts) // pp
            said_mtp = _number(engine, tokens, "--mtp-num-layers") if "--mtp-num-layers" in tokens else 0
            if named != said_mtp:
                raise ModelcarveError(f"{title(engine)}: {flag} places {named} MTP depth(s) (m) but --mtp-num-layers "
                                      f"says {said_mtp}; Megatron asserts they match")
            notes.append(f"{title(engine)}'s {flag} read as the planner option pipeline_layout: each rank holds the "
                         f"layers its stages name ({len(counts)} stages: {', '.join(map(str, counts))} decoder layers)")
            i += 2
            continue
        if "option" in arg and arg.get("number"):  # a count the planner prices, e.g. Megatron's --mtp-num-layers N
            value = _number(engine, tokens, flag)
            notes.append(f"{title(engine)}'s {flag} {value} read as the planner option {arg['option']}={value}")
            i += 2
            continue
        if "option" in arg:  # a switch of the planner's options, not the layout (read_options)
            if "word" in arg and i + 1 >= len(tokens):
                raise ModelcarveError(f"{title(engine)}: {flag} needs a value")
            shown = f"{flag} {tokens[i + 1]}" if "word" in arg else flag
            if "equals" not in arg:
                value = _set_options(engine, tokens).get(arg["option"])
                notes.append(f"{title(engine)}'s {flag} read as the planner option {arg['option']}"
                             + ("" if value is True else f"={value}") + _OPTION_NOTE.get(arg["option"], ""))
            elif _set_options(engine, tokens).get(arg["option"]) == arg["equals"]:
                notes.append(f"{title(engine)}'s {shown} read as the planner option {arg['option']}={arg['equals']}")
            else:  # e.g. the loss fusion without TE's kernel
                needs = " with ".join(a["flag"] + (" " + a["word"] if "word" in a else "") for a in t["args"]
                                      if a.get("option") == arg["option"] and a.get("equals") == arg["equals"])
                notes.append(f"{title(engine)}'s {shown}: not the planner option {arg['option']}={arg['equals']}, "
                             f"which needs {needs}" + _LOSS_NOTE.get(arg["option"], ""))
            i += 2 if "word" in arg else 1
            continue
        if "value" not in arg:  # a switch: what its condition says
            when = arg.get("when", "")
            if when in ("sp", "!sp"):
                fields["sp"] = when == "sp"
            elif ">" in when and when.split(">")[0] == "zero":
                floors["zero"] = max(floors.get("zero", 0), int(when.split(">")[1]) + 1)
            elif "==" in when:  # e.g. Megatron's --grad-reduce-in-bf16: grad_dtype==bf16
                key, value = when.split("==")
                fields[key] = value
                notes.append(f"{title(engine)}'s {flag} read as {key}={value}")
            i += 1
            continue
        if i + 1 >= len(tokens):
            raise ModelcarveError(f"{title(engine)}: {flag} needs a value")
        word, name = tokens[i + 1], arg["value"]
        i += 2
        if arg.get("nargs"):  # e.g. Megatron's --recompute-modules core_attn mlp: every word up to the next flag
            words = [word]
            while i < len(tokens) and not tokens[i].startswith("-"):
                words.append(tokens[i])
                i += 1
            if name == "recompute_list":
                modules = "+".join(words)
            continue
        if name == "recompute" and arg.get("map") == "recompute_method":
            if _inverse(t["maps"]["recompute_method"], word) is None:  # Megatron's block: N layers a stage only
                raise ModelcarveError(
                    f"{title(engine)}: {flag} {word} recomputes only the first --recompute-num-layers layers of each "
                    f"stage, which modelcarve does not model; use {flag} "
                    f"{t['maps']['recompute_method']['full']} (every layer) or selective recomputation")
            continue
        if name == "one" and word != "1":  # uniform over chunks of N layers: each chunk's input kept
            notes.append(f"{title(engine)}'s {flag} {word} (chunks of {word} layers, each keeping only its input and "
                         f"recomputed whole) read as recompute=full of one layer a chunk: the estimate keeps every "
                         f"layer's input and recomputes one layer at a time")
            continue
        if name in _IGNORED:
            continue
        if "map" in arg:
            ours = _inverse(t["maps"][arg["map"]], word)
            if ours is None:
                raise ModelcarveError(f"{title(engine)}: {flag} {word} is not a value modelcarve reads")
            if arg["map"] == "fp8_recipe":  # delayed / current scaling, or MXFP8 blocks (a dtype of its own)
                if ours == "mxfp8":
                    fields["param_dtype"] = "mxfp8"
                else:
                    fields["fp8_scaling"] = ours
                continue
            if name == "param_dtype":  # the recipe's mxfp8, if read first, stands
                fields.setdefault("param_dtype", ours)
                continue
            if name == "recompute" or ours != word:
                notes.append(_note(engine, name, word, ours))
            fields[_FIELDS.get(name, name)] = int(ours) if name == "zero" else ours
            continue
        fields[_FIELDS.get(name, name)] = int(word) if word.lstrip("-").isdigit() else word
    if modules is not None:  # the module list is the recompute (its granularity flag only says "selective")
        fields["recompute"] = modules
    zero = max(int(fields.pop("zero", 0) or 0), floors.get("zero", 0))
    replicate, shard = fields.pop("dp_replicate", None), fields.pop("dp_shard", None)
    model_parallel = int(fields.get("tp", 1)) * int(fields.get("pp", 1)) * int(fields.get("cp", 1))
    if fields.get("virtual_stages", 1) not in (1, "1") and "schedule" not in fields:
        fields["schedule"] = "interleaved-1f1b"  # Megatron: virtual stages are its interleaved schedule
    if shard is not None:  # torchtitan: dp = replicate x shard (-1: the rest)
        replicate, shard = int(replicate or 1), int(shard or 1)
        if shard == -1:
            if not devices:
                raise ModelcarveError(f"{title(engine)}: data-parallel-shard-degree -1 needs the cluster's devices")
            shard = devices // (model_parallel * replicate)
        fields["dp"] = replicate * shard
        if shard > 1:
            zero = 3
            if replicate > 1:
                fields["dp_shard"] = shard
            notes.append(f"{title(engine)}'s data-parallel shard degree {shard} read as FSDP (zero=3)"
                         + (f" with {replicate} replicas (HSDP)" if replicate > 1 else ""))
    elif devices:  # Megatron: data parallelism is what the other degrees leave
        if devices % model_parallel:
            raise ModelcarveError(f"{title(engine)}: tp x pp x cp = {model_parallel} does not divide the cluster's "
                                  f"{devices} devices")
        fields["dp"] = devices // model_parallel
        notes.append(f"{title(engine)} leaves data parallelism implicit: dp = {devices} devices / (tp x pp x cp) "
                     f"= {fields['dp']}")
        if replicate is not None and int(replicate) > 1:  # distributed-optimizer instances: the state's replicas
            fields["dp_shard"] = fields["dp"] // int(replicate)
    if zero:
        fields["zero"] = zero
        if engine == "megatron" and zero == 1:
            notes.append(f"{title(engine)}'s distributed optimizer read as ZeRO-1 (optimizer state sharded over dp)")
    parts = []
    for key, value in fields.items():
        if value is True:
            parts.append(key)
        elif value is not False:
            parts.append(f"{key}={value}")
    return ",".join(parts), notes


_LOSS_NOTE = {"loss": "; priced as Megatron-Core's unfused loss, 6 B a logit (its native fused path is the same "
                      "arithmetic and holds the same 6 B run eagerly: benchmarks/results/megatron_loss_memory.json)"}
"""What a value-taking option flag read with another value is priced as (``_flags``' note)."""
_OPTION_NOTE = {"tp_overlap": ": the fraction of tensor-parallel traffic Transformer Engine's comm-GEMM overlap "
                              "(userbuffers) hides, as fitted to the Megatron-Bridge recipes that run it "
                              "(plan/train/calibration.py TP_COMM_OVERLAP)"}
"""What an option flag read means, beyond its name (``_flags``' note)."""


def read_options(engine: str, text: str) -> dict:
    """The planner options (plan/train/options.py TrainOptions) that ``text``, ``engine``'s own flags,
    switches on: the table's args with an ``option`` (Megatron's ``--fp8-param-gather``; an arg with
    ``equals`` sets that value when every flag of it is given: ``--cross-entropy-loss-fusion`` with
    ``--cross-entropy-fusion-impl te`` is ``loss="fused"``; an arg with ``absent`` sets that value when
    its flag is not given: Megatron's ``--overlap-grad-reduce``, off by default); empty for our keys'
    form and for engines without such flags."""
    text = text.strip()
    if engine == "megatron-bridge":  # its overrides are Megatron-LM's flags by other names
        from modelcarve.commands.emit.bridge_vocab import bridge_flags

        flags, options, _notes = bridge_flags(text)
        return {**read_options("megatron", flags), **options}
    if engine == "deepspeed" or not text.startswith("--"):
        return {}
    return _set_options(engine, shlex.split(text))


def _word_after(words: list[str], flag: str, default: str) -> str:
    """The word after ``flag`` in a command line's ``words``, or ``default`` when the flag is not there."""
    return words[words.index(flag) + 1] if flag in words[:-1] else default


def _number(engine: str, words: list[str], flag: str) -> int:
    """The whole number after ``flag`` in ``words``, or one line saying what it needs."""
    at = words.index(flag)
    word = words[at + 1] if at + 1 < len(words) else ""
    if not word.isdigit():
        raise ModelcarveError(f"{title(engine)}: {flag} needs a whole number, e.g. {flag} 1"
                              + (f" (got {word!r})" if word else ""))
    return int(word)


def _set_options(engine: str, words: list[str]) -> dict:
    """``read_options`` over the words of a command line."""
    counts = [arg for arg in table(engine)["args"] if "option" in arg and arg.get("number")]
    texts = [arg for arg in table(engine)["args"] if "option" in arg and arg.get("text")]
    args = [arg for arg in table(engine)["args"] if "option" in arg and not arg.get("number") and not arg.get("text")]
    said = {arg["flag"]: (arg["flag"] in words and (
        "word" not in arg or words.index(arg["flag"]) + 1 < len(words) and words[words.index(arg["flag"]) + 1] == arg["word"]))
        for arg in args}
    options: dict = {}
    for arg in args:  # an option with a value (``equals``) is set when every flag of that value is given
        kin = [a for a in args if a["option"] == arg["option"] and a.get("equals") == arg.get("equals")]
        if all(said[a["flag"]] for a in kin):
            options[arg["option"]] = arg.get("equals", True)
    for arg in args:  # the framework's own default where the flag is not given
        if "absent" in arg and not said[arg["flag"]]:
            options.setdefault(arg["option"], arg["absent"])
    for arg in counts:  # a count given with its flag (Megatron's --mtp-num-layers N)
        if arg["flag"] in words:
            options[arg["option"]] = _number(engine, words, arg["flag"])
    for arg in texts:  # a word given with its flag (Megatron's --pipeline-model-parallel-layout)
        at = words.index(arg["flag"]) if arg["flag"] in words else -1
        if 0 <= at < len(words) - 1:
            options[arg["option"]] = words[at + 1]
    if options.get("tp_overlap") is True:  # Megatron's --tp-comm-overlap: the fraction it hides
        from modelcarve.plan.train.calibration import TP_COMM_OVERLAP

        options["tp_overlap"] = TP_COMM_OVERLAP
    return options


def read_layout(engine: str, text: str, devices: int | None = None) -> tuple[str, list[str]]:
    """``(layout text in our words, notes)`` for ``text`` in ``engine``'s words (see the module doc)."""
    text = text.strip()
    if engine == "deepspeed":  # a config file, not flags: its own reader
        from modelcarve.commands.emit.deepspeed_vocab import read_deepspeed

        return read_deepspeed(text, devices)
    if engine == "megatron-bridge":  # Hydra overrides of Megatron-Core's configs: read as Megatron-LM's flags
        from modelcarve.commands.emit.bridge_vocab import bridge_flags

        flags, _options, notes = bridge_flags(text)
        layout, more = _flags("megatron", flags, devices)
        return layout, notes + more
    if text.startswith("--"):
        layout, notes = _flags(engine, text, devices)
        if engine == "megatron":
            notes += _megatron_overlap(shlex.split(text)) + _megatron_split(shlex.split(text))
        return layout, notes
    return _words(engine, text)


def _megatron_split(words: list[str]) -> list[str]:
    """How Megatron-LM splits the layers over the stages (transformer_config.py @ core_v0.15.3), beside
    the split priced: without ``--pipeline-model-parallel-layout`` the planner prices its balanced split,
    the embedding and the loss a layer each, which is what the two ``--account-for-*-in-pipeline-split``
    flags ask for; Megatron without them splits the decoder layers evenly (they must divide), and with
    one of them counts only that one. Said in a note; a layout string is priced as stated."""
    pp = _word_after(words, "--pipeline-model-parallel-size", "1")
    if pp == "1" or "--pipeline-model-parallel-layout" in words:
        return []
    if "--decoder-first-pipeline-num-layers" in words or "--decoder-last-pipeline-num-layers" in words:
        return []  # Megatron's uneven split, priced as stated
    given = [f for f in ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")
             if f in words]
    if len(given) == 2:
        return []
    name = title("megatron")
    what = (f"with only {given[0]} Megatron counts only that end as a layer" if given else
            "without --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split Megatron "
            "splits the decoder layers evenly (they must divide by the stages)")
    return [f"{name}: {what}; priced with the planner's balanced split, the embedding and the loss a layer each "
            f"(both flags' split); give --pipeline-model-parallel-layout to price a split as stated"]


def _megatron_overlap(words: list[str]) -> list[str]:
    """Megatron-LM's own rules for its overlap flags (arguments.py @ core_v0.19.0, refused in one line as it
    refuses them) and the notes of the ones not given (see the module doc). Megatron-LM's flags only:
    Megatron-Bridge decides these its own way (bridge_vocab.py) and passes them as given flags."""
    name = title("megatron")
    tp = _word_after(words, "--tensor-model-parallel-size", "1")
    sharded = "--use-distributed-optimizer" in words or "--use-megatron-fsdp" in words
    if "--tp-comm-overlap" in words and ("--sequence-parallel" not in words or tp == "1"):
        raise ModelcarveError(f"{name}: --tp-comm-overlap needs --sequence-parallel with --tensor-model-parallel-size "
                              f"> 1 (Megatron asserts it, and turns sequence parallelism off at TP 1)")
    if "--overlap-param-gather" in words and not (sharded and "--overlap-grad-reduce" in words):
        raise ModelcarveError(f"{name}: --overlap-param-gather needs --overlap-grad-reduce and the distributed "
                              f"optimizer (--use-distributed-optimizer) or --use-megatron-fsdp (Megatron asserts both)")
    notes = []
    if "--overlap-grad-reduce" not in words:
        notes.append(f"{name}: --overlap-grad-reduce not given: Megatron reduces the gradients after the backward "
                     f"(its default), priced so (overlap_grad_reduce=False: more exposed data-parallel time than "
                     f"modelcarve priced for these flags before it read them); add --overlap-grad-reduce to price "
                     f"the overlap")
    if sharded and "--overlap-param-gather" not in words:
        notes.append(f"{name}: --overlap-param-gather not given: Megatron gathers the parameters before the "
                     f"forward (its default), priced so (overlap_param_gather=False)")
    return notes
