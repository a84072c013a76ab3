"""A training run described in Megatron-Bridge's words, read into modelcarve's: ``estimate --framework megatron-bridge``.

    text, notes = read_layout("megatron-bridge", "model.tensor_model_parallel_size=4 model.sequence_parallel=true "
                              "train.micro_batch_size=1 train.global_batch_size=64 "
                              "mixed_precision=bf16_with_fp8_current_scaling_mixed", devices=64)
    # "tp=4,sp,mbs=1,gbs=64,param_dtype=fp8,fp8_scaling=current,dp=16" (commands/emit/vocab.py)

``--layout`` is the overrides a Megatron-Bridge recipe takes on its command line
(``scripts/training/run_recipe.py --recipe ... model.tensor_model_parallel_size=4 ...``, Hydra's
``key=value``, as ``training/utils/omegaconf_utils.py`` parses them): ``section.field=value``
separated by spaces, lists as ``[a,b]``, ``true`` / ``false`` / ``null``.

Megatron-Bridge's ``ConfigContainer`` holds Megatron-Core's own configs (``model``: the
``TransformerConfig`` / ``ModelParallelConfig`` fields; ``ddp``: ``DistributedDataParallelConfig``;
``train``: the batch sizes), whose fields are Megatron-LM's arguments by the same names. So each
override is translated here into the Megatron-LM flag of that field (``bridge_flags``), which
vocab.py then reads through its one Megatron reader: the same meanings, the same notes, one
implementation.
What Megatron-Bridge adds, as v0.3.1 (the 25.11 release) defines it (training/config.py,
training/mixed_precision.py):

* ``mixed_precision=<preset>``: ``bf16_mixed`` (bf16, fp32 gradient reduction),
  ``bf16_with_fp8_delayed_scaling_mixed`` (FP8 hybrid, delayed scaling), ``bf16_with_fp8_current_scaling_mixed``
  (FP8 hybrid, per-tensor current scaling; the preset keeps the first and last layer in bf16, which the
  planner does not model), ``bf16_with_mxfp8_mixed`` (MXFP8); every FP8 preset sets ``fp8_param_gather``
  (the planner option ``--fp8-param-gather``: FP8 weights, no bf16 copy) and every bf16 one
  ``grad_reduce_in_fp32=True``. The hyphen spellings are the same presets. Not given: the recipes'
  ``bf16_mixed`` (said in a note). ``mixed_precision.<field>=`` overrides one field of the preset.
* ``mixed_precision.grad_reduce_in_fp32`` decides the gradient dtype: at validation the preset's
  fields overwrite ``ddp``'s of the same name (``update_config_with_precision_overrides``), so a
  lone ``ddp.grad_reduce_in_fp32=false`` under a preset does not take effect (said in a note), and the
  performance scripts set both (scripts/performance/configs/*/*_llm_pretrain.py).
* ``ddp.use_megatron_fsdp`` or ``dist.use_megatron_fsdp`` with ``ddp.data_parallel_sharding_strategy``:
  Megatron-FSDP, as Megatron-LM's ``--use-megatron-fsdp``.

**Communication overlap** (``comm_overlap.*``, ``ddp.overlap_*``, ``model.overlap_moe_expert_parallel_comm``),
as v0.3.1 applies it: ``ConfigContainer.comm_overlap`` is ``None`` unless the recipe sets a
``CommOverlapConfig`` (training/config.py:1343), and when set, ``runtime_config_update`` runs its
``setup`` after the mixed-precision one (config.py:1870-1872), which *overwrites* the model's and ddp's
fields of the same names (training/comm_overlap.py ``_apply_cfgs``):

* ``CommOverlapConfig`` (comm_overlap.py:374-395): ``tp_comm_overlap`` has no default (a recipe sets
  it), every other field ``None`` = "the config's choice": ``_get_model_comm_overlap_cfgs``
  (:419-525) keeps TP overlap and the MoE all-to-all overlap off unless given (:431-435), turns a given
  ``tp_comm_overlap=True`` off, with a warning, at TP < 2, without ``sequence_parallel`` or without
  Transformer Engine (:439-448: its userbuffers), and overlaps the pipeline sends exactly when
  pp > 1 with virtual stages (:450-460); ``_get_optimizer_overlap_cfgs`` (:527-549) overlaps the
  gradient reduce and the parameter gather when the data-parallel size is > 1, and ``setup`` applies
  it to ``ddp`` only with ``ddp.use_distributed_optimizer`` (:598-605). Read so: a
  ``comm_overlap.<field>`` override presumes the recipe sets a ``CommOverlapConfig`` (the Llama 3 70B+
  and the MoE pretraining recipes do; many leave it ``null``). Its data-parallel rule is read as on
  (the size is not known here; at data-parallel size 1 there is no gradient traffic to overlap, bar CP's).
  A given ``ddp.overlap_*`` or ``model.overlap_moe_expert_parallel_comm`` it overwrites is said in a note.
* Without ``comm_overlap`` overrides, ``ddp.overlap_grad_reduce`` / ``ddp.overlap_param_gather`` (Megatron-Core's
  ``DistributedDataParallelConfig``, default False: distributed/distributed_data_parallel_config.py:14-17 at
  core_v0.16.0; v0.3.1 pins megatron-core >=0.15,<0.17) and ``model.overlap_moe_expert_parallel_comm`` are read
  as given. Not given at all, the recipe decides, which modelcarve cannot see: the pretraining recipes set
  both DP overlaps on (recipes/llama/llama3.py ``cfg.ddp.overlap_grad_reduce = True``, ...), so they are
  priced overlapped, the planner's default, as before these fields were read (said in a note); TP overlap
  and the MoE all-to-all overlap off, as before. Existing estimates of Bridge overrides are unchanged.
* Each is passed on as Megatron-LM's flag (``--overlap-grad-reduce``, ``--overlap-param-gather`` with the
  distributed optimizer or Megatron-FSDP, ``--tp-comm-overlap``, ``--no-overlap-p2p-communication``,
  ``--overlap-moe-expert-parallel-comm``), which vocab.py reads (``tp_overlap``: calibration's
  ``TP_COMM_OVERLAP``); Megatron-LM's own asserts on them are not Megatron-Bridge's, so not applied.
  ``model.moe_a2a_overlap`` is not a field: ``moe_a2a_overlap`` is the performance scripts' argument, which
  sets ``comm_overlap.overlap_moe_expert_parallel_comm`` (scripts/performance/utils/overrides.py:149-154).
  ``comm_overlap``'s tuning fields (userbuffer configs, buckets, ``delay_wgrad_compute``, ...) are skipped with a note.

``model.moe_token_dispatcher_type`` is the planner's ``moe_dispatcher`` (alltoall; flex = DeepEP / HybridEP);
``model.cross_entropy_loss_fusion`` (on by default) with ``model.cross_entropy_fusion_impl=te`` is the
planner's ``loss=fused`` (Transformer Engine's kernel, as the performance scripts set it);
``model`` fields that choose kernels, fusions or CUDA graphs are skipped with a note. Keys of sections that
change nothing the planner prices (``optimizer.lr``, ``scheduler``, ``logger``,
``checkpoint``, ``train.train_iters``, ...) are listed in a note and skipped; any other ``model``,
``ddp``, ``comm_overlap`` or ``mixed_precision`` field, and fp16 presets, are refused in one line.
"""

