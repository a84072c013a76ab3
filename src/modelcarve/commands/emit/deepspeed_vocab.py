"""A training run described as a DeepSpeed config, read into modelcarve's layout: ``estimate --framework deepspeed``.

    text, notes = read_deepspeed('{"train_batch_size": 256, "train_micro_batch_size_per_gpu": 2, '
                                 '"zero_optimization": {"stage": 2}, "bf16": {"enabled": true}}', devices=64)
    # "dp=64,mbs=2,gbs=256,zero=2,param_dtype=bf16"

``--layout`` is the ``ds_config.json`` path (or its JSON text), optionally followed by ``,key=value``
in modelcarve's words for what a DeepSpeed config does not hold (the model code or the launcher
decides it): ``tp`` / ``pp`` (Megatron-DeepSpeed's ``--tensor-model-parallel-size`` /
``--pipeline-model-parallel-size``, or a ``PipelineModule``'s stages), ``seq``, ``recompute``
(whether the model calls ``deepspeed.checkpointing``: ``full`` is Megatron-DeepSpeed's
``--checkpoint-activations`` and Hugging Face's ``gradient_checkpointing``).

What each DeepSpeed word means here, as DeepSpeed 0.18.3 defines it (deepspeed/runtime/config.py,
deepspeed/runtime/zero/config.py) — checked against DeepSpeed's own ``DeepSpeedConfig`` in
tests/commands/test_deepspeed_vocab.py:

* ``train_micro_batch_size_per_gpu`` -> ``mbs``; ``train_batch_size`` -> ``gbs``; with only two of
  (train_batch_size, micro batch, ``gradient_accumulation_steps``) the third follows DeepSpeed's rule
  ``train_batch_size = micro x gradient_accumulation_steps x data-parallel size``; all three given
  must satisfy it (DeepSpeed asserts the same).
* data-parallel size: the devices over ``tp x pp`` (DeepSpeed takes it from the mpu / the world).
* ``zero_optimization.stage`` 0/1/2/3 -> ``zero`` (1: optimizer states partitioned, 2: + gradients
  reduce-scattered, 3: + parameters, gathered per module: FSDP); ``mics_shard_size`` (MiCS: ZeRO-3
  sharded inside groups of that many ranks, replicated across them) -> HSDP ``dp_shard``.
* ``bf16.enabled`` -> ``param_dtype=bf16`` (bf16 weights, fp32 master weights and Adam states in the
  optimizer: modelcarve's bf16 accounting), ``fp16.enabled`` -> ``fp16``, neither -> ``fp32``.
* ``tensor_parallel.autotp_size`` (DeepSpeed AutoTP training) -> ``tp``.

Refused in one line (not modelled, rather than priced as something else): ZeRO-Offload / Infinity
(``offload_optimizer`` / ``offload_param`` to cpu or nvme), ZeRO++ hierarchical partitioning
(``zero_hpz_partition_size``: a secondary parameter copy per node beside the primary partition),
DeepSpeed-Ulysses (``sequence_parallel_size``: all-to-all over heads; modelcarve's ``cp`` is ring
attention), and keys this reader does not know that change the layout.
"""

from __future__ import annotations

import json
from pathlib import Path

from modelcarve.spec.errors import ModelcarveError

VERSION = "0.18.3"
TITLE = f"DeepSpeed {VERSION}"

_IGNORED = {
    # keys that do not change memory, traffic or the step of the layout
    "optimizer", "scheduler", "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "prescale_gradients",
    "gradient_predivide_factor", "sparse_gradients", "zero_allow_untested_optimizer", "dump_state", "flops_profiler",
    "tensorboard", "wandb", "csv_monitor", "comms_logger", "checkpoint", "data_efficiency", "aio", "elasticity",
    "communication_data_type", "seq_parallel_communication_data_type", "amp", "activation_checkpointing",
    "memory_breakdown", "compile", "torch_autocast",
}
_ZERO_IGNORED = {
    "stage", "contiguous_gradients", "overlap_comm", "reduce_scatter", "reduce_bucket_size", "allgather_partitions",
    "allgather_bucket_size", "round_robin_gradients", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
    "sub_group_size", "load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters", "mics_shard_size",
    "mics_hierarchical_params_gather", "zero_quantized_weights", "zero_quantized_gradients", "memory_efficient_linear",
    "log_trace_cache_warnings", "use_multi_rank_bucket_allreduce", "gather_16bit_weights_on_model_save",
    "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "max_reuse_distance",
}
_REFUSED_ZERO = {
    "offload_optimizer": "ZeRO-Offload (optimizer states in {device} memory) is not modelled: the planner keeps them on the "
                         "device; drop offload_optimizer to price the run without it",
    "offload_param": "ZeRO-Infinity parameter offload (to {device}) is not modelled; drop offload_param to price the run "
                     "without it",
    "zero_hpz_partition_size": "ZeRO++ hierarchical partitioning (zero_hpz_partition_size={value}: a secondary parameter copy "
                               "per group beside the primary partition) is not modelled; its nearest is HSDP "
                               "(mics_shard_size, or dp_shard=N), which also replicates the optimizer state",
}
_OURS = {"tp", "pp", "cp", "seq", "recompute", "schedule", "virtual_stages", "sp", "ep", "etp"}
"""Keys the user may add after the config, in modelcarve's words (what a DeepSpeed config does not hold)."""


