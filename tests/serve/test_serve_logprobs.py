"""Log-probabilities through ``modelcarve serve`` as lm-eval-harness asks for them, with the ``openai`` client.

One server (tests/serve_fixtures.py: a tiny llama with its own BPE tokenizer and chat template,
fp32, one device). The oracle is ``torch.log_softmax(AutoModelForCausalLM(...)(ids).logits.float())``
on the same checkpoint, within 1e-5:

* ``/v1/completions`` with ``echo: true, logprobs: 5``, ``max_tokens`` 0 (the prompt only, finish
  "length", no completion tokens) and 3 (greedy): every prompt token's logprob (the first null)
  and every generated one's, and each position's ``top_logprobs`` dict (the chosen token and the 5
  most likely); tokens named by id (vLLM's ``return_tokens_as_token_ids``) so that ids that decode
  alike stay apart, and once by their text (the tokens spell the text, the offsets count it);
* the same streamed: the same tokens and logprobs;
* chat ``logprobs: true, top_logprobs: 5``: content[i] with its 5 alternatives in order;
* out-of-range requests: 400 naming the parameter.

The layouts (tp, pp, dp, ep) are tests/runtime/test_engine_logprobs.py's (the engine directly) and
tests/serve/test_serve_api_layouts.py's echo request.
"""

from __future__ import annotations

import pytest
import torch

from serve_fixtures import Server, build_checkpoint

TOL = 1e-5
K = 5
PROMPTS = ["Plan a layout", "The pipeline of stages runs", "a"]
IDS = {"return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("serve_logprobs") / "ckpt")


@pytest.fixture(scope="module")
def server(ckpt):
    with Server(ckpt, "tp=1,param_dtype=fp32", args=("--served-model-name", "tiny")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hf(ckpt):
    import transformers

    return (transformers.AutoTokenizer.from_pretrained(ckpt),
            transformers.AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype="float32").eval())


def reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def _id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token.split(":", 1)[1])


def check_completion_logprobs(lp, ids: list[int], ref: torch.Tensor, k: int = K) -> float:
    """Legacy completion logprobs named by id (echo: ``ids`` = prompt + generated) against ``ref``."""
    assert [_id(t) for t in lp.tokens] == ids
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    worst = 0.0
    for pos in range(1, len(ids)):
        row = ref[pos - 1]
        worst = max(worst, abs(lp.token_logprobs[pos] - row[ids[pos]].item()))
        top = {_id(t): v for t, v in lp.top_logprobs[pos].items()}
        best = torch.topk(row, k).indices.tolist()
        assert set(best) <= set(top) <= set(best) | {ids[pos]}, (pos, top, best)
        worst = max(worst, max(abs(v - row[i].item()) for i, v in top.items()))
    return worst


def test_echo_logprobs_equal_transformers(client, hf):
    tok, model = hf
    worst = 0.0
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        ref = reference(model, ids)
        out = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=K, max_tokens=0,
                                        temperature=0, extra_body=IDS)
        choice = out.choices[0]
        assert choice.text == prompt and choice.finish_reason == "length"
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
        worst = max(worst, check_completion_logprobs(choice.logprobs, ids, ref))
        # and generating: the prompt's logprobs, then the generated tokens' (greedy: the argmax)
        out = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=K, max_tokens=3,
                                        temperature=0, extra_body=IDS | {"ignore_eos": True})
        gen = list(out.choices[0].model_extra["token_ids"])
        full = reference(model, ids + gen)
        assert gen == [full[len(ids) - 1 + j].argmax().item() for j in range(3)]
        worst = max(worst, check_completion_logprobs(out.choices[0].logprobs, ids + gen, full))
    assert worst <= TOL, worst
    print(f"max |logprob - transformers| through the server: {worst:.3g}")


def test_echo_logprobs_as_text_and_streamed(client, hf):
    tok, _ = hf
    prompt = PROMPTS[1]
    out = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=2, max_tokens=4, temperature=0)
    lp = out.choices[0].logprobs
    # Each token is named by its own decoding, as vLLM names logprob tokens: a byte-level token
    # that holds part of a multi-byte character decodes alone to U+FFFD, so the names join to the
    # text exactly when no token splits a character; the ids decode to the text always.
    ids = tok(prompt, add_special_tokens=False)["input_ids"] + list(out.choices[0].model_extra["token_ids"])
    assert lp.tokens == [tok.decode([i]) for i in ids]
    assert tok.decode(ids) == out.choices[0].text and out.choices[0].text.startswith(prompt)
    if "\ufffd" not in "".join(lp.tokens):
        assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # the chosen token and the 2 most likely (fewer keys where they coincide, or where byte tokens
    # all decode to the same replacement character: why lm-eval may ask for token ids)
    assert all(1 <= len(d) <= 3 and d[t] == v for d, t, v in zip(lp.top_logprobs[1:], lp.tokens[1:],
                                                                   lp.token_logprobs[1:])), lp.top_logprobs
    chunks = list(client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=2, max_tokens=4,
                                            temperature=0, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_chat_top_logprobs_equal_transformers(client, hf):
    tok, model = hf
    messages = [{"role": "user", "content": "Plan a layout"}]
    out = client.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=K, max_tokens=4,
                                         temperature=0, extra_body=IDS)
    choice = out.choices[0]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    gen = list(choice.model_extra["token_ids"])
    ref = reference(model, list(prompt) + gen)
    worst = 0.0
    assert len(choice.logprobs.content) == len(gen)
    for j, entry in enumerate(choice.logprobs.content):
        row = ref[len(prompt) - 1 + j]
        assert _id(entry.token) == gen[j]
        worst = max(worst, abs(entry.logprob - row[gen[j]].item()))
        best = torch.topk(row, K)
        assert [_id(t.token) for t in entry.top_logprobs] == best.indices.tolist()
        worst = max(worst, max(abs(t.logprob - v) for t, v in zip(entry.top_logprobs, best.values.tolist())))
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)
    assert worst <= TOL, worst


def _param(err) -> str:
    body = err.body if isinstance(err.body, dict) else {}
    return body.get("error", body).get("param")


def test_out_of_range_is_400(client):
    import openai

    for kwargs, param in ((dict(logprobs=21), "logprobs"), (dict(max_tokens=0), "max_tokens"),
                          (dict(logprobs=-1), "logprobs")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", prompt="Plan", **({"max_tokens": 2} | kwargs))
        assert _param(err.value) == param, err.value.body
    messages = [{"role": "user", "content": "x"}]
    for kwargs in (dict(top_logprobs=3), dict(logprobs=True, top_logprobs=21)):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, **kwargs)
        assert _param(err.value) == "top_logprobs", err.value.body
