"""Can modelcarve's own runtime run this layout of this model, and why not: every refusal in one place.

The planner prices layouts for any framework (Megatron, torchtitan, vLLM, ...); our runtime
(runtime/) executes fewer. This module is the one statement of what it executes, read by
everything that asks before work starts:

* ``run`` / ``verify`` / ``run --dry-run`` (commands/, through ``check_training``), and
  ``parallelize`` itself on every rank;
* ``generate`` / ``serve`` (``check_generation``, which also caps the training-only ``seq``);
* the planner, which marks the layouts the runtime would refuse (``training_problems``) without
  dropping them: a user planning for Megatron may still want them.

Pure Python (no torch), so the planner and the CLI can call it before any process starts.
Each problem is one clause saying how to fix it; the raising checks join them with ``"; "`` into
one ``LayoutError`` line.

What is refused, by kind:

* the model: layers the reference model (runtime/model/) does not have (``missing_layers``);
* the layout as such: ``Layout.validate`` (divisibility, batch, precision);
* the training runtime: recompute modes other than none/selective/full, dtypes other than fp32/bf16 parameters with fp32 gradients and optimiser
  state, sequence parallelism with learned positions, ring attention past a sliding window or a
  dynamic rope's context, folded experts whose sequence slices do not divide, and the pipeline
  schedule rules of torch's ``pipelining`` (``pipeline_problems``);
* generation: sp, cp, virtual stages, ep with pp, and the weight / KV dtypes the engine quantises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelcarve.spec.errors import LayoutError
from modelcarve.spec.hf_config import SUPPORTED_MODEL_TYPES
from modelcarve.spec.stages import stage_count_problem
from modelcarve.spec.layout import SCHEDULES  # all four run: torch.distributed.pipelining's schedules

if TYPE_CHECKING:
    from modelcarve.spec.layout import Layout
    from modelcarve.spec.model import ModelSpec

RUNTIME_FAMILIES = SUPPORTED_MODEL_TYPES + ("kimi_k2", "deepseek_v2")
"""Families whose layers and checkpoint names the reference model has (runtime/model/transformer.py,
runtime/checkpoint/hf_load.py)."""

_FAMILY_LAYERS = {
    "gpt_oss": "attention sinks, biased experts with a clamped SwiGLU, MXFP4 expert checkpoints",
    "llama4": "chunked attention with NoPE layers, weightless L2 q/k norm, fused expert tensors",
    "gemma3": "four norms per layer, (1 + w) RMSNorm, gated GELU-tanh MLP, per-layer-type rope",
    "phi3": "fused qkv_proj / gate_up_proj checkpoint tensors",
    "nemotron": "squared-ReLU MLP, LayerNorm1P, partial rotary",
    "bloom": "ALiBi attention and fused query_key_value tensors",
    "opt": "learned positions with an offset, fc1/fc2 ReLU MLP naming",
}

RECOMPUTE_RUNTIME = ("none", "selective", "full")
"""``recompute`` modes the runtime applies (runtime/parallel/recompute.py); ``ops`` and Megatron's
module lists are planned, not run."""
TRAIN_PARAM_DTYPES = ("fp32", "bf16")
"""``param_dtype`` values the training runtime executes (gradients and optimiser state in fp32)."""
RUNTIME_DTYPES = ("fp32", "bf16", "fp16")
WEIGHT_RUNTIME = RUNTIME_DTYPES + ("int8", "int4", "fp8")
"""Weight dtypes the generation engine holds (runtime/engine/quant.py quantises to these)."""
KV_RUNTIME = RUNTIME_DTYPES + ("int8", "fp8")
"""KV-cache dtypes the generation engine holds."""


# --- the model --------------------------------------------------------------------------
def missing_layers(spec: "ModelSpec") -> list[str]:
    """The layers ``spec`` needs that the reference model does not have (empty: it can run).

    Looks at the layers a ModelSpec asks for, not only its family name, so a config of a supported
    family that asks for an unsupported layer (partial rotary, a fifth norm) is refused too."""
    missing = []
    if spec.family not in RUNTIME_FAMILIES:
        missing.append(f"the {spec.family} family ({_FAMILY_LAYERS.get(spec.family, 'its layers')})")
    checks = [
        (spec.attention_sinks, "attention sinks"),
        (spec.router_bias, "a router bias"),
        (spec.layer_norms != 2, f"{spec.layer_norms} norms per layer"),
        (spec.embedding_norm, "a norm after the embedding"),
        (spec.position_offset != 0, "an offset learned-position table"),
        (spec.position_kind == "alibi", "ALiBi positions"),
        (spec.partial_rotary_factor != 1.0, f"partial rotary ({spec.partial_rotary_factor:g} of each head)"),
        (bool(spec.chunked_layers), "chunked attention"),
        (spec.activation == "relu2", "a squared-ReLU MLP"),
        (spec.family == "deepseek_v2" and spec.num_expert_groups > 1,
         "DeepSeek-V2's group-limited greedy routing (groups scored by their best expert)"),
    ]
    return missing + [what for present, what in checks if present]


def model_problem(spec: "ModelSpec") -> str | None:
    """One line when the reference model cannot build ``spec``, else None."""
    missing = missing_layers(spec)
    if not missing:
        return None
    return (f"model {spec.name!r} ({spec.family}) can be planned but not run: the runtime's reference model lacks "
            + "; ".join(missing)
            + f". Use `modelcarve plan`/`estimate` for it, or run a model of: {', '.join(RUNTIME_FAMILIES)}")


# --- the pipeline -----------------------------------------------------------------------
def pipeline_problems(layout: "Layout", num_layers: int) -> list[str]:
    """What keeps ``layout``'s pipeline from running a model of ``num_layers`` layers, each
    with its fix (empty when it can run): torch's schedules' micro-batch and stage rules."""
    if layout.pp * layout.virtual_stages <= 1:
        return []
    problems = []
    n, pp, stages = layout.num_microbatches, layout.pp, layout.pp * layout.virtual_stages
    if layout.schedule not in SCHEDULES:
        problems.append(f"schedule={layout.schedule!r} is not supported; use one of {', '.join(SCHEDULES)}")
    if layout.virtual_stages > 1 and layout.schedule in ("gpipe", "1f1b"):
        problems.append(f"virtual_stages={layout.virtual_stages} needs schedule=interleaved-1f1b")
    if layout.schedule != "gpipe" and n < pp:
        problems.append(
            f"schedule {layout.schedule} needs at least pp={pp} micro-batches, got {n}; "
            f"raise gbs to {pp * layout.mbs * layout.dp} or use schedule=gpipe"
        )
    elif layout.schedule in ("interleaved-1f1b", "zero-bubble") and n % pp:
        problems.append(
            f"schedule {layout.schedule} needs the micro-batch count ({n}) to be a multiple of pp={pp}; "
            f"set gbs to a multiple of {pp * layout.mbs * layout.dp}"
        )
    stage_problem = stage_count_problem(num_layers, stages)
    if stage_problem:
        problems.append(stage_problem)
    return problems


# --- training ---------------------------------------------------------------------------
def held_param_dtype(layout: "Layout") -> str:
    """The dtype the training runtime holds the model's parameters in for ``layout``: the one
    precision-policy rule, read by the runtime (parallel/data_parallel.py builds the optimiser by
    it), verify's single-device reference (which then holds the same), the dry run and the
    planner's forecast of our runtime.

    ``"bf16"`` exactly when the distributed optimiser exists and owns an fp32 master copy:
    ``param_dtype=bf16`` with ZeRO-1/2 over more than one data-parallel (dp x cp) rank
    (zero_optimizer.ShardedAdamW's mixed precision, as Megatron's distributed optimiser holds it:
    bf16 parameters, fp32 master range, fp32 moments, fp32 gradient accumulation). Every other
    layout — zero=0, FSDP2 (zero=3), a ZeRO stage over one replica (plain AdamW), fp32 — holds
    fp32 parameters, which are then their own master weights, and a bf16 layout computes under
    autocast. Gradients and optimiser state are fp32 everywhere (``runtime_problems``)."""
    return held_dtype_of(layout.param_dtype, layout.zero, layout.dp * layout.cp)


def held_dtype_of(param_dtype: str, zero: int, replicas: int) -> str:
    """``held_param_dtype`` from the three fields it reads (``replicas``: dp x cp), for the planner's
    candidates, which are not Layouts (plan/train/states.py ``stored_param_dtype``)."""
    if param_dtype == "bf16" and zero in (1, 2) and replicas > 1:
        return "bf16"
    return "fp32"


def fsdp_reshards_after_forward(pp: int, schedule: str) -> bool:
    """Whether FSDP2 (zero=3) reshards a decoder layer after its forward under a pipeline of ``pp``
    ranks running ``schedule``: the one rule the runtime (parallel/data_parallel.py passes it as
    ``reshard_after_forward``), the per-op predictor (plan/predict/step_traffic.py ``fsdp_units``) and
    the full-scale planner (plan/train/states.py) follow.

    False under the zero-bubble schedule with a pipeline: torch's input step I
    (``stage_backward_input``) lists the stage's parameters before its backward unshards them, so a
    layer resharded after its forward would be left out of the deferred weight step W. The layers
    therefore stay gathered from their first forward to the step's gradient reduction: one
    all-gather a step per unit instead of one per micro-batch pass, and the stage's layers held
    unsharded for the whole step. True otherwise (FSDP2's default)."""
    return not (pp > 1 and schedule == "zero-bubble")


def fsdp_holds_gradients(pp: int) -> bool:
    """Whether FSDP2 (zero=3) holds the unsharded gradients of a stage's units, and leaves each
    unit gathered after its backward, until the step's end, under a pipeline of ``pp`` ranks: the
    rule the per-op predictor (plan/predict/step_traffic.py ``fsdp_units``) and the full-scale
    planner (plan/train/model.py ``holds_layers``) follow.

    True for every schedule with a pipeline (gpipe, 1f1b, interleaved-1f1b, zero-bubble): torch's
    ``PipelineStage.backward_maybe_with_nosync`` calls ``set_requires_gradient_sync(False)`` and
    ``set_reshard_after_backward(False)`` (recursive) on the stage's FSDP root before every backward,
    and only ``perform_reduce_grad``, after the stage's last backward (``_add_reduce_grad``; the
    single-stage schedules call it at the end of ``_step_microbatches``), reduce-scatters and
    reshards. So the stage's (chunk's) gradients accumulate unsharded to the step's one
    reduce-scatter per unit, every layer stays gathered from a backward to its next forward (which
    reshards it, ``fsdp_reshards_after_forward``), and the root unit (embedding, final norm, head:
    FSDP2's root, never resharded after forward) stays gathered from its first forward to the
    step's end. False without a pipeline: the trainer's own backward reduce-scatters and reshards
    every unit each micro-batch."""
    return pp > 1


def fsdp_layer_gathers(pp: int, schedule: str, microbatches: int) -> int:
    """All-gathers of each FSDP2 decoder layer in one training step of ``microbatches``
    micro-batches (each chunk's, under an interleaved schedule): a layer is gathered by every
    forward or backward that finds it sharded. Without a pipeline FSDP2 reshards after every
    forward and backward: ``2 m``. With one (``fsdp_holds_gradients``) a layer is resharded after
    each forward only, so each forward and the action after each forward finds it sharded: a chunk's
    actions start with a forward and end with a backward, so ``m + 1``; under zero-bubble it is not
    resharded after forward either (``fsdp_reshards_after_forward``): ``1``."""
    if not fsdp_holds_gradients(pp):
        return 2 * microbatches
    if not fsdp_reshards_after_forward(pp, schedule):
        return 1
    return microbatches + 1


def runtime_problems(layout: "Layout", spec: "ModelSpec") -> list[str]:
    """What the training runtime does not execute of a layout ``Layout.validate`` accepts."""
    problems = []
    if layout.folded and layout.tp > 1 and not layout.sp and (layout.seq // layout.cp) % layout.tp:
        # (MoE parallel folding: each TP rank routes its own slice of the sequence, expert.py)
        problems.append(f"folded experts (etp={layout.expert_tp}, tp={layout.tp}): each TP rank routes seq/cp / tp "
                        f"tokens, but seq/cp = {layout.seq // layout.cp} is not divisible by tp={layout.tp}; "
                        f"choose seq a multiple of {layout.cp * layout.tp}")
    if spec.is_moe and layout.ep == 1 and layout.etp and layout.etp != layout.tp:
        # the planner prices Megatron's fold (experts etp-way split, replicated over the rest); the
        # runtime builds an expert mesh only under EP (expert.py) and would split them over tp
        problems.append(f"etp={layout.etp} != tp={layout.tp} without expert parallelism is not implemented by the "
                        f"runtime (it folds the expert mesh only under ep > 1); drop etp, or set etp={layout.tp}, "
                        f"or use ep > 1")
    if layout.param_dtype not in TRAIN_PARAM_DTYPES:
        problems.append(f"param_dtype={layout.param_dtype} is not implemented by the runtime; use bf16 or fp32")
    if layout.recompute not in RECOMPUTE_RUNTIME:
        problems.append(f"recompute={layout.recompute} is not implemented by the runtime; use one of "
                        f"{', '.join(RECOMPUTE_RUNTIME)}")
    for name in ("grad_dtype", "optim_dtype"):
        if getattr(layout, name) != "fp32":
            problems.append(f"{name}={getattr(layout, name)} is not implemented by the runtime (fp32 master state); "
                            f"use {name}=fp32")
    # (a vocabulary tp does not divide is padded: tensor.padded_vocab_size)
    if layout.sp and layout.tp > 1 and spec.position_kind == "learned":
        problems.append("sequence parallelism with learned positions (gpt2) is not supported; drop sp")
    if spec.position_kind == "learned" and layout.seq > spec.max_position:
        problems.append(f"seq={layout.seq} exceeds the {spec.max_position} learned positions of {spec.name}; "
                        f"use seq <= {spec.max_position}")
    # (sequence parallelism's seq/cp divisible by tp is Layout.validate's)
    if layout.cp > 1 and spec.sliding_layers and spec.sliding_window < layout.seq:
        problems.append(f"cp={layout.cp}: ring attention has no sliding window ({spec.sliding_window} tokens < "
                        f"seq {layout.seq}); use cp=1 or seq <= {spec.sliding_window}")
    if layout.cp > 1 and spec.rope_parameters.get("rope_type") == "dynamic" and layout.seq > spec.max_position:
        problems.append(f"cp={layout.cp}: dynamic rope past max_position {spec.max_position} needs the whole "
                        f"sequence's length on every rank; use cp=1 or seq <= {spec.max_position}")
    problems += pipeline_problems(layout, spec.num_layers)  # torch's schedules' micro-batch and stage rules
    return problems


def training_problems(layout: "Layout", spec: "ModelSpec", world_size: int | None = None) -> list[str]:
    """Every reason ``modelcarve run`` would refuse ``layout`` of ``spec`` (empty: it runs), in
    the order ``check_training`` reports them: the model, ``Layout.validate``, the runtime."""
    problem = model_problem(spec)
    if problem:
        return [problem]
    try:
        layout.validate(spec, world_size=world_size)
    except LayoutError as err:
        return [str(err)]
    return runtime_problems(layout, spec)


def check_training(layout: "Layout", spec: "ModelSpec", world_size: int | None = None) -> None:
    """Raise LayoutError (one line) if the runtime cannot train ``layout`` on ``spec``."""
    problems = training_problems(layout, spec, world_size)
    if problems:
        raise LayoutError("; ".join(problems))


# --- generation -------------------------------------------------------------------------
def generation_problems(layout: "Layout", spec: "ModelSpec", weight_dtype: str, kv_dtype: str) -> list[str]:
    """What the generation engine does not execute of ``layout`` (beyond the training checks)."""
    problems = []
    if layout.sp:
        problems.append("sp (sequence parallelism) is not supported for generation; drop sp")
    if layout.param_dtype not in TRAIN_PARAM_DTYPES:
        problems.append(f"param_dtype={layout.param_dtype} cannot be executed; use fp32 or bf16")
    if weight_dtype not in WEIGHT_RUNTIME:
        problems.append(f"weight_dtype={weight_dtype} cannot be executed by this runtime; use one of {', '.join(WEIGHT_RUNTIME)}")
    if kv_dtype not in KV_RUNTIME:
        problems.append(f"kv_dtype={kv_dtype} cannot be executed by this runtime; use one of {', '.join(KV_RUNTIME)}")
    if layout.cp > 1:
        problems.append("cp > 1 (context parallelism) is not supported for generation; use cp=1")
    if layout.virtual_stages > 1:
        problems.append("virtual_stages > 1 is not supported for generation; use virtual_stages=1")
    if layout.ep > 1 and layout.pp > 1:
        problems.append("ep > 1 with pp > 1 is not supported for generation; use pp=1 with ep")
    return problems


def check_generation(layout: "Layout", spec: "ModelSpec", weight_dtype: str, kv_dtype: str,
                     world_size: int | None = None) -> "Layout":
    """Refuse, before any rank starts, what the engine cannot run; returns the layout with its
    training-only ``seq`` capped at the model's context (generation lengths are per request)."""
    layout = layout.replace(seq=min(layout.seq, spec.max_position))
    problems = generation_problems(layout, spec, weight_dtype, kv_dtype)
    if problems:
        raise LayoutError("; ".join(problems))
    check_training(layout, spec, world_size=world_size)
    return layout
