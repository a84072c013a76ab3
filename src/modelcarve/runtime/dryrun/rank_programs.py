"""The collective-order check at full world size: one rank per class played on the meta device.

``check_layout_order_at_scale(model_name, layout, cluster)`` refuses (LayoutError, naming two
concrete ranks and the collective where they part) a layout whose ranks would issue their
collectives in different orders, for the planner's full-scale layouts (Llama-3.1-405B on 16,384
ranks, DeepSeek-V3 on 2,048), before any launch. collective_order.py plays EVERY rank for real
on CPU tensors; that cannot scale (a 405B model, 16,384 programs, an O(world^2) comparison).
Here:

**Classes.** The ranks of one pipeline stage run the same program up to which concrete groups
they use: the same layers, the same micro-batches, split into equal shapes (TP, CP, EP and the
dp row blocks split evenly; ZeRO pads its buckets to a multiple of the group) and the same
collectives. So one representative per pipeline stage (its first rank) is played. MoE does not
add classes: under the dry run's balanced routing (fake_transport.balanced_routing) every EP
rank sends and receives the same counts, so the all-to-all split sizes, and with them the
program, do not depend on the ep coordinate (with real routing the sizes differ step to step,
the order and groups do not). A rank named in ``hook_ranks`` (``hook(rank, trainer)`` may change
its program: the tests inject a deliberate mismatch) is a class of its own, played separately.

**Playing a class** is collective_order's play, on the meta device: the model is built on meta
(shapes, no storage) and ``parallelize``-d under torch's fake process group of the FULL world
size at the representative's rank, registered for both cpu and meta tensors
(``cpu:fake,meta:fake``); then one real training step (trainer.TrainConfig(dry_run=True)) is
recorded by fake_transport.PlayLog: every micro-batch of the schedule (DeepSeek-V3's top layout
runs 960 per step), every action the pipeline schedule takes, every collective (the stage compute
of the middle micro-batches replayed from a checked memo: "Replayed micro-batches" below). What
cannot run on meta is supplied by the runtime itself: the loss and norm are reported as nan, ring attention
takes the fused kernel's meta shapes, MoE counts come from the host (the balanced routing's
counts, fake_transport._balanced_counts). ``MetaShapeCache`` memoises the meta kernels of the
pure ops (same op, same input shapes/strides/dtypes and arguments -> the same output shapes),
which torch computes in Python: it changes the cost, not what is issued.

**Replayed micro-batches** (replay.py ``ActionMemo``; a class played without a hook, 4 or more
micro-batches): the stage compute of micro-batches other than 0, 1 and the last is replayed from
micro-batch 1's recorded events once micro-batches 0 and 1 recorded the same; any difference plays
the rank again with every micro-batch real. replay.py's module doc says exactly what is played and
what is replayed.

**dtypes.** Autocast has no meta backend: on meta, matmuls of a ``param_dtype=bf16`` layout
give fp32 activations where a real launch gives bf16. ZeRO-1/2's bf16 parameters stay bf16 and
tensor.py's backward messages take the host autocast's dtype (as on a real launch), but forward
activations (the pipeline's sends, the TP all-gathers / reduce-scatters of the forward, the CP
ring's K/V) are recorded as fp32 where a bf16 launch sends bf16: same ops, groups, order and
shapes, twice the dtype's bytes. The order check compares ranks of the same dry run with each
other, so every rank sees the same substitution.

**Checking at scale.** Each recorded collective's group becomes a rule over the mesh axes
(``GroupRule``: which pipeline stages, all of tp or this rank's, and which ``dp x cp`` indices:
this rank's, all, an aligned block (EP, ZeRO shard) or a stride (expert-dp, replicate)); each
point-to-point message a coordinate step (pp +-1, the CP ring's cp +-1). Every rank's groups are
then instantiated from its coordinates (``rank_of`` / ``coords``: spec/ranks.py), and:

1. per concrete group, every member issues the same sequence of collectives on it (op, shapes,
   dtype), and no member issues none;
2. for two groups sharing at least two ranks, those ranks interleave the two groups' collectives
   alike;
3. rank r's messages to r + d are the ones r + d receives from r (shapes, in order).

One thing the single played rank cannot know is another rank's object size: all_gather_object
gathers every rank's byte count, then all-gathers the pickled bytes padded to the largest, so a
real launch issues the same shapes on every rank; played alone, a rank pads to its own (the MoE
step stats DeepSeek-V3's dense stages gather are 5 bytes, an MoE stage's 132). The bytes' all-gather
(uint8, right after an all-gather of int64 [1] counts on the same group) is therefore compared as
op, group and dtype, its shapes recorded as ``OBJECT_BYTES``; the counts' all-gather is compared
as any collective.

1 and 2 together are collectives.check_order's pairwise condition (two ranks' sequences over the
groups holding both agree iff every such group's sub-sequence agrees and every two such groups
interleave alike); the cost is O(world x groups per rank x pairs) dictionary entries with the
signatures computed once per class, not O(world^2 x events). tests/runtime/
test_dry_run_order_scale.py checks the verdicts equal collective_order's every-rank check on tiny
layouts, and checks the two full-scale layouts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from modelcarve.runtime.dryrun.replay import ActionMemo, MetaShapeCache, MemoMismatch, schedule_memo
from modelcarve.spec.errors import LayoutError
from modelcarve.spec.ranks import coords, rank_of


def play_rank(model_name: str, layout, rank: int, mailbox: dict, seed: int = 0, hook=None, memo: bool | None = None,
              stats: dict | None = None) -> list:
    """The collective events (collectives.Event) of ``rank``'s training step of ``layout``, played
    on the meta device under the fake process group of the full world size (module doc).
    ``mailbox``: the pipeline stage metadata of the ranks played before (fake_transport.play_pipeline:
    a stage's forward metadata comes from the previous stage's representative). ``memo`` (default:
    no ``hook``) replays the pipeline actions of micro-batches 2 to the last but one (ActionMemo),
    falling back to playing every one on any mismatch; ``stats`` gets {"played", "replayed"
    (actions), "fallback" (why the memo was dropped, or None)}."""
    stats = {} if stats is None else stats
    stats.update(played=0, replayed=0, fallback=None)
    if memo is None:
        memo = hook is None
    if memo:
        quiet = logging.getLogger("torch.distributed.pipelining.schedules")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)  # torch logs the whole schedule when a mismatch stops it
        try:
            return _play_rank(model_name, layout, rank, mailbox, seed, hook, True, stats)
        except MemoMismatch as err:
            stats["fallback"] = str(err)
        finally:
            quiet.setLevel(level)
    return _play_rank(model_name, layout, rank, mailbox, seed, hook, False, stats)


def _play_rank(model_name, layout, rank, mailbox, seed, hook, memo, stats) -> list:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from modelcarve.runtime.checkpoint.hf_load import load_model
    from modelcarve.runtime.distributed.mesh import build_mesh, destroy, init_distributed
    from modelcarve.runtime.dryrun.fake_transport import PlayLog, balanced_routing, play_pipeline
    from modelcarve.runtime.parallel.parallelize import parallelize
    from modelcarve.runtime.train.trainer import TrainConfig, Trainer, seed_everything

    if dist.is_initialized():
        raise LayoutError("the dry run needs a process without a process group (it plays the ranks itself)")
    model, spec = load_model(model_name, device="meta", dtype=torch.float32)
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        init_distributed()
        seed_everything(seed)
        mesh = build_mesh(layout)
        chunks = parallelize(model, layout, mesh)
        balanced_routing(chunks)
        with schedule_memo():
            trainer = Trainer(chunks, layout, mesh, TrainConfig(seed=seed, dry_run=True))
        log = PlayLog(layout, per_node=layout.world_size)  # tiers do not matter to the order
        play_pipeline(trainer.runner, mailbox, log)
        actions = None
        if memo and trainer.runner is not None and layout.num_microbatches >= 4:
            actions = ActionMemo(trainer.runner, log, layout.num_microbatches)
        if hook is not None:
            hook(rank, trainer)
        tokens = torch.zeros(layout.global_batch, layout.seq, dtype=torch.long)
        with log, MetaShapeCache():
            trainer.step(tokens, tokens)
        if actions is not None:
            stats.update(played=actions.played, replayed=actions.replayed)
        return log.events
    finally:
        destroy()


# --- groups as rules over the mesh axes -----------------------------------------------------


@dataclass(frozen=True)
class GroupRule:
    """A group a class's representative used, as a rule any rank of the class instantiates:
    ``stages`` (pipeline ranks in it), ``tp_all`` (every tp index, else the rank's own) and
    ``f`` over the ``dp x cp`` index ``f = dp_i * cp + cp_i``: ("one",), ("all",), ("block", k)
    (the aligned k consecutive indices holding the rank's) or ("stride", s) (indices congruent
    to the rank's mod s)."""

    stages: tuple
    tp_all: bool
    f: tuple

    def key(self, c: dict, layout) -> tuple:
        f = c["dp"] * layout.cp + c["cp"]
        fk = {"one": ("one", f), "all": ("all",)}.get(self.f[0]) or (
            (self.f[0], self.f[1], f // self.f[1]) if self.f[0] == "block" else (self.f[0], self.f[1], f % self.f[1]))
        return self.stages, ("all",) if self.tp_all else ("one", c["tp"]), fk

    def size(self, layout) -> int:
        n_f = layout.dp * layout.cp
        f = {"one": 1, "all": n_f}.get(self.f[0]) or (self.f[1] if self.f[0] == "block" else n_f // self.f[1])
        return len(self.stages) * (layout.tp if self.tp_all else 1) * f


def _f_rule(fs: set, mine: int, n_f: int) -> tuple | None:
    k = len(fs)
    if k == 1:
        return ("one",)
    if k == n_f:
        return ("all",)
    lo = mine - mine % k
    if fs == set(range(lo, lo + k)):
        return ("block", k)
    s = n_f // k
    if n_f % k == 0 and fs == set(range(mine % s, n_f, s)):
        return ("stride", s)
    return None


def rule_of(ranks, rank: int, layout) -> GroupRule:
    """The GroupRule of the group ``ranks`` seen from its member ``rank`` (LayoutError if the
    group is not a product of stages, tp and a dp x cp block or stride)."""
    cs = [coords(layout, r) for r in ranks]
    me = coords(layout, rank)
    stages = tuple(sorted({c["pp"] for c in cs}))
    tps = {c["tp"] for c in cs}
    fs = {c["dp"] * layout.cp + c["cp"] for c in cs}
    n_f = layout.dp * layout.cp
    f = _f_rule(fs, me["dp"] * layout.cp + me["cp"], n_f)
    tp_all = len(tps) == layout.tp
    rule = None if f is None or not (tp_all or tps == {me["tp"]}) else GroupRule(stages, tp_all, f)
    if rule is None or rule.size(layout) != len(set(ranks)):
        raise LayoutError(f"the full-scale order check cannot express the group of ranks {sorted(ranks)[:16]} "
                          f"(seen from rank {rank} of {layout.short()}) over the mesh axes")
    return rule


def _step(peer: int, rank: int, layout) -> tuple:
    """The coordinate step from ``rank`` to ``peer``, each axis mod its size."""
    a, b = coords(layout, rank), coords(layout, peer)
    return tuple((b[x] - a[x]) % getattr(layout, x) for x in ("pp", "dp", "cp", "tp"))


def _apply(step: tuple, rank: int, layout, sign: int = 1) -> int:
    c = coords(layout, rank)
    return rank_of(layout, **{x: (c[x] + sign * d) % getattr(layout, x) for x, d in zip(("pp", "dp", "cp", "tp"), step)})


@dataclass
class ClassProgram:
    """One played representative's program, in rules (module doc)."""

    rank: int
    rules: list  # GroupRule per rule index
    groups: list  # the representative's concrete member set per rule index
    by_rule: dict  # rule index -> [(op, shapes, dtype)] in issue order
    order: list  # rule index of each collective, in issue order
    sends: dict  # step -> [shapes]
    recvs: dict  # step -> [shapes]
    events: int
    played: dict = None  # play_rank's stats: actions played / replayed, why the memo fell back


OBJECT_BYTES = (("object bytes",),)
"""The shapes an object all-gather's bytes are recorded with (module doc, "Checking at scale")."""


def program_of(events: list, rank: int, layout) -> ClassProgram:
    rules, groups, index = [], [], {}
    by_rule, order, sends, recvs = {}, [], {}, {}
    for e in events:
        if e.op in ("send", "recv"):
            (sends if e.op == "send" else recvs).setdefault(_step(e.peer, rank, layout), []).append(e.shapes)
            continue
        members = frozenset(e.ranks)
        if len(members) < 2:
            continue
        i = index.get(members)
        if i is None:
            i = index[members] = len(rules)
            rules.append(rule_of(members, rank, layout))
            groups.append(members)
        shapes = e.shapes
        if e.op == "all_gather" and e.dtype == "uint8" and by_rule.get(i) and _object_sizes(by_rule[i][-1]):
            shapes = OBJECT_BYTES  # all_gather_object: torch pads every rank's bytes to the largest
        by_rule.setdefault(i, []).append((e.op, shapes, e.dtype))
        order.append(i)
    return ClassProgram(rank, rules, groups, by_rule, order, sends, recvs, len(events))


def _object_sizes(signature) -> bool:
    """Is this (op, shapes, dtype) all_gather_object's first collective, the byte counts?"""
    op, shapes, dtype = signature
    return op == "all_gather" and dtype == "int64" and all(x == (1,) for x in shapes)


# --- the check over every rank --------------------------------------------------------------


def _describe(event) -> str:
    if event is None:
        return "nothing"
    op, shapes, dtype = event
    return f"{op} of {dtype} {[list(x) for x in shapes] if shapes != OBJECT_BYTES else 'object bytes'}"


def _members(rule: GroupRule, rank: int, layout) -> list[int]:
    c = coords(layout, rank)
    f0 = c["dp"] * layout.cp + c["cp"]
    n_f = layout.dp * layout.cp
    kind = rule.f[0]
    fs = ([f0] if kind == "one" else range(n_f) if kind == "all" else
          range(f0 - f0 % rule.f[1], f0 - f0 % rule.f[1] + rule.f[1]) if kind == "block" else range(f0 % rule.f[1], n_f, rule.f[1]))
    tps = range(layout.tp) if rule.tp_all else [c["tp"]]
    return sorted(rank_of(layout, pp=p, dp=f // layout.cp, cp=f % layout.cp, tp=t) for p in rule.stages for f in fs for t in tps)


def _group_text(rule: GroupRule, rank: int, layout) -> str:
    m = _members(rule, rank, layout)
    return f"ranks {m}" if len(m) <= 8 else f"{len(m)} ranks {m[:4]}...{m[-2:]}"


def _first_difference(a: list, b: list) -> int:
    return next((i for i in range(max(len(a), len(b))) if (a[i] if i < len(a) else None) != (b[i] if i < len(b) else None)), 0)


def check_programs(programs: dict, class_of, layout) -> int:
    """Refuse (LayoutError) unless every rank's program, ``programs[class_of(rank)]`` instantiated at
    its coordinates, agrees with its peers' (module doc: 1, 2, 3); returns the collectives checked
    (summed over every rank)."""
    sig = {c: {i: hash(tuple(seq)) for i, seq in p.by_rule.items()} for c, p in programs.items()}
    pairs = {}
    for c, p in programs.items():  # 2: rule pairs sharing >= 2 ranks, with their interleaving
        out = pairs[c] = []
        for i in range(len(p.rules)):
            for j in range(i + 1, len(p.rules)):
                if len(p.groups[i] & p.groups[j]) >= 2:
                    # labelled by the concrete groups (which comes first in key order), not by this
                    # class's rule indices: two classes can meet the same groups in another order
                    labels = [x for x in p.order if x in (i, j)]
                    out.append((i, j, hash(tuple(x == j for x in labels)), hash(tuple(x == i for x in labels))))
    seen: dict = {}  # concrete group key -> (first rank, its class, rule index, signature)
    count: dict = {}
    inter: dict = {}
    checked = 0
    for rank in range(layout.world_size):
        c = class_of(rank)
        p = programs[c]
        checked += p.events
        me = coords(layout, rank)
        keys = [rule.key(me, layout) for rule in p.rules]
        for i, key in enumerate(keys):
            first = seen.setdefault(key, (rank, c, i, sig[c][i]))
            count[key] = count.get(key, 0) + 1
            if first[3] != sig[c][i]:
                a, ca, ia, _ = first
                sa, sb = programs[ca].by_rule[ia], p.by_rule[i]
                k = _first_difference(sa, sb)
                raise LayoutError(
                    f"ranks {a} and {rank} would deadlock: on their group ({_group_text(p.rules[i], rank, layout)}) "
                    f"collective #{k + 1} differs (rank {a}: {_describe(sa[k] if k < len(sa) else None)}; rank {rank}: "
                    f"{_describe(sb[k] if k < len(sb) else None)})")
        for i, j, h_ij, h_ji in pairs[c]:
            h = h_ij if keys[i] <= keys[j] else h_ji
            first = inter.setdefault((keys[i], keys[j]) if keys[i] <= keys[j] else (keys[j], keys[i]), (rank, h))
            if first[1] != h:
                raise LayoutError(
                    f"ranks {first[0]} and {rank} would deadlock: they order their collectives on "
                    f"{_group_text(p.rules[i], rank, layout)} and on {_group_text(p.rules[j], rank, layout)} differently")
        for step, shapes in p.sends.items():
            peer = _apply(step, rank, layout)
            got = programs[class_of(peer)].recvs.get(tuple((-d) % getattr(layout, x) for x, d in
                                                          zip(("pp", "dp", "cp", "tp"), step)), [])
            if got != shapes:
                raise LayoutError(f"rank {rank} sends {len(shapes)} messages to rank {peer} which receives {len(got)} "
                                  f"(shapes {shapes[:3]} vs {got[:3]}): the pipeline's sends and receives do not pair")
        for step, shapes in p.recvs.items():
            peer = _apply(step, rank, layout)
            back = tuple((-d) % getattr(layout, x) for x, d in zip(("pp", "dp", "cp", "tp"), step))
            sent = programs[class_of(peer)].sends.get(back, [])
            if sent != shapes:
                raise LayoutError(f"rank {peer} sends {len(sent)} messages to rank {rank} which receives {len(shapes)} "
                                  f"(shapes {sent[:3]} vs {shapes[:3]}): the pipeline's sends and receives do not pair")
    for key, (rank, c, i, _) in seen.items():  # 1: no member issues nothing on a group the others use
        rule = programs[c].rules[i]
        if count[key] != rule.size(layout):
            members = _members(rule, rank, layout)
            idle = next(m for m in members if key not in
                        {r.key(coords(layout, m), layout) for r in programs[class_of(m)].rules})
            seq = programs[c].by_rule[i]
            a, b = sorted((rank, idle))
            raise LayoutError(
                f"ranks {a} and {b} would deadlock: on their group ({_group_text(rule, rank, layout)}) collective #1 "
                f"differs (rank {rank}: {_describe(seq[0])}; rank {idle}: nothing); the layout's groups are used "
                f"in a different order on different ranks")
    return checked


_PLAYED: dict = {}
"""(model, layout, representative rank) -> ClassProgram of a class played without a hook (one process
plays each stage once however often it is checked)."""


def class_programs(model_name: str, layout, seed: int = 0, hook=None, hook_ranks=()) -> tuple[dict, object]:
    """({class: ClassProgram}, class_of): one representative per pipeline stage (its first rank not
    in ``hook_ranks``), and each rank of ``hook_ranks`` played alone with ``hook`` (module doc)."""
    hooked = sorted(set(hook_ranks))
    per_stage = layout.tp * layout.cp * layout.dp
    reps = {}
    for p in range(layout.pp):
        free = next((r for r in range(p * per_stage, (p + 1) * per_stage) if r not in hooked), None)
        if free is not None:
            reps[("stage", p)] = free
    programs: dict = {}
    mailbox: dict = {}
    from modelcarve.runtime.dryrun.fake_transport import play_in_passes

    def play(which):
        cls, rank = which
        memo = (model_name, layout.short(), seed, rank)
        if cls[0] == "stage" and memo in _PLAYED:
            programs[cls], saved = _PLAYED[memo]
            mailbox.update(saved)
            return
        stats: dict = {}
        events = play_rank(model_name, layout, rank, mailbox, seed, hook if cls[0] == "rank" else None, stats=stats)
        programs[cls] = program_of(events, rank, layout)
        programs[cls].played = stats
        if cls[0] == "stage":
            _PLAYED[memo] = (programs[cls], dict(mailbox))

    jobs = list(reps.items()) + [(("rank", r), r) for r in hooked]
    play_in_passes(jobs, play, mailbox)
    hooked_set = set(hooked)

    def class_of(rank: int):
        return ("rank", rank) if rank in hooked_set else ("stage", rank // per_stage)

    return programs, class_of


def check_layout_order_at_scale(model_name: str, layout, cluster=None, hook=None, hook_ranks=(), seed: int = 0) -> dict:
    """Refuse (LayoutError) a layout whose ranks would issue collectives in different orders, at its
    full world size (module doc); returns {"world_size", "classes", "ranks_played", "collectives"
    (summed over every rank), "actions_played" / "actions_replayed" (pipeline actions whose stage
    compute ran / was replayed, ActionMemo; counted over the classes memoised), "memo_fallbacks"
    (why a class was played again without the memo), "elapsed_s"}. ``cluster`` (a ClusterSpec) is checked against the
    layout's world size when given; ``hook(rank, trainer)`` runs on each rank of ``hook_ranks``."""
    if cluster is not None and getattr(cluster, "num_devices", layout.world_size) != layout.world_size:
        raise LayoutError(f"layout {layout.short()} needs {layout.world_size} ranks; the cluster has {cluster.num_devices}")
    t0 = time.perf_counter()
    programs, class_of = class_programs(model_name, layout, seed, hook, hook_ranks)
    checked = check_programs(programs, class_of, layout)
    stats = [p.played or {} for p in programs.values()]
    return {"world_size": layout.world_size, "classes": len(programs), "ranks_played": sorted(p.rank for p in programs.values()),
            "collectives": checked, "actions_played": sum(s.get("played", 0) for s in stats),
            "actions_replayed": sum(s.get("replayed", 0) for s in stats),
            "memo_fallbacks": sorted({s["fallback"] for s in stats if s.get("fallback")}),
            "elapsed_s": round(time.perf_counter() - t0, 1)}
