"""Serving that holds up. Continuous batching (join at the next step, leave at once),
memory-bounded admission, defaults that keep short chats whole, and the review's faults, each
driven over loopback with the official openai client (tiny model; the real one for the defaults).
A ``Gate`` holds the worker while the requests a test sends together arrive."""

import asyncio

import pytest
import torch
from torch.overrides import TorchFunctionMode

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvevict.generate import generate  # noqa: E402
from kvevict.serve.detokenize import TextStream  # noqa: E402
from kvevict.serve.sampling import next_token, pick_tokens  # noqa: E402
from kvevict.serve.server import ServerThread, build  # noqa: E402
from kvevict.storage import PAGE  # noqa: E402
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
    reference,
    result,
    token_bytes,
    wait_until,
)
from tiny_chat_model import char_tokenizer  # noqa: E402

LONG = dict(max_tokens=300, extra_body={"ignore_eos": True})


def _client(srv, timeout=DEADLINE):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="t", max_retries=0, timeout=timeout)


def _aclient(srv):
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="t", max_retries=0, timeout=DEADLINE)


def _events(engine, kind):
    return {e["id"]: e for e in events(engine, kind)}


async def _together(engine, gate, calls):
    """Send ``calls`` (coroutines) at once with the worker held, let it go once all have arrived;
    their results."""
    before = arrived(engine)
    tasks = [asyncio.ensure_future(c) for c in calls]
    gathered = await asyncio.to_thread(wait_until, lambda: arrived(engine) - before == len(tasks))
    gate.open()
    assert gathered, "the requests did not all reach the server"
    return await asyncio.gather(*tasks)


@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_a_request_arriving_mid_decode_joins_before_the_running_one_ends(folder, reference, policy):
    model, tok = reference
    app, engine = build(folder, {**DEFAULTS, "policy": policy})
    with ServerThread(app) as srv, Gate(engine) as gate:
        client = _client(srv)
        flight = in_background(client.chat.completions.create, model=MODEL, messages=chat("Go on and on."), **LONG)
        assert gate.wait_held()  # at the long one's prefill
        quick = in_background(client.chat.completions.create, model=MODEL, messages=chat("Quick one?"), max_tokens=8)
        assert wait_until(lambda: arrived(engine) == 2)  # it waits while the long one is held
        gate.open()
        short, long = result(*quick), {"r": result(*flight)}
    a, b = long["r"].id.removeprefix("chatcmpl-"), short.id.removeprefix("chatcmpl-")
    admitted, finished = _events(engine, "admit"), _events(engine, "finish")
    # the timeline: b was admitted while a decoded, ran beside it, and left first
    assert admitted[a]["t"] < admitted[b]["t"] < finished[b]["t"] < finished[a]["t"]
    assert admitted[b]["running"] == 1
    assert (
        short.choices[0].message.content.strip()
        == generate(model, tok, chat("Quick one?"), alone(policy), DEFAULTS["budget"], max_new_tokens=8).text
    )
    assert _events(engine, "join")[b]["size"] == 2  # one cache: it joined the running batch


def test_admission_queues_when_memory_is_full_and_never_exceeds_it(folder, reference):
    model, tok = reference
    # room for two sequences at a budget of 8 tokens: a page of 32 slots each (kvevict.storage.paged)
    app, engine = build(folder, {**DEFAULTS, "max_batch": 8, "kv_memory": int(2.5 * PAGE * token_bytes(model))})
    texts = [f"Request number {i}, tell me something." for i in range(6)]
    with ServerThread(app) as srv, Gate(engine) as gate:

        async def main():
            async with _aclient(srv) as ac:
                return await _together(
                    engine,
                    gate,
                    [
                        ac.chat.completions.create(
                            model=MODEL, messages=chat(t), max_tokens=20, extra_body={"ignore_eos": True}
                        )
                        for t in texts
                    ],
                )

        got = asyncio.run(main())
        text = get(srv.url, "/metrics")[1]
    assert all(r.usage.completion_tokens == 20 for r in got)  # none failed, none lost
    for t, r in zip(texts, got):
        assert r.choices[0].message.content == generate(model, tok, chat(t), "h2o", 8, max_new_tokens=20).text
    admits = events(engine, "admit")
    assert max(e["running"] for e in admits) == 1  # at most two at once
    # all six were there from the start: four waited for memory, admitted only once a row had ended
    log = events(engine)
    first_end = next(i for i, e in enumerate(log) if e["event"] == "finish")
    assert sum(e["event"] == "admit" for e in log[first_end:]) == 4
    assert engine.metrics.get("kvevict_kv_bytes_peak") <= engine.settings.kv_memory
    for name in (
        "kvevict_kv_bytes_held",
        "kvevict_queued_requests",
        "kvevict_tokens_per_second",
        'kvevict_time_to_first_token_seconds{quantile="0.95"}',
        "kvevict_kv_memory_bytes",
    ):
        assert name in text
    assert f"kvevict_kv_memory_bytes {engine.settings.kv_memory}" in text
    assert "kvevict_time_to_first_token_seconds_count 6" in text


