"""The serving goals, ``serve-latency`` and ``serve-throughput``, behind the one search.

Usage::

    from modelcarve.plan.search import search
    plan = search(model, cluster, "serve-latency", top=5, input_len=2048, output_len=256)
    plan = search(model, cluster, "serve-throughput", input_len=2048, output_len=256,
                  ttft_ms=2000, tpot_ms=50)

Candidates: every ``tp x pp x dp`` factorisation of the cluster (``dp`` = replicas), every
``ep`` dividing ``dp`` and the expert count (MoE only), every weight dtype and KV dtype allowed
(``weight_dtypes`` / ``kv_dtypes`` options; default the quality floor bf16, fp8 for weights and
bf16, fp8 for KV: int8, int4, fp4/nvfp4/mxfp4 only when the user widens ``weight_dtypes``).

* ``serve-latency`` decodes ``batch`` sequences (default 1) per replica and minimises TPOT,
  rejecting layouts that do not fit or miss the TTFT bound (``ttft_ms``) or TPOT bound.
* ``serve-throughput`` picks, per layout, the largest batch that fits in memory and meets
  ``ttft_ms`` and ``tpot_ms`` (TPOT and TTFT grow with the batch, tokens/s per device grows
  with it, so the largest admissible batch is the best), and maximises output tokens/s per
  device.
* With a request rate (``rate``, requests/s over the cluster), both goals cost each layout at
  that load: a layout whose capacity (its ``dp`` replicas at their full batch: the largest that
  fits and meets the TTFT and TPOT bounds, or ``batch``) is at or below the rate is rejected ("capacity below the request rate");
  otherwise the batch is the one the rate keeps in flight (plan/serve/batch.py's
  ``sustained_batch``, Little's law), TPOT and TTFT are what a request sees beside the others in
  flight on average (``at_rate``: a fractional batch ``n = 1 + rate x T``, ``result['queue']
  ['concurrency']``) and TTFT adds the M/D/1 queue wait in front of each replica
  (plan/serve/queue.py); ``result['queue']`` has the figures. Latency
  still minimises TPOT; throughput ranks by capacity per device (the tokens/s per device at the
  full batch, ``serve['capacity_tokens_per_s_per_device']``), since at a given rate every
  layout of the cluster delivers the same tokens/s.

Every result says which mesh axis crosses a node boundary and what it adds to each token, and
carries the quality note of its weight and KV dtypes (``plan.quant``).

This module owns the candidates and the goal objects (screen and full evaluation); the options
are read in plan/serve/options.py, the throughput goal's batch is chosen in plan/serve/batch.py,
its pruning is plan/serve/prune.py, and why the winner beats each other shape is
plan/serve/why.py. plan/goals.py lists the two goals for the search.
"""

from __future__ import annotations

import dataclasses

from modelcarve.plan.factors import divisors
from modelcarve.plan.cost.quant import QUALITY_SHORT, quality_note
from modelcarve.plan.serve.batch import _largest_batch, at_rate
from modelcarve.plan.serve.layout_costs import layout_costs
from modelcarve.plan.serve.memory import GiB, max_sequences, memory_from_facts, min_devices, served_expert_dtype, shard_facts
from modelcarve.plan.serve.options import MAX_BATCH, ServeOptions, serve_options  # noqa: F401 - MAX_BATCH for callers
from modelcarve.plan.serve.prune import prune
from modelcarve.plan.serve.queue import md1_wait_s, queued_ttft
from modelcarve.plan.serve.time import ServeTime, _ensure_prefill, _rates, _serve_time, decode_tpot_s
from modelcarve.spec.errors import LayoutError
from modelcarve.spec.layout import Layout

_QUALITY_RANK = {"fp32": 0, "bf16": 1, "fp16": 1, "fp8": 2, "int8": 3, "fp4": 3, "nvfp4": 3, "mxfp4": 3, "int4": 4}

FIT = "does not fit in memory"
TTFT = "TTFT above the bound"
TPOT = "TPOT above the bound"
INVALID = "invalid layout"
RATE = "capacity below the request rate"


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


_PLAIN_LAYOUT = not any(hasattr(Layout, name) for name in ("__post_init__", "__slots__"))