from __future__ import annotations

import shlex

from modelcarve.spec.errors import ModelcarveError

VERSION = "0.3.1"
TITLE = f"Megatron-Bridge {VERSION}"

_VALUES = {
    "model.tensor_model_parallel_size": "--tensor-model-parallel-size",
    "model.pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "model.context_parallel_size": "--context-parallel-size",
    "model.expert_model_parallel_size": "--expert-model-parallel-size",
    "model.expert_tensor_parallel_size": "--expert-tensor-parallel-size",
    "model.virtual_pipeline_model_parallel_size": "--num-virtual-stages-per-pipeline-rank",
    "model.seq_length": "--seq-length",
    "dataset.sequence_length": "--seq-length",
    "dataset.seq_length": "--seq-length",  # GPTDatasetConfig's alias of MCore's sequence_length
    "train.micro_batch_size": "--micro-batch-size",
    "train.global_batch_size": "--global-batch-size",
    "model.recompute_granularity": "--recompute-granularity",
    "model.recompute_method": "--recompute-method",
    "model.recompute_num_layers": "--recompute-num-layers",
    "model.recompute_modules": "--recompute-modules",
    "model.mtp_num_layers": "--mtp-num-layers",
    "model.cuda_graph_impl": "--cuda-graph-impl",
    "model.pipeline_model_parallel_layout": "--pipeline-model-parallel-layout",
    "ddp.num_distributed_optimizer_instances": "--num-distributed-optimizer-instances",
    "ddp.data_parallel_sharding_strategy": "--data-parallel-sharding-strategy",
}
"""Overrides whose value is a Megatron-LM flag's value (the same field in Megatron-Core)."""
_SWITCHES = {
    "model.sequence_parallel": "--sequence-parallel",
    "ddp.use_distributed_optimizer": "--use-distributed-optimizer",
    "optimizer.use_distributed_optimizer": "--use-distributed-optimizer",
    "ddp.use_megatron_fsdp": "--use-megatron-fsdp",
    "dist.use_megatron_fsdp": "--use-megatron-fsdp",
    "model.use_transformer_engine_op_fuser": "--use-transformer-engine-op-fuser",
}
"""Boolean overrides that are a Megatron-LM switch when true."""
PRESETS = {
    "bf16_mixed": {"fp8": None, "fp8_recipe": None, "fp8_param_gather": False, "grad_reduce_in_fp32": True},
    "bf16_with_fp8_delayed_scaling_mixed": {"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_param_gather": True,
                                            "grad_reduce_in_fp32": True},
    "bf16_with_fp8_current_scaling_mixed": {"fp8": "hybrid", "fp8_recipe": "tensorwise", "fp8_param_gather": True,
                                            "grad_reduce_in_fp32": True},
    "bf16_with_mxfp8_mixed": {"fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_param_gather": True,
                              "grad_reduce_in_fp32": True},
}
"""Megatron-Bridge's bf16 mixed-precision presets (training/mixed_precision.py @ v0.3.1): the fields
the planner reads of each."""
_PRECISION_FIELDS = ("fp8", "fp8_recipe", "fp8_param_gather", "fp8_param", "grad_reduce_in_fp32",
                     "reuse_grad_buf_for_mxfp8_param_ag")
