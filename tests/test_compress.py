"""Compress once, ask many (``kvevict.compress``, ``kvevict.fork``): a fork of a context kept whole
is the stock cache, batched questions answer as one at a time, the compressed context is never
changed by what is asked of it, a fork's bytes are its own tail, and bad input is a ValueError."""

import pytest
import torch
from transformers import DynamicCache

import kvevict
from conftest import tiny_model
from eval_helpers import tiny_tokenizer
from kvevict.generate import generate

TEXT = "The pass key is 12345. Remember it. Old Tom keeps the lighthouse on the rock. " * 5
QUESTIONS = ["What is the pass key?", "Who keeps the lighthouse on the rock every night?", "Remember?"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _fork_logits(model, ctx, fork, questions):
    """Logits of every question token, a fork's forward over ``ctx.inputs(questions)``."""
    inputs = ctx.inputs(questions)
    n, mask = ctx.length, inputs["attention_mask"]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, n:]  # as generate counts them: real tokens only
    with torch.no_grad():
        return model(inputs["input_ids"][:, n:], attention_mask=mask, position_ids=pos, cache=fork).logits


def _state(cache) -> list:
    """Every tensor a cache's layers hold, and their host counts, copied."""
    out = []
    for layer in cache.layers:
        out += [layer.seen, layer.n_real.clone(), layer.progress.evicted]
        for t in layer._parts():
            out += [t.filled, t.store.keys.clone(), t.store.values.clone(), t.pos.clone(), t.valid.clone()]
            out += [s.clone() for s in t.stats.values()]
        if layer.keyspace is not None:
            out.append(layer.keyspace.center.clone())
    return out


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2"])
def test_a_fork_of_a_context_kept_whole_is_the_stock_cache(arch, tok):
    model = tiny_model(arch)
    ctx = kvevict.compress(model, tok, TEXT, "full")
    assert ctx.cache.layers[0].filled == ctx.length  # every context token kept
    q = ctx.question_ids(QUESTIONS[0])
    got = _fork_logits(model, ctx, ctx.fork(), [QUESTIONS[0]])
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        want = model(torch.cat([ctx.ids, q], 1), cache=DynamicCache(config=model.config)).logits[:, ctx.length :]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # and the greedy answer, decoding through the fork, is the stock cache's
    answer = ctx.ask(QUESTIONS[0], max_new_tokens=6)
    model.set_attn_implementation("sdpa")
    ids = torch.cat([ctx.ids, q], 1)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6, pad_token_id=3)
    assert answer == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def test_a_fork_reads_sliding_window_layers_as_the_stock_cache():
    """Gemma 3's sliding layers: the context kept whole is the stock cache's (its window), and two
    questions batched past the window answer as each alone."""
    from test_sliding import tiny_gemma3

    model = tiny_gemma3()
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(1, 128, (1, 40), generator=gen)
    questions = [torch.randint(1, 128, (1, 5), generator=gen), torch.randint(1, 128, (1, 3), generator=gen)]
    ctx = kvevict.compress(model, None, context, "full")
    got = _fork_logits(model, ctx, ctx.fork(), questions[:1])
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ids = torch.cat([context, questions[0]], 1)
        want = model(ids, cache=DynamicCache(config=model.config)).logits[:, 40:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    together = _fork_logits(model, ctx, ctx.fork(2), questions)
    torch.testing.assert_close(together[0], got[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        together[1, -3:], _fork_logits(model, ctx, ctx.fork(), questions[1:])[0], atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("spec", ["h2o/int4@0.3", "ada-snapkv@0.3", "merge-h2o@0.3", "kvzip-pool@memory=0.2"])
def test_batched_questions_answer_as_one_at_a_time(spec, tok):
    """Three questions of different lengths in one left-padded forward: each row's logits and greedy
    answer are those of its question asked alone (the parent's pieces broadcast to the rows)."""
    model = tiny_model("llama-gqa")
    ctx = kvevict.compress(model, tok, TEXT, spec)
    assert ctx.cache.layers[0].evicted > 0 or spec.startswith("kvzip")  # it really compressed
    together = _fork_logits(model, ctx, ctx.fork(len(QUESTIONS)), QUESTIONS)
    for row, question in enumerate(QUESTIONS):
        alone = _fork_logits(model, ctx, ctx.fork(), [question])
        q = alone.shape[1]
        torch.testing.assert_close(together[row, -q:], alone[0], atol=1e-4, rtol=1e-4)
    batched = ctx.ask(QUESTIONS, max_new_tokens=6)
    assert batched == [ctx.ask(question, max_new_tokens=6) for question in QUESTIONS]


def test_the_fused_decode_step_reads_a_fork_as_the_torch_path_does(tok, monkeypatch):
    """A decode step over a fork (packed parent + tail, rows expanded without a copy) gives the
    same logits through the compiled CPU kernel as through attend's torch path."""
    from kvevict.kernels import cpu

    if not cpu.available()[0]:
        pytest.skip("no compiled CPU kernel here")
    model = tiny_model("llama-gqa")
    ctx = kvevict.compress(model, tok, TEXT, "h2o/int8@0.3")
    got = {}
    for backend in ("torch", "cpu"):
        monkeypatch.setenv("KVEVICT_KERNEL", backend)
        inputs = ctx.inputs(QUESTIONS[:2])
        out = model.generate(
            **inputs,
            cache=ctx.fork(2),
            do_sample=False,
            max_new_tokens=5,
            pad_token_id=3,
            output_logits=True,
            return_dict_in_generate=True,
        )
        got[backend] = torch.stack(out.logits)
    torch.testing.assert_close(got["cpu"], got["torch"], atol=1e-4, rtol=1e-4)


def test_the_compressed_context_is_never_changed_by_its_questions(tok):
    model = tiny_model("llama-gqa")
    ctx = kvevict.compress(model, tok, TEXT, "h2o/int8+int4@0.3")
    before, held = _state(ctx.cache), ctx.kv_bytes()
    first = ctx.ask(QUESTIONS[0], max_new_tokens=20)  # decodes far past the slack's turn-over
    ctx.ask(QUESTIONS, max_new_tokens=8)
    assert _same(before, _state(ctx.cache))
    assert ctx.kv_bytes() == held
    assert ctx.ask(QUESTIONS[0], max_new_tokens=20) == first  # asked again: the same answer


def test_a_fork_counts_its_own_tail(tok):
    model = tiny_model("llama-gqa")
    ctx = kvevict.compress(model, tok, TEXT, "h2o/int4@0.3")
    fork = ctx.fork(2)
    assert fork.kv_bytes() == sum(layer.tail.nbytes() for layer in fork.layers)
    empty = fork.kv_bytes()
    _fork_logits(model, ctx, fork, QUESTIONS[:2])
    assert fork.kv_bytes() > empty
    layer = fork.layers[0]
    # the keys and values of every appended slot, in the model's dtype, and its position and validity
    h, dk, dv = layer.parent.dims
    slot = 2 * h * (dk + dv) * 4 + 2 * (1 + 8)
    assert fork.kv_bytes() >= len(fork.layers) * layer.tail.filled * slot
    assert fork.shared_kv_bytes() == ctx.kv_bytes()
    # a stock cache holds the whole context again in each row, and the tail
    stock = 2 * len(fork.layers) * h * (ctx.length + layer.tail.filled) * (dk + dv) * 2
    assert fork.full_kv_bytes() == stock


def test_a_fork_holds_no_more_slots_than_its_question_and_answer(tok):
    model = tiny_model("llama-gqa")
    ctx = kvevict.compress(model, tok, TEXT, "h2o/int4@0.3")
    q, new = ctx.question_ids(QUESTIONS[1]).shape[1], 6
    assert q > new  # so doubling past the question would reserve q slots more than asked for
    caps = {}
    for limit in (None, q + new):
        fork = ctx.fork(1, limit=limit)
        model.generate(**ctx.inputs([QUESTIONS[1]]), cache=fork, max_new_tokens=new, min_new_tokens=new)
        caps[limit] = {layer.tail.k.shape[2] for layer in fork.layers}
        assert {layer.tail.filled for layer in fork.layers} == {q + new - 1}  # the last token is never fed
    assert caps == {None: {2 * q}, q + new: {q + new}}
    # answer() knows both: the fork's bytes are those of at most the question and max_new_tokens
    res = ctx.answer(QUESTIONS[1], max_new_tokens=new)
    h, dk, dv = ctx.cache.layers[0].dims
    per_layer = (q + new) * (h * (dk + dv) * 4 + 1 + 8) + 8  # keys, values (fp32), validity, position; n_real
    assert res.kv_bytes - ctx.kv_bytes() <= len(ctx.cache.layers) * per_layer


@pytest.mark.parametrize("limit", [0, -3, 2.5, True])
def test_a_fork_refuses_a_limit_that_is_not_a_count(limit, tok):
    ctx = kvevict.compress(tiny_model("llama-gqa"), tok, TEXT, "h2o/int4@0.3")
    with pytest.raises(ValueError, match="limit is the tokens a row appends"):
        ctx.fork(1, limit=limit)


def test_generate_answers_a_question_over_a_compressed_context(tok):
    model = tiny_model("llama-gqa")
    ctx = kvevict.compress(model, tok, TEXT, memory=0.2)
    res = generate(model, tok, QUESTIONS[0], cache=ctx, max_new_tokens=6)
    assert res.text == ctx.ask(QUESTIONS[0], max_new_tokens=6)
    assert res.policy == "kvzip-pool" and res.prompt_tokens == ctx.length + ctx.question_ids(QUESTIONS[0]).shape[1]
    assert res.kv_bytes > ctx.kv_bytes()  # the compressed part and the fork's tail


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda m, t: kvevict.compress(m, t, ""), "context is empty"),
        (lambda m, t: kvevict.compress(m, t, "   \n"), "context is empty"),
        (lambda m, t: kvevict.compress(m, t, torch.zeros(1, 0, dtype=torch.long)), r"empty \(0 tokens\)"),
        (lambda m, t: kvevict.compress(m, t, 3.5), "must be a text or token ids"),
        (lambda m, t: kvevict.compress(m, t, TEXT, "snapkv+q@0.5"), r"drop the \+q"),
        (lambda m, t: kvevict.compress(m, t, TEXT, "h2o", question=4), "drop question="),
        (lambda m, t: kvevict.compress(m, t, TEXT, "oracle"), "oracle"),
        (lambda m, t: kvevict.compress(m, t, TEXT, "full", budget=0.5), "full keeps every token"),
        (lambda m, t: kvevict.compress(m, t, TEXT, "h2o@0.5").fork(0), "batch >= 1"),
        (lambda m, t: kvevict.compress(m, t, TEXT, "h2o@0.5").fork(1.5), "batch >= 1"),
        (lambda m, t: kvevict.compress(m, t, TEXT, "h2o@0.5").ask(12), "string or a list of strings"),
        (lambda m, t: kvevict.compress(m, t, TEXT, "h2o@0.5").ask([]), "no question given"),
        (lambda m, t: kvevict.compress(m, t, TEXT, "h2o@0.5").ask([1, 2]), "string or a list of strings"),
        (lambda m, t: kvevict.compress(m, t, TEXT, "h2o@0.5").ask("Q?", max_new_tokens=0), "max_new_tokens"),
        (lambda m, t: generate(m, t, "Q?", "h2o", cache=kvevict.compress(m, t, TEXT)), "drop policy="),
        (lambda m, t: generate(m, t, "Q?", cache=object()), "cache= takes a compressed context"),
        (lambda m, t: kvevict.ForkCache(kvevict.make_cache(m, "h2o", 8)), "filled EvictingCache"),
        (
            lambda m, t: kvevict.compress(m, None, torch.arange(4, 40), "h2o").ask("Q?"),
            r"give compress\(\) a tokenizer",
        ),
        (lambda m, t: kvevict.compress(m, None, torch.arange(4, 40)), r"repeat it: give compress\(\) a tokenizer"),
        (lambda m, t: kvevict.compress(m, None, TEXT, "h2o"), "a context as text needs a tokenizer"),
    ],
)
def test_bad_input_is_a_clear_value_error(call, words, tok):
    model = tiny_model("llama-gqa")
    with pytest.raises(ValueError, match=words):
        call(model, tok)


def test_a_fork_fed_another_batch_says_to_fork_again(tok):
    model = tiny_model("llama-gqa")
    ctx = kvevict.compress(model, tok, TEXT, "h2o@0.5")
    with pytest.raises(ValueError, match="fork the context again with batch=2"):
        _fork_logits(model, ctx, ctx.fork(1), QUESTIONS[:2])
