"""One rank's model for generation: build it for a layout, and run a step's plan through it.

``ModelRunner(model, layout, ...)`` on every rank: loads the weights (a checkpoint slice by slice,
or a catalogue model's seeded random weights), applies the layout through ``parallelize`` (TP,
the pipeline split, EP; DP replicas are whole copies), swaps quantised weights in
(runtime/engine/quant.py) -- or, for fp32 / bf16 weights on CPU, gives the layers' and the head's
linears a packed copy made once at load (``PackedLinear``, fused.py: for the native kernels
of native.py where they are built, else oneDNN's layout; when it fits in a quarter of free memory)
--, sizes and allocates the paged KV cache (kv_cache.py; the block count is the minimum over
ranks), installs paged attention (paged_attention.py) and runs the layers that qualify as fused
blocks (fused.py ``FusedBlock``: one packed linear for q|k|v and one for w1|w3,
cos/sin from a table made at load).

``execute(plan)`` runs one engine step on this rank. ``plan`` is a ``StepPlan`` (step_plan.py):
per DP replica, a ``StepItem`` (token_ids, start, block_table, sample, logprob rows) per scheduled chunk. A
replica's ranks run only its items:

* pipeline (pp > 1): one plan is one micro-batch (per replica) and the engine keeps up to ``pp``
  of them, of disjoint requests, in flight across its steps: rank 0 sends each plan point to
  point (``send_plan`` / ``recv_plan``, no broadcast that would wait for the busy stages), runs
  stage 0 (``launch``) and sends the hidden states on (``isend``); each next stage receives, runs
  its layers and sends on, while stage 0 already runs the next micro-batch; rank 0 receives a
  micro-batch's logits when the engine retires it (``collect``). Every forward is recorded
  (``records``: rank, micro-batch, start and end);
* the last stage applies the final norm and the LM head to the rows that sample only, gathers
  the vocabulary-parallel logits over tp once (``full_vocab_logits``: padded ids cut off) and its
  tp-rank 0 sends them to global rank 0 (which receives them per micro-batch per replica);
* prompt logprobs (items with ``logprob_rows``, echo with logprobs): the last stage also runs the
  norm and head over those rows (a separate call, so the sampling rows' arithmetic is unchanged),
  takes the fp32 log-softmax over the full vocabulary and sends back per row only the target's
  logprob and the top-k (ids, logprobs) (``step_plan.top_and_chosen``: ``1 + 2k`` floats a row);
* tensor parallelism on CPU: the TP group's all-reduces and logit gathers go through shared
  memory when its ranks share the host (runtime/distributed/host_shm.py; ``shm`` says why not);
* expert parallelism (ep > 1, pp = 1): the MoE all-to-all spans the replicas, so a replica with
  nothing to do runs one dummy token (written to the scratch slot 0) to take part.

Bytes rank 0 broadcasts (the plan) and receives (logits) are counted in ``plan_bytes`` /
``logit_bytes``.
"""

from __future__ import annotations

import math
import pickle
from array import array
import time

import torch
import torch.distributed as dist

from modelcarve.runtime.engine.fused import PackedLinear, PackedRowParallel, RopeTable, fuse_blocks, packable_dtypes
from modelcarve.runtime.engine.kv_cache import DTYPES, KV_FRACTION, KVCache, bytes_per_token, free_memory_bytes, num_blocks_for
from modelcarve.runtime.engine.paged_attention import StepContext, StepShape, bucket, install
from modelcarve.runtime.engine.step_plan import DUMMY_ITEM, StepItem, StepPlan, top_and_chosen
from modelcarve.spec.errors import LayoutError



PLAN_TAG = 7
"""The point-to-point tag of plans (pp > 1), apart from the hidden states' and logits' tag 0."""

PLAN_FIRST = 16384
"""Bytes of a step plan's one broadcast (``ModelRunner.broadcast``): its length and the first bytes."""

RECORDS = 16384
"""Step records kept per rank (the oldest are dropped)."""