def _with_dtypes(base: Layout, weight_dtype: str, kv_dtype: str) -> Layout:
    """``dataclasses.replace(base, weight_dtype=..., kv_dtype=...)``, a quarter of the cost: the
    frozen constructor's twenty ``object.__setattr__`` calls are most of what enumerating the
    candidates costs (eight dtype variants per mesh). Layout's constructor only assigns fields
    (no ``__post_init__``), so copying them is the same object; otherwise, the constructor."""
    if not _PLAIN_LAYOUT:
        return dataclasses.replace(base, weight_dtype=weight_dtype, kv_dtype=kv_dtype)
    layout = object.__new__(Layout)
    fields = layout.__dict__  # frozen blocks setattr, not the instance's own dict
    fields.update(base.__dict__)
    fields["weight_dtype"] = weight_dtype
    fields["kv_dtype"] = kv_dtype
    return layout


_LAYOUT_FIELDS = tuple(field.name for field in dataclasses.fields(Layout))
_FLAT_LAYOUT = all(str(field.type) in ("int", "float", "str", "bool") for field in dataclasses.fields(Layout))


def _layout_dict(layout: Layout) -> dict:
    """``layout.to_dict()`` (``dataclasses.asdict``) without asdict's recursive deep copy, which
    is a fifth of the cost of evaluating a serving layout in full; the same dict while every
    Layout field is a plain scalar (otherwise asdict itself)."""
    if not _FLAT_LAYOUT or layout.redundant_experts:
        return layout.to_dict()
    return {name: getattr(layout, name) for name in _LAYOUT_FIELDS if name != "redundant_experts"}


def _name(layout: Layout, expert_dtype: str = "") -> str:
    experts = f" (experts {expert_dtype})" if expert_dtype else ""
    return f"{layout.short()} w{layout.weight_dtype}/kv{layout.kv_dtype}{experts}"