def test_a_request_bigger_than_the_whole_memory_is_a_400(folder):
    app, engine = build(folder, {**DEFAULTS, "kv_memory": 1 << 16})
    with ServerThread(app) as srv:
        client = _client(srv)
        with pytest.raises(openai.BadRequestError, match="more than the server's kv_memory"):
            client.chat.completions.create(
                model=MODEL, messages=chat("hi"), max_tokens=400, extra_body={"kv_policy": "full"}
            )
        r = client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=4)  # budget 8 fits
        assert r.usage.completion_tokens >= 1


def test_pyramidkv_budget_checked_per_layer_and_fails_only_its_request(folder):
    app, engine = build(folder, DEFAULTS)
    with ServerThread(app) as srv:
        client = _client(srv)
        # budget 12 fits recent=4, but PyramidKV gives the deepest of the 3 layers 1 token
        with pytest.raises(openai.BadRequestError, match="its layers get 1 to 23 tokens"):
            client.chat.completions.create(
                model=MODEL,
                messages=chat("hi"),
                max_tokens=4,
                extra_body={"kv_policy": "pyramidkv", "kv_budget": 12, "kv_recent": 4},
            )
        ok = client.chat.completions.create(
            model=MODEL, messages=chat("hi"), max_tokens=4, extra_body={"kv_policy": "pyramidkv", "kv_budget": 64}
        )
        assert ok.usage.kv_budget_tokens == 64


