"""Attention over the paged KV cache, installed into the reference model's attention modules.

A step's tokens (from several sequences: prefill chunks and single decode tokens) run through
the model packed as one batch row ``[1, T, H]`` with their absolute positions. ``StepContext``
describes the packing (padded to a ``StepShape`` when bucketed, below): per sequence its queries
(``q_len`` tokens at positions ``start .. start + q_len - 1``) and its context (``ctx_len = start + q_len`` tokens, all in the
cache once this step's k/v are written), the slot of every new token, and every sequence's
block table padded to the longest with block 0 (``block_index``). It is built with a few tensor
operations per step (no per-position Python lists).

Each attention call (``install(chunk, cache)`` sets ``attn.kv_cache`` on every layer; the model
file only calls it instead of its own core attention):

1. writes the new tokens' k/v (MLA: normalised latent and rotated k_rot) into their slots;
2. gathers each sequence's context from the cache ``[n, L, ...]`` as whole blocks (one
   ``index_select`` of block-sized rows per stored tensor and layer; ``L`` = the longest context
   rounded up to a block, or -- unbucketed -- exactly the context for a single sequence), and its queries
   ``[n, Q, ...]`` (a decode-only step, one query per sequence, needs no gather: a view);
3. runs ``scaled_dot_product_attention`` with a boolean mask per sequence: key ``j`` is visible to a
   query at position ``p`` when ``j <= p`` and, for a sliding-window layer, ``j > p - window``
   (transformers' rule), so keys past a sequence's context (block padding) are never seen;
   padded queries see key 0 only, and are dropped;
4. returns ``[1, heads, T, d_v]`` in the packed order, as the model's core attention would.

On a decode step of a fused block (``PagedGQA.packed``) over an fp32 / bf16 cache, steps 2-3 are
instead one call of the engine's native kernel (native.py ``decode_attention``, where it is built):
each sequence's keys and values read in place through its block table, the same fp32 arithmetic.

Step shapes (``bucket`` / ``StepShape``; ``StepContext(..., buckets=True)``, the engine's default):
a step runs with its sizes padded to a fixed set (1, 2, 4, 8, 16, 32, then 48, 64, 96, 128, 192,
...: powers of two and, from 32, the 1.5x between them), so
the native kernels' per-shape caches (oneDNN's primitives, the allocator's sizes) see a bounded set
of shapes however long the server runs -- what CUDA-graph capture sizes do for vLLM. Padded are
the packed token count (extra tokens at position 0 write the scratch slot 0 of block 0, which no
request owns, and skip attention; a decode step pads with one-token sequences instead), the
sequences (empty ones), the longest chunk (queries that see key 0 only), the block-table width
(block 0, keys masked) and the rows through the LM head (a repeated row). Padding comes after
every real row and is dropped before anything returns: a request's tokens do not change.

MLA recomputes the keys and values of the whole context from the cached latent (``wkv_b``),
the same (non-absorbed) arithmetic the reference model does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from modelcarve.runtime.engine import native
from modelcarve.runtime.engine.quant import KV_KINDS as KV_QUANT

BUCKET_FINE = 32
"""Up to here the buckets are the powers of two; above, also 1.5x each power of two."""


def bucket(n: int) -> int:
    """The smallest step size >= ``n`` in the fixed set (see module doc); ``bucket(0) == 0``."""
    if n < 0:
        raise ValueError(f"a step size must be >= 0, got {n}")
    p = 1
    while p < n:
        p *= 2
    return p * 3 // 4 if p > BUCKET_FINE and n <= p * 3 // 4 else (p if n else 0)


class StepShape(NamedTuple):
    """One forward's padded sizes (``StepShape.of``); equal to the real ones when not bucketed."""

    tokens: int
    """Rows of the packed batch (the linears' M)."""
    seqs: int
    """Sequences of the attention (a decode step: ``== tokens``)."""
    queries: int
    """Query rows per sequence (1 in a decode step)."""
    blocks: int
    """Block-table width (keys: ``blocks x block_size``)."""

    @classmethod
    def of(cls, q_lens: list[int], ctx_blocks: int, buckets: bool = True) -> "StepShape":
        """For sequences of ``q_lens`` new tokens whose longest context spans ``ctx_blocks`` blocks."""
        n, t, q = len(q_lens), sum(q_lens), max(q_lens)
        if not buckets:
            return cls(t, n, q, ctx_blocks)
        if q == 1:  # decode: one token per sequence, the padding too
            return cls(bucket(n), bucket(n), 1, bucket(ctx_blocks))
        return cls(bucket(t), bucket(n), bucket(q), bucket(ctx_blocks))


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, memo: dict) -> torch.Tensor:
    """[n, 1, Q, L] True where query position ``q_pos [n, Q]`` may see key position ``k_pos [L]``:
    causal, and within ``window`` when one is set; made once per window into ``memo``."""
    if window not in memo:
        q, k = q_pos[:, :, None], k_pos[None, None, :]
        allowed = k <= q
        if window is not None:
            allowed = allowed & (k > q - window)
        memo[window] = allowed[:, None]
    return memo[window]


