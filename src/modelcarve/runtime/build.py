"""The one load -> parallelize path: a rank's model chunks for a layout, with their weights.

``build_chunks(name, layout, mesh, ...)`` is what the run worker (train/launch.py), the
generation engine (engine/model_runner.py), verify (verify/reference.py, against_transformers.py)
and the collective-order dry run (dryrun/collective_order.py) call to build this rank's part of the
model. ``name`` is a catalogue model or a checkpoint directory (checkpoint/hf_load.py):

* a checkpoint, ``sharded`` (the default) and a mesh: the model is made on the ``meta`` device
  (shapes, no storage), ``parallelize``-d, then each rank reads only its own slices into it
  (``load_sharded``, on ``device``); no rank ever holds the whole model;
* otherwise the whole model is built on ``device``: a catalogue model with random weights from
  ``seed`` (``build_model``), a checkpoint read whole (``load_full``); ``on_model(model, spec)``
  sees it before ``parallelize`` consumes it (verify keeps a copy as its reference, the dry run
  refuses MoE models there); then ``parallelize(model, layout, mesh)``, or, with no mesh (one
  process, no parallelism: the engine's single rank), the whole model is the one chunk.

The global seeds (``trainer.seed_everything``) and the mesh (``mesh.build_mesh``) are the
caller's: each sets them where its own run needs them.
"""

from __future__ import annotations

import torch

from modelcarve.runtime.checkpoint.hf_load import is_checkpoint, load_model, load_sharded
from modelcarve.runtime.parallel.parallelize import parallelize


def build_chunks(name: str, layout, mesh, *, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 sharded: bool = True, on_model=None) -> tuple[list, object]:
    """(this rank's chunks, the ModelSpec) of ``name`` split as ``layout`` over ``mesh`` (module doc).

    ``mesh`` None: no parallelize, ``[model]``. ``sharded=False``: a checkpoint is read whole on
    every rank (what ``on_model`` needs: it is called only with a whole model)."""
    if sharded and mesh is not None and is_checkpoint(name):
        if on_model is not None:
            raise ValueError("on_model needs the whole model: pass sharded=False")
        meta, spec = load_model(name, dtype=dtype, device="meta")
        chunks = parallelize(meta, layout, mesh)
        load_sharded(chunks, name, device=device)
        return chunks, spec
    model, spec = load_model(name, seed=seed, dtype=dtype, device=device)
    if on_model is not None:
        on_model(model, spec)
    if mesh is None:
        return [model], spec
    return parallelize(model, layout, mesh), spec


__all__ = ["build_chunks"]