class _Syncs(TorchFunctionMode):
    """Counts device-to-host reads (tolist, item, int) under it."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += getattr(func, "__name__", "") in ("tolist", "item", "__int__", "__index__")
        return func(*args, **(kwargs or {}))


def test_greedy_rows_cost_one_host_read_per_step_and_sampling_matches_one_by_one():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    with _Syncs() as s:
        got = pick_tokens(logits, [(0.0, 1.0, None)] * 16)
    assert s.n == 1 and got == logits.argmax(-1).tolist()
    how = [(0.0, 1.0, None), (0.8, 0.9, torch.Generator().manual_seed(3)), (0.0, 1.0, None)]
    ref = [(0.0, 1.0, None), (0.8, 0.9, torch.Generator().manual_seed(3)), (0.0, 1.0, None)]
    assert pick_tokens(logits[:3], how) == [next_token(logits[i], t, p, g) for i, (t, p, g) in enumerate(ref)]


class _CountingTokenizer:
    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


def test_detokenizer_is_linear_and_equals_decoding_the_whole():
    tok = char_tokenizer()
    text = "DÉJÀ vu: ÀÈÇÉ, stop here. " * 40
    ids = tok(text)["input_ids"]
    counting = _CountingTokenizer(tok)
    stream = TextStream(counting)
    out = "".join(stream.add(i) for i in ids) + stream.flush()
    assert out == tok.decode(ids, skip_special_tokens=True)
    assert counting.decoded < 6 * len(ids)  # whole-completion decoding would be ~len(ids)**2 / 2
    stream = TextStream(tok, stop=["here."])
    out = "".join(stream.add(i) for i in ids) + stream.flush()
    assert out == text[: text.index("here.")] and stream.stopped


def test_real_model_defaults_answer_a_short_chat_whole(real_model, tmp_path):
    """With no kv_* fields the server must not cut a 40-token chat (it once did)."""
    app, engine = build("smollm2-135m", {"model_id": "smollm2-135m"})
    q = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    with ServerThread(app) as srv:
        r = _client(srv, 120).chat.completions.create(model="smollm2-135m", messages=q, max_tokens=16)
    assert "Paris" in r.choices[0].message.content
    assert r.usage.kv_budget_tokens == engine.settings.budget >= 1024 > r.usage.prompt_tokens
    assert r.usage.kv_evicted_tokens == 0


def test_default_budget_is_each_sequences_share_of_the_memory(folder, reference):
    model, _ = reference
    _, engine = build(folder, {"model_id": MODEL, "max_batch": 4, "kv_bits": None})
    engine.stop()
    per_token, rest = engine.budgeter.per_token("h2o")  # K, V and H2O's state of one kept token
    assert per_token > token_bytes(model)
    for memory, want in (
        (4 * (rest + 200 * per_token), 192),  # 200 tokens each, down to a multiple of 64
        (4 * (rest + 10 * per_token), 64),  # never below the floor (min_budget)
        (1 << 40, model.config.max_position_embeddings),
    ):  # never past the context
        _, engine = build(folder, {"model_id": MODEL, "kv_memory": memory, "max_batch": 4, "kv_bits": None})
        engine.stop()
        assert engine.settings.budget == want
        # max_batch sequences at the default budget fit the memory
        assert 4 * engine.budgeter.row_bytes("h2o", want, None, want) <= memory or want == 64


MIXED = [("tova", 12), ("recency", 16), ("h2o", 24), ("roco", 10), ("h2o", 0.5)]


def test_mixed_policies_and_budgets_share_one_batch_each_equal_its_answer_alone(folder, reference):
    model, tok = reference
    app, engine = build(folder, DEFAULTS)
    texts = [f"Mixed request {i}: name a colour." + " now" * i for i in range(len(MIXED))]
    with ServerThread(app) as srv, Gate(engine) as gate:
        client = _client(srv)
        flight = in_background(client.chat.completions.create, model=MODEL, messages=chat("Go on and on."), **LONG)
        assert gate.wait_held()  # at the long one's prefill: the mixed ones arrive while it runs

        async def main():
            async with _aclient(srv) as ac:
                return await _together(
                    engine,
                    gate,
                    [
                        ac.chat.completions.create(
                            model=MODEL, messages=chat(text), max_tokens=12, extra_body={"kv_policy": p, "kv_budget": b}
                        )
                        for text, (p, b) in zip(texts, MIXED)
                    ],
                )

        got = asyncio.run(main())
        long = {"r": result(*flight)}
    for text, (policy, _b), r in zip(texts, MIXED, got):
        want = generate(model, tok, chat(text), alone(policy), r.usage.kv_budget_tokens, max_new_tokens=12)
        assert r.choices[0].message.content.strip() == want.text, (policy, r.usage.kv_budget_tokens)
        assert r.usage.completion_tokens == want.new_tokens > 1
    assert len({r.usage.kv_budget_tokens for r in got} | {8}) == 6  # six budgets, four policies
    ids = [r.id.removeprefix("chatcmpl-") for r in got]
    a = long["r"].id.removeprefix("chatcmpl-")
    joins, finished = _events(engine, "join"), _events(engine, "finish")
    # the timeline: every mixed request joined the long one's batch (one cache, one forward per
    # step) while it decoded, and left before it ended
    assert {joins[i]["batch"] for i in ids} == {joins[a]["batch"]}
    assert max(joins[i]["size"] for i in ids) >= 3
    assert all(joins[a]["t"] < joins[i]["t"] < finished[i]["t"] < finished[a]["t"] for i in ids)
    assert len(_events(engine, "join")) == 1 + len(ids)
    assert engine.metrics.get("kvevict_kv_bytes_peak") <= engine.settings.kv_memory


def test_admission_counts_a_mixed_batch_at_its_widest_budget_and_union_of_statistics(reference):
    """A row sharing a batch holds, in every layer, the pages of the batch's longest row under its
    widest budget, with every row's policy statistics per slot: the bound admission uses is exactly
    what the cache then holds."""
    from kvevict.serve.batch import DecodeBatch
    from kvevict.serve.budgeter import Budgeter

    model, _ = reference
    budgeter = Budgeter(model)
    rows = [("recency", 8, None), ("tova", 24, None), ("roco", 16, 4), ("pyramidkv", 32, None)]
    batch = None
    with torch.no_grad():
        for i, (policy, budget, recent) in enumerate(rows):
            other, _ = DecodeBatch.prefill(model, list(range(1, 12 + 3 * i)), policy, budget, recent)
            assert other.kv_bytes() == budgeter.batch_bytes([(policy, budget, recent, 11 + 3 * i)])
            if batch is None:
                batch = other
            else:
                batch.join(other)
            specs = [(p, b, r, 11 + 3 * j) for j, (p, b, r) in enumerate(rows[: i + 1])]
            assert batch.kv_bytes() == budgeter.batch_bytes(specs)
        batch.step([1, 2, 3, 4])
        specs = [(p, b, r, n + 1) for p, b, r, n in specs]
        assert batch.kv_bytes() == budgeter.batch_bytes(specs)
        # more than each row alone: the small rows pay for the widest one
        assert batch.kv_bytes() > sum(budgeter.row_bytes(p, b, r, n) for p, b, r, n in specs)
        batch.keep([0, 2])  # the widest rows left: the storage narrows, their statistics go with them
        assert batch.kv_bytes() == budgeter.batch_bytes([specs[0], specs[2]])
        # Ada-KV rows (one slot pool per layer, a head id per slot) share a batch of their own
        ada, _ = DecodeBatch.prefill(model, list(range(1, 20)), "adakv", 8, None)
        assert not batch.can_join(ada)
        other, _ = DecodeBatch.prefill(model, list(range(1, 9)), "ada-snapkv", 12, None)
        ada.join(other)
        assert ada.kv_bytes() == budgeter.batch_bytes([("adakv", 8, None, 19), ("ada-snapkv", 12, None, 8)])


def test_64_clients_mixing_short_chats_and_long_prompts_short_ones_hold_their_own_pages(folder, reference):
    """Per-row pages in the server: every request completes, the K/V held and the page pools never
    pass kv_memory, a short chat holds only its own pages, and short chats decode in one forward
    beside the long prompts (no batch of their own)."""
    from kvevict.storage import page_slots

    model, _ = reference
    per_slot = held_bytes(model, 1, "h2o") - held_bytes(model, 0, "h2o")
    memory = 3 * 256 * per_slot + 20 * 64 * per_slot  # three long prompts at a time, or many chats
    app, engine = build(folder, {**DEFAULTS, "budget": 256, "max_batch": 64, "kv_memory": memory})
    asks = [("Tell me a story. " * 25 if i % 4 == 0 else f"Hi {i}, name a colour.") for i in range(64)]
    with ServerThread(app) as srv, Gate(engine) as gate:

        async def main():
            async with _aclient(srv) as ac:
                return await _together(
                    engine,
                    gate,
                    [ac.chat.completions.create(model=MODEL, messages=chat(t), max_tokens=8) for t in asks],
                )

        got = asyncio.run(main())
        peak = metric(srv.url, "kvevict_kv_bytes_peak")
        pool = metric(srv.url, "kvevict_kv_pool_bytes")
    assert len(got) == 64 and all(r.usage.completion_tokens >= 1 for r in got)
    assert peak <= memory and 0 < pool <= memory
    assert wait_until(
        lambda: engine.pages.pages_in_use() == 0
    )  # every row gave its pages back (the last as the worker let go)
    long_ids, short_ids = set(), set()
    for text, r in zip(asks, got):
        fed = r.usage.prompt_tokens + r.usage.completion_tokens - 1
        assert r.usage.kv_bytes == held_bytes(model, page_slots(fed, 256), "h2o")
        (long_ids if len(text) > 100 else short_ids).add(r.id.removeprefix("chatcmpl-"))
    joins = events(engine, "join")
    assert any(set(e["ids"]) & long_ids and len(set(e["ids"]) & short_ids) > 3 for e in joins)
