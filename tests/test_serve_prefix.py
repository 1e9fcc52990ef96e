"""The server's prompt-prefix store (``kvevict.serve.prefix_store``, ``--prefix-cache-memory``): a
chat request stores its earlier turns' cache, and a request whose prompt begins with a stored
prefix prefills only the rest and answers as a recomputation of the same parts would; the store
keeps to its bytes, evicting the least recently used first; one API key's prefixes never serve
another's; bad flags and fields are clear errors. Over loopback on the tiny chat model
(tests/tiny_chat_model.py); every request is answered before the next is sent, so nothing races."""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import torch  # noqa: E402

from kvevict.serve.batch import DecodeBatch  # noqa: E402
from kvevict.serve.engine import Engine  # noqa: E402
from kvevict.serve.server import ServerThread, build  # noqa: E402
from kvevict.serve.settings import Settings  # noqa: E402
from kvevict.storage import Pools  # noqa: E402
from serve_helpers import (  # noqa: E402,F401
    DEFAULTS,
    MODEL,
    Gate,
    arrived,
    events,
    folder,
    in_background,
    metric,
    reference,
    request,
    result,
    wait_until,
)

STORE = 64 << 20  # bytes the prefix store may hold in most tests: every prefix here fits
NEW = 12  # tokens each answer has (greedy, EOS ignored)


def doc(i: int = 0) -> str:
    """A system prompt of some 200 tokens (characters, for the tiny model's tokenizer)."""
    return " ".join(f"item {i}-{j} costs {(i + j * 7) % 13} coins." for j in range(9))


def turn(system: str, *said: str) -> list[dict]:
    """A conversation: the system prompt, then user and assistant turns alternating, a user's last."""
    roles = ["user", "assistant"]
    return [{"role": "system", "content": system}] + [
        {"role": roles[i % 2], "content": text} for i, text in enumerate(said)
    ]


def ask(url, messages, key=None, **extra) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": NEW, "ignore_eos": True, **extra}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    status, _, text = request(url, "POST", "/v1/chat/completions", body, headers)
    assert status == 200, text
    return json.loads(text)["choices"][0]["message"]["content"]


def counts(url) -> tuple:
    """(hits, misses, tokens saved) so far."""
    return tuple(int(metric(url, f"kvevict_prefix_cache_{name}_total")) for name in ("hits", "misses", "tokens_saved"))


def ids_of(tok, messages, generation=True) -> list[int]:
    got = tok.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True, return_dict=True)
    return list(got["input_ids"])


def in_parts(model, ids, cuts, policy, budget, bits=None) -> list[int]:
    """The answer recomputed in the parts the server prefills: ``ids`` up to each cut, then the rest,
    into one cache of ``policy`` at ``budget`` (one eviction a step, as the server's), greedy."""
    ends = [*cuts, len(ids)]
    with torch.inference_mode():
        batch, logits = DecodeBatch.prefill(model, ids[: ends[0]], policy, budget, None, bits, Pools())
        for a, b in zip(ends, ends[1:]):
            logits = batch.extend(ids[a:b])
        out = []
        for _ in range(NEW):
            out.append(int(logits[0].argmax()))
            logits = batch.step([out[-1]])
    return out


def test_full_cache_reuse_gives_the_tokens_of_no_store_and_prefills_only_the_rest(folder):
    app, engine = build(folder, {**DEFAULTS, "policy": "full", "prefix_cache_memory": STORE})
    tok = engine.tokenizer
    with ServerThread(app) as srv:
        url = srv.url
        first = turn(doc(), "What does item 0-3 cost?")
        second = turn(doc(), "And item 0-5?")
        split = len(ids_of(tok, first[:1], generation=False))
        assert ask(url, first) == ask(url, first, prefix_cache=False)  # miss, stored; the opt-out looks for none
        assert counts(url) == (0, 1, 0) and metric(url, "kvevict_prefix_cache_entries") == 1
        assert ask(url, second) == ask(url, second, prefix_cache=False)
        assert counts(url) == (1, 1, split)
        last = events(engine, "prefix")[-1]
        assert last["reused"] == split and last["prefilled"] == len(ids_of(tok, second)) - split
        # a plain completion whose token ids begin with the stored prefix reuses it too
        prompt = ids_of(tok, second)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": NEW, "ignore_eos": True}
        status, _, text = request(url, "POST", "/v1/completions", body)
        assert status == 200, text
        assert json.loads(text)["choices"][0]["text"] == ask(url, second, prefix_cache=False)
        assert counts(url) == (2, 1, 2 * split)
        assert 0 < metric(url, "kvevict_prefix_cache_bytes") <= STORE


