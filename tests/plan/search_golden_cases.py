"""The searches whose answers the speed work must not change (tests/plan/test_search_golden.py).

``SUITE`` runs in the test suite (small clusters, each well under a second); ``FRONTIER`` are
the two full-scale searches of benchmarks/plan_speed.py, recorded too and checked by that
benchmark. ``answer`` reduces a search to what a user sees: the top ``TOP`` layouts (the whole
estimate JSON of each), the counts of candidates evaluated and rejected per reason, and the
alternatives (each's short form, family or reject reason, and score). The golden files were
written by ``python tests/plan/search_golden_cases.py`` on the commit before the speed work
(187ce0a), and are never rewritten to make a test pass. A change of the cost model itself re-records
them, each in its own commit that says why: 2026-12-05, the MoE combine keeps no expert outputs
(Megatron-Core 0.13+, plan/cost/activations.py): the MoE searches' activation memory and so their
rejections and top 10 moved; the dense ones are unchanged. 2026-12-05 again: context parallelism's
ring-attention buffers (plan/train/profile.py ``cp_ring_bytes``) join the comm buffers: every suite's
CP layouts hold a little more, a few more candidates are rejected, no top 10 changes order; and the MoE
dispatch buffers count the tokens an expert-TP shard sees (T k etp / tp, as the activations do): the MoE
suites reject a few more, no top 10 changes order. 2026-12-06: Megatron-Core's unfused cross entropy
(the default ``loss="materialized"``) priced at the 6 bytes a logit measured with Megatron-Core 0.15.3,
not 10 (plan/train/profile.py ``LOGITS_BYTES_PER_ELEM``): last stages hold less, fewer candidates are
rejected, no top 10 changes (their worst stage is not the last); qwen3's and kimi-k2's alternatives
move. 2026-12-06 again: the flex dispatcher (the default ``moe_dispatcher="fused"``) sends a token
across nodes once per other node holding one of its experts, NVLink fanning it out (plan/cost/comm.py
``moe_remote_nodes``): EP across nodes costs less, so kimi-k2's top 10 moves from EP8 in a node to
EP16 over two (CP2-PP16-DP8-Z1-EP16 first), qwen3's keeps its first five and takes EP16 layouts
at 6-7; deepseek-v3-128xH100's alternatives move; the frontier DeepSeek-V3 on 2,048 x 8 H100 moves
from EP8 inside a node to EP16 over two nodes (CP2-PP32-DP256-Z1-EP16 first; re-recorded only on
2026-12-06 when benchmarks/plan_speed.py, which checks the frontier files, was next run: the answer of
1262ac1, the commit that changed it, equals the recorded one).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TOP = 10
GOLDEN = Path(__file__).parent / "golden"

SUITE = [
    # (id, model, cluster, goal, options)
    ("llama-3.1-70b-64xH100", "llama-3.1-70b", "8x8xH100", "train", {"global_batch": 512, "seq": 4096}),
    ("llama-3.1-70b-64xH100-fp8", "llama-3.1-70b", "8x8xH100", "train", {"global_batch": 512, "seq": 8192, "precision": "fp8"}),
    ("gpt3-175b-1024xA100", "gpt3-175b", "128x8xA100-80GB", "train", {"global_batch": 1536, "seq": 2048}),
    ("qwen3-235b-128xH100", "qwen3-235b-a22b", "16x8xH100", "train", {"global_batch": 512, "seq": 4096}),
    ("kimi-k2-256xH200", "kimi-k2", "32x8xH200", "train", {"global_batch": 1024, "seq": 4096}),
    ("deepseek-v3-128xH100", "deepseek-v3", "16x8xH100", "train", {"global_batch": 960, "seq": 4096}),
    ("mixtral-8x7b-16xH100-fused", "mixtral-8x7b", "2x8xH100", "train", {"global_batch": 256, "seq": 4096, "loss": "fused"}),
    ("llama-3.1-70b-8xH100-serve", "llama-3.1-70b", "1x8xH100", "serve-throughput", {}),
]

FRONTIER = [
    ("deepseek-v3-16384xH100", "deepseek-v3", "2048x8xH100", "train", {"global_batch": 15360, "seq": 4096}),
    ("gpt-1t-131072xH100", "gpt-1t", "16384x8xH100", "train", {"global_batch": 16384, "seq": 2048}),
]


def run(case: tuple) -> dict:
    """The search of ``case``, reduced by ``answer``, through JSON (as a golden file holds it)."""
    from modelcarve.plan.search import search
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.hardware import parse_cluster

    _id, model, cluster, goal, options = case
    result = search(get_model(model), parse_cluster(cluster), goal, top=TOP, **options)
    return json.loads(json.dumps(answer(result)))


def answer(result: dict) -> dict:
    return {
        "layouts": result["layouts"],
        "evaluated": result["evaluated"],
        "rejected": result["rejected"],
        "alternatives": [
            {"short": a.get("short"), "family": a.get("family"), "reject_category": a.get("reject_category"),
             "why": a.get("why"), "tokens_per_s": (a.get("time") or {}).get("tokens_per_s")}
            for a in result["alternatives"]
        ],
    }


def golden_path(case: tuple) -> Path:
    return GOLDEN / f"{case[0]}.json"


if __name__ == "__main__":
    cases = SUITE + FRONTIER if len(sys.argv) < 2 else [c for c in SUITE + FRONTIER if c[0] in sys.argv[1:]]
    GOLDEN.mkdir(exist_ok=True)
    for case in cases:
        golden_path(case).write_text(json.dumps(run(case), indent=1, sort_keys=True) + "\n")
        print("wrote", golden_path(case))
