"""The OpenAI-compatible server, driven over loopback with the official openai client on a tiny
random Llama with a character tokenizer (tests/tiny_chat_model.py)."""

import asyncio
import http.client
import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import kvevict  # noqa: E402
from kvevict.generate import generate  # noqa: E402
from kvevict.serve.metrics import OUTCOMES  # noqa: E402
from kvevict.serve.server import ServerThread, build  # noqa: E402
from kvevict.storage import page_slots  # noqa: E402
from serve_helpers import (  # noqa: E402,F401
    DEADLINE,
    DEFAULTS,
    MODEL,
    Gate,
    alone,
    arrived,
    chat,
    events,
    folder,
    get,
    held_bytes,
    in_background,
    metric,
    open_stream,
    post,
    reference,
    result,
    rows,
    wait_until,
)


@pytest.fixture(scope="module")
def server(folder):
    app, engine = build(folder, DEFAULTS)
    with ServerThread(app) as srv:
        yield srv, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="test", max_retries=0, timeout=DEADLINE)


def test_models_health_and_metrics_format(server, client):
    srv, _ = server
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, body = get(srv.url, "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, text = get(srv.url, "/metrics")
    assert status == 200
    for name in (
        "kvevict_requests_total",
        "kvevict_generated_tokens_total",
        "kvevict_tokens_per_second",
        "kvevict_kv_bytes_held",
        "kvevict_evicted_tokens_total",
    ):
        assert f"# TYPE {name} " in text
    # every outcome's series is there from the start, at 0 (nothing has ended yet): a count of 0 is
    # told from a series that is missing, which the tests' reads fail on
    assert {o: metric(srv.url, "kvevict_requests_total", outcome=o) for o in OUTCOMES} == dict.fromkeys(OUTCOMES, 0)
    with pytest.raises(AssertionError, match='no series kvevict_requests_total{outcome="lost"}'):
        metric(srv.url, "kvevict_requests_total", outcome="lost")
    # the values move with a request: one completed, its tokens counted, evictions past an 8-token budget
    done0 = metric(srv.url, "kvevict_requests_total", outcome="completed")
    gen0, ev0 = metric(srv.url, "kvevict_generated_tokens_total"), metric(srv.url, "kvevict_evicted_tokens_total")
    r = client.chat.completions.create(
        model=MODEL,
        messages=chat("count the metrics, please"),
        max_tokens=6,
        extra_body={"kv_policy": "h2o", "kv_budget": 8},
    )
    assert metric(srv.url, "kvevict_requests_total", outcome="completed") - done0 == 1
    assert metric(srv.url, "kvevict_generated_tokens_total") - gen0 == r.usage.completion_tokens >= 1
    assert metric(srv.url, "kvevict_evicted_tokens_total") > ev0 and metric(srv.url, "kvevict_kv_bytes_peak") > 0


def test_chat_equals_generate_alone_and_reports_kv_bytes(client, reference):
    model, tok = reference
    messages = chat("Tell me a story about a fox and a crow, please.")
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, extra_body={"kv_policy": "h2o", "kv_budget": 8}
    )
    want = generate(model, tok, messages, "h2o", 8, max_new_tokens=16)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content.strip() == want.text
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens) == (want.prompt_tokens, want.new_tokens)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert (u.kv_bytes, u.kv_bytes_full) == (want.kv_bytes, want.full_kv_bytes)
    assert u.kv_bytes == held_bytes(model, 8, "h2o") < u.kv_bytes_full
    assert u.kv_policy == "h2o" and u.kv_budget_tokens == 8
    # the same cache named as a spec (kvevict.spec): the same answer and bytes
    r2 = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, extra_body={"kv_policy": "h2o@8"}
    )
    assert r2.choices[0].message.content == r.choices[0].message.content
    assert (r2.usage.kv_policy, r2.usage.kv_budget_tokens, r2.usage.kv_bytes) == ("h2o", 8, u.kv_bytes)


def test_completion_with_server_defaults_and_full_cache(client, reference):
    model, tok = reference
    prompt = "Once upon a time, in a land far away,"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10)  # server default: h2o, 8
    want = generate(model, tok, prompt, "h2o", 8, max_new_tokens=10)
    assert r.choices[0].text.strip() == want.text and r.usage.kv_budget_tokens == 8
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, extra_body={"kv_policy": "full"})
    want = generate(model, tok, prompt, "full", None, max_new_tokens=10)
    assert r.choices[0].text.strip() == want.text
    # the fp32 stock cache holds twice what the 16-bit stock cache (every ratio's denominator) would
    assert r.usage.kv_bytes == want.kv_bytes == 2 * r.usage.kv_bytes_full == 2 * want.full_kv_bytes


