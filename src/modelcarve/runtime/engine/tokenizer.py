"""The tokenizer of a checkpoint directory, offline, and its end-of-sequence ids.

``load_tokenizer(path)`` returns a ``Tokenizer`` or None when the directory has no tokenizer
files (``tokenizer.json``, ``tokenizer_config.json``, ``vocab.json``/``merges.txt``,
``tokenizer.model``). It goes through transformers' ``AutoTokenizer`` with
``local_files_only=True`` (never the network), which reads the chat template from
``tokenizer_config.json`` or ``chat_template.jinja``; without transformers, a bare
``tokenizer.json`` is read by ``tokenizers`` (no chat template then).

``encode`` tokenises as transformers' tokenizer does by default (special tokens such as BOS
added when the tokenizer adds them); ``decode`` skips special tokens, as OpenAI-style servers
return text. ``eos_token_ids(path)`` reads ``generation_config.json`` then ``config.json``
(an int or a list), falling back on the tokenizer's eos token.
"""

from __future__ import annotations

import json
from pathlib import Path

from modelcarve.spec.errors import ModelcarveError

_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class Tokenizer:
    """A thin wrapper with one interface over AutoTokenizer and a bare ``tokenizers`` file."""

    def __init__(self, hf=None, raw=None):
        self._hf, self._raw = hf, raw

    def encode(self, text: str) -> list[int]:
        if self._hf is not None:
            return list(self._hf(text)["input_ids"])
        return self._raw.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=True)
        return self._raw.decode(ids, skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._hf is not None and bool(getattr(self._hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not self.has_chat_template:
            raise ModelcarveError("this checkpoint's tokenizer has no chat template (tokenizer_config.json "
                                  "chat_template or chat_template.jinja); send a plain prompt instead")
        out = self._hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    @property
    def eos_token_id(self) -> int | None:
        if self._hf is not None:
            return self._hf.eos_token_id
        return None


def has_tokenizer(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and any((p / name).is_file() for name in _FILES)


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    if not has_tokenizer(path):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        AutoTokenizer = None
    if AutoTokenizer is not None:
        try:
            return Tokenizer(hf=AutoTokenizer.from_pretrained(str(path), local_files_only=True))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    file = Path(path) / "tokenizer.json"
    if file.is_file():
        from tokenizers import Tokenizer as RawTokenizer

        return Tokenizer(raw=RawTokenizer.from_file(str(file)))
    return None


def eos_token_ids(path: str | Path, tokenizer: Tokenizer | None = None) -> tuple[int, ...]:
    p = Path(path)
    for name in ("generation_config.json", "config.json"):
        f = p / name
        if f.is_file():
            value = json.loads(f.read_text()).get("eos_token_id")
            if value is not None:
                return tuple(value) if isinstance(value, list) else (int(value),)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return (tokenizer.eos_token_id,)
    return ()