@pytest.mark.parametrize("policy, bits", [("h2o", None), ("snapkv", 8)])
def test_evicting_reuse_equals_recomputing_the_same_parts(folder, reference, policy, bits):
    """h2o/snapkv at 32 tokens: a hit answers as the miss did, and as the library recomputing the
    prompt in the same parts (earlier turns, then the newest) with the same cache spec."""
    budget = 32
    app, engine = build(
        folder, {**DEFAULTS, "policy": policy, "budget": budget, "kv_bits": bits, "prefix_cache_memory": STORE}
    )
    tok = engine.tokenizer
    with ServerThread(app) as srv:
        url = srv.url
        one = turn(doc(1), "What does item 1-2 cost?")
        answer = ask(url, one)  # a miss: the system prompt alone, stored, then the newest turn
        assert ask(url, one) == answer  # a hit on the system prompt: the same parts, the same answer
        two = turn(doc(1), "What does item 1-2 cost?", answer, "And item 1-4?")
        again = ask(url, two)  # a hit on the system prompt; the earlier turns stored; the newest turn
        assert ask(url, two) == again  # a hit on the earlier turns
        assert counts(url)[:2] == (3, 1)
    model, system = reference[0], len(ids_of(tok, one[:1], generation=False))
    assert answer == tok.decode(in_parts(model, ids_of(tok, one), [system], policy, budget, bits))
    cuts = [system, len(ids_of(tok, two[:3], generation=False))]
    assert again == tok.decode(in_parts(model, ids_of(tok, two), cuts, policy, budget, bits))


def test_a_hit_joins_a_running_batch_and_answers_as_alone(folder):
    """A request started from a stored prefix joins the batch of a row already decoding (its copy
    is pages of the same pools), and answers as it did alone."""
    app, engine = build(folder, {**DEFAULTS, "budget": 32, "prefix_cache_memory": STORE})
    one = turn(doc(7), "What does item 7-1 cost?")
    with ServerThread(app) as srv, Gate(engine, closed=False) as gate:
        url = srv.url
        ask(url, one)  # a miss: stored
        alone = ask(url, one)  # a hit, alone
        gate.close()
        before = arrived(engine)
        long = in_background(ask, url, turn(doc(8), "Talk."), max_tokens=60, prefix_cache=False)
        assert gate.wait_held()  # the long one is held at its prefill
        hit = in_background(ask, url, one)
        assert wait_until(lambda: arrived(engine) == before + 2)
        gate.open()
        assert result(*hit) == alone
        result(*long)
        assert counts(url)[:2] == (2, 1)
    assert len([e for e in events(engine, "join") if e["size"] == 2]) == 1


def prefix_bytes(model, ids, policy, budget) -> int:
    """What the server's store holds for one prefix: the cache's own ``kv_bytes`` after it."""
    with torch.inference_mode():
        batch, _ = DecodeBatch.prefill(model, ids, policy, budget, None, None, Pools())
    return batch.kv_bytes()


def test_the_store_keeps_to_its_bytes_evicting_the_least_recently_used(folder, reference):
    model, tok = reference
    system = ids_of(tok, turn(doc(0))[:1], generation=False)
    one = prefix_bytes(model, system, "h2o", 32)  # every doc(i < 10) has as many tokens
    limit = int(2.5 * one)  # room for two prefixes
    app, engine = build(folder, {**DEFAULTS, "budget": 32, "prefix_cache_memory": limit})
    with ServerThread(app) as srv:
        url = srv.url
        for i in range(6):
            ask(url, turn(doc(i), "What costs most?"))
            assert metric(url, "kvevict_prefix_cache_bytes") == min(i + 1, 2) * one <= limit
        assert metric(url, "kvevict_prefix_cache_evictions_total") == 4
        assert counts(url) == (0, 6, 0)
        ask(url, turn(doc(4), "And least?"))  # a hit: doc(4) is now used after doc(5)
        ask(url, turn(doc(6), "What costs most?"))  # a miss: doc(5), the least recently used, goes
        assert counts(url)[:2] == (1, 7)
        ask(url, turn(doc(4), "Which is free?"))
        idle = engine.trims
        ask(url, turn(doc(5), "Which is free?"))
        assert counts(url)[:2] == (2, 8)
        assert wait_until(lambda: engine.trims > idle)  # idle again (maybe before this ask's batch was dropped)
        with engine.work.cond:  # the worker cannot admit: nothing else touches the store
            assert engine.pages.pages_in_use() > 0
            engine.prefixes.shrink(0)
            # the stored prefixes held every page in use, no more: the last batch's pages go back as
            # the worker lets go of it (it may still be finishing its step; the store is only read
            # and written at admission, which this lock holds off)
            assert wait_until(lambda: engine.pages.pages_in_use() == 0)
        assert metric(url, "kvevict_prefix_cache_bytes") == 0


