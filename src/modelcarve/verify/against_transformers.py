"""verify --reference transformers: our single-device reference AND a split layout against
transformers' own model on the same checkpoint, so a wrong reference cannot pass.

    modelcarve verify --reference transformers --model ./my-checkpoint --layout "tp=2" --dtype fp32

The prompts: ``gbs`` rows of random token ids (seeded) of different lengths, ``seq - new_tokens``
for the first row and shorter for the others; transformers' ``generate(do_sample=False)``
extends each by ``new_tokens`` greedy tokens (no end-of-sequence stop, no repetition penalty:
a fresh GenerationConfig); the rows are padded with id 0 to the layout's ``seq``. Compared on
rank 0, each against a stated tolerance (verify.TOLERANCES of the dtype, greedy: exactly):

* ``logits/reference``, ``logits/split``: our single-device model's and the split model's logits
  of those rows against transformers' (max abs diff, every position),
* ``greedy/reference``: our reference decodes greedily by repeated full-sequence forward from
  each prompt; the count of generated tokens that differ from transformers',
* ``greedy/split``: the split model's argmax at every generated position of transformers'
  sequences, against the next token (teacher-forced: for a causal model this equals greedy
  decoding token for token; the split layouts' shape rules -- pipeline micro-batches, cp
  chunks, sp -- fix the sequence length, so the split side does not grow one token at a time).

Every rank builds the split model from its checkpoint slices (runtime/build.py's build_chunks); rank 0 also holds
the reference and transformers' model (AutoModelForCausalLM, fp32, CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from modelcarve.verify.reference import TOLERANCES, Check, compare, gather_logits


def _prompt_lengths(gbs: int, seq: int, new_tokens: int) -> list[int]:
    longest = seq - new_tokens
    return [max(1, longest - (i * max(1, longest // max(1, gbs))) % longest) for i in range(gbs)]


def _transformers_rows(path: str, vocab: int, gbs: int, seq: int, new_tokens: int, seed: int):
    """(transformers' model, [gbs, seq] prompt + greedy continuation rows, prompt lengths)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # else generate falls back to the checkpoint's end-of-sequence id
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                              repetition_penalty=1.0)
    gen = torch.Generator().manual_seed(seed)
    lengths = _prompt_lengths(gbs, seq, new_tokens)
    rows = torch.zeros(gbs, seq, dtype=torch.long)
    with torch.no_grad():
        for i, n in enumerate(lengths):
            prompt = torch.randint(0, vocab, (1, n), generator=gen)
            out = hf.generate(prompt, generation_config=config, attention_mask=torch.ones_like(prompt))
            if out.shape[1] != n + new_tokens:
                raise RuntimeError(f"transformers generated {out.shape[1] - n} tokens, not {new_tokens}")
            rows[i] = torch.cat([out[0], rows.new_zeros(seq - out.shape[1])])
    return hf, rows, lengths


def _mismatches(logits: torch.Tensor, rows: torch.Tensor, lengths: list[int], new_tokens: int) -> int:
    """Generated positions whose argmax is not the next token of ``rows``."""
    bad = 0
    for i, n in enumerate(lengths):
        predicted = logits[i, n - 1 : n - 1 + new_tokens].argmax(-1)
        bad += int((predicted != rows[i, n : n + new_tokens]).sum())
    return bad


def _greedy(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    ids = prompt[None]
    for _ in range(new_tokens):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, prompt.numel():]


def _count_check(name: str, bad: int, total: int) -> Check:
    return Check(name, float(bad), bad / max(1, total), 0.0, "abs")


def verify_transformers_worker(model: str, layout: str, seed: int = 0, dtype: str | None = None,
                               new_tokens: int = 8, **_unused) -> dict | None:
    """Run on every rank after init_distributed(); returns the report on rank 0 (None elsewhere)."""
    from modelcarve.runtime.checkpoint.hf_load import load_model
    from modelcarve.runtime.distributed.mesh import build_mesh, device_type
    from modelcarve.runtime.build import build_chunks
    from modelcarve.runtime.train.trainer import TrainConfig, Trainer, seed_everything
    from modelcarve.spec.layout import Layout

    lay = Layout.parse(layout)
    if dtype:
        lay = lay.replace(param_dtype=dtype)
    seed_everything(seed)
    mesh = build_mesh(lay)
    chunks, spec = build_chunks(model, lay, mesh, seed=seed, device=device_type())  # checkpoint slices per rank
    runner = Trainer(chunks, lay, mesh, TrainConfig(seed=seed)).runner  # the pipeline schedule, when pp > 1
    new_tokens = max(1, min(new_tokens, lay.seq - 1))
    rank0 = dist.get_rank() == 0
    rows = torch.zeros(lay.global_batch, lay.seq, dtype=torch.long)
    if rank0:
        hf, rows, lengths = _transformers_rows(model, spec.vocab_size, lay.global_batch, lay.seq, new_tokens, seed)
    dist.broadcast(rows, src=0)
    split = gather_logits(chunks, lay, mesh, rows, runner)
    if not rank0:
        return None
    tol = TOLERANCES["bf16" if lay.param_dtype == "bf16" else "fp32"]
    reference, _ = load_model(model, seed=seed)
    reference.eval()
    with torch.no_grad():
        want = hf(rows).logits.float()
        ref_logits = reference(rows).float()
        ref_bad = sum(int((_greedy(reference, rows[i, :n], new_tokens) != rows[i, n : n + new_tokens]).sum())
                      for i, n in enumerate(lengths))
    total = new_tokens * len(lengths)
    checks = [compare("logits/reference", ref_logits, want, tol["logits"]),
              _count_check("greedy/reference", ref_bad, total)]
    if split is not None:
        checks += [compare("logits/split", split, want, tol["logits"]),
                   _count_check("greedy/split", _mismatches(split, rows, lengths, new_tokens), total)]
    return dict(model=spec.name, layout=lay.short(), layout_fields=lay.to_dict(), world_size=dist.get_world_size(),
                steps=0, dtype=lay.param_dtype, tolerances=tol, reference="transformers",
                prompt_lengths=lengths, new_tokens=new_tokens, checks=[c.to_dict() for c in checks],
                passed=all(c.passed for c in checks), kinds=["logits", "greedy"], moe=[], memory=[])
