"""runtime/build.py's one-process path: no mesh is the whole model, seeded as load_model builds it."""

import torch


def test_no_mesh_is_the_whole_seeded_model_and_on_model_sees_it():
    from modelcarve.runtime.checkpoint.hf_load import load_model
    from modelcarve.runtime.build import build_chunks

    seen = []
    chunks, spec = build_chunks("tiny-llama", None, None, seed=3, on_model=lambda m, s: seen.append((m, s.name)))
    want, _ = load_model("tiny-llama", seed=3)
    assert len(chunks) == 1 and seen == [(chunks[0], spec.name)]
    got = dict(chunks[0].named_parameters())
    assert got.keys() == dict(want.named_parameters()).keys()
    assert all(torch.equal(got[k], p) for k, p in want.named_parameters())
