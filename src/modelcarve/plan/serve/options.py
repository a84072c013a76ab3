"""The request shape and service bounds a serving plan is made for, read from the search's options.

``serve_options(**options)`` turns the keyword options of ``search`` / ``evaluate`` (``input_len``,
``output_len``, ``ttft_ms``, ``tpot_ms``, ``batch``, ``weight_dtypes``, ``kv_dtypes``,
``max_batch``, ``load_imbalance``, ``rate``, ``kv_memory``, ``memory_fraction``; the CLI's flags) into one
``ServeOptions``, refusing a bad value in one line that names the flag.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelcarve.plan.serve.memory import KV_MEMORY_RULES, MEMORY_FRACTION, MOE_IMBALANCE, MemoryRule
from modelcarve.spec.errors import ModelcarveError

WEIGHT_DTYPES = ("bf16", "fp8")
"""The default: the quality floor (plan.quant.QUALITY_FLOOR); --weight-dtypes bf16,fp8,int8,int4,fp4 widens it."""
ALL_WEIGHT_DTYPES = ("bf16", "fp8", "int8", "int4", "fp4", "mxfp4")
KV_DTYPES = ("bf16", "fp8")
MAX_BATCH = 1024
"""Largest batch per replica the throughput goal considers (a typical max_num_seqs ceiling)."""


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """The request shape and service bounds a serving plan is made for."""

    input_len: int = 2048
    output_len: int = 256
    ttft_s: float | None = None
    tpot_s: float | None = None
    batch: int | None = None
    """Fixed sequences in flight per replica; None: 1 for latency, chosen for throughput."""
    weight_dtypes: tuple[str, ...] = WEIGHT_DTYPES
    kv_dtypes: tuple[str, ...] = KV_DTYPES
    max_batch: int = MAX_BATCH
    load_imbalance: float = MOE_IMBALANCE
    """Busiest expert-parallel rank's routed tokens over the mean."""
    released_experts: bool = True
    """Size routed experts in the dtype the checkpoint ships them in when that is narrower than
    the weight dtype (gpt-oss: MXFP4; ``memory.released_expert_dtype``): the default, off when the
    user names the weight dtypes (``--weight-dtypes``), which then apply to every matrix."""
    redundant_experts: int = 0
    """EPLB replicas the search may add to an expert-parallel layout (``--redundant-experts``): with R > 0
    it also tries every ep dividing experts + R but not the experts (``Layout.redundant_experts``); 0: only ep
    dividing the experts."""
    kv_memory: str = "device"
    """How the engine sizes its KV cache (``memory.MemoryRule``): ``device`` (vLLM, SGLang: ``memory_fraction``
    of the device holds weights and KV) or ``free`` (TensorRT-LLM: that fraction of what the weights leave)."""
    memory_fraction: float = MEMORY_FRACTION
    rate_rps: float | None = None
    """Requests/s the cluster is asked to serve (``--rate``); None: each layout at its own batch.
    With a rate, a layout must sustain it, TTFT carries the queue and TPOT is that of the batch
    the rate keeps in flight (plan/serve/batch.py's ``sustained_batch``)."""

    @property
    def context(self) -> int:
        return self.input_len + self.output_len

    @property
    def memory_rule(self) -> MemoryRule:
        return MemoryRule(self.memory_fraction, self.kv_memory)


def _split(value, default: tuple[str, ...]) -> tuple[str, ...]:
    if value is None:
        return default
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    return tuple(value)


def serve_options(**options) -> ServeOptions:
    """Read the serving options out of the search's keyword options (others are ignored)."""

    def num(name, cast, minimum):
        value = options.get(name)
        if value is None:
            return None
        try:
            value = cast(value)
        except (TypeError, ValueError):
            raise ModelcarveError(f"--{name.replace('_', '-')}={value!r} is not a number") from None
        if value < minimum:
            raise ModelcarveError(f"--{name.replace('_', '-')}={value} must be at least {minimum}")
        return value

    input_len = num("input_len", int, 1) or 2048
    output_len = num("output_len", int, 1) or 256
    ttft_ms = num("ttft_ms", float, 0.001)
    tpot_ms = num("tpot_ms", float, 0.001)
    batch = num("batch", int, 1)
    rate = num("rate", float, 0.0)
    if rate is not None and not 0.0 < rate < float("inf"):
        raise ModelcarveError(f"--rate {rate:g} must be a positive, finite number of requests/s")
    kv_memory = options.get("kv_memory") or "device"
    if kv_memory not in KV_MEMORY_RULES:
        raise ModelcarveError(f"--kv-memory {kv_memory!r} unknown; choose device (vLLM, SGLang) or free (TensorRT-LLM)")
    fraction = num("memory_fraction", float, 0.0)
    if fraction is not None and not 0.0 < fraction <= 1.0:
        raise ModelcarveError(f"--memory-fraction {fraction:g} must be in (0, 1], e.g. 0.9")
    opts = ServeOptions(
        input_len=input_len,
        output_len=output_len,
        ttft_s=ttft_ms / 1e3 if ttft_ms else None,
        tpot_s=tpot_ms / 1e3 if tpot_ms else None,
        batch=batch,
        weight_dtypes=_split(options.get("weight_dtypes"), WEIGHT_DTYPES),
        kv_dtypes=_split(options.get("kv_dtypes"), KV_DTYPES),
        max_batch=num("max_batch", int, 1) or MAX_BATCH,
        load_imbalance=num("load_imbalance", float, 1.0) or MOE_IMBALANCE,
        rate_rps=rate,
        redundant_experts=num("redundant_experts", int, 0) or 0,
        released_experts=options.get("weight_dtypes") is None,
        kv_memory=kv_memory,
        memory_fraction=fraction or MEMORY_FRACTION,
    )
    from modelcarve.plan.cost.quant import KV_FORMATS, WEIGHT_FORMATS

    if not opts.weight_dtypes or not opts.kv_dtypes:
        raise ModelcarveError("--weight-dtypes and --kv-dtypes need at least one dtype each, e.g. --weight-dtypes bf16,fp8")
    for name in opts.weight_dtypes:
        if name not in WEIGHT_FORMATS:
            raise ModelcarveError(f"weight dtype {name!r} unknown; choose from {', '.join(WEIGHT_FORMATS)}")
    for name in opts.kv_dtypes:
        if name not in KV_FORMATS:
            raise ModelcarveError(f"KV dtype {name!r} unknown; choose from {', '.join(KV_FORMATS)}")
    return opts
