"""The generation engine loop: requests in, one scheduler step at a time, tokens out.

Interface (the server, serve/bridge.py, builds on exactly this)::

    engine = Engine(EngineConfig(model=PATH, layout="tp=2"))     # collective: every rank
    if engine.is_driver:                                          # global rank 0
        engine.add_request("r1", [1, 2, 3], SamplingParams(max_tokens=32, temperature=0))
        while engine.has_unfinished():
            for out in engine.step(): ...                         # RequestOutput per request
        engine.shutdown()                                         # ends the followers' loop
    else:
        engine.follow()

Rank 0 owns one Scheduler (and BlockManager) per DP replica; each ``step()`` asks every
replica's scheduler for its chunks, broadcasts that plan to all ranks, runs its own share
(model_runner.py), receives the logits of the sampling rows, samples (sampler.py), detokenises
incrementally, checks stops and frees finished sequences. A request with ``prompt_logprobs``
(``echo`` with ``logprobs``) gets its prompt tokens' logprobs (and top alternatives) from the
runner's packed rows; ``max_tokens=0`` computes the prompt and generates nothing ("length").
New requests go to the replica with the fewest unfinished sequences.

Pipeline parallelism (pp > 1; vLLM's one batch per pipeline stage): one plan is one micro-batch
and ``step()`` keeps up to ``pp`` in flight across steps -- it launches micro-batches (each of about
1/pp of the requests, none of them in a micro-batch still in flight: a request's next token needs
its previous one) until ``pp`` are out, running stage 0 of each itself, then retires the oldest
(receives its logits, samples): stage 0 works on micro-batch k+1 while the last stage finishes k,
and a request is scheduled again as soon as its own token is sampled. Plans go to the other ranks
point to point (a broadcast would wait for the busy stages). An abort of a request in flight takes
effect when its micro-batch is back. ``step_records()`` gives every forward's rank, micro-batch,
start and end (and rank 0's launch/retire times per micro-batch); ``stats().max_in_flight``. ``add_request`` / ``abort`` take a lock and may be called from
another thread than ``step``; call ``step()`` regularly even when idle (every ``HEARTBEAT_S`` it
sends the followers an empty plan, so they do not hit their collective timeout). Dtypes: ``weight_dtype`` / ``kv_dtype`` not stated in the layout
default to its ``param_dtype`` (``resolve_layout``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from modelcarve.runtime.engine.block_manager import BlockManager
from modelcarve.runtime.engine.sampler import SamplingParams, StopChecker, make_generator, sample
from modelcarve.runtime.engine.scheduler import Scheduler, Sequence
from modelcarve.runtime.engine.step_plan import StepPlan, unpack_tops
from modelcarve.spec.errors import ModelcarveError
from modelcarve.spec.support import check_generation

__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestOutput", "SamplingParams", "resolve_layout"]

HEARTBEAT_S = 5.0
"""An idle ``step()`` sends an empty plan this often, so followers never wait a whole collective
timeout for work (call ``step()`` regularly, e.g. every few ms, even with nothing to do)."""


def resolve_layout(layout, dtype: str | None = None):
    """(Layout, weight_dtype, kv_dtype) for generation from a Layout, a layout string or a JSON file
    path; unstated weight/kv dtypes default to param_dtype; ``dtype`` overrides param_dtype."""
    from modelcarve.spec.layout import Layout

    if isinstance(layout, Layout):
        lay, stated = layout, {"weight_dtype", "kv_dtype"}
    else:
        text = str(layout).strip()
        lay = Layout.parse(text)  # every malformed layout is refused here, in one line
        if text.startswith("{") or text.endswith(".json"):
            raw = json.loads(text if text.startswith("{") else Path(text).read_text())
            stated = set(raw["layout"] if isinstance(raw.get("layout"), dict) else raw)
        else:
            stated = {part.partition("=")[0].strip().lower().replace("-", "_") for part in text.split(",")}
    if dtype:
        lay = lay.replace(param_dtype=dtype)
    weight = lay.weight_dtype if "weight_dtype" in stated else lay.param_dtype
    kv = lay.kv_dtype if "kv_dtype" in stated else lay.param_dtype
    if lay.pp > 1 and lay.schedule != "gpipe":
        lay = lay.replace(schedule="gpipe")  # training schedules do not apply; the engine pipelines itself
    return lay, weight, kv


@dataclass
class EngineConfig:
    model: str
    layout: object = "tp=1"
    kv_cache_bytes: float | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    prefix_caching: bool = True
    dtype: str | None = None
    weight_dtype: str | None = None
    kv_dtype: str | None = None
    seed: int = 0
    step_buckets: bool = True
    """Run each step at a bucketed shape (paged_attention.StepShape): bounded native caches, same tokens."""
    timeout_s: float = 120.0
    quiet: bool = True


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list
    new_logprobs: list | None
    token_ids: list
    new_text: str
    text: str
    finished: bool
    finish_reason: str | None
    stop_reason: object
    num_prompt_tokens: int
    num_cached_tokens: int
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    logprobs: list | None = None
    """All chosen tokens' logprobs so far (when requested)."""
    new_top_logprobs: list | None = None
    """Per new token, [(id, logprob), ...] of the ``top_logprobs`` most likely (when asked)."""
    top_logprobs: list | None = None
    """The same for every generated token so far."""
    prompt_logprobs: list | None = None
    """Per prompt token, its logprob (None for the first) once the prompt is computed (when asked)."""
    prompt_top_logprobs: list | None = None
    """Per prompt token, [(id, logprob), ...] of the ``top_logprobs`` most likely (None for the first)."""


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    block_size: int
    kv_bytes_per_token: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    steps: int
    plan_bytes: int
    logit_bytes: int
    prompt_tokens: int
    generation_tokens: int
    microbatches: int = 0
    """Forwards rank 0 ran."""
    max_in_flight: int = 0
    """pp > 1: the most micro-batches in flight at once (across steps); 0 otherwise."""

    def to_dict(self) -> dict:
        return asdict(self)