class StepContext:
    """The packing of one forward's tokens (see module doc). ``seqs``: (start, q_len, block_table);
    ``buckets``: run at the padded ``StepShape`` (real rows first, padding after)."""

    def __init__(self, seqs: list[tuple[int, int, list[int]]], block_size: int, device="cpu", buckets: bool = False):
        bs = block_size
        real = sum(q for _, q, _ in seqs)
        need_blocks = -(-max(s + q for s, q, _ in seqs) // bs)
        shape = StepShape.of([q for _, q, _ in seqs], need_blocks, buckets)
        # padding sequences: one-token ones at position 0 (decode), else empty ones
        n_real = len(seqs)
        seqs = list(seqs) + [(0, 1 if shape.queries == 1 else 0, [])] * (shape.seqs - len(seqs))
        n = len(seqs)
        starts = [s for s, _, _ in seqs]
        q_lens = [q for _, q, _ in seqs]
        ctx = [s + q for s, q in zip(starts, q_lens)]
        l_max, q_max = max(ctx), shape.queries
        nb = shape.blocks
        rows = []
        for (_, _, table), c in zip(seqs, ctx):
            row = table[:-(-c // bs)]  # a padding sequence's is empty: block 0
            rows.append(row + [0] * (nb - len(row)))
        tables = torch.tensor(rows, dtype=torch.long, device=device)             # [n, nb]
        start_t = torch.tensor(starts, dtype=torch.long, device=device)
        self.decode = q_max == 1
        self.num_tokens = t = shape.tokens
        self.real_tokens = real
        if self.decode:  # one query per sequence: token i is sequence i
            self.positions = start_t
            slots = tables.gather(1, (start_t // bs)[:, None])[:, 0] * bs + start_t % bs
            self.q_pos = start_t[:, None]
            self.q_index = self.q_valid = None
        else:
            q_len_t = torch.tensor(q_lens, dtype=torch.long, device=device)
            offsets = torch.cumsum(q_len_t, 0) - q_len_t
            seq_of = torch.repeat_interleave(torch.arange(n, device=device), q_len_t)
            positions = start_t[seq_of] + torch.arange(real, device=device) - offsets[seq_of]
            slots = tables[seq_of, positions // bs] * bs + positions % bs
            if t > real:  # padding tokens: position 0, the scratch slot 0 (block 0); no attention
                positions = torch.cat([positions, positions.new_zeros(t - real)])
                slots = torch.cat([slots, slots.new_zeros(t - real)])
            self.positions = positions
            j = torch.arange(q_max, device=device)[None]
            self.q_valid = j < q_len_t[:, None]
            self.q_index = torch.where(self.q_valid, offsets[:, None] + j, 0)
            self.q_pos = torch.where(self.q_valid, start_t[:, None] + j, 0)
        self.slot_mapping = slots
        self.tables = tables
        """[n, blocks] every sequence's block table, padded with block 0."""
        self.ctx_lens = torch.tensor(ctx, dtype=torch.long, device=device) if self.decode else None
        """[n] every sequence's context length once this step's k/v are written (decode steps: the
        native decode attention's input; None otherwise)."""
        self.block_index = tables.view(-1)
        self.num_seqs = n
        first = rows[0][0]
        used = -(-ctx[0] // bs)
        self.run = first if n == 1 and rows[0][:used] == list(range(first, first + used)) else None
        """One sequence whose blocks are consecutive from block ``run``: its keys are a view of the
        store (``keys``), no gather; the padding blocks after its own (keys masked) are the next ones."""
        # one sequence, unbucketed: its keys are the (contiguous) prefix of the gathered blocks
        self.key_len = l_max if n == 1 and not buckets else nb * bs
        self.k_pos = torch.arange(self.key_len, device=device)
        self.decode_one = n == 1 and t == 1 and self.key_len == l_max
        self._masks: dict = {}
        self.groups = _length_groups(ctx[:n_real], rows, bs, buckets, device, n - n_real) \
            if self.decode and (n_real > 1 or n > n_real) else None
        """Decode steps of sequences of very different lengths: ``DecodeGroup``s of rows whose keys
        are gathered and attended at their own (bucketed) length (None: one group, the whole step)."""

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[n, 1, Q, L] True where a query may attend a key (None: all keys, one decoding sequence
        whose context fits the window)."""
        if self.decode_one and (window is None or self.k_pos.numel() <= window):
            return None
        return _visible(self.q_pos, self.k_pos, window, self._masks)

    def keys(self, store, name: str) -> torch.Tensor:
        """[n, L, ...] the context of every sequence from ``store`` (one gather of whole blocks)."""
        if self.run is not None and store.kind not in KV_QUANT:
            data = store.data[name]
            bs = store.block_size
            if (self.run * bs + self.key_len) <= data.shape[0]:
                out = data[self.run * bs:self.run * bs + self.key_len][None]
                return out if out.dtype == store.dtype else out.to(store.dtype)
        out = store.gather_blocks(name, self.block_index, self.num_seqs)
        return out[:, :self.key_len] if out.shape[1] != self.key_len else out

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """[1, heads, T, d] packed -> [n, heads, Q, d] per sequence."""
        if self.decode:
            return x[0].transpose(0, 1)[:, :, None]
        return x[0].transpose(0, 1)[self.q_index].permute(0, 2, 1, 3)

    def queries_rows(self, q: torch.Tensor) -> torch.Tensor:
        """[T, heads, d] packed rows -> [n, heads, Q, d] per sequence."""
        if self.decode:
            return q[:, :, None]
        return q[self.q_index].permute(0, 2, 1, 3)

    def pack_rows(self, out: torch.Tensor) -> torch.Tensor:
        """[n, heads, Q, d] -> [T, heads * d] (valid queries, packed order; padding rows zero)."""
        if self.decode:
            return out[:, :, 0].reshape(out.shape[0], -1)
        out = out.permute(0, 2, 1, 3)[self.q_valid]                              # [real, heads, d]
        if self.num_tokens > self.real_tokens:
            out = torch.cat([out, out.new_zeros(self.num_tokens - self.real_tokens, *out.shape[1:])])
        return out.reshape(out.shape[0], -1)

    def pack(self, out: torch.Tensor) -> torch.Tensor:
        """[n, heads, Q, d] -> [1, heads, T, d] (valid queries, packed order)."""
        if self.decode:
            return out[:, :, 0].transpose(0, 1)[None]
        out = out.permute(0, 2, 1, 3)[self.q_valid]                              # [real, heads, d]
        if self.num_tokens > self.real_tokens:  # padding tokens' rows: zeros
            out = torch.cat([out, out.new_zeros(self.num_tokens - self.real_tokens, *out.shape[1:])])
        return out.permute(1, 0, 2).unsqueeze(0)


GROUP_COST = 512
"""A decode step's sequences are attended in length groups (``_length_groups``) when a group saves
more than this many padded (sequence x key) pairs: about what one more set of attention calls
per layer costs (a few small ops, ~10-20 us on one CPU thread; SDPA ~0.1 us per pair)."""
MAX_GROUPS = 3


class DecodeGroup:
    """Some of a decode step's sequences, attended together at their own key length."""

    def __init__(self, rows: list[int], block_rows: list[list[int]], ctx: list[int], blocks: int, bs: int, device):
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)
        """The group's sequences (= their rows: a decode step has one token per sequence)."""
        self.n = len(rows)
        self.block_index = torch.tensor([r[:blocks] + [0] * (blocks - len(r[:blocks])) for r in block_rows],
                                        dtype=torch.long, device=device).view(-1)
        """Their block tables, ``blocks`` wide, flattened."""
        self.key_len = blocks * bs
        self.q_pos = torch.tensor(ctx, dtype=torch.long, device=device)[:, None] - 1
        self.k_pos = torch.arange(self.key_len, device=device)
        self._masks: dict = {}

    def mask(self, window: int | None) -> torch.Tensor:
        """[n, 1, 1, key_len], ``StepContext.mask``'s rule."""
        return _visible(self.q_pos, self.k_pos, window, self._masks)


def _length_groups(ctx: list[int], rows: list[list[int]], bs: int, buckets: bool, device,
                   padding: int = 0) -> list | None:
    """Partition a decode step's real sequences (context lengths ``ctx``, padded block rows
    ``rows``) into up to ``MAX_GROUPS`` groups of similar (bucketed) key length, longest first,
    when a new group saves more than ``GROUP_COST`` padded (sequence x key) pairs; None when one
    group of all rows is best. Padding rows (``padding`` of them, after the real ones) are in no
    group: their attention output is zero (one group of the real rows only, when that saves as much)."""
    width = [bucket(-(-c // bs)) if buckets else -(-c // bs) for c in ctx]
    order = sorted(range(len(ctx)), key=lambda i: -width[i])
    groups = [[order[0]]]
    for at in range(1, len(order)):
        i = order[at]
        top = width[groups[-1][0]]
        # a new group from here: every remaining sequence is at most this wide
        if width[i] != top and len(groups) < MAX_GROUPS and (top - width[i]) * bs * (len(order) - at) > GROUP_COST:
            groups.append([i])
        else:
            groups[-1].append(i)
    if len(groups) == 1 and padding * width[order[0]] * bs <= GROUP_COST:
        return None
    return [DecodeGroup(g, [rows[i] for i in g], [ctx[i] for i in g], width[g[0]], bs, device) for g in groups]


UPCAST = (torch.bfloat16, torch.float16)
"""On the CPU, attention over these dtypes runs in fp32 (see ``_attend``)."""


def _attend(q, k, v, mask, scale):
    """SDPA; GQA without copying k/v (``enable_gqa``). ``mask`` None: every key is visible.

    bf16 / fp16 on the CPU: q, k, v are cast to fp32 and the result back. torch's CPU flash kernel
    in bf16 was measured here ~8x slower than in fp32 at decode shapes (16 sequences x 256 keys:
    3.7 ms against 0.43 ms, the casts 0.1 ms each; 4x at one sequence), and the fp32 result is the
    more exact one (the bf16 kernel rounds the probabilities to bf16 before ``P V``)."""
    if q.dtype in UPCAST and q.device.type == "cpu":
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


class PagedGQA:
    """``attn.kv_cache`` for runtime.model.Attention: (q, k, v) -> out (see module doc)."""

    def __init__(self, cache, key: str, attn):
        self.cache, self.store = cache, cache.layers[key]
        self.scale, self.window = attn.core_attention.scale, attn.core_attention.window

    def _grouped(self, ctx, q):
        """A decode step in length groups (``StepContext.groups``): q [T, heads, d] -> [T, heads, d]."""
        out = torch.zeros_like(q)
        for g in ctx.groups:
            keys = self.store.gather_blocks("k", g.block_index, g.n).permute(0, 2, 1, 3)
            values = self.store.gather_blocks("v", g.block_index, g.n).permute(0, 2, 1, 3)
            got = _attend(q.index_select(0, g.rows)[:, :, None], keys, values, g.mask(self.window), self.scale)
            out.index_copy_(0, g.rows, got[:, :, 0])
        return out

    def __call__(self, q, k, v):
        ctx = self.cache.ctx
        self.store.write("k", ctx.slot_mapping, k[0].transpose(0, 1))
        self.store.write("v", ctx.slot_mapping, v[0].transpose(0, 1))
        if ctx.groups is not None:
            return self._grouped(ctx, q[0].transpose(0, 1)).transpose(0, 1)[None]
        keys = ctx.keys(self.store, "k").permute(0, 2, 1, 3)
        values = ctx.keys(self.store, "v").permute(0, 2, 1, 3)
        out = _attend(ctx.queries(q), keys, values, ctx.mask(self.window), self.scale)
        return ctx.pack(out)

    def packed(self, q, k, v):
        """The same on packed rows (engine/fused.py): q [T, heads, d], k/v [T, kv_heads, d] ->
        [T, heads * d]."""
        ctx = self.cache.ctx
        self.store.write("k", ctx.slot_mapping, k)
        self.store.write("v", ctx.slot_mapping, v)
        if ctx.decode and self.store.kind not in KV_QUANT and native.attention_fits(q, self.store.data["k"]):
            # the native kernel reads each sequence's keys through its block table: no gather, no mask
            scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
            return native.decode_attention(q, self.store.data["k"], self.store.data["v"], ctx.tables, ctx.ctx_lens,
                                           self.store.block_size, self.window, scale)
        if ctx.groups is not None:
            return self._grouped(ctx, q).reshape(q.shape[0], -1)
        keys = ctx.keys(self.store, "k").permute(0, 2, 1, 3)
        values = ctx.keys(self.store, "v").permute(0, 2, 1, 3)
        out = _attend(ctx.queries_rows(q), keys, values, ctx.mask(self.window), self.scale)
        return ctx.pack_rows(out)


class PagedMLA:
    """``attn.kv_cache`` for runtime.model.MLAttention: (attn, q, latent, k_rot) -> out."""

    def __init__(self, cache, key: str, attn):
        self.cache, self.store = cache, cache.layers[key]
        self.scale, self.window = attn.core_attention.scale, attn.core_attention.window

    def __call__(self, attn, q, latent, k_rot):
        ctx = self.cache.ctx
        self.store.write("latent", ctx.slot_mapping, latent[0])
        self.store.write("k_rot", ctx.slot_mapping, k_rot[0, 0])
        lat = ctx.keys(self.store, "latent")                  # [n, L, r]
        rot = ctx.keys(self.store, "k_rot")                   # [n, L, rope]
        n, length = lat.shape[:2]
        kv = attn.wkv_b(lat).view(n, length, -1, attn.nope + attn.v_dim)
        k_pass, v = kv.split([attn.nope, attn.v_dim], dim=-1)
        k = torch.cat((k_pass, rot[:, :, None].expand(-1, -1, k_pass.shape[2], -1)), dim=-1)
        out = _attend(ctx.queries(q), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), ctx.mask(self.window), self.scale)
        return ctx.pack(out)


def install(chunk, cache) -> None:
    """Point every attention module of ``chunk`` at ``cache`` (a kv_cache.KVCache)."""
    for key, block in chunk.layers.items():
        attn = block.attention
        attn.kv_cache = (PagedMLA if hasattr(attn, "kv_lora_rank") else PagedGQA)(cache, key, attn)