_DISPATCHERS = {"alltoall": "alltoall", "flex": "fused"}
"""``model.moe_token_dispatcher_type`` -> the planner's ``moe_dispatcher`` (flex: DeepEP / HybridEP kernels that
size their own buffers; Megatron's allgather dispatcher is not modelled)."""
_KERNEL_FIELDS = frozenset({
    "moe_router_padding_for_fp8", "moe_router_padding_for_quantization", "moe_flex_dispatcher_backend",
    "moe_permute_fusion", "moe_router_fusion", "moe_grouped_gemm", "bias_activation_fusion", "bias_dropout_fusion",
    "apply_rope_fusion", "masked_softmax_fusion", "gradient_accumulation_fusion", "persist_layer_norm", "attention_backend", "cuda_graph_scope",
    "cuda_graph_warmup_steps",
})
"""``model`` fields that choose kernels, fusions or CUDA graphs: the planner prices none of them per field
(its efficiency is one profile), so they are skipped with a note rather than refused. ``model.cuda_graph_impl``
is read (``_VALUES``: Megatron's ``--cuda-graph-impl``; ``full_iteration``, as the v0.5.0 presets spell it, lifts the
experts' host-issue bound), ``model.cuda_graph_scope`` skipped: layer-wise scopes leave dropless experts eager."""
_OVERLAPS = ("tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather", "overlap_p2p_comm",
             "overlap_moe_expert_parallel_comm")
"""``CommOverlapConfig`` fields the planner prices (comm_overlap.py @ v0.3.1)."""
_OVERLAP_TUNING = frozenset({"tp_comm_overlap_cfg", "tp_comm_bootstrap_backend", "batch_p2p_comm",
                             "overlap_param_gather_with_optimizer_step", "align_param_gather", "bucket_size",
                             "defer_embedding_wgrad_compute", "wgrad_deferral_limit", "data_parallel_size",
                             "delay_wgrad_compute"})
"""``CommOverlapConfig``'s other fields: how the overlap is tuned, not whether it runs (skipped with a note)."""
_SKIPPED = ("optimizer.", "scheduler.", "logger.", "checkpoint.", "rng.", "tokenizer.", "profiling.", "ft.",
            "straggler.", "nvrx_straggler.", "rerun_state_machine.", "train.", "dataset.", "dist.")
"""Sections (or the rest of them) whose fields change nothing the planner prices."""


def _value(word: str):
    low = word.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none", "~"):
        return None
    if word.startswith("[") and word.endswith("]"):
        return [w.strip().strip("'\"") for w in word[1:-1].split(",") if w.strip()]
    return word.strip("'\"")


