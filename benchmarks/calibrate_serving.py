"""Serving planner vs published measured serving results; writes JSON and docs/calibration_serving.md.

Usage::

    .venv/bin/python benchmarks/calibrate_serving.py          # benchmarks/results/calibrate_serving.json
                                                             # and docs/calibration_serving.md
    .venv/bin/python benchmarks/calibrate_serving.py --fit    # also refit the three decode constants

The published figures and their sources are in data/serving_published.csv (header comments).
Rows marked ``fit`` are those the decode constants of plan/serve/rates.py were fitted to
(``--fit`` prints that fit; the constants are then written into serve_rates.py by hand, with the
fit's figures beside them); ``check`` rows are independent checks; ``excluded`` rows are shown
with the reason they are not used.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from modelcarve.plan.serve import rates as serve_rates
from modelcarve.plan.serve.calibration import TOLERANCE, calibrate, fit_decode_constants

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "serving_published.csv"
SOURCES = {
    "trtllm": "NVIDIA TensorRT-LLM Performance Overview (docs/source/performance/perf-overview.md @ 00f37686), "
    "trtllm-bench throughput, H100 SXM 80GB, ModelOpt FP8 checkpoints, total output tokens/s at infinite request rate",
    "vllm-a100": "J. Musgrave, 'vLLM throughput-latency sweep on NVIDIA A100' (johnmusgrave.com): vLLM 0.23.0, "
    "A100 40GB, Llama-3.1-8B-Instruct bf16, 1024 in / 128 out, concurrency 1: ~75 tokens/s",
    "vllm-h100": "InferenceBench concurrency-sweep recipe (yobitelcomm.github.io/bench): vLLM 0.21.0, H100-80GB, "
    "Llama-3.1-8B-Instruct fp16, concurrency 1, TPOT p50 6.48 ms (prompt lengths not stated; 512/256 assumed)",
    "trtllm-fp4": "TensorRT-LLM Performance Overview (@ 00f37686), Blackwell tables: B200 and GB200 NVL72, ModelOpt NVFP4 "
    "checkpoints (Llama-3.3-70B, Llama-3.1-405B, Qwen3-235B-A22B, Qwen3-30B-A3B), total output tokens/s at infinite rate",
    "sglang-disagg": "SGLang team, 'Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism on 96 H100 "
    "GPUs' (lmsys.org, 2025-05-05): prefill EP32 50,302 input tok/s per node (4K prompts), decode EP72 22,282 output tok/s per node",
    "gpt-fast": "pytorch-labs/gpt-fast README @ 0f925b5d: 8x A100-80GB (330 W, hybrid cube mesh), batch 1, 5-token "
    "prompt, torch.compile; Llama-2-7B and -70B at TP 1-8 in bf16, and weight-only int8/int4",
}


def _fmt(value: float, metric: str) -> str:
    if metric == "tpot_ms":
        return f"{value:.2f} ms"
    return f"{value:,.0f} tok/s/dev" if metric.endswith("_per_device") else f"{value:,.0f} tok/s"


def _summary(rows: list[dict]) -> str:
    errors = [abs(r["error"]) for r in rows]
    if not errors:
        return "none"
    inside = sum(e <= TOLERANCE for e in errors)
    return (f"{inside} of {len(rows)} within ±{TOLERANCE:.0%}, median |error| {statistics.median(errors):.1%}, "
            f"max {max(errors):.1%}")


def markdown(rows: list[dict], fit: dict | None) -> str:
    checks = [r for r in rows if r["role"] == "check"]
    fits = [r for r in rows if r["role"] == "fit"]
    lines = [
        "# Serving planner calibration",
        "",
        "Regenerate with `.venv/bin/python benchmarks/calibrate_serving.py` (data: `data/serving_published.csv`,",
        "every source cited in its header).",
        "",
        "Each row is a published, measured serving result beside the planner's prediction for the same model, device,",
        "layout (TP, weight and KV dtype) and request shape. Offline throughput rows (concurrency `max`) use the",
        "`serve-throughput` goal on the publisher's layout with no latency bounds, so the planner picks the batch",
        "(the largest that fits, at most 1024); latency rows use `serve-latency` at the stated concurrency.",
        "",
        "Three constants of `plan/serve/rates.py` are fitted to the rows marked **fit** (batch-1 latencies:",
        f"`DECODE_HBM_EFFICIENCY` = {serve_rates.DECODE_HBM_EFFICIENCY:.2f}, `LAYER_OVERHEAD_S` = "
        f"{serve_rates.LAYER_OVERHEAD_S * 1e6:.1f} µs, `ALLREDUCE_FLOOR_S` = {serve_rates.ALLREDUCE_FLOOR_S * 1e6:.1f} µs;",
        "`--fit` reruns the least-squares fit). The rows marked **check** are independent of every constant.",
        "",
        f"**Checks: {_summary(checks)}.**  Fit rows: {_summary(fits)}.",
        "",
        "By source: " + "; ".join(f"{src} checks {_summary([r for r in checks if r['source'] == src])}"
                                  for src in dict.fromkeys(r["source"] for r in checks)) + ".",
        f"FP4 rows: one constant, `FP4_GEMM_FRACTION` = {serve_rates.FP4_GEMM_FRACTION:.2f} (share of the FP4 peak), fitted to the "
        f"{sum(r['role'] == 'fit-fp4' for r in rows)} `fit-fp4` rows ({_summary([r for r in rows if r['role'] == 'fit-fp4'])}). "
        "Wide-EP rows (sglang-disagg): no constant fitted; the exchange model is plan/serve/ep.py.",
        "",
        "| role | source | model | devices | layout | dtype (w/kv) | in/out | conc. | measured | predicted | error | batch | bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {"check": 0, "fit": 1, "fit-fp4": 1, "excluded": 2}
    for r in sorted(rows, key=lambda r: order[r["role"]]):
        flag = "" if abs(r["error"]) <= TOLERANCE or r["role"] == "excluded" else " ✗"
        lines.append(
            f"| {r['role']} | {r['source']} | {r['model']} | {r['devices']}x{r['device']} | {r['layout']} "
            f"| {r['weight_dtype']}/{r['kv_dtype']} | {r['input_len']}/{r['output_len']} | {r['concurrency'] or 'max'} "
            f"| {_fmt(r['measured'], r['metric'])} | {_fmt(r['predicted'], r['metric'])} | {r['error']:+.1%}{flag} "
            f"| {r['batch']} | {r['bound']} |"
        )
    if fit:
        lines += ["", "## The fit", "", "```", json.dumps(fit, indent=2), "```"]
    lines += ["", "## Sources", ""]
    lines += [f"- **{key}**: {text}" for key, text in SOURCES.items()]
    misses = [r for r in checks if abs(r["error"]) > TOLERANCE]
    lines += ["", "## Where the model misses", ""]
    if misses:
        lines.append(
            "Check rows outside ±20%: "
            + "; ".join(f"{r['source']} {r['model']} {r['layout']} {r['input_len']}/{r['output_len']} ({r['error']:+.0%})" for r in misses)
            + "."
        )
    lines += [
        "",
        "Excluded rows: gpt-fast's weight-only int8/int4 kernels are bound by dequantisation (its own table shows them",
        "streaming 1069 and 863 GB/s against 1397 GB/s in bf16); the planner assumes quantised decode kernels stream",
        "weights at the bf16 rate, as Marlin-style and TensorRT-LLM fp8 kernels do, so those rows are shown, not used.",
        "Qwen3-30B-A3B (FP4, one B200/GB200) is excluded: at 3.3B active parameters per token the engine's per-step",
        "host and scheduling cost, which the planner does not model, bounds it (the planner is 37-380% high).",
        "FP4 GEMMs: the GEMM efficiency model's memory roofline reads an FP4 weight as 0.5625 bytes (NVFP4 with its",
        "scales; plan/cost/efficiency.py), and one fitted constant scales the FP4 peak (FP4_GEMM_FRACTION).",
        "",
        "Not modelled, and candidates for the remaining errors (none fitted): the KV-cache capacity an engine leaves",
        "after its activation buffers and CUDA graphs (the planner keeps 1 GiB plus one prefill chunk's activations),",
        "attention kernels with one KV head per GPU reading below the weight-streaming bandwidth, NCCL reaching less",
        "than its peak bus bandwidth on the few-MB all-reduces of large decode batches, and scheduler overhead.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="refit the decode constants to the fit rows and print them")
    args = parser.parse_args()
    fit = fit_decode_constants(DATA, grid=81) if args.fit else None
    rows = calibrate(DATA)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibrate_serving.json").write_text(json.dumps({"tolerance": TOLERANCE, "fit": fit, "rows": rows}, indent=2))
    (ROOT / "docs" / "calibration_serving.md").write_text(markdown(rows, fit))
    if fit:
        print("fit:", json.dumps(fit))
    for role in ("check", "fit", "fit-fp4", "excluded"):
        print(f"{role:8s}: {_summary([r for r in rows if r['role'] == role])}")
    for r in rows:
        print(f"{r['role']:8s} {r['source']:9s} {r['model']:15s} {r['layout']:5s} {r['input_len']:>6}/{r['output_len']:<5} "
              f"measured {_fmt(r['measured'], r['metric']):>14s} predicted {_fmt(r['predicted'], r['metric']):>14s} {r['error']:+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
