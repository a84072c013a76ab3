"""Quality of quantised weights and KV cache on a tiny trained model, beside the planner's stated cost.

    OMP_NUM_THREADS=1 python benchmarks/quant_quality.py --out benchmarks/results/quant_quality.json

1. Trains a byte-level llama (vocabulary 256, hidden 256, 4 layers, 4 heads of 64, 2 kv heads,
   ffn 512: 2.5M parameters) for ``--steps`` AdamW steps on a local text (this repository's
   Markdown and Python files, concatenated in sorted order; the last 10% held out). Training
   runs the runtime's own ``Trainer`` and ``TokenFile`` (what ``modelcarve run --data FILE``
   executes on each rank), in process, single device, fp32, because ``modelcarve run`` does not
   save weights.
2. On ``--eval-batches`` held-out windows, compares each quantised variant with the unquantised
   fp32 model on every position: top-1 agreement (argmax equal), mean KL(p_ref || p_quant) in
   nats per token, and both models' held-out cross-entropy. Variants: weights int8, int4 g32 /
   g64 / g128, fp8 (runtime/engine/quant.py quantize_model, fp32 activations), and the KV cache in int8
   and fp8 (k and v quantised and dequantised per (token, head) exactly as quant.quantize_kv
   stores them, weights fp32).
3. Writes each variant's figures beside the planner's stated quality cost of that dtype
   (plan/cost/quant.py WEIGHT_FORMATS / KV_FORMATS) and the measured resident weight bytes.

These are quality figures, not timings; they do not depend on load (same seed, same result).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

CONFIG = dict(model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
              tie_word_embeddings=False)


def write_corpus(path: Path) -> dict:
    files = sorted(p for p in ROOT.rglob("*") if p.suffix in (".md", ".py") and ".git" not in p.parts
                   and "results" not in p.parts)
    text = b"\n".join(p.read_bytes() for p in files)
    text = bytes(b for b in text if b < 128)  # ASCII only: byte ids < 128 of the 256 vocabulary
    cut = int(len(text) * 0.9)
    (path / "train.txt").write_bytes(text[:cut])
    (path / "heldout.txt").write_bytes(text[cut:])
    return dict(files=len(files), train_bytes=cut, heldout_bytes=len(text) - cut)


def _fake_quant_kv(kind: str):
    from modelcarve.runtime.engine.quant import dequantize_kv, quantize_kv

    def hook(module, args, kwargs):
        q, k, v = args[:3]
        return (q, dequantize_kv(*quantize_kv(k, kind), k.dtype), dequantize_kv(*quantize_kv(v, kind), v.dtype),
                *args[3:]), kwargs

    return hook


def _compare(ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    ref_logp, logp = ref_logits.log_softmax(-1), logits.log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    return dict(top1_agreement=(ref_logits.argmax(-1) == logits.argmax(-1)).float().mean().item(),
                kl_nats_per_token=kl.mean().item(), kl_max=kl.max().item(),
                heldout_ce=torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item())


def worker(workdir: str, steps: int, eval_batches: int, seq: int, gbs: int, lr: float) -> dict | None:
    import copy

    from modelcarve.plan.cost.quant import KV_FORMATS, QUALITY_SHORT, WEIGHT_FORMATS
    from modelcarve.runtime.distributed.mesh import build_mesh
    from modelcarve.runtime.model.transformer import build_model
    from modelcarve.runtime.parallel.parallelize import parallelize
    from modelcarve.runtime.engine.quant import quantize_model, weight_bytes
    from modelcarve.runtime.train.trainer import TokenFile, TrainConfig, Trainer, seed_everything
    from modelcarve.spec.hf_config import spec_from_hf_config
    from modelcarve.spec.layout import Layout

    spec = spec_from_hf_config(CONFIG, name="quant-quality-bytes")
    layout = Layout.parse(f"dp=1,seq={seq},gbs={gbs},param_dtype=fp32")
    seed_everything(0)
    chunks = parallelize(build_model(spec, seed=0), layout, build_mesh(layout))
    trainer = Trainer(chunks, layout, build_mesh(layout), TrainConfig(lr=lr, seed=0))
    data = TokenFile(Path(workdir) / "train.txt", spec.vocab_size, seed=0)
    losses, start = [], time.perf_counter()
    for step in range(steps):
        losses.append(trainer.step(*data.batch(step, gbs, seq))["loss"])
    train_s = time.perf_counter() - start
    model = chunks[0].eval()
    held = TokenFile(Path(workdir) / "heldout.txt", spec.vocab_size, seed=1)
    batches = [held.batch(i, 8, seq) for i in range(eval_batches)]
    with torch.no_grad():
        ref = [model(t) for t, _ in batches]
    targets = torch.cat([y for _, y in batches])
    ref_all = torch.cat(ref)
    ref_ce = torch.nn.functional.cross_entropy(ref_all.flatten(0, 1), targets.flatten()).item()
    variants = []
    for kind, group in (("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128), ("fp8", 0)):
        quant = quantize_model(copy.deepcopy(model), kind, group_size=group or 128)
        with torch.no_grad():
            got = torch.cat([quant(t) for t, _ in batches])
        fmt = WEIGHT_FORMATS[kind]
        variants.append(dict(what="weights", dtype=kind, group_size=group or None,
                             weight_bytes_fp32_base=weight_bytes(quant),
                             planner_quality=fmt.quality, planner_short=QUALITY_SHORT[kind],
                             planner_bytes_per_weight=fmt.bytes_per_param(spec.hidden_size),
                             ) | _compare(ref_all, got, targets))
    for kind in ("int8", "fp8"):
        kv = copy.deepcopy(model)
        for block in kv.layers.values():
            block.attention.core_attention.register_forward_pre_hook(_fake_quant_kv(kind), with_kwargs=True)
        with torch.no_grad():
            got = torch.cat([kv(t) for t, _ in batches])
        variants.append(dict(what="kv_cache", dtype=kind, scales="fp16 per (token, head)",
                             planner_quality=KV_FORMATS[kind][1]) | _compare(ref_all, got, targets))
    return dict(model=CONFIG, params=sum(p.numel() for p in model.parameters()), layout=layout.short(),
                steps=steps, seq=seq, gbs=gbs, lr=lr, train_seconds=round(train_s, 1),
                loss_first=losses[0], loss_last_10_mean=sum(losses[-10:]) / len(losses[-10:]),
                heldout_tokens=targets.numel(), reference_heldout_ce=ref_ce, variants=variants)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/quant_quality.json"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--gbs", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    from dist import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(Path(tmp))
        result = run_distributed(worker, 1, tmp, args.steps, args.eval_batches, args.seq, args.gbs, args.lr,
                                 timeout=3600)[0]
    result["corpus"] = corpus | dict(source="this repository's *.md and *.py files (ASCII bytes), sorted, "
                                            "last 10% held out")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for v in result["variants"]:
        print(f"{v['what']:8} {v['dtype']:5} g={v.get('group_size') or '-':<4} top1 {v['top1_agreement']:.4f} "
              f"KL {v['kl_nats_per_token']:.5f} CE {v['heldout_ce']:.4f} (ref {result['reference_heldout_ce']:.4f})"
              f"  planner: {v['planner_quality'][:60]}")


if __name__ == "__main__":
    main()
