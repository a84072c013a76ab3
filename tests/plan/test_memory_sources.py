"""``estimate`` names the rule and the source of every part of its memory table (``memory.sources``
in its JSON, a column in its table): each part of the breakdown has one, and the words say which
meaning of a framework's term was used (Megatron's selective = the attention core; torchtitan's
op-level SAC = ``ops``), which loss and which ZeRO sharding."""

from __future__ import annotations

import json

import pytest


def _estimate(capsys, layout: str, *extra) -> dict:
    from modelcarve.cli import main

    assert main(["estimate", "--model", "llama-3.1-8b", "--cluster", "1x8xH100", "--layout", layout, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("layout,words", [
    ("tp=2,dp=4,zero=1,gbs=32,mbs=1,seq=4096,recompute=selective", ["Megatron-LM's --recompute-granularity selective",
                                                                    "Megatron's distributed optimizer"]),
    ("dp=8,fsdp,gbs=32,mbs=1,seq=4096,recompute=ops", ["torchtitan's op-level selective AC", "one 1/(dp x cp) shard",
                                                      "FSDP2's default forward prefetch"]),
    ("tp=2,pp=2,dp=2,gbs=32,mbs=1,seq=4096,recompute=full,param_dtype=fp8", ["keeps its input only",
                                                                             "FP8 row- and column-wise copies"]),
])
def test_every_memory_part_has_its_rule_and_source(capsys, layout, words):
    result = _estimate(capsys, layout)
    mem = result["memory"]
    assert set(mem["sources"]) == set(mem["breakdown"])
    assert all(len(text) > 10 for text in mem["sources"].values())
    text = " ".join(mem["sources"].values())
    for w in words:
        assert w in text, (w, text)


def test_the_table_prints_the_rule_column(capsys):
    from modelcarve.cli import main

    assert main(["estimate", "--model", "llama-3.1-8b", "--cluster", "1x8xH100", "--layout",
                 "dp=8,gbs=32,mbs=1,seq=4096"]) == 0
    out = capsys.readouterr().out
    assert "rule (source)" in out and "Rajbhandari" in out
