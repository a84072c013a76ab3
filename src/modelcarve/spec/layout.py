"""Layout: how one model is cut over devices — the object the planner emits and the runtime reads.

Axes and how they nest
----------------------
``world = dp x cp x tp x pp`` ranks. On the device mesh, TP is innermost (neighbouring ranks,
inside a node), then CP, then DP, and PP outermost: rank = ((pp_i*dp + dp_i)*cp + cp_i)*tp + tp_i
(``Layout.coords`` / ``Layout.rank_of``; spec/ranks.py is the one implementation, the expert mesh's too).

Expert parallelism does not add ranks. As in Megatron-Core, the experts of an MoE layer are
sharded over an EP group carved out of the ``dp x cp`` ranks that hold the same attention
shard: ``ep`` must divide ``dp * cp``, and the remaining ``dp * cp / ep`` ranks form the
expert-data-parallel group that all-reduces (or ZeRO-shards) expert gradients. Attention and
dense layers are unaffected by ``ep``. Expert weights are also split by ``tp`` (expert TP = TP).

MoE parallel folding (Megatron-Core, Liu et al. 2025, arXiv 2504.14960): the expert layers get
their own mesh over the same ranks, ``ETP x EP x EDP x PP`` beside the attention mesh
``TP x CP x DP x PP``, so EP may also take the TP ranks: ``tp=2,dp=16,ep=32,etp=1`` puts 32-way
EP over the 32 ranks of a stage. ``etp`` (expert tensor parallelism) defaults to ``tp`` when
``ep`` divides ``dp x cp`` (the unfolded layout above) and to 1 otherwise; ``etp x ep`` must
divide ``tp x cp x dp`` and ``edp = tp x cp x dp / (etp x ep)``. ETP is innermost in the expert
mesh (neighbouring ranks), then EP, then EDP.

Redundant experts (EPLB, DeepSeek's Expert Parallelism Load Balancer, as vLLM and SGLang serve
DeepSeek with wide EP): ``redundant_experts=R`` (short ``eplb=R``) adds R replicas of the busiest
routed experts, so each MoE layer holds ``E + R`` physical experts (256 + 32 = 288 for DeepSeek-V3)
and every EP rank holds ``(E + R) / ep`` of them: ``ep`` must divide ``E + R`` instead of ``E``
(``ep=72`` with 288). 0 (the default) is plain EP, and then the field is left out of
``to_dict`` and ``short`` so existing layouts read and print as before.

Precision: ``param_dtype=fp8`` (alias ``precision=fp8``) runs the linear layers' GEMMs in FP8 as
Transformer Engine does (``fp8_scaling`` delayed or current, per-tensor scales), ``mxfp8`` with
MX block scales (1 x 32, Blackwell); weights stay bf16 with fp32 master weights and Adam state,
and attention core, embedding, LM head and router stay bf16 (plan/train/layer.py).

Recomputation: ``none``, ``selective`` (Korthikanti's attention core), ``full`` (whole layer),
``ops`` (torchtitan's op-level selective AC: matmul and attention outputs saved, element-wise
ops recomputed), or a ``+``-joined list of Megatron ``--recompute-modules``:
``core_attn+layernorm+mlp_act+mlp``, and ``mla_up_proj`` for MLA models (see plan/cost/activations.py
for what each drops).

Data-parallel sharding: ``zero`` 0 (plain all-reduce DP), 1 (optimiser state), 2 (+ gradients),
3 (+ parameters; FSDP). ``dp_shard`` is the size of the group the ZeRO state is sharded over:
``dp`` by default; fewer with ``zero=3`` is HSDP (shard inside ``dp_shard``, replicate across
``dp / dp_shard``).

String form: ``"tp=8,pp=4,dp=2,zero=1,mbs=1"``; aliases ``fsdp`` (zero=3), ``hsdp=R`` (zero=3,
R replicas), ``sp`` (sequence parallel on). Short form: ``TP8-PP4-DP2-Z1``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from modelcarve.spec.errors import LayoutError
from modelcarve.spec.stages import stage_count_problem

if TYPE_CHECKING:
    from modelcarve.spec.hardware import ClusterSpec
    from modelcarve.spec.model import ModelSpec

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
RECOMPUTE = ("none", "selective", "full", "ops")
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp_act", "mlp", "mla_up_proj")
"""Megatron ``--recompute-modules`` the planner models (``moe_act``/``moe`` are aliases;
``mla_up_proj`` applies to MLA attention only)."""
TRAIN_DTYPES = ("fp32", "bf16", "fp16")
COMPUTE_DTYPES = TRAIN_DTYPES + ("fp8", "mxfp8")
"""``param_dtype`` values: the 16/32-bit dtypes, FP8 (Hopper and later) and MXFP8 (Blackwell)."""
FP8_SCALING = ("delayed", "current")
WEIGHT_DTYPES = ("fp32", "bf16", "fp16", "fp8", "int8", "int4", "fp4", "nvfp4", "mxfp4")
KV_DTYPES = ("fp32", "bf16", "fp16", "fp8", "int8", "fp4", "nvfp4")
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}

_ALIASES = {
    "schedule": {"interleaved": "interleaved-1f1b", "zb": "zero-bubble", "zerobubble": "zero-bubble", "zb-h1": "zero-bubble"},
    "recompute": {"off": "none", "false": "none", "true": "full", "sel": "selective", "op": "ops", "sac": "ops"},
    "param_dtype": {"fp8-cs": "fp8", "fp8cs": "fp8", "fp8-mx": "mxfp8", "fp8mx": "mxfp8"},
}
_LIMITS = {"mbs": 2**31, "gbs": 2**31, "seq": 2**31}
"""Largest accepted value of a layout field (default 2^20: more devices than any cluster has)."""
_MODULE_ALIASES = {"moe_act": "mlp_act", "moe": "mlp", "core_attention": "core_attn", "norm": "layernorm"}


def recompute_modules(value: str) -> frozenset[str]:
    """The Megatron recompute modules a ``recompute`` value names (``core_attn+mlp_act``), or
    raise LayoutError naming the unknown ones. ``selective`` is ``core_attn``."""
    if value == "selective":
        return frozenset({"core_attn"})
    names = [_MODULE_ALIASES.get(n, n) for n in value.split("+") if n]
    bad = [n for n in names if n not in RECOMPUTE_MODULES]
    if bad or not names:
        raise LayoutError(
            f"recompute={value!r} is not one of: {', '.join(RECOMPUTE)}, nor a '+'-joined list of modules "
            f"({', '.join(RECOMPUTE_MODULES)}; moe_act/moe are aliases), e.g. recompute=core_attn+mlp_act"
        )
    return frozenset(names)


def canonical_recompute(value: str) -> str:
    """``recompute`` in one spelling: the named modes as they are, module lists sorted."""
    if value in RECOMPUTE:
        return value
    return "+".join(sorted(recompute_modules(value)))


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to split a model; every field has a default so partial layouts parse."""

    dp: int = 1
    """Data-parallel replicas (attention/dense weights)."""
    tp: int = 1
    """Tensor-parallel degree (innermost mesh axis, inside a node)."""
    pp: int = 1
    """Pipeline stages (outermost mesh axis)."""
    cp: int = 1
    """Context-parallel degree: the sequence split over ranks, ring attention."""
    ep: int = 1
    """Expert-parallel degree, folded into dp x cp, or over tp x cp x dp with etp (see module doc)."""
    etp: int = 0
    """Expert tensor-parallel degree; 0: tp when ep divides dp x cp, else 1 (MoE parallel folding)."""
    redundant_experts: int = 0
    """Redundant expert replicas per MoE layer (EPLB): ``E + R`` physical experts, ``(E + R) / ep``
    per EP rank. vLLM: ``--enable-eplb --eplb-config '{"num_redundant_experts": R}'`` (older
    releases: ``--num-redundant-experts``); SGLang: ``--ep-num-redundant-experts R``. Needs ep > 1;
    0 is plain EP and is omitted from ``to_dict`` / ``short``."""
    sp: bool = False
    """Sequence parallelism for the norm/dropout regions of a TP group (needs tp > 1)."""
    zero: int = 0
    """ZeRO stage 0-3 over the data-parallel group; 3 is FSDP."""
    dp_shard: int = 0
    """Ranks the ZeRO/FSDP state is sharded over; 0 means all of dp; less than dp is HSDP."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved-1f1b, zero-bubble."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved-1f1b)."""
    mbs: int = 1
    """Micro-batch size, sequences."""
    gbs: int = 0
    """Global batch, sequences per optimiser step; 0 means mbs x dp (one micro-batch per replica)."""
    seq: int = 2048
    """Sequence length, tokens."""
    recompute: str = "none"
    """Activation recomputation: none, selective (attention core), full (whole layer), ops
    (op-level SAC), or modules joined by '+' (core_attn, layernorm, mlp_act, mlp)."""
    param_dtype: str = "bf16"
    """Dtype the GEMMs run in: fp32/bf16/fp16, or fp8/mxfp8 (FP8 linear layers, bf16 weights kept)."""
    fp8_scaling: str = "delayed"
    """FP8 scaling recipe for param_dtype=fp8: delayed (amax history) or current (per step)."""
    grad_dtype: str = "fp32"
    """Dtype gradients are reduced and accumulated in."""
    optim_dtype: str = "fp32"
    """Dtype of master weights and Adam moments."""
    weight_dtype: str = "bf16"
    """Serving: dtype weights are stored in (fp8/int8/int4 are quantised)."""
    kv_dtype: str = "bf16"
    """Serving: KV-cache dtype."""

    # --- derived ------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        return self.gbs or self.mbs * self.dp

    @property
    def num_microbatches(self) -> int:
        """Micro-batches each pipeline processes per step: gbs / (mbs x dp)."""
        return self.global_batch // (self.mbs * self.dp)

    @property
    def shard_group(self) -> int:
        """Size of the group ZeRO/FSDP state is sharded over (1 when zero=0)."""
        if self.zero == 0:
            return 1
        return self.dp_shard or self.dp

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel degree (``etp``, or its default: see the module doc)."""
        if self.etp:
            return self.etp
        return self.tp if (self.dp * self.cp) % self.ep == 0 else 1

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel degree: ranks holding the same experts (tp x cp x dp / (etp x ep))."""
        return max(1, self.tp * self.dp * self.cp // (self.expert_tp * self.ep))

    @property
    def folded(self) -> bool:
        """Experts use their own mesh (etp differs from tp): MoE parallel folding."""
        return self.ep > 1 and self.expert_tp != self.tp

    def coords(self, rank: int) -> dict[str, int]:
        """This layout's ``{"pp", "dp", "cp", "tp"}`` coordinates of global ``rank`` (spec/ranks.py)."""
        from modelcarve.spec.ranks import coords

        return coords(self, rank)

    def rank_of(self, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank at these coordinates (spec/ranks.py: TP innermost, PP outermost)."""
        from modelcarve.spec.ranks import rank_of

        return rank_of(self, pp=pp, dp=dp, cp=cp, tp=tp)

    def short(self) -> str:
        """One-line name, e.g. ``TP8-SP-PP4v2-DP2-Z1-EP2`` (``-FP8`` / ``-MXFP8`` for FP8 GEMMs, ``-BF16G`` for
        gradients held and reduced in bf16)."""
        parts = []
        if self.tp > 1:
            parts.append(f"TP{self.tp}" + ("-SP" if self.sp else ""))
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        if self.pp > 1:
            parts.append(f"PP{self.pp}" + (f"v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.dp > 1 or not parts:
            parts.append(f"DP{self.dp}")
        if self.zero:
            hsdp = self.zero == 3 and self.dp_shard and self.dp_shard < self.dp
            parts.append(f"HSDP{self.dp // self.dp_shard}x{self.dp_shard}" if hsdp else f"Z{self.zero}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}" + (f"-ETP{self.expert_tp}" if self.folded else "")
                         + (f"-EPLB{self.redundant_experts}" if self.redundant_experts else ""))
        if self.param_dtype in ("fp8", "mxfp8"):
            parts.append(self.param_dtype.upper())
        if self.grad_dtype == "bf16":  # Megatron's --grad-reduce-in-bf16
            parts.append("BF16G")
        return "-".join(parts)

    # --- serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Every field, except ``redundant_experts`` when 0 (plain EP reads as it always has)."""
        out = dataclasses.asdict(self)
        if not self.redundant_experts:
            del out["redundant_experts"]
        return out

    def physical_experts(self, num_experts: int) -> int:
        """Routed experts held per MoE layer over the EP group: ``num_experts + redundant_experts``."""
        return num_experts + self.redundant_experts if num_experts else 0

    def experts_per_rank(self, num_experts: int) -> int:
        """Routed experts (replicas included) each EP rank holds: ``(E + R) / ep``."""
        return self.physical_experts(num_experts) // self.ep

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def replace(self, **changes) -> "Layout":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, raw: dict) -> "Layout":
        if not isinstance(raw, dict):
            raise LayoutError(f"a layout must be a JSON object of fields, got {type(raw).__name__}")
        raw = raw.get("layout", raw) if isinstance(raw.get("layout"), dict) else raw
        known = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for key, value in raw.items():
            if key not in known:
                raise LayoutError(f"unknown layout field {key!r}; known: {', '.join(known)}")
            values[key] = _coerce(key, value, known[key].type)
        layout = cls(**values)
        layout.check()
        return layout

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """A ``key=value,...`` string, a JSON object, or the path of a layout JSON file."""
        if not isinstance(text, str) or not text.strip():
            raise LayoutError('empty layout; give e.g. "tp=2,pp=2,dp=2" or a layout.json path')
        text = text.strip()
        if text.startswith("{"):
            from modelcarve.spec.errors import SpecError
            from modelcarve.spec.files import loads_json

            try:
                raw = loads_json(text, "layout JSON is malformed")
            except SpecError as err:
                raise LayoutError(str(err)) from None
            return cls.from_dict(raw)
        if text.endswith(".json"):
            import modelcarve.spec.files as files

            if not files.is_file(files.user_path(text, "layout file")):
                raise LayoutError(f"layout file {text} does not exist")
            return cls.from_dict(files.read_json(text, "layout file"))
        values: dict = {}
        for item in text.replace(" ", "").split(","):
            if not item:
                continue
            key, sep, value = item.partition("=")
            key = key.lower().replace("-", "_")
            if key == "fsdp" and not sep:
                values["zero"] = 3
                continue
            if key == "sp" and not sep:
                values["sp"] = True
                continue
            if not sep:
                raise LayoutError(f"layout item {item!r} is not key=value (e.g. tp=2)")
            if key == "hsdp":
                values["zero"] = 3
                values["_hsdp_replicas"] = _int("hsdp", value)
                continue
            if key in ("virtual", "v", "vp", "vpp"):
                key = "virtual_stages"
            if key in ("microbatch", "micro_batch"):
                key = "mbs"
            if key in ("global_batch", "batch"):
                key = "gbs"
            if key == "precision":
                key = "param_dtype"
            if key in ("expert_tp", "expert_tensor_parallel"):
                key = "etp"
            if key in ("eplb", "num_redundant_experts", "ep_num_redundant_experts", "redundant"):
                key = "redundant_experts"
            if key in values:
                raise LayoutError(f"layout key {key!r} given twice")
            values[key] = value
        if str(values.get("param_dtype", "")).lower() in ("fp8-cs", "fp8cs"):
            values.setdefault("fp8_scaling", "current")
        replicas = values.pop("_hsdp_replicas", None)
        if replicas is not None:
            dp = _int("dp", values.get("dp", 1))
            if replicas < 1 or dp % replicas:
                raise LayoutError(f"hsdp={replicas} replicas do not divide dp={dp}; choose a divisor of dp")
            values["dp_shard"] = dp // replicas
        return cls.from_dict(values)

    # --- checks -------------------------------------------------------------------------
    def check(self) -> None:
        """Checks that need no model or cluster: ranges, enums, divisibility of the batch."""
        for name in ("dp", "tp", "pp", "cp", "ep", "virtual_stages", "mbs", "seq"):
            value = getattr(self, name)
            if value < 1:
                raise LayoutError(f"{name}={value} must be at least 1")
        for name in ("dp", "tp", "pp", "cp", "ep", "etp", "redundant_experts", "virtual_stages", "dp_shard", "mbs", "gbs", "seq"):
            limit = _LIMITS.get(name, 2**20)
            if getattr(self, name) > limit:
                raise LayoutError(f"{name}={getattr(self, name)} is above the accepted {limit:,}")
        if self.etp < 0:
            raise LayoutError(f"etp={self.etp} must be at least 1 (or 0 for the default)")
        if self.redundant_experts < 0:
            raise LayoutError(f"redundant_experts={self.redundant_experts} must be 0 (plain EP) or more")
        if self.redundant_experts and self.ep == 1:
            raise LayoutError(f"redundant_experts={self.redundant_experts} needs expert parallelism (ep > 1): "
                              f"replicas balance the EP ranks; set ep or drop redundant_experts")
        if self.zero not in (0, 1, 2, 3):
            raise LayoutError(f"zero={self.zero} is not a ZeRO stage; valid: 0, 1, 2, 3")
        if self.dp_shard < 0 or (self.dp_shard and self.dp % self.dp_shard):
            raise LayoutError(f"dp_shard={self.dp_shard} does not divide dp={self.dp}; valid: {_divisors(self.dp)}")
        if self.dp_shard and self.dp_shard < self.dp and self.zero == 0:
            raise LayoutError("dp_shard < dp (HSDP) needs zero=1..3; add zero=3")
        _enum("schedule", self.schedule, SCHEDULES)
        if self.recompute not in RECOMPUTE:
            recompute_modules(self.recompute)
        _enum("param_dtype", self.param_dtype, COMPUTE_DTYPES)
        _enum("fp8_scaling", self.fp8_scaling, FP8_SCALING)
        for name in ("grad_dtype", "optim_dtype"):
            _enum(name, getattr(self, name), TRAIN_DTYPES)
        _enum("weight_dtype", self.weight_dtype, WEIGHT_DTYPES)
        _enum("kv_dtype", self.kv_dtype, KV_DTYPES)
        if self.sp and self.tp == 1:
            raise LayoutError("sequence parallelism (sp) needs tp > 1; drop sp or set tp=2 or more")
        if self.virtual_stages > 1 and self.schedule != "interleaved-1f1b":
            raise LayoutError(
                f"virtual_stages={self.virtual_stages} needs schedule=interleaved-1f1b (got {self.schedule})"
            )
        if self.gbs and self.gbs % (self.mbs * self.dp):
            raise LayoutError(
                f"gbs={self.gbs} is not a multiple of mbs x dp = {self.mbs} x {self.dp}; "
                f"use gbs={self.mbs * self.dp * max(1, round(self.gbs / (self.mbs * self.dp)))}"
            )
        if self.schedule == "interleaved-1f1b" and self.pp > 1 and self.num_microbatches % self.pp:
            raise LayoutError(
                f"interleaved-1f1b needs the micro-batch count ({self.num_microbatches}) to be a multiple of pp={self.pp}"
            )

    def _precision_problems(self, cluster: "ClusterSpec") -> list[str]:
        if self.param_dtype not in ("fp8", "mxfp8"):
            return []
        dev = cluster.device
        if "fp8" not in dev.peak_flops:
            return [f"param_dtype={self.param_dtype}: {dev.name} has no FP8 tensor cores; use bf16"]
        if self.param_dtype == "mxfp8" and not _blackwell(dev.name):
            return [f"param_dtype=mxfp8 needs Blackwell (B200/GB200/B300/GB300) MX block scaling; {dev.name} "
                    f"runs per-tensor fp8 (param_dtype=fp8)"]
        return []

    def validate_precision(self, cluster: "ClusterSpec") -> None:
        """Raise LayoutError if ``cluster``'s device cannot run this layout's param_dtype."""
        problems = self._precision_problems(cluster)
        if problems:
            raise LayoutError("; ".join(problems))

    def validate(self, model: "ModelSpec", cluster: "ClusterSpec | None" = None, world_size: int | None = None) -> None:
        """Raise LayoutError, naming every factor that disagrees, if this layout cannot run
        ``model`` on ``cluster`` (or on ``world_size`` ranks)."""
        self.check()
        problems = []
        devices = cluster.num_devices if cluster is not None else world_size
        if devices is not None and self.world_size != devices:
            where = f"the cluster {cluster.name} has" if cluster is not None else "there are"
            problems.append(
                f"dp x cp x tp x pp = {self.dp} x {self.cp} x {self.tp} x {self.pp} = {self.world_size} "
                f"but {where} {devices} devices"
            )
        heads = model.num_heads
        if heads % self.tp:
            problems.append(
                f"tp={self.tp} does not divide {heads} attention heads; valid tp: {_fmt(_divisors(heads))}"
            )
        kv = model.num_kv_heads
        if model.attention_kind == "gqa" and kv % self.tp and self.tp % kv:
            problems.append(
                f"tp={self.tp} and {kv} kv heads: one must divide the other to shard or replicate kv heads"
            )
        if model.ffn_size % self.tp:
            problems.append(f"tp={self.tp} does not divide ffn size {model.ffn_size}; valid tp: {_fmt(_divisors(model.ffn_size))}")
        if model.is_moe and self.expert_tp == self.tp and model.expert_ffn_size % self.tp:
            problems.append(f"tp={self.tp} does not divide expert ffn size {model.expert_ffn_size}")
        stage_problem = stage_count_problem(model.num_layers, self.pp * self.virtual_stages)
        if stage_problem:
            problems.append(stage_problem)
        if self.ep > 1:
            if not model.is_moe:
                problems.append(f"ep={self.ep} but {model.name} has no experts; use ep=1")
            else:
                problems += _expert_problems(self.ep, self.redundant_experts, model.num_experts)
                etp, ranks = self.expert_tp, self.tp * self.cp * self.dp
                if ranks % (etp * self.ep) and self.tp == 1:
                    problems.append(
                        f"ep={self.ep} must divide dp x cp = {self.dp * self.cp} (experts are sharded over the "
                        f"data/context-parallel ranks); valid ep: {_fmt(_divisors(self.dp * self.cp))}"
                    )
                elif ranks % (etp * self.ep):
                    problems.append(
                        f"etp x ep = {etp} x {self.ep} must divide tp x cp x dp = {ranks} (the expert mesh "
                        f"ETP x EP x EDP covers the attention mesh's ranks); with etp={etp} valid ep: "
                        f"{_fmt(_divisors(ranks // etp if ranks % etp == 0 else 1))}"
                        + ("" if etp == 1 else "; or set etp=1 to fold EP over the tensor-parallel ranks")
                    )
                if model.expert_ffn_size % etp:
                    problems.append(f"etp={etp} does not divide expert ffn size {model.expert_ffn_size}")
        if self.cp > 1 and self.seq % (2 * self.cp):
            problems.append(
                f"seq={self.seq} is not a multiple of 2 x cp = {2 * self.cp} (zig-zag ring attention chunks)"
            )
        if self.sp and (self.seq // self.cp) % self.tp:
            # each context-parallel rank's chunk is what SP splits over the TP group
            problems.append(
                f"sequence parallelism needs seq/cp = {self.seq // self.cp} tokens per rank divisible by tp={self.tp}"
            )
        if cluster is not None:
            problems += self._precision_problems(cluster)
        if problems:
            raise LayoutError("; ".join(problems))


def _expert_problems(ep: int, redundant: int, experts: int) -> list[str]:
    """The one rule for how routed experts split over ``ep`` ranks: ``ep`` divides ``E + R``
    (``E`` experts, ``R`` redundant replicas, EPLB), and ``R`` is at most ``E`` (beyond one replica
    of every expert, a larger ``ep`` or plain expert-data parallelism does the same)."""
    if redundant > experts:
        return [f"redundant_experts={redundant} exceeds the model's {experts} experts (at most one extra replica "
                f"each); valid: 0..{experts}, with ep dividing {experts} + redundant_experts"]
    total = experts + redundant
    if total % ep == 0:
        return []
    if redundant == 0:
        fixes = [r for r in range(1, experts + 1) if (experts + r) % ep == 0][:4]
        hint = f"; or keep ep={ep} with redundant_experts={fixes[0]} (EPLB)" if fixes else ""
        return [f"ep={ep} does not divide {experts} experts; valid ep: {_fmt(_divisors(experts))}{hint}"]
    fixes = [r for r in range(0, experts + 1) if (experts + r) % ep == 0][:4]
    valid_r = f"with ep={ep} valid redundant_experts: {_fmt(fixes)}" if fixes else f"no redundant_experts fits ep={ep}"
    return [f"ep={ep} does not divide {experts} + {redundant} = {total} physical experts ({experts} experts + "
            f"redundant_experts={redundant}); {valid_r}; or ep in {_fmt(_divisors(total))}"]


def _blackwell(name: str) -> bool:
    return name.upper().startswith(("B200", "GB200", "B300", "GB300", "B100"))


def _divisors(n: int, limit: int = 128) -> list[int]:
    """Divisors of ``n`` up to ``limit`` (no parallel degree of interest is larger)."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _fmt(values: list[int]) -> str:
    return ", ".join(map(str, values))


def _enum(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise LayoutError(f"{name}={value!r} is not one of: {', '.join(valid)}")


def _int(name: str, value) -> int:
    if isinstance(value, bool):
        raise LayoutError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    try:
        return int(str(value))
    except ValueError:
        raise LayoutError(f"{name}={value!r} is not an integer") from None


def _coerce(name: str, value, annotation: str):
    if annotation == "int":
        return _int(name, value)
    if annotation == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in ("1", "true", "on", "yes"):
            return True
        if text in ("0", "false", "off", "no"):
            return False
        raise LayoutError(f"{name}={value!r} is not a boolean (true/false)")
    text = str(value).lower()
    text = _ALIASES.get(name, {}).get(text, text)
    if name == "recompute" and text not in RECOMPUTE:
        text = canonical_recompute(text)
    return text
