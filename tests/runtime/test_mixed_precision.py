"""Mixed precision as it is run at scale (issue 26): ZeRO-1/2 with ``param_dtype=bf16`` hold bf16
parameters, the fp32 master weights and fp32 Adam moments in the distributed optimiser, and
fp32 gradients accumulated across micro-batches (zero_optimizer.py); a checkpoint holds the
fp32 master weights, and resuming from it is bit-identical (real gloo processes).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: dist.py
from dist import run_distributed  # noqa: E402

LAYOUT = "dp=2,zero={zero},gbs=8,seq=16,mbs=2,param_dtype=bf16"


def _worker(root):
    import torch
    import torch.distributed as dist

    from modelcarve.runtime.train.launch import run_worker

    out = {}
    for zero in (1, 2):
        layout = LAYOUT.format(zero=zero)
        ckpt = f"{root}/z{zero}"
        full = run_worker("tiny-llama", layout, steps=4, quiet=True, checkpoint=dict(checkpoint_dir=ckpt, save_every=2))
        dist.barrier()
        resumed = run_worker("tiny-llama", layout, steps=4, quiet=True,
                             checkpoint=dict(resume=f"{ckpt}/step_00000002"))
        dist.barrier()
        if dist.get_rank() == 0:
            out[zero] = dict(full=[h["loss"] for h in full["history"]], resumed=[h["loss"] for h in resumed["history"]])
    # what one built trainer holds
    from modelcarve.runtime.build import build_chunks
    from modelcarve.runtime.distributed.mesh import build_mesh
    from modelcarve.runtime.train.trainer import Trainer
    from modelcarve.spec.layout import Layout

    layout = Layout.parse(LAYOUT.format(zero=1))
    mesh = build_mesh(layout)
    chunks, _spec = build_chunks("tiny-llama", layout, mesh)
    fp32 = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    trainer = Trainer(chunks, layout, mesh)
    opt = trainer.optimizer
    out["param_dtypes"] = sorted({str(p.dtype) for p in chunks[0].parameters()})
    out["master_dtypes"] = sorted({str(b.master.dtype) for b in opt.buckets})
    masters = opt.master_params()
    out["master_exact"] = all(torch.equal(masters[id(p)], fp32[n]) for n, p in chunks[0].named_parameters())
    from modelcarve.runtime.train.trainer import SyntheticData

    tokens, targets = SyntheticData(chunks[0].spec.vocab_size).batch(0, layout.global_batch, layout.seq)
    trainer.forward_backward(tokens, targets)
    out["grad_dtypes"] = sorted({str(b.master.grad.dtype) for b in opt.buckets})
    out["p_grads"] = sum(p.grad is not None for p in chunks[0].parameters())
    return out


def test_bf16_zero_holds_fp32_master_and_resumes_bit_identically(tmp_path):
    out = run_distributed(_worker, 2, str(tmp_path), timeout=600)[0]
    for zero in (1, 2):
        full, resumed = out[zero]["full"], out[zero]["resumed"]
        assert len(full) == 4 and len(resumed) == 2
        assert resumed == full[2:], (zero, full, resumed)
    assert out["param_dtypes"] == ["torch.bfloat16"]
    assert out["master_dtypes"] == ["torch.float32"]
    assert out["master_exact"]  # the master is the fp32 weights the model was built with
    assert out["grad_dtypes"] == ["torch.float32"]
    assert out["p_grads"] == 0  # the bf16 micro-batch gradients went into the fp32 buffer


def test_checkpoint_holds_fp32_weights(tmp_path):
    run_distributed(_save_only, 2, str(tmp_path), timeout=300)
    from modelcarve.runtime.checkpoint.dcp import _SafeReader

    step = next(p for p in (tmp_path / "c").glob("step_*") if p.is_dir())
    meta = _SafeReader(str(step)).read_metadata()
    dtypes = {k: str(v.properties.dtype) for k, v in meta.state_dict_metadata.items()
              if k.startswith("model.") and hasattr(v, "properties")}
    assert dtypes and set(dtypes.values()) == {"torch.float32"}, dtypes


def _save_only(root):
    from modelcarve.runtime.train.launch import run_worker

    run_worker("tiny-llama", LAYOUT.format(zero=1), steps=1, quiet=True,
               checkpoint=dict(checkpoint_dir=f"{root}/c", save_every=1))
