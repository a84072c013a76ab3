"""The per-(tp, cp, pp, mbs, ...) half of the training cost model: one micro-batch's time and
memory rows per pipeline stage, before data parallelism and the schedule are applied.

    cost.screen_profile(tp, cp, pp, dp, ep, mbs, sp, recompute, seq)   # what the search screens
    cost.profile(tp, cp, pp, dp, ep, mbs, sp, recompute, seq)          # the full dict, for finalists
    cost.screen_rows(...)                                              # memory rows alone

``ProfileMixin`` is a part of ``TrainCostModel`` (plan/train/model.py), split out by idea: it
reads the model's caches (``_layers``, ``_heads``, ``_leans``, ``_stage_params``, ``_tiers``) and
its ``stage_params`` / ``tier``; one layer's cost is plan/train/layer.py's. The screen profile is
what the full profile is built from, so the two agree to the last bit.
"""

from __future__ import annotations

from modelcarve.plan.cost import comm
from modelcarve.plan.cost.activations import kv_heads_per_rank
from modelcarve.plan.cost.efficiency import gemm_time_s, memory_bound_time_s
from modelcarve.plan.cost.offload import host_link_bytes_per_s, offload_split
from modelcarve.plan.train.layer import layer_base, layer_cost
from modelcarve.spec.errors import LayoutError

_GEMM_DTYPE = {"fp8cs": "fp8", "mxfp8": "fp8"}
"""Compute keys whose GEMMs run at another dtype's peak (MXFP8 and current scaling: the FP8 rate)."""