def test_streaming_equals_plain_and_ends_with_done(server, client):
    srv, _ = server
    messages = chat("Name three colours.")
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.kv_bytes == plain.usage.kv_bytes
    assert len({c.id for c in chunks}) == 1
    # the wire format itself: SSE events, the last one [DONE]
    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=DEADLINE)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "abc", "max_tokens": 5, "stream": True}),
        {"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.getheader("content-type").startswith("text/event-stream")
    events = [e for e in resp.read().decode().split("\n\n") if e]
    conn.close()
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


BAD = [
    ({"kv_policy": "h20"}, "unknown kv_policy 'h20'; known policies: full,", "kv_policy"),
    ({"kv_policy": "h2o@1.5"}, "a share of the prompt is in (0, 1]", "kv_policy"),
    ({"kv_policy": "h2o@8", "kv_budget": 8}, "names its budget already", "kv_budget"),
    ({"kv_policy": "h2o@memory=0.2"}, "the server's memory is its --kv-memory", "kv_policy"),
    ({"kv_policy": "h2o/int8@8"}, "the storage is the server's (--kv-bits)", "kv_policy"),
    ({"kv_policy": "full/int4"}, "the storage is the server's (--kv-bits)", "kv_policy"),
    ({"seed": 2**64}, "'seed' must be in", "seed"),
    ({"kv_budget": 0}, "positive", "kv_budget"),
    ({"kv_budget": 1.5}, "(0, 1]", "kv_budget"),
    ({"kv_budget": "20%"}, "budget must be", "kv_budget"),
    ({"kv_budget": 4, "kv_recent": 4}, "recent=4 must be smaller", "kv_budget"),
    ({"max_tokens": 0}, "'max_tokens' must be an integer in [1, 480]", "max_tokens"),
    ({"max_tokens": "ten"}, "'max_tokens' must be an integer", "max_tokens"),
    ({"max_tokens": 480, "messages": chat("hello " * 10)}, "more than the model's 512 positions", "max_tokens"),
    ({"temperature": 5}, "'temperature' must be a number in [0, 2]", "temperature"),
    ({"n": 2}, "only n=1", "n"),
    ({"messages": None}, "'messages' is required", "messages"),
    ({"messages": []}, "non-empty list", "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role in", "messages[0]"),
]


@pytest.mark.parametrize("fields, message, param", BAD, ids=[b[1][:24] for b in BAD])
def test_bad_input_is_400_with_a_clear_message(server, fields, message, param):
    srv, _ = server
    body = {"model": MODEL, "messages": chat("hello"), **fields}
    body = {k: v for k, v in body.items() if v is not None}
    status, err = post(srv.url, "/v1/chat/completions", json.dumps(body))
    assert status == 400
    err = json.loads(err)["error"]
    assert message in err["message"] and err["param"] == param and err["type"] == "invalid_request_error"


def test_bad_input_through_the_client_then_server_still_serves(server, client):
    srv, _ = server
    with pytest.raises(openai.BadRequestError, match="unknown kv_policy"):
        client.chat.completions.create(model=MODEL, messages=chat("hi"), extra_body={"kv_policy": "nope"})
    with pytest.raises(openai.BadRequestError, match="'prompt' is required"):
        client.completions.create(model=MODEL, prompt=None)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=chat("hi"))
    assert post(srv.url, "/v1/chat/completions", "{not json")[0] == 400
    r = client.chat.completions.create(model=MODEL, messages=chat("still there?"), max_tokens=4)
    assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("stop", "length")