def _overrides(text: str) -> dict:
    out: dict = {}
    for token in shlex.split(text):
        key, eq, word = token.lstrip("+").partition("=")
        if not eq or "." not in key and key != "mixed_precision":
            raise ModelcarveError(f"{TITLE}: {token!r} is not an override; give section.field=value words, e.g. "
                                  f"model.tensor_model_parallel_size=8 train.micro_batch_size=1")
        out[key] = _value(word)
    return out


def _precision(overrides: dict, notes: list[str]) -> dict:
    """The mixed-precision fields in force: the preset's, then its overridden fields."""
    name = overrides.pop("mixed_precision", None)
    if name is None:
        name = "bf16_mixed"
        notes.append(f"{TITLE}: mixed_precision not given: read as the recipes' bf16_mixed")
    preset = PRESETS.get(str(name).replace("-", "_"))
    if preset is None:
        raise ModelcarveError(f"{TITLE}: mixed_precision={name} is not a preset modelcarve reads; it reads "
                              f"{', '.join(PRESETS)} (fp16 presets are not modelled)")
    fields = dict(preset)
    for key in [k for k in overrides if k.startswith("mixed_precision.")]:
        name = key.split(".", 1)[1]
        if name not in _PRECISION_FIELDS:
            raise ModelcarveError(f"{TITLE}: {key} is not a field modelcarve reads; it reads "
                                  f"{', '.join('mixed_precision.' + f for f in _PRECISION_FIELDS)}")
        fields["fp8_param_gather" if name == "fp8_param" else name] = overrides.pop(key)
    reuse = fields.pop("reuse_grad_buf_for_mxfp8_param_ag", None)
    if reuse is False and fields["fp8_param_gather"] and fields["fp8_recipe"] == "mxfp8":
        raise ModelcarveError(f"{TITLE}: fp8_param_gather with the mxfp8 recipe needs "
                              f"reuse_grad_buf_for_mxfp8_param_ag=true (MixedPrecisionConfig.finalize asserts it); "
                              f"set it, or mixed_precision.fp8_param_gather=false")
    ddp = overrides.pop("ddp.grad_reduce_in_fp32", None)
    if ddp is not None and ddp != fields["grad_reduce_in_fp32"]:
        notes.append(f"{TITLE}: ddp.grad_reduce_in_fp32={str(ddp).lower()} is overwritten by the mixed-precision "
                     f"config's grad_reduce_in_fp32={str(fields['grad_reduce_in_fp32']).lower()} "
                     f"(update_config_with_precision_overrides); set mixed_precision.grad_reduce_in_fp32 to change it")
    return fields


def _loss_flags(overrides: dict, notes: list[str]) -> list[str]:
    """Megatron-LM's loss flags for ``model.cross_entropy_loss_fusion`` (``GPTProvider``'s default:
    on) and ``model.cross_entropy_fusion_impl`` (``te``: Transformer Engine's kernel, the planner's
    ``loss=fused``; ``native``: Megatron-Core's, priced as its unfused loss)."""
    fusion = overrides.pop("model.cross_entropy_loss_fusion", True)
    impl = overrides.pop("model.cross_entropy_fusion_impl", None)
    if impl not in (None, "te", "native"):
        raise ModelcarveError(f"{TITLE}: model.cross_entropy_fusion_impl={impl} is not one modelcarve reads; "
                              f"give te or native")
    if impl is None and fusion:
        notes.append(f"{TITLE}: model.cross_entropy_fusion_impl not given: the model provider's default decides "
                     f"(te for the Llama, DeepSeek and Kimi providers, Megatron-Core's native otherwise); priced "
                     f"as native, the unfused loss's 6 B a logit: give model.cross_entropy_fusion_impl=te to price "
                     f"TE's kernel (2 B a logit)")
    out = ["--cross-entropy-loss-fusion"] if fusion else []
    return out + (["--cross-entropy-fusion-impl", str(impl)] if impl is not None else [])


def _switch(key: str, value):
    """A boolean override's value (None: not given or ``null``), or one line refusing it."""
    if value is None or isinstance(value, bool):
        return value
    raise ModelcarveError(f"{TITLE}: {key}={value} is not a boolean; give true or false")


