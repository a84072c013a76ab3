"""The serving goals, ``serve-latency`` and ``serve-throughput``, behind the one search.

Usage::

    from modelcarve.plan.search import search
    plan = search(model, cluster, "serve-latency", top=5, input_len=2048, output_len=256)
    plan = search(model, cluster, "serve-throughput", input_len=2048, output_len=256,
                  ttft_ms=2000, tpot_ms=50)

Candidates: every ``tp x pp x dp`` factorisation of the cluster (``dp`` = replicas), every
``ep`` dividing ``dp`` and the expert count (MoE only), every weight dtype and KV dtype allowed
(``weight_dtypes`` / ``kv_dtypes`` options; default bf16, fp8, int8, int4 and bf16, fp8).

* ``serve-latency`` decodes ``batch`` sequences (default 1) per replica and minimises TPOT,
  rejecting layouts that do not fit or miss the TTFT bound (``ttft_ms``) or TPOT bound.
* ``serve-throughput`` picks, per layout, the largest batch that fits in memory and meets
  ``ttft_ms`` and ``tpot_ms`` (TPOT and TTFT grow with the batch, tokens/s per device grows
  with it, so the largest admissible batch is the best), and maximises output tokens/s per
  device.

Every result says which mesh axis crosses a node boundary and what it adds to each token, and
carries the quality note of its weight and KV dtypes (``plan.quant``).
"""

from __future__ import annotations

from dataclasses import dataclass

from modelcarve.plan import goals
from modelcarve.plan.quant import QUALITY_SHORT, quality_note
from modelcarve.plan.search import divisors
from modelcarve.plan.serve_memory import GiB, memory_from_facts, min_devices, shard_facts
from modelcarve.plan.serve_time import ServeTime, _context, _serve_time
from modelcarve.spec.errors import LayoutError, ModelcarveError
from modelcarve.spec.layout import Layout

WEIGHT_DTYPES = ("bf16", "fp8", "int8", "int4")
KV_DTYPES = ("bf16", "fp8")
MAX_BATCH = 1024
"""Largest batch per replica the throughput goal considers (a typical max_num_seqs ceiling)."""

_QUALITY_RANK = {"fp32": 0, "bf16": 1, "fp16": 1, "fp8": 2, "int8": 3, "int4": 4}

FIT = "does not fit in memory"
TTFT = "TTFT above the bound"
TPOT = "TPOT above the bound"
INVALID = "invalid layout"


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

    @property
    def context(self) -> int:
        return self.input_len + self.output_len


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
    opts = ServeOptions(
        input_len=input_len,
        output_len=output_len,
        ttft_s=ttft_ms / 1e3 if ttft_ms else None,
        tpot_s=tpot_ms / 1e3 if tpot_ms else None,
        batch=batch,
        weight_dtypes=_split(options.get("weight_dtypes"), WEIGHT_DTYPES),
        kv_dtypes=_split(options.get("kv_dtypes"), KV_DTYPES),
        max_batch=num("max_batch", int, 1) or MAX_BATCH,
    )
    from modelcarve.plan.quant import KV_FORMATS, WEIGHT_FORMATS

    for name in opts.weight_dtypes:
        if name not in WEIGHT_FORMATS:
            raise ModelcarveError(f"weight dtype {name!r} unknown; choose from {', '.join(WEIGHT_FORMATS)}")
    for name in opts.kv_dtypes:
        if name not in KV_FORMATS:
            raise ModelcarveError(f"KV dtype {name!r} unknown; choose from {', '.join(KV_FORMATS)}")
    return opts


def _tp_values(model, n: int) -> list[int]:
    out = []
    for tp in divisors(n):
        if model.num_heads % tp or model.ffn_size % tp:
            continue
        if model.is_moe and model.expert_ffn_size % tp:
            continue
        if model.attention_kind == "gqa" and model.num_kv_heads % tp and tp % model.num_kv_heads:
            continue
        out.append(tp)
    return out


def _name(layout: Layout) -> str:
    return f"{layout.short()} w{layout.weight_dtype}/kv{layout.kv_dtype}"


