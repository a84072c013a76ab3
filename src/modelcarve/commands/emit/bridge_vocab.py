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

``model.moe_token_dispatcher_type`` is the planner's ``moe_dispatcher`` (alltoall; flex = DeepEP / HybridEP);
``model.cross_entropy_loss_fusion`` (on by default) with ``model.cross_entropy_fusion_impl=te`` is the
planner's ``loss=fused`` (Transformer Engine's kernel, as the performance scripts set it);
``model`` fields that choose kernels, fusions or CUDA graphs are skipped with a note. Keys of sections that
change nothing the planner prices (``optimizer.lr``, ``scheduler``, ``logger``,
``checkpoint``, ``train.train_iters``, ...) are listed in a note and skipped; any other ``model``,
``ddp`` or ``mixed_precision`` field, and fp16 presets, are refused in one line.
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
    "apply_rope_fusion", "masked_softmax_fusion", "gradient_accumulation_fusion", "persist_layer_norm", "attention_backend", "cuda_graph_impl", "cuda_graph_scope",
    "cuda_graph_warmup_steps",
})
"""``model`` fields that choose kernels, fusions or CUDA graphs: the planner prices none of them per field
(its efficiency is one profile), so they are skipped with a note rather than refused."""
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
                                  f"{', '.join(sorted(set(_VALUES) | set(_SWITCHES)))}, mixed_precision and "
                                  f"mixed_precision.<field>")
    if skipped:
        notes.append(f"{TITLE}: skipped, as nothing the planner prices: {', '.join(skipped)}")
    flags.append("--bf16")
    if precision["fp8"]:
        flags += ["--fp8-format", str(precision["fp8"]), "--fp8-recipe", str(precision["fp8_recipe"])]
        if precision["fp8_param_gather"]:
            flags.append("--fp8-param-gather")
    if precision["grad_reduce_in_fp32"] is False:
        flags.append("--grad-reduce-in-bf16")
    return flags, options, notes


def bridge_flags(text: str) -> tuple[str, dict, list[str]]:
    """``(Megatron-LM flags, planner options no Megatron flag reads, notes)`` for Megatron-Bridge
    overrides (see the module doc); ``vocab.read_layout`` / ``read_options`` read the flags as Megatron's."""
    flags, options, notes = _translate(text)
    notes.append(f"{TITLE}'s overrides read as Megatron-LM's flags: {shlex.join(flags)}")
    return shlex.join(flags), options, notes