class RecordRing:
    """The last ``size`` records of the numbers ``fields`` (ints, but the ``times``), held in one
    float array allocated at start: no object per record, so the memory of a server that runs for
    days stays flat. Iterating gives dicts (with ``constant`` added to each), oldest first."""

    def __init__(self, fields: tuple[str, ...], times: tuple[str, ...], size: int = RECORDS, **constant):
        self.fields, self.times, self.size, self.constant = fields, set(times), size, constant
        self.data = array("d", bytes(8 * len(fields) * size))
        self.count = 0

    def append(self, *values: float) -> None:
        at = (self.count % self.size) * len(self.fields)
        for i, value in enumerate(values):
            self.data[at + i] = value
        self.count += 1

    def __len__(self) -> int:
        return min(self.count, self.size)

    def __iter__(self):
        width = len(self.fields)
        for k in range(self.count - len(self), self.count):
            at = (k % self.size) * width
            yield self.constant | {f: (v if f in self.times else int(v))
                                   for f, v in zip(self.fields, self.data[at:at + width])}

LOGPROB_ROWS = 256
"""Prompt-logprob rows go through the head this many at a time (bounds the [rows, V] fp32 logits)."""

PACK_FRACTION = 0.25
"""The packed copies are made only when they take at most this share of free memory."""


def _packable(mod, dtypes: tuple) -> bool:
    from modelcarve.runtime.parallel.tensor import RowParallelLinear

    return (type(mod) in (torch.nn.Linear, RowParallelLinear) and type(mod.weight) is torch.nn.Parameter
            and mod.weight.dtype in dtypes and mod.weight.device.type == "cpu")


def prepack_linears(chunk, free_bytes: int) -> int:
    """Give the plain fp32 / bf16 CPU ``nn.Linear`` of every layer's attention and MLP (MoE routers
    kept) and the LM head a packed copy (``PackedLinear``; a TP rank's row-parallel shards
    ``PackedRowParallel``, which reduces as ``RowParallelLinear`` does) when those copies fit in
    ``PACK_FRACTION`` of ``free_bytes``; returns how many. Nothing happens without oneDNN (bf16:
    without its bf16 kernels, ``packable_dtypes``)."""
    dtypes = packable_dtypes()
    if not dtypes:
        return 0
    found = []  # (owner module, attribute, linear)
    for block in chunk.layers.values():
        for part in (block.attention, block.feed_forward):
            for name, mod in part.named_modules():
                if name and "router" not in name.split(".") and _packable(mod, dtypes):
                    owner, _, leaf = name.rpartition(".")
                    found.append((part.get_submodule(owner) if owner else part, leaf, mod))
    if getattr(chunk, "output", None) is not None and _packable(chunk.output, dtypes):
        found.append((chunk, "output", chunk.output))
    if sum(mod.weight.nbytes for *_, mod in found) > PACK_FRACTION * free_bytes:
        return 0
    for owner, leaf, mod in found:
        setattr(owner, leaf, PackedLinear(mod) if type(mod) is torch.nn.Linear else PackedRowParallel(mod))
    return len(found)


def _int4_group(chunk) -> int:
    from torch import nn

    fan_in = 0
    for mod in chunk.layers.modules():
        if isinstance(mod, nn.Linear) or type(mod).__name__ == "RowParallelLinear":
            fan_in = math.gcd(fan_in, mod.weight.shape[1])
        elif type(mod).__name__ == "GroupedExperts":
            fan_in = math.gcd(fan_in, math.gcd(mod.w1.shape[-1], mod.w2.shape[-1]))
    for group in (128, 64, 32):
        if fan_in % group == 0:
            return group
    raise LayoutError(f"weight_dtype=int4 needs every matrix's fan-in divisible by 32 (gcd here {fan_in}); "
                      f"use int8 or fp8")