def _overlap_flags(overrides: dict, notes: list[str]) -> list[str]:
    """Megatron-LM's overlap flags for the communication-overlap overrides, resolved as Megatron-Bridge
    resolves them (see the module doc); their keys are taken out of ``overrides``."""
    if "model.moe_a2a_overlap" in overrides:
        raise ModelcarveError(f"{TITLE}: model.moe_a2a_overlap is not a field (moe_a2a_overlap is the performance "
                              f"scripts' argument, which sets comm_overlap.overlap_moe_expert_parallel_comm=true); "
                              f"give comm_overlap.overlap_moe_expert_parallel_comm=true")
    co, tuning = {}, []
    for key in [k for k in overrides if k.startswith("comm_overlap.")]:
        name = key.split(".", 1)[1]
        if name in _OVERLAPS:
            co[name] = _switch(key, overrides.pop(key))
        elif name in _OVERLAP_TUNING:
            tuning.append(key)
            del overrides[key]
        else:
            raise ModelcarveError(f"{TITLE}: {key} is not a field modelcarve reads; it reads "
                                  f"{', '.join('comm_overlap.' + f for f in _OVERLAPS)} (and skips "
                                  f"{', '.join(sorted(_OVERLAP_TUNING))})")
    if tuning:
        notes.append(f"{TITLE}: communication-overlap tuning the planner does not price, skipped: {', '.join(tuning)}")
    configured = bool(co) or bool(tuning)  # an override of comm_overlap: the recipe sets a CommOverlapConfig
    given = {k: _switch(k, overrides.pop(k, None)) for k in
             ("ddp.overlap_grad_reduce", "ddp.overlap_param_gather", "model.overlap_moe_expert_parallel_comm")}
    tp = int(overrides.get("model.tensor_model_parallel_size") or 1)
    sp = overrides.get("model.sequence_parallel") is True
    distributed = any(overrides.get(k) is True for k in ("ddp.use_distributed_optimizer",
                                                         "optimizer.use_distributed_optimizer"))
    sharded = distributed or any(overrides.get(k) is True for k in ("ddp.use_megatron_fsdp", "dist.use_megatron_fsdp"))
    flags: list[str] = []
    # data parallelism: the comm_overlap config's (on, unless given) over ddp's, with the distributed optimizer
    dp_from_config = configured and distributed
    for field in ("overlap_grad_reduce", "overlap_param_gather"):
        ddp = given[f"ddp.{field}"]
        if dp_from_config:
            value = True if co.get(field) is None else co[field]
            if ddp is not None and ddp != value:
                notes.append(f"{TITLE}: ddp.{field}={str(ddp).lower()} is overwritten by the comm_overlap config's "
                             f"{field}={str(value).lower()} (CommOverlapConfig.setup, with the distributed optimizer)")
        else:
            if co.get(field) is not None:
                notes.append(f"{TITLE}: comm_overlap.{field} applies only with ddp.use_distributed_optimizer "
                             f"(CommOverlapConfig.setup); ddp.{field} decides")
            value = ddp
            if value is None and (field == "overlap_grad_reduce" or sharded):  # ZeRO-0: no gather to price
                value = True
                notes.append(f"{TITLE}: ddp.{field} not given: the recipe's setting decides (its pretraining recipes "
                             f"set it true); priced as {field}=True, the planner's default")
        if value and (field == "overlap_grad_reduce" or sharded):  # ZeRO-0 gathers no parameters
            flags.append("--" + field.replace("_", "-"))
    # tensor parallelism: off unless given; Megatron-Bridge turns a given one off where it cannot run
    if co.get("tp_comm_overlap"):
        if tp < 2 or not sp:
            notes.append(f"{TITLE}: comm_overlap.tp_comm_overlap=true is turned off by Megatron-Bridge "
                         f"({'TP < 2' if tp < 2 else 'sequence_parallel=false'}); priced without it")
        else:
            flags.append("--tp-comm-overlap")
    elif co.get("tp_comm_overlap") is None and tp > 1:
        notes.append(f"{TITLE}: comm_overlap.tp_comm_overlap not given: priced without TP comm-GEMM overlap "
                     f"(the recipe's CommOverlapConfig may set it; give comm_overlap.tp_comm_overlap=true to price it)")
    # pipeline sends: the config overlaps them with virtual stages unless given (the planner prices no other case)
    if co.get("overlap_p2p_comm") is False:
        flags.append("--no-overlap-p2p-communication")
    # the MoE all-to-all: the config's (off unless given) over the model's
    moe = given["model.overlap_moe_expert_parallel_comm"]
    if configured:
        value = bool(co.get("overlap_moe_expert_parallel_comm"))
        if moe is not None and moe != value:
            notes.append(f"{TITLE}: model.overlap_moe_expert_parallel_comm={str(moe).lower()} is overwritten by the "
                         f"comm_overlap config's overlap_moe_expert_parallel_comm={str(value).lower()} "
                         f"(CommOverlapConfig.setup); set comm_overlap.overlap_moe_expert_parallel_comm to change it")
        moe = value
    if moe:
        if int(overrides.get("model.expert_model_parallel_size") or 1) < 2:
            raise ModelcarveError(f"{TITLE}: overlap_moe_expert_parallel_comm needs "
                                  f"model.expert_model_parallel_size > 1 (CommOverlapConfig asserts it)")
        flags.append("--overlap-moe-expert-parallel-comm")
    return flags