def _expert_dtype(model, layout: Layout, opts: ServeOptions) -> str:
    """The routed experts' dtype when not the layout's weight dtype: as the checkpoint ships them
    (gpt-oss: mxfp4) unless the user named the weight dtypes."""
    return served_expert_dtype(model, layout.weight_dtype, opts.released_experts)


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
                eps = [(1, 0)]
                if model.is_moe:
                    for e in divisors(dp):
                        if e > 1 and model.num_experts % e == 0:
                            eps.append((e, 0))
                        elif e > 1 and opts.redundant_experts and (model.num_experts + opts.redundant_experts) % e == 0:
                            # EPLB lets ep divide experts + R; where ep divides the experts already, replicas
                            # only add memory here (the load imbalance is not derived from R: layout_costs)
                            eps.append((e, opts.redundant_experts))
                for ep, r in eps:
                    base = Layout(tp=tp, pp=pp, dp=dp, ep=ep, seq=seq, redundant_experts=r)
                    for wd in opts.weight_dtypes:
                        for kd in opts.kv_dtypes:
                            yield _with_dtypes(base, wd, kd)

    # --- the core: batch choice, bounds ------------------------------------------------------
    def _solve(self, model, cluster, layout: Layout, opts: ServeOptions):
        """(ServeTime | None, ServeMemory, category, reason, queue | None) for one layout; with a
        request rate the ServeTime is at the sustained batch with the queue wait in its TTFT."""
        ed = _expert_dtype(model, layout, opts)
        f = shard_facts(model, tp=layout.tp, pp=layout.pp, ep=layout.ep, weight_dtype=layout.weight_dtype, kv_dtype=layout.kv_dtype,
                        expert_dtype=ed, redundant_experts=layout.redundant_experts)
        memory_bytes = cluster.device.memory_bytes
        ctx_len = opts.context
        mem = memory_from_facts(f, memory_bytes, batch=1, context=ctx_len, rule=opts.memory_rule)
        max_b = min(mem.max_sequences, opts.max_batch)
        if max_b < 1:
            reason = (
                f"{_name(layout)}: weights {mem.weights_bytes / GiB:.1f} GiB + KV of one {ctx_len}-token "
                f"sequence {mem.kv_bytes / GiB:.1f} GiB + workspace {mem.workspace_bytes / GiB:.1f} GiB + runtime "
                f"{mem.runtime_bytes / GiB:.0f} GiB = {mem.total_bytes / GiB:.1f} GiB > {mem.budget_bytes / GiB:.1f} GiB usable per device"
            )
            return None, mem, FIT, reason, None
        c = layout_costs(model, cluster, layout.tp, layout.pp, layout.ep, layout.dp, layout.weight_dtype, layout.kv_dtype, opts.input_len, opts.output_len, opts.load_imbalance, f,
                         expert_dtype=ed, redundant_experts=layout.redundant_experts)
        if opts.batch is not None or self.latency:
            batch = opts.batch or 1
            if batch > mem.max_sequences:
                mem = memory_from_facts(f, memory_bytes, batch=batch, context=ctx_len, rule=opts.memory_rule)
                reason = (
                    f"{_name(layout)}: {batch} sequences of {ctx_len} tokens need {mem.kv_bytes / GiB:.1f} GiB of KV cache; "
                    f"only {mem.max_sequences} fit beside {mem.weights_bytes / GiB:.1f} GiB of weights"
                )
                return None, mem, FIT, reason, None
            if opts.rate_rps is None:
                t = _serve_time(c, batch)
            elif opts.batch is not None:
                max_b = batch  # at a rate the latency goal's batch is the rate's, unless --batch caps it
        elif opts.rate_rps is None:
            t = self._largest_batch(c, max_b, opts)
        else:
            max_b = self._largest_batch(c, max_b, opts).batch  # the full batch within the bounds
        queue = None
        if opts.rate_rps is not None:
            t, queue = self._at_rate(c, max_b, layout.dp, opts.rate_rps)
        category, reason = self._check_bounds(layout, t, opts, queue)
        mem = memory_from_facts(f, memory_bytes, batch=t.batch, context=ctx_len, rule=opts.memory_rule)
        return t, mem, category, reason, queue

    @staticmethod
    def _at_rate(c, max_b: int, dp: int, rate: float) -> tuple[ServeTime, dict]:
        """The layout at ``rate`` requests/s over its ``dp`` replicas: the sustained batch's
        figures with the queue wait in TTFT, and the queue (``queued_ttft`` plus the full batch
        and its capacity per device)."""
        batch, capacity, (_, tpot, ttft, _), n = at_rate(c, max_b, rate / dp)
        t = dataclasses.replace(_serve_time(c, batch), tpot_s=tpot, ttft_s=ttft)
        queue = queued_ttft(ttft_s=t.ttft_s, capacity_rps=capacity, rate_rps=rate, replicas=dp)
        queue.update(batch=batch, concurrency=n, full_batch=max_b, ttft_unqueued_s=t.ttft_s,
                     capacity_tokens_per_s_per_device=capacity * c.output_len / (c.tp * c.pp))
        return dataclasses.replace(t, ttft_s=queue["ttft_s"]), queue

    @staticmethod
    def _largest_batch(c, max_b: int, opts: ServeOptions) -> ServeTime:
        """The largest batch in 1..max_b meeting the bounds, with its figures."""
        inf = float("inf")
        ttft = opts.ttft_s if opts.ttft_s is not None else inf
        tpot = opts.tpot_s if opts.tpot_s is not None else inf
        return _serve_time(c, _largest_batch(c, max_b, ttft, tpot)[0])

    @staticmethod
    def _check_bounds(layout: Layout, t: ServeTime, opts: ServeOptions, queue: dict | None = None):
        if queue is not None and not queue["stable"]:
            return RATE, (
                f"{_name(layout)}: capacity {queue['capacity_total_rps']:.3g} requests/s ({layout.dp} replica(s) of "
                f"{queue['capacity_rps']:.3g} at batch {queue['full_batch']}) is at or below --rate {queue['rate_rps']:g}: "
                f"the queue would grow without bound"
            )
        if opts.ttft_s is not None and t.ttft_s > opts.ttft_s:
            waits = f" and the queue wait at --rate {queue['rate_rps']:g} {queue['wait_s'] * 1e3:.0f} ms" if queue else ""
            return TTFT, (
                f"{_name(layout)}: TTFT {t.ttft_s * 1e3:.0f} ms at batch {t.batch} exceeds {opts.ttft_s * 1e3:.0f} ms "
                f"(prefill of {opts.input_len} tokens takes {t.prefill_s * 1e3:.0f} ms{waits})"
            )
        if opts.tpot_s is not None and t.tpot_s > opts.tpot_s:
            return TPOT, (
                f"{_name(layout)}: TPOT {t.tpot_s * 1e3:.1f} ms at batch {t.batch} exceeds {opts.tpot_s * 1e3:.0f} ms "
                f"(decode is {t.bound}-bound)"
            )
        return None, None

    # --- the Goal protocol ------------------------------------------------------------------
    def prepare(self, model, cluster, **options):
        """The search's cheap scorer: floats only; the reasons are written for rejections. The
        throughput screen (batch chosen) also answers ``screen.above(layout, floor)``: None for a
        layout it proves accepted at no more than ``floor`` (plan/serve/prune.py)."""
        opts = serve_options(**options)
        memory_bytes = cluster.device.memory_bytes
        ctx_len = opts.context
        ttft_bound = opts.ttft_s if opts.ttft_s is not None else float("inf")
        tpot_bound = opts.tpot_s if opts.tpot_s is not None else float("inf")
        latency = self.latency
        rate = opts.rate_rps
        released = opts.released_experts

        def screen(layout: Layout, floor: float | None = None):
            ed = served_expert_dtype(model, layout.weight_dtype, released)
            f = shard_facts(model, tp=layout.tp, pp=layout.pp, ep=layout.ep, weight_dtype=layout.weight_dtype, kv_dtype=layout.kv_dtype,
                            expert_dtype=ed, redundant_experts=layout.redundant_experts)
            fit = max_sequences(f, memory_bytes, ctx_len, rule=opts.memory_rule)
            fixed = opts.batch or (1 if latency else None)
            # Rejections carry a short reason: the search evaluates the best rejected candidate
            # of each category in full, which writes the sentence with its figures.
            if fit < 1 or (fixed is not None and fixed > fit):
                # The closest to fitting ranks first (the no-fit error names it): the smallest
                # need per device over the usable memory, below every other category's score.
                need = memory_from_facts(f, memory_bytes, batch=fixed or 1, context=ctx_len, rule=opts.memory_rule)
                return -1e6 - need.total_bytes / need.budget_bytes, FIT, f"{_name(layout)}: {FIT}"
            c = layout_costs(model, cluster, layout.tp, layout.pp, layout.ep, layout.dp, layout.weight_dtype, layout.kv_dtype, opts.input_len, opts.output_len, opts.load_imbalance, f,
                             expert_dtype=ed, redundant_experts=layout.redundant_experts)
            if rate is not None:
                # At a request rate: the sustained batch, its TPOT, TTFT with the queue wait.
                top_b = opts.batch or (fit if fit < opts.max_batch else opts.max_batch)
                if opts.batch is None:
                    top_b = _largest_batch(c, top_b, ttft_bound, tpot_bound)[0]  # the full batch within the bounds
                batch, capacity, (_, tpot, ttft, _), _n = at_rate(c, top_b, rate / layout.dp)
                per_replica = rate / layout.dp
                if per_replica >= capacity:
                    # Ranked by how close the capacity comes to the rate.
                    return capacity / per_replica - 2.0, RATE, f"{_name(layout)}: {RATE}"
                ttft += md1_wait_s(per_replica, capacity)
                raw = -tpot if latency else capacity * c.output_len / (layout.tp * layout.pp)
            elif latency and fixed == 1 and opts.ttft_s is None:
                # The common latency question: one sequence, no TTFT bound; no prefill to cost.
                tpot = decode_tpot_s(c, 1)
                if tpot > tpot_bound:
                    return -tpot, TPOT, f"{_name(layout)}: TPOT {tpot * 1e3:.1f} ms exceeds {tpot_bound * 1e3:.0f} ms"
                return -tpot - tpot * 1e-9 * _QUALITY_RANK.get(layout.weight_dtype, 9), None, None
            elif fixed is None:
                max_b = fit if fit < opts.max_batch else opts.max_batch
                if floor is not None:
                    # Pruning (``screen.above``, plan/serve/prune.py): skip the batch search of a
                    # candidate accepted below ``floor`` (it cannot change the top) or one that
                    # batch 1 alone proves rejected (the same answer, from one step).
                    if c.prefill_s < 0:
                        _ensure_prefill(c)
                    round_1 = prune(c, max_b, ttft_bound, tpot_bound, floor * (layout.tp * layout.pp))
                    if round_1 is not None:
                        if not round_1:
                            return None
                        # _largest_batch's batch-1 answer, the same operations.
                        group = 1 / (round_1 + c.input_len * c.prefill_token_s / 1 / c.output_len)
                        reason = f"{_name(layout)}: TPOT {round_1 * 1e3:.1f} ms exceeds {tpot_bound * 1e3:.0f} ms"
                        return group / (layout.tp * layout.pp), TPOT, reason
                _, (_, tpot, ttft, group) = _largest_batch(c, max_b, ttft_bound, tpot_bound)
                raw = group / (layout.tp * layout.pp)
            else:
                _, tpot, ttft, group = _rates(c, fixed)
                raw = -tpot if latency else group / (layout.tp * layout.pp)
            if ttft > ttft_bound:
                return raw, TTFT, f"{_name(layout)}: TTFT {ttft * 1e3:.0f} ms exceeds {ttft_bound * 1e3:.0f} ms"
            if tpot > tpot_bound:
                return raw, TPOT, f"{_name(layout)}: TPOT {tpot * 1e3:.1f} ms exceeds {tpot_bound * 1e3:.0f} ms"
            # Equal speed (fp8 and int8 move the same bytes): the smaller quality cost ranks first.
            return raw - abs(raw) * 1e-9 * _QUALITY_RANK.get(layout.weight_dtype, 9), None, None

        if not latency and opts.batch is None and rate is None:
            screen.above = screen  # the throughput screen can prune (see search.py, goals.py)
        return screen

    def score(self, result: dict) -> float:
        # Equal speed (fp8 and int8 move the same bytes): the smaller quality cost ranks first.
        serve = result.get("serve")
        if not serve:
            return float("-inf")
        raw = -serve["tpot_s"] if self.latency else serve.get("capacity_tokens_per_s_per_device", serve["tokens_per_s_per_device"])
        return raw - abs(raw) * 1e-9 * _QUALITY_RANK.get(result["layout"]["weight_dtype"], 9)

    def evaluate(self, model, cluster, candidate, **options) -> dict:
        opts = serve_options(**options)
        layout = candidate if isinstance(candidate, Layout) else Layout.parse(str(candidate))
        result = {
            "goal": self.name,
            "layout": _layout_dict(layout),
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
        t, mem, category, reason, queue = self._solve(model, cluster, layout, opts)
        ed = _expert_dtype(model, layout, opts)
        if ed:
            result["name"] = _name(layout, ed)
            result["expert_dtype"] = ed
        result["memory"] = mem.to_dict()
        result["fits"] = t is not None
        result["reject_reason"] = reason
        if category:
            result["reject_category"] = category
        if t is None:
            needed = min_devices(
                model, cluster.device.memory_bytes, weight_dtype=layout.weight_dtype, kv_dtype=layout.kv_dtype,
                context=opts.context, batch=opts.batch or 1, expert_dtype=ed,
            )
            where = f"at least {needed} x {cluster.device.name}" if needed else f"more than 1024 x {cluster.device.name}"
            weights = f"{layout.weight_dtype} weights" + (f" ({ed} experts)" if ed else "")
            result["reject_reason"] = f"{reason}; {weights} with this context need {where}"
            return result
        result["serve"] = dict(t.to_dict(), concurrency=t.batch * layout.dp)
        if queue is not None:
            result["queue"] = queue
            result["serve"].update(ttft_unqueued_s=queue["ttft_unqueued_s"], queue_wait_s=queue["wait_s"],
                                   capacity_rps=queue["capacity_total_rps"],
                                   capacity_tokens_per_s_per_device=queue["capacity_tokens_per_s_per_device"])
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
                "ep": f"EP={layout.ep} spans nodes: the MoE all-to-alls ({2 * model.num_moe_layers} per step, x{opts.load_imbalance:g} load imbalance) go over {link}",
                "pp": f"PP={layout.pp} stage hand-offs cross nodes over {link}",
            }[axis]
            out.append(f"{what}: {ms:.2f} ms of each {t.tpot_s * 1e3:.2f} ms token ({info['bytes_per_round'] / max(t.batch, 1) / 1e3:.1f} kB per token per device)")
        if "ep" in t.comm and t.comm["ep"]["straggler_s_per_round"] > 0:
            info = t.comm["ep"]
            out.append(
                f"EP={layout.ep} straggler: the busiest expert rank receives {opts.load_imbalance:g}x the mean tokens, "
                f"adding {info['straggler_s_per_round'] * 1e3:.2f} ms of all-to-all to each decode round "
                f"(--load-imbalance sets it; the runtime measures the real per-expert counts)"
            )
        if layout.redundant_experts and model.is_moe:
            out.append(_eplb_note(model, layout, opts.load_imbalance))
        if t.bubble > 0:
            out.append(
                f"pp={layout.pp} with {t.batch} sequence(s) in flight: stages sit idle {t.bubble:.0%} of each decode round; "
                f"PP needs at least {layout.pp} sequences in flight"
            )
        if opts.context > model.max_position:
            out.append(f"context {opts.context} tokens exceeds {model.name}'s trained {model.max_position}; needs rope scaling (e.g. YaRN)")
        split = layout.tp * layout.pp * layout.ep  # devices one copy of the weights spans
        if split > 1:
            # Only when one device could not serve even one sequence is the split forced.
            one = memory_from_facts(
                shard_facts(model, tp=1, pp=1, ep=1, weight_dtype=layout.weight_dtype, kv_dtype=layout.kv_dtype,
                            expert_dtype=_expert_dtype(model, layout, opts)),
                cluster.device.memory_bytes, batch=1, context=opts.context, rule=opts.memory_rule,
            )
            if not one.fits:
                out.append(
                    f"one model copy spans {split} devices (TP x PP x EP) because one {cluster.device.name} would need {one.total_bytes / GiB:.1f} GiB "
                    f"(weights {one.weights_bytes / GiB:.1f} + KV {one.kv_bytes / GiB:.1f}) > {one.budget_bytes / GiB:.1f} GiB usable"
                )
        ed = _expert_dtype(model, layout, opts)
        if ed:
            out.append(
                f"routed experts sized in {ed}, as {model.name}'s checkpoint ships them (the rest {layout.weight_dtype}); "
                f"--weight-dtypes {layout.weight_dtype} sizes every matrix in {layout.weight_dtype}"
            )
        if layout.weight_dtype in ("int4", "int8", "fp4", "nvfp4", "mxfp4"):
            out.append(
                f"quality: {quality_note(layout.weight_dtype, layout.kv_dtype)} "
                f"(--weight-dtypes bf16,fp8 keeps the search to near-lossless weights)"
            )
        return out


def _eplb_note(model, layout: Layout, imbalance: float) -> str:
    """What a layout's redundant experts (EPLB) are priced at, and what is not modelled."""
    physical = layout.physical_experts(model.num_experts)
    return (
        f"EPLB: {layout.redundant_experts} redundant experts, {physical} physical experts per MoE layer, "
        f"{physical // layout.ep} per EP rank ({physical} / {layout.ep}) priced in memory and in expert weights read; "
        f"the busiest rank's load stays --load-imbalance {imbalance:g} (not derived from the replicas: set it to the "
        f"balance the deployment's EPLB reaches)"
    )


SERVE_LATENCY = _ServeGoal(
    "serve-latency", "minimise time per output token at low concurrency, subject to fitting and a TTFT bound", latency=True
)
SERVE_THROUGHPUT = _ServeGoal(
    "serve-throughput", "maximise output tokens/s per device subject to TTFT and TPOT bounds, choosing the batch", latency=False
)