def _plan_messages(plan) -> list[torch.Tensor]:
    """``plan`` pickled as its messages: ``PLAN_FIRST`` bytes (the pickle's length as 8 little-endian
    bytes, then its first bytes, zero-padded), and the rest, if any, as a second message."""
    data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
    cap = PLAN_FIRST - 8
    head = torch.zeros(PLAN_FIRST, dtype=torch.uint8)
    head[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    head[8:8 + min(len(data), cap)] = torch.frombuffer(bytearray(data[:cap]), dtype=torch.uint8)
    if len(data) <= cap:
        return [head]
    return [head, torch.frombuffer(bytearray(data[cap:]), dtype=torch.uint8)]


def _plan_from(head: torch.Tensor, receive) -> "StepPlan | None":
    """The plan whose first message is ``head``; ``receive(tensor)`` fills the second, if any."""
    cap = PLAN_FIRST - 8
    n = int.from_bytes(head[:8].numpy().tobytes(), "little")
    data = head[8:8 + min(n, cap)].numpy().tobytes()
    if n > cap:
        rest = torch.empty(n - cap, dtype=torch.uint8)
        receive(rest)
        data += rest.numpy().tobytes()
    return pickle.loads(data)


class ModelRunner:
    """This rank's part of the model and its KV cache (see module doc)."""

    def __init__(self, model: str, layout, *, dtype: str, weight_dtype: str, kv_dtype: str, block_size: int = 16,
                 kv_cache_bytes: float | None = None, seed: int = 0, max_num_seqs: int = 64,
                 buckets: bool = True):
        from modelcarve.runtime.build import build_chunks

        self.layout, self.block_size, self.kv_dtype = layout, block_size, kv_dtype
        self.dtype = DTYPES[dtype]
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if self.world == 1:  # one process: the whole model (a checkpoint read whole), no parallelize
            self.mesh = None
        else:
            from modelcarve.runtime.distributed.mesh import build_mesh

            self.mesh = build_mesh(layout)
        # on the CPU in fp32 (with a mesh, a checkpoint slice by slice), cast below
        chunks, spec = build_chunks(model, layout, self.mesh, seed=seed)
        chunk = chunks[0]
        self.spec = spec
        chunk = chunk.to(self.dtype).eval()
        for p in chunk.parameters():
            p.requires_grad_(False)
        if weight_dtype not in DTYPES:
            from modelcarve.runtime.engine.quant import quantize_model

            quantize_model(chunk, weight_dtype, _int4_group(chunk) if weight_dtype == "int4" else 128)
        self.device = next(chunk.parameters()).device
        if DTYPES.get(weight_dtype) == self.dtype and self.dtype in packable_dtypes() and self.device.type == "cpu":
            prepack_linears(chunk, free_memory_bytes(self.device))
        self.chunk = chunk
        self.shm = self._attach_shm()
        """Why the TP group's collectives go through gloo (None: through shared memory, host_shm.py)."""
        self.shm_calls = 0
        """Collectives the TP group ran through shared memory (counted at ``close``)."""
        at = layout.coords(self.rank)  # the one rank order (spec/ranks.py)
        self.tp_rank, self.dp_rank, self.pp_rank = at["tp"], at["dp"], at["pp"]
        self.first = self.pp_rank == 0
        self.last = self.pp_rank == layout.pp - 1
        self.bytes_per_token = bytes_per_token(chunk, kv_dtype)
        budget = kv_cache_bytes if kv_cache_bytes else KV_FRACTION * free_memory_bytes(self.device)
        blocks = num_blocks_for(budget, block_size, self.bytes_per_token)
        if not kv_cache_bytes:  # never more than max_num_seqs full contexts can use (+ the scratch block)
            blocks = min(blocks, max_num_seqs * -(-spec.max_position // block_size) + 1)
        if self.world > 1:
            both = torch.tensor([blocks, -self.bytes_per_token], dtype=torch.int64)
            dist.all_reduce(both, op=dist.ReduceOp.MIN)
            blocks, self.max_bytes_per_token = int(both[0]), -int(both[1])
        else:
            self.max_bytes_per_token = self.bytes_per_token
        self.num_blocks = blocks
        if blocks < 2:
            raise LayoutError(f"the KV cache budget ({budget:.0f} bytes per rank) holds {blocks} blocks of "
                              f"{block_size} tokens ({self.bytes_per_token} bytes/token); give --kv-cache-bytes "
                              f"of at least {2 * block_size * self.bytes_per_token}")
        self.cache = KVCache(chunk, blocks, block_size, kv_dtype, self.dtype, self.device)
        install(chunk, self.cache)
        self.blocks = fuse_blocks(chunk)
        """Per layer: engine/fused.py's ``FusedBlock`` where the layer qualifies, else the module."""
        self.rope_table = RopeTable.make(chunk, self.dtype, self.device)
        """cos/sin rows made once (None: computed per step, e.g. dynamic rope)."""
        # MoE with a per-sequence expert capacity: padding tokens would take real tokens' places
        self.buckets = buckets and not any(getattr(m, "capacity_factor", None) for m in chunk.modules())
        """Forwards run at bucketed shapes (paged_attention.StepShape), not each step's own."""
        self.plan_bytes = 0
        self._plan_head = torch.zeros(PLAN_FIRST, dtype=torch.uint8)
        """The buffer of a plan's one broadcast (reused every step)."""
        self.logit_bytes = 0
        self.microbatches = 0
        """Forwards this rank ran."""
        self.pipelined = layout.pp > 1 and self.world > 1
        """One plan is one micro-batch and the engine keeps several in flight (``send_plan``)."""
        self.records = RecordRing(("mb", "sub", "step", "start", "end"), ("start", "end"), rank=self.rank,
                                  pp=self.pp_rank, tp=self.tp_rank, dp=self.dp_rank)
        """The step records: per forward, dict(mb, sub, step, rank, pp, tp, dp, start, end)."""

    def _attach_shm(self) -> str | None:
        """The TP group's all-reduces and gathers through shared memory where its ranks share this
        host (runtime/distributed/host_shm.py): a collective over the TP group, on every rank."""
        if self.mesh is None or self.layout.tp == 1:
            return "no tensor parallelism"
        if self.device.type != "cpu":
            return f"{self.device.type} tensors"
        from modelcarve.runtime.distributed import host_shm
        from modelcarve.runtime.distributed.mesh import axis_group, collective_timeout

        return host_shm.attach(axis_group(self.mesh, "tp"), collective_timeout().total_seconds())

    def close(self) -> None:
        """Unmap the TP group's shared segment (its collectives go through gloo again)."""
        if self.mesh is not None and self.layout.tp > 1:
            from modelcarve.runtime.distributed import host_shm
            from modelcarve.runtime.distributed.mesh import axis_group

            group = axis_group(self.mesh, "tp")
            host = host_shm.lookup(group)
            self.shm_calls += host.seq if host is not None else 0
            host_shm.detach(group)

    def output_rank(self, replica: int) -> int:
        """The rank that holds replica ``replica``'s logits: its last stage's first TP rank."""
        return self.layout.rank_of(pp=self.layout.pp - 1, dp=replica)

    # --- the plan -------------------------------------------------------------------------
    def broadcast(self, plan: StepPlan | None) -> StepPlan | None:
        """Rank 0 sends ``plan`` to all ranks (None ends the followers' loop); every rank returns it.

        One broadcast of ``PLAN_FIRST`` bytes (``_plan_messages``: the pickle's length, then up to
        ``PLAN_FIRST - 8`` of its bytes) carries any decode step's plan; only a longer one (a
        prefill of many long prompts) takes a second broadcast for the rest. (Two every step, the
        length then the bytes, cost a second gloo message a step: ~1-2 ms at tp=2 on a busy 2-core
        host.)"""
        if self.world == 1:
            return plan
        if self.rank == 0:
            for part in _plan_messages(plan):
                dist.broadcast(part, 0)
                self.plan_bytes += part.numel()
            return plan
        head = self._plan_head
        dist.broadcast(head, 0)
        return _plan_from(head, lambda rest: dist.broadcast(rest, 0))

    def send_plan(self, plan: StepPlan | None) -> list:
        """Rank 0 (pp > 1): send ``plan`` to every other rank point to point (tag ``PLAN_TAG``; the same
        one or two messages as ``broadcast``) without waiting for them: a rank still busy with an
        earlier plan takes it when it gets there. Returns the pending sends ((work, tensor) pairs;
        ``wait`` them before they are dropped)."""
        pending = []
        parts = _plan_messages(plan)
        for r in range(1, self.world):
            for part in parts:
                pending.append((dist.isend(part, r, tag=PLAN_TAG), part))
                self.plan_bytes += part.numel()
        return pending

    def recv_plan(self) -> StepPlan | None:
        """Other ranks (pp > 1): the next plan ``send_plan`` sent (None: the end of the loop)."""
        head = self._plan_head
        dist.recv(head, 0, tag=PLAN_TAG)
        return _plan_from(head, lambda rest: dist.recv(rest, 0, tag=PLAN_TAG))

    def micro_batches(self, items: list[StepItem]) -> list[list[StepItem]]:
        """How ``execute`` cuts a replica's items (the engine reads its results in this order)."""
        return self._microbatches(items)

    def _microbatches(self, items: list[StepItem]) -> list[list[StepItem]]:
        if self.pipelined or self.layout.pp == 1 or len(items) <= 1:
            return [items] if items else []
        m = min(len(items), 2 * self.layout.pp)
        total = sum(len(it.token_ids) for it in items)
        out, cur, acc = [], [], 0
        for it in items:
            cur.append(it)
            acc += len(it.token_ids)
            if acc >= total * (len(out) + 1) / m and len(out) < m - 1:
                out.append(cur)
                cur = []
        if cur:
            out.append(cur)
        return out

    @staticmethod
    def logprob_width(items: list[StepItem]) -> tuple[int, int]:
        """(prompt-logprob rows, top-k) of a micro-batch: its packed result is [rows, 1 + 2k]."""
        rows = sum(it.logprob_rows for it in items)
        return rows, max((it.top_logprobs for it in items if it.logprob_rows), default=0)

    def _prompt_logprobs(self, h: torch.Tensor, items: list[StepItem]) -> torch.Tensor | None:
        """The packed prompt logprobs [rows, 1 + 2k] of a micro-batch's logprob rows (last stage)."""
        from modelcarve.runtime.parallel.tensor import full_vocab_logits

        n, k = self.logprob_width(items)
        if not n:
            return None
        rows, targets, t = [], [], 0
        for it in items:
            if it.logprob_rows:
                rows += range(t, t + it.logprob_rows)
                targets += (list(it.token_ids[1:]) + [it.next_token])[:it.logprob_rows]
            t += len(it.token_ids)
        out = []
        for at in range(0, n, LOGPROB_ROWS):
            part = rows[at:at + LOGPROB_ROWS]
            logits = full_vocab_logits(self.chunk.output(self.chunk.norm(h[:, part])), self.chunk)[0].float()
            out.append(top_and_chosen(torch.log_softmax(logits, dim=-1),
                                      torch.tensor(targets[at:at + LOGPROB_ROWS], device=logits.device), k).cpu())
        return torch.cat(out) if len(out) > 1 else out[0]

    @torch.no_grad()
    def _forward(self, items: list[StepItem], h: torch.Tensor | None):
        """This rank's layers over one micro-batch: hidden states, or (last stage) the pair (logits
        [rows that sample, V] of the true vocabulary, packed prompt logprobs or None)."""
        from modelcarve.runtime.parallel.tensor import full_vocab_logits

        chunk = self.chunk
        ctx = StepContext([(it.start, len(it.token_ids), it.block_table) for it in items], self.block_size, self.device,
                          self.buckets)
        positions = ctx.positions
        if h is None:
            ids = [t for it in items for t in it.token_ids] + [0] * (ctx.num_tokens - ctx.real_tokens)
            ids = torch.tensor(ids, dtype=torch.long, device=self.device)[None]
            h = chunk.tok_embeddings(ids)
            if chunk.pos_embeddings is not None:
                h = h + chunk.pos_embeddings(positions)
        self.cache.ctx = ctx
        rope = self.rope_table(positions) if self.rope_table is not None and h.dtype == self.dtype \
            else chunk.rope(positions, h.dtype)
        for layer in self.blocks:
            h = layer(h, rope)
        self.cache.ctx = None
        if not self.last:
            return h
        rows, t = [], 0
        for it in items:
            t += len(it.token_ids)
            if it.sample:
                rows.append(t - 1)
        packed = self._prompt_logprobs(h, items)
        n = len(rows)
        if self.buckets and rows:  # the head at a bucketed row count too (a repeated row, cut off below)
            rows += [rows[-1]] * (bucket(n) - n)
        h = chunk.norm(h[:, rows])
        return full_vocab_logits(chunk.output(h), chunk)[0, :n].float(), packed

    def launch(self, plan: StepPlan) -> tuple[list, list]:
        """This rank's compute and sends for ``plan``: (sends still pending as (work, tensor) pairs,
        the results rank 0 holds itself when it is the last stage). Every forward is recorded in
        ``records`` (per rank, per micro-batch: start/end in ``time.monotonic()`` seconds)."""
        mine = plan.for_replica(self.dp_rank)
        dummy = not mine and self.layout.ep > 1 and bool(plan)
        if dummy:
            mine = [DUMMY_ITEM]
        pending = []
        results_here = []
        for j, mb in enumerate(self._microbatches(mine)):
            if self.first:
                h = None
            else:
                t = StepShape.of([len(it.token_ids) for it in mb], 0, self.buckets).tokens
                h = torch.empty(1, t, self.spec.hidden_size, dtype=self.dtype, device=self.device)
                dist.recv(h, self.layout.rank_of(pp=self.pp_rank - 1, dp=self.dp_rank, tp=self.tp_rank))
            start = time.monotonic()
            out = self._forward(mb, h)
            self.records.append(plan.index, j, plan.step, start, time.monotonic())
            self.microbatches += 1
            if not self.last:
                after = self.layout.rank_of(pp=self.pp_rank + 1, dp=self.dp_rank, tp=self.tp_rank)
                out = out.contiguous()
                pending.append((dist.isend(out, after), out))
            elif not dummy:
                logits, packed = out
                if self.rank == 0:
                    results_here.append((logits, packed))
                elif self.tp_rank == 0:
                    if any(it.sample for it in mb):
                        logits = logits.contiguous()
                        pending.append((dist.isend(logits, 0), logits))
                    if packed is not None:
                        packed = packed.contiguous()
                        pending.append((dist.isend(packed, 0), packed))
        return pending, results_here

    def collect(self, plan: StepPlan, results_here: list | None = None) -> list[list[tuple]]:
        """Rank 0: per replica, per micro-batch (in item order), the pair (logits of its sampling rows
        or None, its packed prompt logprobs or None), received from each replica's last stage."""
        results = []
        for replica, items in enumerate(plan.replicas):
            if replica == 0 and self.last:
                results.append(results_here or [])
                continue
            got = []
            for mb in self._microbatches(items):
                n = sum(1 for it in mb if it.sample)
                logits = packed = None
                if n:
                    logits = torch.empty(n, self.spec.vocab_size, dtype=torch.float32)
                    dist.recv(logits, self.output_rank(replica))
                    self.logit_bytes += logits.nbytes
                rows, k = self.logprob_width(mb)
                if rows:
                    packed = torch.empty(rows, 1 + 2 * k, dtype=torch.float32)
                    dist.recv(packed, self.output_rank(replica))
                    self.logit_bytes += packed.nbytes
                if logits is not None or packed is not None:
                    got.append((logits, packed))
            results.append(got)
        return results

    @staticmethod
    def wait(pending: list) -> None:
        for work, _ in pending:
            work.wait()

    def execute(self, plan: StepPlan) -> list[list[tuple]] | None:
        """Run this rank's share of ``plan`` and wait for it; rank 0 returns ``collect``'s results."""
        pending, here = self.launch(plan)
        results = self.collect(plan, here) if self.rank == 0 else None
        self.wait(pending)
        return results
