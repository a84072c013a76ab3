"""Pipeline serving: what another request's prefill costs the requests decoding beside it
(plan/serve/time.py ``prefill_overlap``).

A pipeline engine keeps ``micro = min(pp, batch)`` micro-batches in flight and each trails the
one ahead of it through every stage. Two stages, a decoding request A (10 ms a stage) and a
prompt P arriving as A's token enters stage 1 (50 ms a stage), hand-drawn:

    stage 0:  P [0, 50]            A [50, 60]
    stage 1:  A [0, 10]            P [50, 100]    A [100, 110]

A's tokens come out at 10 and 110 ms: 100 ms apart, P's whole walk, where alone they come its own
20 ms walk apart; sharing P's walk over the two stages would have said 20 + 50. So a prefill is shared by the
stages only when several fall in one round: ``q = batch / output_len`` prefills a round on average,
each costing the round ``1 / min(micro, max(1, q))`` of its walk. Measured (CPU, pp=2, ~97M llama,
64-token prompts, 16 new tokens, 0.65 requests/s, benchmarks/serve_predicted_vs_measured.py):
TPOT p50 39.0 ms where a lone request decodes at ~30 ms, i.e. another request's ~130 ms prefill
over 15 tokens, as the whole walk gives (``/ micro`` predicted 29.0 ms)."""

import pytest

from modelcarve.plan.serve.layout_costs import layout_costs
from modelcarve.plan.serve.time import _rates, prefill_overlap, round_s
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster


def test_prefill_overlap_by_hand():
    # no pipeline: one micro-batch, nothing to share
    assert [prefill_overlap(1, b, 256) for b in (1, 256, 4096)] == [1.0, 1.0, 1.0]
    # pp = 2: a prefill every 128 rounds (q = 2 / 256), alone in its round: its whole walk
    assert prefill_overlap(2, 2, 256) == 1.0
    # q = 384 / 256 = 1.5 prefills a round, in 1.5 of the 2 micro-batches: 1.5 share a walk
    assert prefill_overlap(2, 384, 256) == 1.5
    # q = 1024 / 256 = 4 >= 2: every micro-batch carries one, both stages busy: / 2
    assert prefill_overlap(2, 1024, 256) == 2.0
    assert prefill_overlap(8, 1024, 256) == 4.0


@pytest.mark.parametrize("batch,shared", [(2, 1.0), (384, 1.5), (1024, 2.0)])
def test_tpot_carries_the_others_prefill_walks(batch, shared):
    """llama-3.1-8b fp8 on 8xH100 at pp=2, 2048 in / 256 out: TPOT = the decode round + (batch - 1)
    x the prompt's prefill (2048 x seconds a prompt token) / shared / 256; the throughput carries all
    ``batch`` prefills the same way."""
    c = layout_costs(get_model("llama-3.1-8b"), parse_cluster("8xH100"), 1, 2, 1, 1, "fp8", "fp8", 2048, 256)
    rnd, tpot, _, tokens = _rates(c, batch)
    drain = 2048 * c.prefill_token_s
    assert rnd == round_s(c, batch)
    assert tpot == pytest.approx(rnd + (batch - 1) * drain / shared / 256, rel=1e-12)
    assert tokens == pytest.approx(batch / (rnd + batch * drain / shared / 256), rel=1e-12)


def test_pipeline_tpot_at_a_low_rate_pays_the_whole_prefill():
    """At batch 2 (one other request) a pp=2 user's TPOT carries one whole prefill walk per 256
    tokens: twice what halving it over the stages gave."""
    c = layout_costs(get_model("llama-3.1-8b"), parse_cluster("8xH100"), 1, 2, 1, 1, "fp8", "fp8", 2048, 256)
    rnd, tpot, _, _ = _rates(c, 2)
    halved = rnd + 2048 * c.prefill_token_s / 2 / 256
    assert tpot - rnd == pytest.approx(2 * (halved - rnd), rel=1e-12)
