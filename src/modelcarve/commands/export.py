"""``modelcarve export``: a training checkpoint (any layout) -> a Hugging Face model directory.

    modelcarve export --checkpoint ckpt --out hf-model               # the newest intact step
    modelcarve export --checkpoint ckpt/step_00000100 --out hf-model --max-shard-size 500MB

The directory (config.json with its ``architectures``, sharded safetensors,
model.safetensors.index.json, and the tokenizer / generation files of the checkpoint the run
started from, or of ``--tokenizer-from DIR``) loads with transformers' ``AutoModelForCausalLM``
and ``AutoTokenizer``, and with ``modelcarve run / generate / serve --model``.
The work is runtime/checkpoint/export_hf.py's.
"""

from __future__ import annotations

import re

from modelcarve.spec.errors import ModelcarveError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise ModelcarveError(f"--max-shard-size {text!r} is not a size; use e.g. 2GB, 500MB or 1000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def register(sub) -> None:
    p = sub.add_parser("export", help="write a training checkpoint as a Hugging Face directory (safetensors)")
    p.add_argument("--checkpoint", required=True, help="a --checkpoint-dir (newest intact step) or one step directory")
    p.add_argument("--out", required=True, help="new directory to write config.json and the safetensors shards into")
    p.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (default 2GB)")
    p.add_argument("--tokenizer-from", default=None, metavar="DIR",
                   help="copy tokenizer / generation files from DIR (default: the checkpoint the run started from)")
    p.set_defaults(func=_export)


def _export(args) -> int:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise ModelcarveError("export needs PyTorch, which is not installed: pip install torch")
    limit = parse_size(args.max_shard_size)
    from modelcarve.runtime.checkpoint.export_hf import export_checkpoint

    done = export_checkpoint(args.checkpoint, args.out, max_shard_bytes=limit, tokenizer_from=args.tokenizer_from)
    for skipped in done["skipped"]:
        print(f"skipped {skipped}")
    print(f"exported step {done['step']} ({done['step_dir']}): {done['tensors']} tensors, "
          f"{done['bytes'] / 2**20:.1f} MiB in {done['files']} safetensors file(s) -> {done['out']}")
    if done["copied"]:
        print(f"copied {', '.join(done['copied'])} {done['copied_note']}")
    else:
        print(f"no tokenizer or generation files copied: {done['copied_note']}")
    return 0
