"""``modelcarve serve`` on two ranks (tp=2 and pp=2, torchrun + gloo), checked with the ``openai`` client.

Greedy output through the server equals transformers' ``generate(do_sample=False)`` on the same
tiny checkpoint, token for token (exact: same fp32 arithmetic up to summation order, std-0.2
weights keep the top logits apart; see tests/serve/test_serve_api.py), with exact usage counts. The
pp=2 checkpoint has no chat template, so chat answers 400. The tp=2 server is then drained with
SIGTERM: exit 0, and no process of it (launcher, torchrun, both ranks) is left.

Both servers start at once (each start costs seconds of imports); ``--timeout 600`` keeps the
follower rank's collective wait longer than any idle gap in this module.
"""

from __future__ import annotations

import signal
import time

import pytest

from serve_fixtures import Server, alive, build_checkpoint
from test_serve_api import PROMPTS, _error, _ids, _post, hf_greedy

ARGS = ("--served-model-name", "tiny", "--kv-cache-bytes", str(8 << 20), "--timeout", "600")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_layouts")
    return dict(tp=build_checkpoint(root / "tp", seed=1), pp=build_checkpoint(root / "pp", seed=2, chat_template=False))


@pytest.fixture(scope="module")
def servers(ckpts):
    srvs = dict(tp=Server(ckpts["tp"], "tp=2,param_dtype=fp32", args=ARGS),
                pp=Server(ckpts["pp"], "pp=2,param_dtype=fp32", args=ARGS))
    try:
        for name in ("tp", "pp"):  # both launch before either is waited for
            srvs[name].launch()
        for srv in srvs.values():
            srv.wait_ready()
        yield srvs
    finally:
        for srv in srvs.values():
            srv.stop()


def _hf(path):
    import transformers

    return (transformers.AutoTokenizer.from_pretrained(path),
            transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype="float32").eval())


def _client(srv):
    from openai import OpenAI

    return OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_greedy_equals_transformers(servers, ckpts, layout):
    hf = _hf(ckpts[layout])
    tok = hf[0]
    client = _client(servers[layout])
    for prompt in PROMPTS[:4]:
        ids = tok(prompt)["input_ids"]
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        assert _ids(out.choices[0]) == hf_greedy(hf, ids, 24), (layout, prompt)
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(_ids(out.choices[0]))
    whole = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_chat_without_template_is_400(servers):
    resp = _post(servers["pp"], "/v1/chat/completions", dict(model="tiny", messages=[{"role": "user", "content": "hi"}]),
                 key=None)
    assert "chat template" in _error(resp, 400, "messages")


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_echo_logprobs_equal_transformers(servers, ckpts, layout):
    """echo + logprobs=5 (what lm-eval-harness sends): the prompt's and 3 generated tokens' logprobs and
    top-5 against transformers' log_softmax within 1e-5, the rows coming from the last stage / tp rank 0."""
    from test_serve_logprobs import IDS, K, TOL, check_completion_logprobs, reference

    tok, model = _hf(ckpts[layout])
    ids = tok(PROMPTS[3])["input_ids"]
    out = _client(servers[layout]).completions.create(model="tiny", prompt=ids, echo=True, logprobs=K, max_tokens=3,
                                                      temperature=0, extra_body=IDS | {"ignore_eos": True})
    gen = list(out.choices[0].model_extra["token_ids"])
    assert len(gen) == 3
    assert check_completion_logprobs(out.choices[0].logprobs, ids + gen, reference(model, ids + gen)) <= TOL


def test_zz_sigterm_drains_every_rank(servers):
    srv = servers["tp"]
    tree = set(srv.tree) | {srv.proc.pid}
    assert len(tree) >= 4, tree  # modelcarve serve, torchrun, two ranks
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(120) == 0, srv.output()[-12000:]  # a crashed rank's last words and torchrun's root cause
    deadline = time.monotonic() + 30
    while any(alive(p) for p in tree):
        assert time.monotonic() < deadline, [p for p in tree if alive(p)]
        time.sleep(0.1)