def test_admission_counts_the_store_and_makes_it_give_way(folder, reference):
    """Full cache: kv_memory fits one request with its prefix's copy and another prefix, not two:
    the second request gets in by the first prefix's eviction, though the store's own bound has room."""
    model, tok = reference
    token = metric_free_token_bytes(model)
    first, second = turn(doc(1), "What costs most?"), turn(doc(2), "What costs most?")
    n, p = len(ids_of(tok, first)), len(ids_of(tok, first[:1], generation=False))
    memory = (n + NEW) * token + p * token + p * token // 2
    app, engine = build(
        folder, {**DEFAULTS, "policy": "full", "kv_memory": memory, "prefix_cache_memory": 2 * p * token}
    )
    with ServerThread(app) as srv:
        url = srv.url
        ask(url, first)
        assert metric(url, "kvevict_prefix_cache_bytes") == p * token
        ask(url, second)
        assert metric(url, "kvevict_prefix_cache_evictions_total") == 1
        assert metric(url, "kvevict_prefix_cache_entries") == 1
        ask(url, second)
        assert counts(url) == (1, 2, len(ids_of(tok, second[:1], generation=False)))  # the one stored: the second's


def metric_free_token_bytes(model) -> int:
    """Bytes one token of one sequence takes in a full cache (K and V of every layer, fp32)."""
    c = model.config
    return c.num_hidden_layers * c.num_key_value_heads * 2 * (c.hidden_size // c.num_attention_heads) * 4


@pytest.mark.parametrize("shared", [False, True])
def test_one_keys_prefixes_never_serve_another_key_unless_flagged(folder, shared):
    keys = ("key-a-0123456789", "key-b-0123456789")
    settings = {**DEFAULTS, "api_key": keys, "prefix_cache_memory": STORE, "prefix_cache_shared": shared}
    app, engine = build(folder, settings)
    with ServerThread(app) as srv:
        url = srv.url
        ask(url, turn(doc(3), "What costs most?"), key=keys[0])  # a miss: key A's prefix stored
        ask(url, turn(doc(3), "Which is free?"), key=keys[1])
        assert counts(url)[0] == (1 if shared else 0)  # key B reuses it only where keys share
        ask(url, turn(doc(3), "And least?"), key=keys[0])
        assert counts(url)[0] == (2 if shared else 1)  # key A's own prefix serves key A
        status, _, _ = request(url, "POST", "/v1/chat/completions", {"model": MODEL, "messages": turn(doc(3), "x")})
        assert status == 401


def test_bad_prefix_cache_field_is_a_400_and_bad_flags_fail_clearly(folder, reference, capsys):
    from kvevict.cli import main

    app, _ = build(folder, {**DEFAULTS, "prefix_cache_memory": STORE})
    with ServerThread(app) as srv:
        body = {"model": MODEL, "messages": turn(doc(), "hi"), "prefix_cache": "no"}
        status, _, text = request(srv.url, "POST", "/v1/chat/completions", body)
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == "prefix_cache" and "true" in err["message"]
    for flags, message in (
        (["--prefix-cache-memory", "lots"], "--prefix-cache-memory takes a size such as 512MiB or 2GiB, got 'lots'"),
        (["--prefix-cache-memory", "4GiB"], "is the part of --kv-memory"),
        (["--no-prefix-cache", "--prefix-cache-memory", "1GiB"], "--no-prefix-cache turns the prefix store off"),
        (
            ["--prefix-cache-memory", "1GiB", "--prefix-cache-shared-across-keys"],
            "it needs --prefix-cache-memory and --api-key",
        ),
    ):
        assert main(["serve", "--model", "nowhere", *flags]) == 2, flags
        out = capsys.readouterr().err
        assert message in out and "Traceback" not in out, out
    with pytest.raises(SystemExit) as unknown:  # argparse's own usage error
        main(["serve", "--model", "nowhere", "--prefix-cache-sharing"])
    assert unknown.value.code == 2 and "unrecognized arguments: --prefix-cache-sharing" in capsys.readouterr().err
    with pytest.raises(ValueError, match="a size below it, or 0 to turn the store off"):
        Engine(*reference, Settings(MODEL, kv_memory=1 << 20, prefix_cache_memory=1 << 20))