class Engine:
    """See module doc."""

    def __init__(self, cfg: EngineConfig):
        from modelcarve.runtime.checkpoint.hf_load import is_checkpoint, model_spec
        from modelcarve.runtime.engine.model_runner import ModelRunner, RecordRing

        self.cfg = cfg
        layout, weight, kv = resolve_layout(cfg.layout, cfg.dtype)
        weight, kv = cfg.weight_dtype or weight, cfg.kv_dtype or kv
        spec = model_spec(cfg.model)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 or layout.world_size > 1:
            from modelcarve.runtime.distributed.mesh import init_distributed

            init_distributed(cfg.timeout_s)
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        layout = check_generation(layout, spec, weight, kv, world_size=world)
        self.layout, self.weight_dtype, self.kv_dtype = layout, weight, kv
        self.runner = ModelRunner(cfg.model, layout, dtype=layout.param_dtype, weight_dtype=weight, kv_dtype=kv,
                                  block_size=cfg.block_size, kv_cache_bytes=cfg.kv_cache_bytes, seed=cfg.seed,
                                  max_num_seqs=cfg.max_num_seqs, buckets=cfg.step_buckets)
        self.spec = self.runner.spec
        self.is_driver = self.runner.rank == 0
        self.tokenizer = None
        eos: tuple = ()
        if is_checkpoint(cfg.model) or Path(cfg.model).is_dir():
            from modelcarve.runtime.engine.tokenizer import eos_token_ids, load_tokenizer

            self.tokenizer = load_tokenizer(cfg.model) if self.is_driver else None
            eos = eos_token_ids(cfg.model, self.tokenizer)
        self.stopper = StopChecker(eos)
        self.schedulers = [Scheduler(BlockManager(self.runner.num_blocks, cfg.block_size, cfg.prefix_caching),
                                     cfg.max_num_batched_tokens, cfg.max_num_seqs) for _ in range(layout.dp)]
        self.seqs: dict[str, Sequence] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._aborted: list[str] = []
        self._lock = threading.Lock()
        self._steps = self._prompt_tokens = self._gen_tokens = 0
        self._next_key = 0
        self._last_plan = time.monotonic()
        self.pipelined = self.runner.pipelined
        self.depth = layout.pp
        """pp > 1: up to this many micro-batches of disjoint requests in flight (one per stage)."""
        self._inflight: deque = deque()  # (scheduled, plan, pending sends, launch time), oldest first
        self._max_in_flight = 0
        self._plans = self._calls = 0
        self._flights = RecordRing(("mb", "step", "launched", "retired"), ("launched", "retired"))

    # --- requests -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def context_length(self) -> int:
        return self.spec.max_position

    def check_prompt(self, n_prompt: int, max_tokens: int) -> None:
        """Raise ModelcarveError if a prompt of ``n_prompt`` tokens cannot run (context, KV budget)."""
        if n_prompt < 1:
            raise ModelcarveError("the prompt is empty; give at least one token")
        if n_prompt >= self.context_length:
            raise ModelcarveError(f"the prompt has {n_prompt} tokens but the model's context is "
                                  f"{self.context_length}; shorten the prompt")
        need = min(n_prompt + max_tokens, self.context_length)
        capacity = (self.runner.num_blocks - 1) * self.cfg.block_size
        if need > capacity:
            raise ModelcarveError(f"the prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) needs {need} tokens "
                                  f"of KV cache but the budget holds {capacity} ({self.runner.num_blocks - 1} blocks of "
                                  f"{self.cfg.block_size}); raise --kv-cache-bytes or lower max_tokens")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        ids = [int(t) for t in prompt_token_ids]
        if any(t < 0 or t >= self.spec.vocab_size for t in ids):
            raise ModelcarveError(f"prompt token ids must be in [0, {self.spec.vocab_size}) for this model")
        if params.stop and self.tokenizer is None:
            raise ModelcarveError("stop strings need the checkpoint's tokenizer, which this model has none of; "
                                  "use stop token ids")
        self.check_prompt(len(ids), params.max_tokens)
        with self._lock:
            if request_id in self.seqs:
                raise ModelcarveError(f"request id {request_id!r} is already in use")
            seq = Sequence(request_id, ids, params, arrival_time=time.perf_counter())
            seq.key = self._next_key
            self._next_key += 1
            loads = [len(s.waiting) + len(s.running) for s in self.schedulers]
            seq.replica = loads.index(min(loads))
            self.seqs[request_id] = seq
            if not params.greedy:
                self._generators[request_id] = make_generator(params.seed)
            self.schedulers[seq.replica].add(seq)
            self._prompt_tokens += len(ids)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self.seqs:
                self._aborted.append(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.seqs) or bool(self._inflight)

    # --- the step --------------------------------------------------------------------------
    def _output(self, seq: Sequence, new: list[int], new_lp: list | None, new_top: list | None = None) -> RequestOutput:
        text = seq.text
        # a later token can rewrite the tail of the decoded text (byte-level merges): only text
        # extending what was already returned is emitted (the full ``text`` is always current)
        if text.startswith(seq.emitted_text):
            new_text = text[len(seq.emitted_text):]
            seq.emitted_text = text
        else:
            new_text = ""
        return RequestOutput(seq.request_id, new, new_lp, list(seq.output), new_text, text, seq.finished,
                             seq.finish_reason, seq.stop_reason, len(seq.prompt), seq.cached_tokens,
                             seq.arrival_time, seq.first_token_time, seq.finish_time,
                             list(seq.logprobs) if seq.params.logprobs else None,
                             new_top if seq.params.logprobs and seq.params.top_logprobs else None,
                             list(seq.top_logprobs) if seq.params.logprobs and seq.params.top_logprobs else None,
                             *self._prompt_lps(seq))

    @staticmethod
    def _prompt_lps(seq: Sequence) -> tuple:
        """(prompt logprobs, prompt top logprobs) once all are known, when the request asked."""
        if not seq.params.prompt_logprobs or not seq.prompt_logprobs_done:
            return None, None
        if not seq.prompt_logprobs:  # a one-token prompt: nothing was computed
            seq.prompt_logprobs, seq.prompt_top_logprobs = [None], [None]
        return seq.prompt_logprobs, (seq.prompt_top_logprobs if seq.params.top_logprobs else None)

    def _take_prompt_logprobs(self, scheduled, items, got) -> None:
        """Write the packed prompt logprobs of one replica's micro-batches into their sequences."""
        packs = iter([packed for _, packed in got if packed is not None])
        by_item = dict(zip(map(id, items), scheduled))
        for mb in self.runner.micro_batches(items):
            rows, k = self.runner.logprob_width(mb)
            if not rows:
                continue
            chosen, tops = unpack_tops(next(packs), k)
            at = 0
            for it in mb:
                if not it.logprob_rows:
                    continue
                seq = by_item[id(it)].seq
                if len(seq.prompt_logprobs) != len(seq.prompt):
                    seq.prompt_logprobs, seq.prompt_top_logprobs = [None] * len(seq.prompt), [None] * len(seq.prompt)
                n = seq.params.top_logprobs
                for j in range(it.logprob_rows):
                    seq.prompt_logprobs[it.start + j + 1] = chosen[at + j]
                    seq.prompt_top_logprobs[it.start + j + 1] = tops[at + j][:n] if tops[at + j] else None
                seq.prompt_filled = max(seq.prompt_filled, it.start + it.logprob_rows + 1)
                at += it.logprob_rows

    def _finish(self, seq: Sequence, reason: str, stop=None) -> None:
        seq.finished, seq.finish_reason, seq.stop_reason = True, reason, stop
        seq.finish_time = time.perf_counter()
        self.schedulers[seq.replica].remove(seq)
        self.seqs.pop(seq.request_id, None)
        self._generators.pop(seq.request_id, None)

    def step(self) -> list[RequestOutput]:
        """One engine step; with pp > 1 it launches micro-batches until ``pp`` are in flight, then
        retires (receives, samples) the oldest, whose requests the next step can schedule again."""
        if self.pipelined:
            return self._pipelined_step()
        outputs = []
        with self._lock:
            outputs += self._take_aborts()
            scheduled = [s.schedule() for s in self.schedulers]
        if not any(scheduled):
            self._heartbeat()
            return outputs
        self._last_plan = time.monotonic()
        plan = StepPlan.from_scheduled(scheduled, self._plans, self._calls)
        self._plans += 1
        self._calls += 1
        self.runner.broadcast(plan)
        launched = time.monotonic()
        results = self.runner.execute(plan)
        self._steps += 1
        self._flights.append(plan.index, plan.step, launched, time.monotonic())
        return outputs + self._absorb(scheduled, plan, results)

    def _take_aborts(self, busy=frozenset()) -> list[RequestOutput]:
        """Finish the aborted requests (under the lock); one in flight waits until it is retired."""
        outputs, keep = [], []
        for rid in self._aborted:
            seq = self.seqs.get(rid)
            if seq is not None and seq in busy:
                keep.append(rid)  # its blocks are being written: free them when its micro-batch is back
            elif seq is not None:
                self._finish(seq, "abort")
                outputs.append(self._output(seq, [], None))
        self._aborted[:] = keep
        return outputs

    def _heartbeat(self) -> None:
        if self.runner.world > 1 and time.monotonic() - self._last_plan > min(HEARTBEAT_S, self.cfg.timeout_s / 4):
            if self.pipelined:
                self.runner.wait(self.runner.send_plan(StepPlan()))
            else:
                self.runner.broadcast(StepPlan())  # keeps idle followers inside their collective timeout
            self._last_plan = time.monotonic()

    def _busy(self) -> set:
        return {item.seq for entry in self._inflight for items in entry[0] for item in items}

    def _pipelined_step(self) -> list[RequestOutput]:
        with self._lock:
            outputs = self._take_aborts(self._busy())
        launched_any = False
        while len(self._inflight) < self.depth:
            with self._lock:
                busy = self._busy()
                # the micro-batches in flight share the requests: each takes about 1/pp of them
                scheduled = [s.schedule(busy, max(1, -(-(len(s.running) + len(s.waiting)) // self.depth)))
                             for s in self.schedulers]
            if not any(scheduled):
                break
            plan = StepPlan.from_scheduled(scheduled, self._plans, self._calls)
            self._plans += 1
            sends = self.runner.send_plan(plan)
            launched = time.monotonic()
            more, _ = self.runner.launch(plan)  # rank 0 is stage 0: never the last stage here
            self._inflight.append((scheduled, plan, sends + more, launched))
            self._max_in_flight = max(self._max_in_flight, len(self._inflight))
            launched_any = True
        if launched_any:
            self._calls += 1
        if not self._inflight:
            self._heartbeat()
            return outputs
        self._last_plan = time.monotonic()
        scheduled, plan, sends, launched = self._inflight.popleft()
        results = self.runner.collect(plan)
        self.runner.wait(sends)
        self._steps += 1
        self._flights.append(plan.index, plan.step, launched, time.monotonic())
        return outputs + self._absorb(scheduled, plan, results)

    def _absorb(self, scheduled, plan: StepPlan, results) -> list[RequestOutput]:
        """Record a step's (or micro-batch's) computed tokens, prompt logprobs and samples."""
        outputs = []
        with self._lock:
            for replica, items in enumerate(scheduled):
                self.schedulers[replica].after_step(items)
                got = results[replica]
                if any(packed is not None for _, packed in got):
                    self._take_prompt_logprobs(items, plan.replicas[replica], got)
                rows = [item.seq for item in items if item.sample]
                if not rows:
                    continue
                parts = [logits for logits, _ in got if logits is not None]
                block = torch.cat(parts) if len(parts) != 1 else parts[0]
                outputs += self._sample(rows, block)
        return outputs

    def step_records(self) -> dict:
        """This rank's step records: ``forwards`` (per forward: mb, sub, step, rank, pp, tp, dp, start,
        end) and, on rank 0, ``flights`` (per plan: mb, step, launched, retired); times are
        ``time.monotonic()`` seconds, one clock for every process of a machine."""
        return dict(forwards=list(self.runner.records), flights=list(self._flights))

    def _sample(self, rows: list[Sequence], logits: torch.Tensor) -> list[RequestOutput]:
        params = [s.params for s in rows]
        banned = []
        for s in rows:
            p = s.params
            banned.append(list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.stopper.eos_ids))
                          if len(s.output) < p.min_tokens else None)
        tokens, logprobs, tops = sample(logits, params, [self._generators.get(s.request_id) for s in rows], banned)
        now = time.perf_counter()
        outs = []
        for seq, tok, lp, top in zip(rows, tokens, logprobs, tops):
            if seq.finished or seq.request_id not in self.seqs:
                continue
            if seq.params.max_tokens == 0:  # echo: the prompt (and its logprobs) only, nothing generated
                self._finish(seq, "length")
                outs.append(self._output(seq, [], None))
                continue
            before = len(seq.text)
            seq.output.append(tok)
            if lp is not None:
                seq.logprobs.append(lp)
            if top is not None:
                seq.top_logprobs.append(top)
            if seq.first_token_time is None:
                seq.first_token_time = now
            self._gen_tokens += 1
            if self.tokenizer is not None:
                text = self.tokenizer.decode(seq.output)
                if not text.endswith("\ufffd"):  # hold back an incomplete UTF-8 character
                    seq.text = text
            limit = min(seq.params.max_tokens, self.context_length - len(seq.prompt))
            reason, stop, cut = self.stopper.check(seq.output, seq.text if self.tokenizer else None, seq.params,
                                                   before, limit)
            if cut is not None:
                seq.text = seq.text[:cut]
            if reason is not None:
                if self.tokenizer is not None and cut is None:
                    seq.text = self.tokenizer.decode(seq.output)  # the held-back tail, if any
                self._finish(seq, reason, stop)
            outs.append(self._output(seq, [tok], [lp] if seq.params.logprobs else None, [top]))
        return outs

    # --- other ranks, end, stats ------------------------------------------------------------
    def follow(self) -> None:
        """Non-zero ranks: execute rank 0's step plans until ``shutdown()``."""
        if self.pipelined:
            pending: deque = deque()
            while True:
                plan = self.runner.recv_plan()
                if plan is None:
                    break
                if plan:
                    pending.append(self.runner.launch(plan)[0])
                    while len(pending) > self.depth:  # sends of plans long retired are done
                        self.runner.wait(pending.popleft())
            for sends in pending:
                self.runner.wait(sends)
            self.runner.close()
            return
        while True:
            plan = self.runner.broadcast(None)
            if plan is None:
                self.runner.close()
                return
            self.runner.execute(plan)

    def shutdown(self) -> None:
        if self.is_driver and self.runner.world > 1:
            if self.pipelined:
                while self._inflight:  # normally none: has_unfinished() is False only when all are back
                    scheduled, plan, sends, _ = self._inflight.popleft()
                    self.runner.collect(plan)
                    self.runner.wait(sends)
                self.runner.wait(self.runner.send_plan(None))
            else:
                self.runner.broadcast(None)
            self.runner.close()

    def stats(self) -> EngineStats:
        with self._lock:
            total = sum(s.blocks.usable_blocks for s in self.schedulers)
            free = sum(s.blocks.num_free() for s in self.schedulers)
            return EngineStats(
                running=sum(len(s.running) for s in self.schedulers),
                waiting=sum(len(s.waiting) for s in self.schedulers),
                kv_blocks_total=total, kv_blocks_used=total - free, kv_blocks_free=free,
                block_size=self.cfg.block_size, kv_bytes_per_token=self.runner.max_bytes_per_token,
                prefix_cache_queries=sum(s.blocks.query_tokens for s in self.schedulers),
                prefix_cache_hits=sum(s.blocks.hit_tokens for s in self.schedulers),
                preemptions=sum(s.preemptions for s in self.schedulers), steps=self._steps,
                plan_bytes=self.runner.plan_bytes, logit_bytes=self.runner.logit_bytes,
                prompt_tokens=self._prompt_tokens, generation_tokens=self._gen_tokens,
                microbatches=self.runner.microbatches, max_in_flight=self._max_in_flight)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Convenience (rank 0): run ``prompts`` together to completion; final outputs in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{self._next_key + i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        while any(rid not in final for rid in ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]