class _ServeGoal:
    """Shared machinery of the two serving goals; ``latency`` says which one."""

    def __init__(self, name: str, description: str, latency: bool) -> None:
        self.name = name
        self.description = description
        self.latency = latency

    # --- enumeration ----------------------------------------------------------------------
    def candidates(self, model, cluster, **options):
        opts = serve_options(**options)
        n = cluster.num_devices
        seq = opts.context
        for tp in _tp_values(model, n):
            for pp in divisors(n // tp):
                if pp > model.num_layers:
                    continue
                dp = n // (tp * pp)
                eps = [1]
                if model.is_moe:
                    eps += [e for e in divisors(dp) if e > 1 and model.num_experts % e == 0]
                for ep in eps:
                    for wd in opts.weight_dtypes:
                        for kd in opts.kv_dtypes:
                            yield Layout(tp=tp, pp=pp, dp=dp, ep=ep, weight_dtype=wd, kv_dtype=kd, seq=seq)

    # --- the core: batch choice, bounds ------------------------------------------------------
    def _solve(self, model, cluster, layout: Layout, opts: ServeOptions):
        """(ServeTime | None, ServeMemory, category, reason) for one layout."""
        f = shard_facts(model, tp=layout.tp, pp=layout.pp, ep=layout.ep, weight_dtype=layout.weight_dtype, kv_dtype=layout.kv_dtype)
        memory_bytes = cluster.device.memory_bytes
        ctx_len = opts.context
        mem = memory_from_facts(f, memory_bytes, batch=1, context=ctx_len)
        max_b = min(mem.max_sequences, opts.max_batch)
        if max_b < 1:
            reason = (
                f"{_name(layout)}: weights {mem.weights_bytes / GiB:.1f} GiB + KV of one {ctx_len}-token "
                f"sequence {mem.kv_bytes / GiB:.1f} GiB + workspace {mem.workspace_bytes / GiB:.1f} GiB + runtime "
                f"{mem.runtime_bytes / GiB:.0f} GiB = {mem.total_bytes / GiB:.1f} GiB > {mem.budget_bytes / GiB:.1f} GiB usable per device"
            )
            return None, mem, FIT, reason
        c = _context(model, cluster, layout.tp, layout.pp, layout.ep, layout.dp, layout.weight_dtype, layout.kv_dtype, opts.input_len, opts.output_len)
        if opts.batch is not None or self.latency:
            batch = opts.batch or 1
            if batch > mem.max_sequences:
                mem = memory_from_facts(f, memory_bytes, batch=batch, context=ctx_len)
                reason = (
                    f"{_name(layout)}: {batch} sequences of {ctx_len} tokens need {mem.kv_bytes / GiB:.1f} GiB of KV cache; "
                    f"only {mem.max_sequences} fit beside {mem.weights_bytes / GiB:.1f} GiB of weights"
                )
                return None, mem, FIT, reason
            t = _serve_time(c, batch)
        else:
            t = self._largest_batch(c, max_b, opts)
        category, reason = self._check_bounds(layout, t, opts)
        mem = memory_from_facts(f, memory_bytes, batch=t.batch, context=ctx_len)
        return t, mem, category, reason

    @staticmethod
    def _meets(t: ServeTime, opts: ServeOptions) -> bool:
        return (opts.ttft_s is None or t.ttft_s <= opts.ttft_s) and (opts.tpot_s is None or t.tpot_s <= opts.tpot_s)

    def _largest_batch(self, c, max_b: int, opts: ServeOptions) -> ServeTime:
        """Largest batch in 1..max_b meeting the bounds (they only tighten as the batch grows)."""
        top = _serve_time(c, max_b)
        if self._meets(top, opts):
            return top
        low = _serve_time(c, 1)
        if not self._meets(low, opts):
            return low
        lo, hi = 1, max_b  # lo meets, hi does not
        best = low
        while hi - lo > 1:
            mid = (lo + hi) // 2
            t = _serve_time(c, mid)
            if self._meets(t, opts):
                lo, best = mid, t
            else:
                hi = mid
        return best

    @staticmethod
    def _check_bounds(layout: Layout, t: ServeTime, opts: ServeOptions):
        if opts.ttft_s is not None and t.ttft_s > opts.ttft_s:
            return TTFT, (
                f"{_name(layout)}: TTFT {t.ttft_s * 1e3:.0f} ms at batch {t.batch} exceeds {opts.ttft_s * 1e3:.0f} ms "
                f"(prefill of {opts.input_len} tokens takes {t.prefill_s * 1e3:.0f} ms)"
            )
        if opts.tpot_s is not None and t.tpot_s > opts.tpot_s:
            return TPOT, (
                f"{_name(layout)}: TPOT {t.tpot_s * 1e3:.1f} ms at batch {t.batch} exceeds {opts.tpot_s * 1e3:.0f} ms "
                f"(decode is {t.bound}-bound)"
            )
        return None, None

    # --- the Goal protocol ------------------------------------------------------------------
    def prepare(self, model, cluster, **options):
        opts = serve_options(**options)

        def screen(layout: Layout):
            t, _, category, reason = self._solve(model, cluster, layout, opts)
            if t is None:
                return float("-inf"), category, reason
            return self._score_time(t, layout.weight_dtype), category, reason

        return screen

    def _score_time(self, t: ServeTime, weight_dtype: str) -> float:
        raw = -t.tpot_s if self.latency else t.tokens_per_s_per_device
        # Equal speed (fp8 and int8 move the same bytes): the smaller quality cost ranks first.
        return raw - abs(raw) * 1e-9 * _QUALITY_RANK.get(weight_dtype, 9)

    def score(self, result: dict) -> float:
        serve = result.get("serve")
        if not serve:
            return float("-inf")
        raw = -serve["tpot_s"] if self.latency else serve["tokens_per_s_per_device"]
        return raw - abs(raw) * 1e-9 * _QUALITY_RANK.get(result["layout"]["weight_dtype"], 9)

    def evaluate(self, model, cluster, candidate, **options) -> dict:
        opts = serve_options(**options)
        layout = candidate if isinstance(candidate, Layout) else Layout.parse(str(candidate))
        result = {
            "goal": self.name,
            "layout": layout.to_dict(),
            "name": _name(layout),
            "fits": False,
            "memory": {},
            "serve": {},
            "comm": {},
            "crosses_nodes": [],
            "quality": quality_note(layout.weight_dtype, layout.kv_dtype),
            "quality_short": QUALITY_SHORT.get(layout.weight_dtype, "?"),
            "warnings": [],
            "reject_reason": None,
        }
        try:
            layout.validate(model, cluster)
            if layout.cp > 1:
                raise LayoutError("context parallelism (cp > 1) is not modelled for serving; use cp=1")
        except LayoutError as err:
            result["reject_reason"] = str(err)
            result["reject_category"] = INVALID
            return result
        t, mem, category, reason = self._solve(model, cluster, layout, opts)
        result["memory"] = mem.to_dict()
        result["fits"] = t is not None
        result["reject_reason"] = reason
        if category:
            result["reject_category"] = category
        if t is None:
            needed = min_devices(
                model, cluster.device.memory_bytes, weight_dtype=layout.weight_dtype, kv_dtype=layout.kv_dtype,
                context=opts.context, batch=opts.batch or 1,
            )
            where = f"{needed} x {cluster.device.name}" if needed else f"more than 1024 x {cluster.device.name}"
            result["reject_reason"] = f"{reason}; {layout.weight_dtype} weights with this context need at least {where}"
            return result
        result["serve"] = dict(t.to_dict(), concurrency=t.batch * layout.dp)
        result["comm"] = {axis: dict(info, crosses_nodes=info["tier"] == "inter") for axis, info in t.comm.items()}
        result["crosses_nodes"] = [axis for axis, info in t.comm.items() if info["tier"] == "inter"]
        result["warnings"] = self._warnings(model, cluster, layout, t, mem, opts)
        return result

    def _warnings(self, model, cluster, layout, t: ServeTime, mem, opts) -> list[str]:
        out = []
        link = cluster.inter_link.name
        for axis, info in t.comm.items():
            if info["tier"] != "inter":
                continue
            ms = info["s_per_round"] * 1e3
            what = {
                "tp": f"TP={layout.tp} spans nodes: {2 * model.num_layers} all-reduces per decode step go over {link}",
                "ep": f"EP={layout.ep} spans nodes: the MoE all-to-alls ({2 * model.num_moe_layers} per step, x{1.3} load imbalance) go over {link}",
                "pp": f"PP={layout.pp} stage hand-offs cross nodes over {link}",
            }[axis]
            out.append(f"{what}: {ms:.2f} ms of each {t.tpot_s * 1e3:.2f} ms token ({info['bytes_per_round'] / max(t.batch, 1) / 1e3:.1f} kB per token per device)")
        if t.bubble > 0:
            out.append(
                f"pp={layout.pp} with {t.batch} sequence(s) in flight: stages sit idle {t.bubble:.0%} of each decode round; "
                f"PP needs at least {layout.pp} sequences in flight"
            )
        if opts.context > model.max_position:
            out.append(f"context {opts.context} tokens exceeds {model.name}'s trained {model.max_position}; needs rope scaling (e.g. YaRN)")
        split = layout.tp * layout.pp
        if split > 1:
            one = memory_from_facts(
                shard_facts(model, tp=1, pp=1, ep=1, weight_dtype=layout.weight_dtype, kv_dtype=layout.kv_dtype),
                cluster.device.memory_bytes, batch=t.batch, context=opts.context,
            )
            if not one.fits:
                out.append(
                    f"split over {split} devices because one {cluster.device.name} would need {one.total_bytes / GiB:.1f} GiB "
                    f"(weights {one.weights_bytes / GiB:.1f} + KV {one.kv_bytes / GiB:.1f}) > {one.budget_bytes / GiB:.1f} GiB usable"
                )
        if layout.weight_dtype in ("int4", "int8"):
            out.append(f"quality: {quality_note(layout.weight_dtype, layout.kv_dtype)}")
        return out


SERVE_LATENCY = goals.register(
    _ServeGoal("serve-latency", "minimise time per output token at low concurrency, subject to fitting and a TTFT bound", latency=True)
)
SERVE_THROUGHPUT = goals.register(
    _ServeGoal("serve-throughput", "maximise output tokens/s per device subject to TTFT and TPOT bounds, choosing the batch", latency=False)
)