def _load(text: str) -> tuple[dict, str]:
    """(the config dict, our-words tail) from ``FILE[,k=v...]`` or ``{json}[,k=v...]``."""
    text = text.strip()
    if text.startswith("{"):
        depth, end = 0, None
        for i, ch in enumerate(text):
            depth += ch == "{"
            depth -= ch == "}"
            if depth == 0:
                end = i + 1
                break
        if end is None:
            raise ModelcarveError(f"{TITLE}: the config JSON has unbalanced braces")
        body, tail = text[:end], text[end:]
    else:
        body, _, tail = text.partition(",")
        path = Path(body)
        if not path.is_file():
            raise ModelcarveError(f"{TITLE}: --layout must be a ds_config.json path or its JSON text; {body!r} is neither")
        body = path.read_text()
        tail = "," + tail if tail else ""
    try:
        config = json.loads(body)
    except json.JSONDecodeError as err:
        raise ModelcarveError(f"{TITLE}: the config is not valid JSON ({err.msg} at line {err.lineno} column {err.colno})")
    if not isinstance(config, dict):
        raise ModelcarveError(f"{TITLE}: the config must be a JSON object, got {type(config).__name__}")
    return config, tail.lstrip(",").strip()


def _int(config: dict, key: str, where: str = "") -> int | None:
    value = config.get(key)
    if value is None or value == "auto":
        if value == "auto":
            raise ModelcarveError(f"{TITLE}: {where}{key}='auto' is filled in by the Hugging Face integration at launch; "
                                  f"give the number")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelcarveError(f"{TITLE}: {where}{key} must be a non-negative integer, got {value!r}")
    return value


