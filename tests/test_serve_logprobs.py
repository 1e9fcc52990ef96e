"""logprobs / top_logprobs on chat and completions, echo with logprobs on completions
(lm-eval's local-completions scores log-likelihoods that way). The full cache's equal a direct
forward's within 1e-4 (fp32); a budgeted cache's equal the same cache run alone, one row."""

import asyncio
import json

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from kvevict.serve.batch import DecodeBatch  # noqa: E402
from kvevict.serve.server import ServerThread, build  # noqa: E402
from serve_helpers import DEADLINE, DEFAULTS, MODEL, chat, folder, post, reference  # noqa: E402,F401

TOL = 1e-4


@pytest.fixture(scope="module")
def server(folder):
    app, engine = build(folder, {**DEFAULTS, "max_batch": 8})
    with ServerThread(app) as srv:
        yield srv, engine


def _aclient(srv):
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="t", max_retries=0, timeout=DEADLINE)


def _direct(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of one forward over ``ids`` with no cache: (len(ids), vocab)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def _alone(model, prompt: list[int], generated: list[int], policy, budget) -> torch.Tensor:
    """The logprobs of each generated token's position under ``policy`` / ``budget``, one row alone
    (no batch, no page pool): (len(generated), vocab)."""
    with torch.no_grad():
        batch, logits = DecodeBatch.prefill(model, prompt, policy, budget, None)
        rows = [logits[0]]
        for t in generated[:-1]:
            rows.append(batch.step([t])[0])
    return torch.log_softmax(torch.stack(rows).float(), -1)


def test_completion_echo_logprobs_equal_a_direct_forward_full_cache(server, reference):
    """Three prompts of different lengths at once (one padded prefill, one decode batch): every
    prompt and generated token's logprob and top-5 equal a forward over prompt + completion."""
    srv, engine = server
    model, tok = reference
    prompts = ["The fox", "Once upon a time, in a land far away, there", "Count: 1, 2, 3,"]

    async def main():
        async with _aclient(srv) as ac:
            return await asyncio.gather(
                *(
                    ac.completions.create(
                        model=MODEL,
                        prompt=p,
                        max_tokens=6,
                        logprobs=5,
                        echo=True,
                        extra_body={"kv_policy": "full", "ignore_eos": True},
                    )
                    for p in prompts
                )
            )

    for prompt, r in zip(prompts, asyncio.run(main())):
        lp = r.choices[0].logprobs
        ids = tok(prompt)["input_ids"]
        n = len(ids)
        assert r.choices[0].text.startswith(prompt) and len(lp.tokens) == n + 6
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes it
        gen = tok(r.choices[0].text[len(prompt) :], add_special_tokens=False)["input_ids"]
        assert len(gen) == 6  # the character tokenizer: one token a character
        want = _direct(model, ids + gen)
        for j, t in enumerate(ids + gen):
            if j == 0:
                continue
            assert abs(lp.token_logprobs[j] - want[j - 1, t].item()) < TOL, j
            top = sorted(lp.top_logprobs[j].values(), reverse=True)
            assert torch.allclose(torch.tensor(top), want[j - 1].topk(5).values, atol=TOL)
        assert "".join(lp.tokens) == r.choices[0].text
        assert lp.text_offset == [sum(len(s) for s in lp.tokens[:j]) for j in range(n + 6)]


def test_chat_logprobs_full_cache_and_streamed_equal_plain(server, reference):
    srv, _ = server
    model, tok = reference
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="t", max_retries=0, timeout=DEADLINE)
    kw = dict(
        model=MODEL,
        messages=chat("Name a colour."),
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
        extra_body={"kv_policy": "full"},
    )
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    prompt = tok.apply_chat_template(
        chat("Name a colour."), add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    gen = [tok.convert_tokens_to_ids(c.token) for c in content]
    assert len(content) == r.usage.completion_tokens  # an EOS counts, and has its entry
    assert "".join(c.token for c in content).replace(tok.eos_token, "") == r.choices[0].message.content
    want = _direct(model, prompt + gen)
    for j, (c, t) in enumerate(zip(content, gen)):
        assert abs(c.logprob - want[len(prompt) - 1 + j, t].item()) < TOL
        assert bytes(c.bytes).decode() == c.token and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].logprob >= c.logprob - TOL  # greedy: the token is the most likely
    streamed = [
        x
        for ch in client.chat.completions.create(**kw, stream=True)
        if ch.choices and ch.choices[0].logprobs
        for x in ch.choices[0].logprobs.content
    ]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_budgeted_logprobs_are_what_that_cache_computes(server, reference):
    """H2O at 8 tokens, batched beside another request: each generated token's logprob equals the
    same cache's run alone, and differs from the full cache's (the budget took effect)."""
    srv, _ = server
    model, tok = reference
    text = "A long prompt so that eight tokens of cache must evict: the quick brown fox jumps."

    async def main():
        async with _aclient(srv) as ac:
            return await asyncio.gather(
                *(
                    ac.completions.create(
                        model=MODEL,
                        prompt=p,
                        max_tokens=10,
                        logprobs=0,
                        extra_body={"kv_policy": "h2o", "kv_budget": 8, "ignore_eos": True},
                    )
                    for p in (text, "Another one beside it.")
                )
            )

    r = asyncio.run(main())[0]
    ids = tok(text)["input_ids"]
    gen = tok(r.choices[0].text, add_special_tokens=False)["input_ids"]
    got = torch.tensor(r.choices[0].logprobs.token_logprobs)
    alone = _alone(model, ids, gen, "h2o", 8)
    want = alone[torch.arange(len(gen)), torch.tensor(gen)]
    assert torch.allclose(got, want, atol=TOL)
    full = _direct(model, ids + gen)[len(ids) - 1 :][torch.arange(len(gen)), torch.tensor(gen)]
    assert (got - full).abs().max() > 1e-3
    assert r.choices[0].logprobs.top_logprobs == [{}] * 10  # logprobs=0: the token's own, no list


BAD = [
    ("/v1/chat/completions", {"top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true", "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "in [0, 20]", "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "'logprobs' must be true or false", "logprobs"),
    ("/v1/chat/completions", {"echo": True}, "'echo' is a /v1/completions field", "echo"),
    ("/v1/completions", {"logprobs": True}, "how many top tokens", "logprobs"),
    (
        "/v1/completions",
        {"logprobs": 2, "top_logprobs": 2},
        "'top_logprobs' is a /v1/chat/completions field",
        "top_logprobs",
    ),
    ("/v1/completions", {"echo": True, "stream": True}, "'echo' with 'stream' is not supported", "echo"),
]


@pytest.mark.parametrize("path, fields, message, param", BAD, ids=[b[2][:30] for b in BAD])
def test_unsupported_logprob_combinations_are_400s_that_say_so(server, path, fields, message, param):
    srv, _ = server
    body = {"model": MODEL, **({"messages": chat("hi")} if "chat" in path else {"prompt": "hi"}), **fields}
    status, text = post(srv.url, path, json.dumps(body))
    err = json.loads(text)["error"]
    assert status == 400 and message in err["message"] and err["param"] == param


def test_echo_without_logprobs_returns_the_prompt_then_the_completion(server):
    srv, _ = server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="t", max_retries=0, timeout=DEADLINE)
    plain = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=5)
    echoed = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=5, echo=True)
    assert echoed.choices[0].text == "Echo me" + plain.choices[0].text and echoed.choices[0].logprobs is None