def _translate(text: str) -> tuple[list[str], dict, list[str]]:
    """(Megatron-LM flags, planner options beyond them, notes) for the overrides ``text``."""
    overrides, notes = _overrides(text), []
    precision = _precision(overrides, notes)
    flags: list[str] = []
    options: dict = {}
    dispatcher = overrides.pop("model.moe_token_dispatcher_type", None)
    if dispatcher is not None:
        if dispatcher not in _DISPATCHERS:
            raise ModelcarveError(f"{TITLE}: model.moe_token_dispatcher_type={dispatcher} is not modelled; "
                                  f"give {' or '.join(_DISPATCHERS)}")
        options["moe_dispatcher"] = _DISPATCHERS[dispatcher]
        notes.append(f"{TITLE}'s model.moe_token_dispatcher_type={dispatcher} read as the planner option "
                     f"moe_dispatcher={options['moe_dispatcher']}")
    flags += _loss_flags(overrides, notes)
    overlaps = _overlap_flags(overrides, notes)
    kernels = sorted(k for k in overrides if k.startswith("model.") and k.split(".", 1)[1] in _KERNEL_FIELDS)
    for key in kernels:
        del overrides[key]
    if kernels:
        notes.append(f"{TITLE}: kernel, fusion and CUDA-graph choices the planner does not price per field, "
                     f"skipped: {', '.join(kernels)}")
    seq = {k: overrides[k] for k in ("model.seq_length", "dataset.seq_length", "dataset.sequence_length")
           if overrides.get(k) is not None}
    if len(set(map(str, seq.values()))) > 1:
        raise ModelcarveError(f"{TITLE}: {' and '.join(seq)} disagree ({' vs '.join(map(str, seq.values()))}); "
                              f"give one sequence length")
    for key in list(seq)[1:]:  # the same length more than once: one flag
        del overrides[key]
    skipped = []
    for key, value in overrides.items():
        if key in _SWITCHES:
            if value is True and _SWITCHES[key] not in flags:
                flags.append(_SWITCHES[key])
        elif key in _VALUES:
            if value is None:  # e.g. virtual_pipeline_model_parallel_size=null, recompute_granularity=null
                continue
            flags.append(_VALUES[key])
            flags.extend(str(v) for v in (value if isinstance(value, list) else [value]))
        elif key.startswith(_SKIPPED):
            skipped.append(key)
        else:
            raise ModelcarveError(f"{TITLE}: {key} is not a field modelcarve reads; it reads "
                                  f"{', '.join(sorted(set(_VALUES) | set(_SWITCHES)))}, "
                                  f"ddp.overlap_grad_reduce, ddp.overlap_param_gather, "
                                  f"model.overlap_moe_expert_parallel_comm, comm_overlap.<field>, mixed_precision "
                                  f"and mixed_precision.<field>")
    if skipped:
        notes.append(f"{TITLE}: skipped, as nothing the planner prices: {', '.join(skipped)}")
    flags.append("--bf16")
    if precision["fp8"]:
        flags += ["--fp8-format", str(precision["fp8"]), "--fp8-recipe", str(precision["fp8_recipe"])]
        if precision["fp8_param_gather"]:
            flags.append("--fp8-param-gather")
    if precision["grad_reduce_in_fp32"] is False:
        flags.append("--grad-reduce-in-bf16")
    return flags + overlaps, options, notes


def bridge_flags(text: str) -> tuple[str, dict, list[str]]:
    """``(Megatron-LM flags, planner options no Megatron flag reads, notes)`` for Megatron-Bridge
    overrides (see the module doc); ``vocab.read_layout`` / ``read_options`` read the flags as Megatron's."""
    flags, options, notes = _translate(text)
    notes.append(f"{TITLE}'s overrides read as Megatron-LM's flags: {shlex.join(flags)}")
    return shlex.join(flags), options, notes