def read_deepspeed(text: str, devices: int | None = None) -> tuple[str, list[str]]:
    """``(layout text in modelcarve's words, notes)`` for a DeepSpeed config (see the module doc)."""
    config, tail = _load(text)
    ours: dict[str, str] = {}
    for part in [p.strip() for p in tail.split(",") if p.strip()]:
        key, sep, value = part.partition("=")
        key = key.strip()
        if key not in _OURS:
            raise ModelcarveError(f"{TITLE}: after the config, only modelcarve's {', '.join(sorted(_OURS))} may be added "
                                  f"(what a DeepSpeed config does not hold); got {key!r}")
        ours[key] = value.strip() if sep else "true"
    unknown = sorted(k for k in config if k not in _IGNORED and k not in (
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization",
        "bf16", "bfloat16", "fp16", "tensor_parallel", "sequence_parallel_size"))
    if unknown:
        raise ModelcarveError(f"{TITLE}: config key(s) {', '.join(unknown)} not read by modelcarve; remove them or ask "
                              f"for them to be modelled")
    notes: list[str] = []
    if _int(config, "sequence_parallel_size") not in (None, 0, 1):
        raise ModelcarveError(f"{TITLE}: sequence_parallel_size={config['sequence_parallel_size']} is DeepSpeed-Ulysses "
                              f"(all-to-all over attention heads), not modelled; modelcarve's cp is ring attention")
    zero_cfg = config.get("zero_optimization") or {}
    if not isinstance(zero_cfg, dict):
        raise ModelcarveError(f"{TITLE}: zero_optimization must be an object, got {zero_cfg!r}")
    for key, why in _REFUSED_ZERO.items():
        value = zero_cfg.get(key)
        if value in (None, 0, 1, False) or (isinstance(value, dict) and value.get("device", "none") == "none"):
            continue
        device = value.get("device", "cpu") if isinstance(value, dict) else ""
        raise ModelcarveError(f"{TITLE}: " + why.format(device=device, value=value))
    unknown = sorted(k for k in zero_cfg if k not in _ZERO_IGNORED and k not in _REFUSED_ZERO)
    if unknown:
        raise ModelcarveError(f"{TITLE}: zero_optimization key(s) {', '.join(unknown)} not read by modelcarve")
    zero = _int(zero_cfg, "stage", "zero_optimization.") or 0
    if zero > 3:
        raise ModelcarveError(f"{TITLE}: zero_optimization.stage={zero}; DeepSpeed's stages are 0, 1, 2, 3")
    fields: dict[str, object] = {}
    tp_cfg = config.get("tensor_parallel") or {}
    autotp = _int(tp_cfg, "autotp_size", "tensor_parallel.") if isinstance(tp_cfg, dict) else None
    if autotp and autotp > 1:
        if "tp" in ours and int(ours["tp"]) != autotp:
            raise ModelcarveError(f"{TITLE}: tensor_parallel.autotp_size={autotp} but tp={ours['tp']} was added")
        ours.setdefault("tp", str(autotp))
        notes.append(f"{TITLE}'s tensor_parallel.autotp_size={autotp} read as tp={autotp} (AutoTP training)")
    tp, pp, cp = (int(ours.get(k, 1)) for k in ("tp", "pp", "cp"))
    if not devices:
        raise ModelcarveError(f"{TITLE}: the data-parallel size follows from the cluster's devices; give --cluster")
    if devices % (tp * pp * cp):
        raise ModelcarveError(f"{TITLE}: tp x pp x cp = {tp * pp * cp} does not divide the cluster's {devices} devices")
    dp = devices // (tp * pp * cp)
    notes.append(f"{TITLE}'s data-parallel size is the devices over the model parallelism: dp = {devices} / "
                 f"(tp x pp x cp) = {dp}")
    train, micro, gas = (_int(config, k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                   "gradient_accumulation_steps"))
    if micro is None and train is None:
        raise ModelcarveError(f"{TITLE}: the config needs train_batch_size or train_micro_batch_size_per_gpu")
    if train is not None and micro is not None and gas is not None and train != micro * gas * dp:
        raise ModelcarveError(f"{TITLE}: train_batch_size {train} != train_micro_batch_size_per_gpu {micro} x "
                              f"gradient_accumulation_steps {gas} x data-parallel size {dp} (DeepSpeed refuses it too)")
    if micro is None:  # DeepSpeed: micro = train / (gas x dp), gas defaulting to 1
        gas = gas or 1
        if train % (gas * dp):
            raise ModelcarveError(f"{TITLE}: train_batch_size {train} is not a multiple of gradient_accumulation_steps "
                                  f"{gas} x data-parallel size {dp}")
        micro = train // (gas * dp)
    if train is None:
        train = micro * (gas or 1) * dp
    if train % (micro * dp):
        raise ModelcarveError(f"{TITLE}: train_batch_size {train} is not a multiple of the micro batch {micro} x "
                              f"data-parallel size {dp}")
    fields.update(dp=dp, mbs=micro, gbs=train)
    if zero:
        fields["zero"] = zero
        meaning = {1: "optimizer states partitioned over dp", 2: "optimizer states and gradients partitioned "
                   "(reduce-scatter)", 3: "parameters too, gathered per module (FSDP)"}[zero]
        notes.append(f"{TITLE}'s ZeRO stage {zero} read as zero={zero}: {meaning}")
    mics = _int(zero_cfg, "mics_shard_size", "zero_optimization.")
    if mics and mics > 0 and mics < dp:
        if zero != 3:
            raise ModelcarveError(f"{TITLE}: mics_shard_size needs ZeRO stage 3 (MiCS shards parameters)")
        if dp % mics:
            raise ModelcarveError(f"{TITLE}: mics_shard_size={mics} does not divide the data-parallel size {dp}")
        fields["dp_shard"] = mics
        notes.append(f"{TITLE}'s MiCS shard size {mics} read as HSDP: dp_shard={mics}, {dp // mics} replicas")
    bf16 = (config.get("bf16") or config.get("bfloat16") or {}).get("enabled", False)
    fp16 = (config.get("fp16") or {}).get("enabled", False)
    if bf16 and fp16:
        raise ModelcarveError(f"{TITLE}: bf16 and fp16 are both enabled; DeepSpeed allows one")
    fields["param_dtype"] = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    if bf16 or fp16:
        notes.append(f"{TITLE}'s {'bf16' if bf16 else 'fp16'}.enabled read as param_dtype={fields['param_dtype']}: "
                     f"16-bit weights, fp32 master weights and Adam states in the optimizer")
    if "recompute" not in ours:
        notes.append(f"{TITLE}: a config does not say whether the model checkpoints activations; recompute=none "
                     f"(add ,recompute=full for --checkpoint-activations / gradient_checkpointing)")
    parts = [f"{k}={v}" for k, v in fields.items()]
    for key, value in ours.items():
        parts.append(key if value == "true" else f"{key}={value}")
    return ",".join(parts), notes