def test_64_concurrent_requests_batched_none_lost_each_as_alone_memory_bounded(server, reference):
    srv, engine = server
    model, tok = reference
    groups = [("h2o", 8), ("full", None), ("h2o", 0.5), ("recency", 8)]
    asks = [
        (
            f"Question {i}: what is {'abcdefgh'[: 1 + i % 8]} backwards?" + " please" * (i % 5),
            *groups[i % 4],
            i % 3 == 0,
        )
        for i in range(64)
    ]
    completed0 = metric(srv.url, "kvevict_requests_total", outcome="completed")
    generated0 = metric(srv.url, "kvevict_generated_tokens_total")
    log0 = len(engine.log)

    async def one(aclient, text, policy, budget, stream):
        extra = {"kv_policy": policy} if budget is None else {"kv_policy": policy, "kv_budget": budget}
        kw = dict(model=MODEL, messages=chat(text), max_tokens=12, extra_body=extra)
        if not stream:
            r = await aclient.chat.completions.create(**kw)
            return r.choices[0].message.content, r.usage
        parts, usage = [], None
        async for c in await aclient.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            parts += [c.choices[0].delta.content or ""] if c.choices else []
            usage = c.usage or usage
        return "".join(parts), usage

    # The requests gather while the worker is held (the first at its prefill), then go: which ones
    # are prefilled together (asserted below) does not hang on how fast the client sends them. Each
    # is sent once the one before it is queued, so the queue holds them in the order asked, whatever
    # the machine's load: the first batch taken holds two of each kind (a prefill group of two)
    async def main(gate):
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="t", max_retries=0, timeout=DEADLINE) as ac:
            tasks = []
            for i, a in enumerate(asks):
                tasks.append(asyncio.create_task(one(ac, *a)))
                queued = await asyncio.to_thread(wait_until, lambda i=i: arrived(engine) - arrived0 > i)
                assert queued, f"request {i} did not reach the server"
                if i == 0:  # the first alone, held at its prefill: the rest queue behind it
                    assert await asyncio.to_thread(gate.wait_held), "the worker did not take the first request"
            gate.open()
            return await asyncio.gather(*tasks)

    arrived0 = arrived(engine)
    with Gate(engine) as gate:
        got = asyncio.run(main(gate))
    assert len(got) == 64
    for (text, policy, budget, _), (answer, usage) in zip(asks, got):
        if isinstance(budget, float):  # a fraction of the prompt, never below the server's floor
            floor = engine.settings.min_budget
            assert usage.kv_budget_tokens == max(floor, kvevict.budget.resolve_budget(budget, usage.prompt_tokens))
        want = generate(model, tok, chat(text), alone(policy), usage.kv_budget_tokens, max_new_tokens=12)
        assert answer.strip() == want.text, (text, policy, budget)
        assert usage.completion_tokens == want.new_tokens and usage.prompt_tokens == want.prompt_tokens
        if budget is not None:  # the memory bound: the budget, not the context
            fed = usage.prompt_tokens + usage.completion_tokens - 1  # the last token is never fed
            assert usage.kv_bytes == held_bytes(model, page_slots(fed, usage.kv_budget_tokens), policy)
    assert len({a for a, _ in got}) > 8  # different prompts, different answers: nothing mixed up
    log = events(engine)[log0:]
    assert sum(e["event"] == "finish" for e in log) == 64
    running = [e["running"] for e in log if e["event"] == "admit"]
    assert max(running) > 1 and max(running) < DEFAULTS["max_batch"]  # decoded together, never past max_batch
    # requests that arrive together are prefilled together (one forward, padded), and each answer
    # above still equals its answer alone
    assert max(e["prefill"] for e in log if e["event"] == "admit") > 1
    assert metric(srv.url, "kvevict_kv_bytes_peak") <= engine.settings.kv_memory
    assert metric(srv.url, "kvevict_requests_total", outcome="completed") - completed0 == 64
    assert metric(srv.url, "kvevict_generated_tokens_total") - generated0 == sum(u.completion_tokens for _, u in got)
    assert wait_until(lambda: metric(srv.url, "kvevict_kv_bytes_held") == 0)  # nothing running, nothing held


def test_seeded_sampling_repeats_and_stop_strings_cut(client):
    kw = dict(model=MODEL, messages=chat("Sample me."), max_tokens=12, temperature=1.0, top_p=0.9)
    a = client.chat.completions.create(**kw, seed=7).choices[0].message.content
    assert a == client.chat.completions.create(**kw, seed=7).choices[0].message.content
    assert {a} != {client.chat.completions.create(**kw, seed=s).choices[0].message.content for s in (1, 2, 3)}
    full = (
        client.chat.completions.create(
            model=MODEL, messages=chat("Stop me."), max_tokens=16, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .message.content
    )
    stop = full[6:8]
    cut = full[: full.find(stop)]
    r = client.chat.completions.create(
        model=MODEL, messages=chat("Stop me."), max_tokens=16, stop=[stop, "\x00"], extra_body={"ignore_eos": True}
    )
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (cut, "stop")
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL,
            messages=chat("Stop me."),
            max_tokens=16,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if c.choices
    )
    assert streamed == cut


LONG_TOKENS = 100  # what the requests that stay ask for: each ends only after the test's checks