LOGITS_BYTES_PER_ELEM = 6.0
"""Bytes per logit on the last stage with Megatron-Core's unfused cross entropy
(``tensor_parallel.vocab_parallel_cross_entropy``): the bf16 logits and ONE fp32 copy, in which the
max is subtracted, exponentiated and normalised in place, so it is also the softmax saved for
backward and, in place again, the gradient; the backward's peak is that gradient beside its bf16
cast, 6 again. Measured: 6.01 with Megatron-Core 0.15.3 itself (torch's MemTracker, CPU; the
profiler's allocation events 6.009; tests/plan/test_loss_memory.py,
benchmarks/results/megatron_loss_memory.json). Was 10 (an fp32 copy and a separate fp32 softmax),
never measured."""
LOSS_KINDS = ("materialized", "fused", "chunked", "torch")
FUSED_LOGITS_BYTES_PER_ELEM = 2.0
"""Megatron's fused cross entropy as the Megatron-Bridge performance recipes run it
(``cross_entropy_loss_fusion=True``, ``cross_entropy_fusion_impl="te"``: scripts/performance
``set_common_perf_overrides``, v0.2.x): Transformer Engine's ``parallel_cross_entropy``, Triton
kernels that read the bf16 logits in fp32 registers, write the softmax gradient into them in
place (bf16) and save them for backward, which scales them in place: the bf16 logits alone,
plus 16 bytes a token (fp32 loss and max / sum / target logit; 12 more a tp rank under TP, the
all-gather). Read from TE 2.8-2.12's code (Triton: it cannot run on the CPU). Megatron-Core's
NATIVE fused path (``cross_entropy_fusion_impl="native"``, Megatron-Core's default) is not this:
it is the unfused arithmetic in ``torch.compile``'d pieces, 6.01 bytes per logit run eagerly and
10.0 compiled by inductor on the CPU (its compiled gradient function copies the saved fp32
softmax before updating it; benchmarks/results/megatron_loss_memory.json)."""
CHUNKED_BYTES_PER_LOGIT = 14.0
"""Bytes per logit of one chunk of the chunked loss, as torchtitan's ``ChunkedLossWrapper`` runs
it: each chunk's output projection, loss (torch's cross entropy on the chunk's logits cast to
fp32) and, at once, its backward; the peak is in that backward, which holds the chunk's bf16
logits (still referenced by the loop) beside the 12 bytes of the torch loss's backward (the saved
fp32 log-softmax, the NLL and log-softmax gradients). Measured: 14.03 with torchtitan 0.3.0 itself
(torch's MemTracker, CPU; benchmarks/torchtitan_chunked_loss_memory.py,
tests/plan/test_loss_memory.py). Liger's fused linear cross entropy chunks the same way (gradients
computed in the forward, chunk by chunk) but is not measured here. Was 10, never measured."""
CHUNKED_TP_BYTES_PER_LOGIT = 18.0
"""``CHUNKED_BYTES_PER_LOGIT`` under TP (torchtitan's loss parallel, vocabulary-sharded chunk
logits): derived, not measured, from two measurements: DTensor's ``loss_parallel`` holds 16 bytes a
local logit where torch's plain loss holds 12 (``LOSS_BYTES_PER_LOGIT``), and the chunked loop adds
the chunk's bf16 logits (2) to the plain loss's 12."""
CHUNKED_BYTES_PER_TOKEN_HIDDEN = 6.0
"""Bytes per token and hidden unit the chunked loss holds beside its chunk: the chunks of the
hidden states, contiguous bf16 copies made up front (2), and the fp32 accumulator of their
gradient (4). Measured with the same torchtitan step: 6.03 (was 4: the accumulator alone)."""
LOSS_BYTES_PER_LOGIT = {
    "materialized": LOGITS_BYTES_PER_ELEM,
    "fused": FUSED_LOGITS_BYTES_PER_ELEM,
    # torch's F.cross_entropy on the logits cast to fp32, the bf16 logits freed before backward
    # (torchtitan's train step: ``del pred``): the peak is in the loss's backward, beside the
    # fp32 log-softmax it saved: the NLL gradient and the log-softmax gradient, fp32 each
    "torch": 12.0,
    # "torch" under TP: DTensor's loss_parallel, which torchtitan turns on with TP (logits sharded
    # over the vocabulary); its log-softmax backward is decomposed, exp(output) a fourth fp32 tensor
    "torch-parallel": 16.0,
}
"""Peak bytes of the loss side per (local) logit of a micro-batch, by ``TrainOptions.loss``
(except ``chunked``, per chunk: ``CHUNKED_BYTES_PER_LOGIT``; ``torch-parallel`` is ``torch`` with
tp > 1). The torch figures are measured with torch's own ``MemTracker`` over the step as
torchtitan writes it, ``materialized`` with Megatron-Core's own loss over the step as its GPT
model runs it (tests/plan/test_loss_memory.py); ``fused`` is read from TE's kernels. They coexist
with every saved activation (the loss runs at the end of the forward)."""

_PER_LAYER_SUMS = (
    "compute_s", "recompute_s", "fwd_s", "bwd_s", "tp_s", "tp_total_s", "cp_s", "cp_total_s", "ep_s", "tp_bytes", "tp_nic", "cp_bytes", "cp_nic",
    "ep_bytes", "ep_nic", "act_bytes",
)
_DETAIL_SUMS = tuple(k for k in _PER_LAYER_SUMS if k not in ("compute_s", "fwd_s", "bwd_s", "tp_s", "cp_s", "ep_s", "act_bytes"))
"""Per-stage sums only the full estimate reads: a profile gets them when a finalist is reported
(``_complete``), not when the search screens it (the screen reads the other seven)."""