def test_client_disconnect_drops_its_sequence_and_frees_its_cache(folder):
    # max_batch 2: the two requests below share one batch (and one cache), the second joining the first
    app, engine = build(folder, {**DEFAULTS, "max_batch": 2, "policy": "full"})
    long = {"model": MODEL, "messages": chat("Talk for a long time."), "max_tokens": LONG_TOKENS, "ignore_eos": True}
    kw = dict(model=MODEL, messages=long["messages"], max_tokens=LONG_TOKENS, extra_body={"ignore_eos": True})
    with ServerThread(app) as srv, Gate(engine) as gate:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="t", max_retries=0, timeout=DEADLINE)
        stayer = in_background(client.chat.completions.create, **kw)
        assert gate.wait_held()  # at the stayer's prefill
        conn, leaver = open_stream(srv.url, long)
        # both decode in one batch, then the worker is held while the leaver's client goes away
        assert gate.run_until(lambda: len(rows(engine)) == 2)
        handle = rows(engine)[leaver].handle
        conn.sock.close()  # the client goes away mid-stream
        conn.close()
        assert wait_until(handle.cancelled.is_set)  # the server saw it, with the worker still held
        gate.open()
        r = result(*stayer)
        assert r.usage.completion_tokens == LONG_TOKENS  # the other sequence went on to the end
        drops = {e["id"]: e for e in events(engine, "finish")}
        assert drops[leaver]["reason"] == "cancelled" and drops[leaver]["generated"] < LONG_TOKENS
        assert drops[leaver]["loops_after_cancel"] <= 1  # dropped at the worker's next step
        shrink = events(engine, "shrink")
        assert shrink and shrink[0]["size_before"] == 2 and shrink[0]["ids"] == [r.id.removeprefix("chatcmpl-")]
        # its half of the cache is gone (and the padding the stayer no longer needs)
        assert 0 < shrink[0]["kv_bytes"] * 2 <= shrink[0]["kv_bytes_before"]
        assert metric(srv.url, "kvevict_requests_total", outcome="cancelled") == 1
        # a non-streamed request whose client gives up while it waits (both rows busy) is cancelled
        # there, never admitted
        gate.close()
        before = arrived(engine)
        busy = [in_background(client.chat.completions.create, **kw) for _ in range(2)]
        assert wait_until(lambda: arrived(engine) == before + 2) and gate.wait_held()
        impatient = openai.OpenAI(base_url=srv.url + "/v1", api_key="t", max_retries=0, timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(model=MODEL, messages=chat("Never mind."), max_tokens=7)
        assert wait_until(lambda: arrived(engine) == before + 3)  # the worker is held: it waits
        late = next(h for h in engine.admission.pending if h.req.max_tokens == 7)
        assert wait_until(late.cancelled.is_set)
        gate.open()
        assert wait_until(lambda: metric(srv.url, "kvevict_requests_total", outcome="cancelled") == 2)
        assert [e["event"] for e in events(engine) if e.get("id") == late.req.id] == ["cancelled"]
        assert all(result(*b).usage.completion_tokens == LONG_TOKENS for b in busy)
        # the two gauges are set one after the other: both waited for, not the second read at once
        assert wait_until(lambda: metric(srv.url, "kvevict_running_sequences") == 0)
        assert wait_until(lambda: metric(srv.url, "kvevict_kv_bytes_held") == 0)


def test_budget_round_lets_prompts_of_different_lengths_share_a_batch(folder, reference):
    model, tok = reference
    app, engine = build(folder, {**DEFAULTS, "max_batch": 2, "budget_round": 16, "min_budget": 1})
    texts = ["Short one.", "A slightly longer one."]  # 30 and 42 tokens: 9 and 13 tokens at 0.3
    with ServerThread(app) as srv, Gate(engine) as gate:  # held until both have arrived: one batch
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="t", max_retries=0, timeout=DEADLINE)
        asks = [
            in_background(
                client.chat.completions.create,
                model=MODEL,
                messages=chat(text),
                max_tokens=8,
                extra_body={"kv_budget": 0.3},
            )
            for text in texts
        ]
        assert wait_until(lambda: arrived(engine) == 2)
        gate.open()
        results = [result(*a) for a in asks]
    budgets = [r.usage.kv_budget_tokens for r in results]
    exact = [kvevict.budget.resolve_budget(0.3, r.usage.prompt_tokens) for r in results]
    assert exact[0] != exact[1] and budgets[0] == budgets[1] == -(-max(exact) // 16) * 16
    assert max(e["size"] for e in events(engine, "join")) == 2  # one batch, one cache
    for text, r in zip(texts, results):  # each as alone with the rounded token budget
        assert (
            r.choices[0].message.content.strip()
            == generate(model, tok, chat(text), alone("h2o"), budgets[0], max_new_tokens=8).text
        )