def cp_ring_bytes(model, T: float, tp: int, cp: int) -> float:
    """Transient bytes of one layer's ring attention under context parallelism (Transformer Engine's
    ``AttnFuncWithCPAndKVP2P``, Megatron's default ``cp_comm_type`` p2p), for ``T`` local tokens:
    the forward keeps every K+V chunk it receives until the layer's attention ends (``cp`` chunks:
    its list of ``cp_size`` receive buffers), the backward two send / receive buffers each holding
    a K+V chunk and its gradient (4 chunks) and a dQ buffer; the larger of the two. A chunk is the
    local tokens' K and V in bf16 (``kv_heads_per_rank`` heads: MLA's are per head, GQA's shared).
    torch's ``context_parallel`` (torchtitan) all-gathers the ``cp`` chunks by default: the forward
    term again. Checked in the torchtitan rows (long sequences, CP 2-8): -6.3..-6.8% -> -5.0..-5.4%."""
    heads = kv_heads_per_rank(model, tp)
    kv = 2.0 * T * heads * (model.qk_head_dim + model.attn_v_head_dim)
    q = 2.0 * T * model.num_heads / tp * model.qk_head_dim
    return max(cp * kv, 4.0 * kv + q)


class ProfileMixin:
    """Stage profiles of a ``TrainCostModel`` (see the module doc)."""

    _buffer_sizes: dict | None = None
    """``screen_buffers``' results by what they read, made on first use (per cost model)."""

    def profile(self, tp: int, cp: int, pp: int, dp: int, ep: int, mbs: int, sp: bool, recompute: str, seq: int,
                dtype: str = "bf16", etp: int = 0, v: int = 1) -> dict:
        """Compute and memory of every stage kind for one micro-batch (GEMMs at ``dtype``'s peak:
        a param_dtype, or ``fp8cs`` for FP8 with current scaling; ``etp`` expert TP, 0 = tp;
        ``v`` virtual stages per pipeline rank)."""
        etp = etp or tp
        key = (tp, cp, pp, dp, ep, mbs, sp, recompute, seq, dtype, etp, self.split_id(pp, v))
        prof = self._profiles.get(key)
        if prof is None:
            self._dtype = dtype
            prof = self._profiles[key] = self._build_profile(tp, cp, pp, dp, ep, mbs, sp, recompute, seq, etp, v)
        return prof

    def _layer_cached(self, moe: bool, tp: int, cp: int, ep: int, mbs: int, sp: bool, recompute: str, seq: int,
                      etp: int) -> dict:
        key = (moe, tp, cp, ep if moe else 1, mbs, sp, recompute, seq, self._dtype, etp if moe else tp)
        layer = self._layers.get(key)
        if layer is None:
            # the recomputation-independent part is shared by the three modes the search tries
            bkey = key[:6] + key[7:]
            base = self._layer_bases.get(bkey)
            if base is None:
                base = self._layer_bases[bkey] = layer_base(self, moe, tp, cp, ep, mbs, sp, seq, etp)
            layer = self._layers[key] = layer_cost(self, moe, tp, cp, ep, mbs, sp, recompute, seq, etp, base)
        return layer

    def _gemm(self, m: float, n: float, k: float, batch: float = 1.0, dtype: str | None = None) -> float:
        """Seconds of a GEMM at the profile's precision, or at ``dtype`` (bf16 for the GEMMs FP8
        recipes keep in bf16: attention core, router, LM head)."""
        dt = dtype or _GEMM_DTYPE.get(self._dtype, self._dtype)
        if dtype and self._dtype in ("fp32", "fp16"):
            dt = self._dtype  # a 16/32-bit run keeps its own dtype everywhere
        key = (m, n, k, batch, dt)
        t = self._gemms.get(key)
        if t is None:
            t = self._gemms[key] = gemm_time_s(self.device, m, n, k, batch, dt)
        return t

    def screen_profile(self, tp: int, cp: int, pp: int, dp: int, ep: int, mbs: int, sp: bool, recompute: str,
                       seq: int, dtype: str = "bf16", etp: int = 0, v: int = 1, keep: bool = True) -> tuple:
        """What a screen reads of ``profile(...)``, without building it: ``(t_mb, rows, buffers,
        p2p_s, n_mb, tokens, stage_sums, slow)`` (``stage_sums``: per stage, the layer sums
        ``_build_profile`` starts from; ``slow``: the index of the slowest stage). The profile is
        built from this, so the two agree to the last bit. ``keep=False``: not kept (the sweep asks
        for each once; keeping them all only lengthens a process's exit), and without the stage
        sums (None: the sweep reads the first six)."""
        etp = etp or tp
        if not keep:  # built afresh: the same numbers as a kept one (one expression, one input)
            self._dtype = dtype
            return self._build_screen_profile(tp, cp, pp, dp, ep, mbs, sp, recompute, seq, etp, v, False)
        key = (tp, cp, pp, dp, ep, mbs, sp, recompute, seq, dtype, etp, self.split_id(pp, v))
        lean = self._leans.get(key)
        if lean is None:
            self._dtype = dtype
            lean = self._leans[key] = self._build_screen_profile(tp, cp, pp, dp, ep, mbs, sp, recompute, seq, etp, v)
        return lean

    def _build_screen_profile(self, tp, cp, pp, dp, ep, mbs, sp, recompute, seq, etp, v, sums_too=True) -> tuple:
        """``screen_profile``'s tuple; ``sums_too=False``: without the stage sums (None), which only
        ``_build_profile`` reads (every other number is the same)."""
        m, o = self.model, self.options
        layers, dtype = self._layers, self._dtype  # _layer_cached's keys, looked up here first (the hot path)
        dense = layers.get((False, tp, cp, 1, mbs, sp, recompute, seq, dtype, tp))
        if dense is None:
            dense = self._layer_cached(False, tp, cp, ep, mbs, sp, recompute, seq, etp)
        if self._is_moe:
            moe = layers.get((True, tp, cp, ep, mbs, sp, recompute, seq, dtype, etp))
            if moe is None:
                moe = self._layer_cached(True, tp, cp, ep, mbs, sp, recompute, seq, etp)
        else:
            moe = dense
        h, V = m.hidden_size, m.vocab_size
        T = mbs * seq / cp
        hkey = (T, tp, self._dtype)  # the head's cost depends on nothing else: shared across pp, dp, ep, sp, recompute
        head = self._heads.get(hkey)
        if head is None:
            head = self._head(T, tp, hkey)
        head_s, logits_bytes = head[2], head[3]
        d_c, d_t, d_cp, d_e, d_a, d_w = (dense["compute_s"], dense["tp_s"], dense["cp_s"], dense["ep_s"],
                                         dense["act_bytes"], dense["work_bytes"])
        m_c, m_t, m_cp, m_e, m_a, m_w = moe["compute_s"], moe["tp_s"], moe["cp_s"], moe["ep_s"], moe["act_bytes"], moe["work_bytes"]
        sums, rows = ([] if sums_too else None), []
        t_mb, slow = -1.0, 0
        off = self._offload
        stages = self._stage_params.get((tp, pp, ep, etp, v)) or self.stage_params(tp, pp, ep, etp, v)
        for i, (kind, index, n_moe, _pd, _pe, _layer, _lin, nls) in enumerate(stages):
            n_dense = nls - n_moe
            last = kind == "last" or kind == "only"
            compute_s = d_c * n_dense + m_c * n_moe
            if last:
                compute_s += head_s
            tp_s, cp_s, ep_s = d_t * n_dense + m_t * n_moe, d_cp * n_dense + m_cp * n_moe, d_e * n_dense + m_e * n_moe
            act_bytes = d_a * n_dense + m_a * n_moe
            if off:
                act_bytes, _moved, exposed = self._offloaded(act_bytes, nls, compute_s, pp)
                compute_s += exposed
            work_bytes = d_w if d_w >= (m_w if n_moe else 0.0) else (m_w if n_moe else 0.0)  # max(), the first on ties
            if sums_too:
                sums.append((compute_s, tp_s, cp_s, ep_s, act_bytes, work_bytes))
            rows.append((kind, index, act_bytes, work_bytes + (logits_bytes if last else 0.0)))
            t = compute_s + tp_s + cp_s + ep_s
            if t > t_mb:  # the first slowest, as max() picks it
                t_mb, slow = t, i
        p2p_bytes, buffers = self.screen_buffers(T, tp, pp, ep, sp, cp, etp)
        if pp > 1:
            tier = self._tiers.get((pp, dp * cp * tp))
            p2p_s = comm.p2p_s(p2p_bytes, tier if tier is not None else self.tier(pp, dp * cp * tp))
        else:
            p2p_s = 0.0
        gbs = o.global_batch or mbs * dp
        return t_mb, rows, buffers, p2p_s, gbs // (mbs * dp), gbs * seq, sums, slow

    def screen_buffers(self, T: float, tp: int, pp: int, ep: int, sp: bool, cp: int, etp: int) -> tuple[float, float]:
        """(bytes of one pipeline send, the ``buffers`` of ``screen_profile``) for micro-batches of ``T``
        tokens per device (``mbs seq / cp``): the send and receive buffers, SP's gathered input, the
        MoE dispatch buffers of one micro-batch and context parallelism's ring buffers
        (``cp_ring_bytes``). The dispatch buffers hold the routed tokens a device's experts see, sent
        and combined back (bf16): ``T k etp / tp`` of them, as the expert activations count them
        (Megatron's all-to-all dispatcher all-gathers the received tokens over the expert-TP group)."""
        cache = self._buffer_sizes
        if cache is None:
            cache = self._buffer_sizes = {}
        key = (T, tp, pp > 1, ep > 1, sp, cp, etp)  # all it reads of pp and ep
        sizes = cache.get(key)
        if sizes is None:
            sizes = cache[key] = self._buffer_bytes(T, tp, pp, ep, sp, cp, etp)
        return sizes

    def _buffer_bytes(self, T: float, tp: int, pp: int, ep: int, sp: bool, cp: int, etp: int) -> tuple[float, float]:
        """``screen_buffers``' numbers, computed."""
        m, o = self.model, self.options
        h = m.hidden_size
        act = 2.0 * T * h
        p2p_bytes = act / tp if (o.scatter_gather_p2p and tp > 1) or sp else act
        buffers = (2 * p2p_bytes if pp > 1 else 0.0) + (act if sp else 0.0) + (
            2.0 * 2.0 * T * m.top_k * h * etp / tp * o.load_imbalance if m.is_moe and ep > 1 else 0.0)
        if cp > 1:
            buffers += cp_ring_bytes(m, T, tp, cp)
        return p2p_bytes, buffers

    def _head(self, T: float, tp: int, hkey: tuple) -> tuple:
        """(forward s, loss s, forward + backward + loss s, logits bytes) of the LM head + loss (last
        stage), per micro-batch of ``T`` tokens; the head stays bf16. Cached under ``hkey``.

        With ``mtp_layers`` multi-token-prediction depths (their decoder layers are the last rank's
        ``holdings``), each adds its input projection (2h -> h over T tokens, column-parallel; the
        bf16 2h-wide input it keeps for backward) and one more pass of the head and loss, whose
        logits are held beside the main ones (Megatron-Core computes every depth's loss in the
        forward); the chunked loss runs each pass's backward chunk by chunk, so its passes do not
        stack."""
        h, V = self.model.hidden_size, self.model.vocab_size
        mtp = self.options.mtp_layers
        head_fwd = (1 + mtp) * self._gemm(T, V / tp, h, 1.0, "bf16")
        loss_s = (1 + mtp) * memory_bound_time_s(self.device, 14.0 * T * V / tp)
        logits = self._logits_bytes(T, V / tp, h, tp)
        if mtp:
            head_fwd += mtp * self._gemm(T, h / tp, 2 * h, 1.0, "bf16")
            logits = logits * (1 if self.options.loss == "chunked" else 1 + mtp) + mtp * 2.0 * T * 2 * h
        head = self._heads[hkey] = (head_fwd, loss_s, 3.0 * head_fwd + loss_s, logits)
        return head

    def screen_rows(self, tp: int, cp: int, pp: int, ep: int, mbs: int, sp: bool, recompute: str, seq: int,
                    dtype: str, etp: int, v: int) -> list:
        """The ``rows`` of ``screen_profile(...)`` (per stage: kind, rank, activation bytes of one
        micro-batch, working set + logits), the same expressions without the stage times: what a
        memory verdict reads. ``etp`` resolved (not 0)."""
        self._dtype = dtype
        # the same lookups as _build_screen_profile's, written out in both: a shared helper costs
        # one more call per screen (measured, quiet: DeepSeek-V3 2048x8 cold 0.97-1.00 s -> 1.02-1.03 s)
        layers = self._layers
        dense = layers.get((False, tp, cp, 1, mbs, sp, recompute, seq, dtype, tp))
        if dense is None:
            dense = self._layer_cached(False, tp, cp, ep, mbs, sp, recompute, seq, etp)
        if self._is_moe:
            moe = layers.get((True, tp, cp, ep, mbs, sp, recompute, seq, dtype, etp))
            if moe is None:
                moe = self._layer_cached(True, tp, cp, ep, mbs, sp, recompute, seq, etp)
        else:
            moe = dense
        T = mbs * seq / cp
        hkey = (T, tp, dtype)
        head = self._heads.get(hkey)
        if head is None:
            head = self._head(T, tp, hkey)
        logits_bytes = head[3]
        d_a, d_w, m_a, m_w = dense["act_bytes"], dense["work_bytes"], moe["act_bytes"], moe["work_bytes"]
        rows = []
        off = self._offload
        stages = self._stage_params.get((tp, pp, ep, etp, v)) or self.stage_params(tp, pp, ep, etp, v)
        for kind, index, n_moe, _pd, _pe, _layer, _lin, nls in stages:
            n_dense = nls - n_moe
            last = kind == "last" or kind == "only"
            act_bytes = d_a * n_dense + m_a * n_moe
            if off:
                compute_s = dense["compute_s"] * n_dense + moe["compute_s"] * n_moe + (head[2] if last else 0.0)
                act_bytes = self._offloaded(act_bytes, nls, compute_s, pp)[0]
            work_bytes = d_w if d_w >= (m_w if n_moe else 0.0) else (m_w if n_moe else 0.0)  # as _build_screen_profile
            rows.append((kind, index, act_bytes, work_bytes + (logits_bytes if last else 0.0)))
        return rows

    def _offloaded(self, act_bytes: float, layers: int, compute_s: float, pp: int) -> tuple:
        """``offload_split`` of one stage under ``TrainOptions.offload_layers`` (plan/cost/offload.py)."""
        if pp > 1:
            raise LayoutError(f"activation offload (offload_layers={self._offload}) runs without pipeline "
                              f"parallelism only, as Megatron-Core requires: use pp=1 or drop the offload")
        return offload_split(act_bytes, layers, self._offload, compute_s, host_link_bytes_per_s(self.device))

    def _build_profile(self, tp, cp, pp, dp, ep, mbs, sp, recompute, seq, etp, v) -> dict:
        m, o = self.model, self.options
        t_mb, rows, buffers, p2p_s, n_mb, tokens, sums, slow_i = self.screen_profile(
            tp, cp, pp, dp, ep, mbs, sp, recompute, seq, self._dtype, etp, v)
        dense = self._layer_cached(False, tp, cp, ep, mbs, sp, recompute, seq, etp)
        moe = self._layer_cached(True, tp, cp, ep, mbs, sp, recompute, seq, etp) if m.is_moe else dense
        h = m.hidden_size
        T = mbs * seq / cp
        head_fwd, loss_s, _head_s, logits_bytes = self._heads[(T, tp, self._dtype)]
        stages = {}
        params = self.stage_params(tp, pp, ep, etp, v)
        for (kind, index, n_moe, params_dense, params_exp, layer, _lin, nls), (compute_s, tp_s, cp_s, ep_s, act_bytes,
                                                                               work_bytes) in zip(params, sums):
            n_dense = nls - n_moe
            last = kind in ("last", "only")
            # the sums the screen reads (the same expression as _complete's for the others)
            stage = {
                "compute_s": compute_s,
                "fwd_s": dense["fwd_s"] * n_dense + moe["fwd_s"] * n_moe,
                "bwd_s": dense["bwd_s"] * n_dense + moe["bwd_s"] * n_moe,
                "tp_s": tp_s,
                "cp_s": cp_s,
                "ep_s": ep_s,
                "act_bytes": act_bytes,
                "offloaded_bytes": (self._offloaded(dense["act_bytes"] * n_dense + moe["act_bytes"] * n_moe, nls,
                                                    dense["compute_s"] * n_dense + moe["compute_s"] * n_moe
                                                    + (_head_s if last else 0.0), pp)[1] if self._offload else 0.0),
            }
            if last:
                stage["fwd_s"] += head_fwd
                stage["bwd_s"] += 2 * head_fwd + loss_s
            stage.update(
                index=index,
                layers=nls,
                moe_layers=n_moe,
                params_dense=params_dense,
                params_expert=params_exp,
                work_bytes=work_bytes,
                logits_bytes=logits_bytes if last else 0.0,
                layer_params=layer,
                linear_params=_lin,
            )
            stages[kind] = stage
        act = 2.0 * T * h
        p2p_bytes = act / tp if (o.scatter_gather_p2p and tp > 1) or sp else act
        pp_tier = self.tier(pp, dp * cp * tp)
        return {
            "stages": stages,
            "rows": rows,
            "slow": list(stages.values())[slow_i],
            "t_mb": t_mb,
            "n_mb": n_mb,
            "tokens": tokens,
            "key": (tp, cp, pp, dp, ep, mbs, sp, recompute, etp, v),
            "dense": dense,
            "moe": moe,
            "p2p_s": p2p_s,
            "p2p_bytes": p2p_bytes if pp > 1 else 0.0,
            "p2p_nic": p2p_bytes if pp > 1 and pp_tier.members_per_node else 0.0,
            "buffers": buffers,
            "dp": {},
        }

    @staticmethod
    def _complete(prof: dict) -> None:
        """Add to each stage of ``prof`` the per-layer sums only the full estimate reads (``_DETAIL_SUMS``)."""
        if prof.get("complete"):
            return
        dense, moe = prof["dense"], prof["moe"]
        for stage in prof["stages"].values():
            n_moe = stage["moe_layers"]
            n_dense = stage["layers"] - n_moe
            for key in _DETAIL_SUMS:
                stage[key] = dense[key] * n_dense + moe[key] * n_moe
        prof["complete"] = True

    def _logits_bytes(self, T: float, v_local: float, h: int, tp: int = 1) -> float:
        """Loss-side memory of one micro-batch on the last stage (``TrainOptions.loss``): the
        whole logits with fp32 copies (``LOSS_BYTES_PER_LOGIT``: Megatron's unfused loss, torch's
        cross entropy, DTensor's loss_parallel), the fused (TE) loss's bf16 logits, or one chunk's
        logits plus the hidden states' chunk copies and the fp32 gradient the chunked loss
        accumulates (torchtitan's ``ChunkedLossWrapper``)."""
        loss = self.options.loss
        if loss == "chunked":
            o = self.options
            chunk = T / o.loss_chunks if o.loss_chunks else min(T, o.loss_chunk)
            per_logit = CHUNKED_TP_BYTES_PER_LOGIT if tp > 1 else CHUNKED_BYTES_PER_LOGIT
            return per_logit * chunk * v_local + CHUNKED_BYTES_PER_TOKEN_HIDDEN * T * h
        if loss == "torch" and tp > 1:
            loss = "torch-parallel"
        return LOSS_BYTES_PER_LOGIT[loss] * T * v_local
