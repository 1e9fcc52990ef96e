"""Continuous batching in the cache: rows at different fill levels share one EvictingCache (and a
DynamicCache for the full policy); a row that joins or leaves mid-decode changes nobody's tokens."""

import pytest
import torch

from conftest import decode_joining, tiny_model
from kvevict.serve.batch import DecodeBatch


def _alone(model, prompt, policy, budget, n):
    batch, logits = DecodeBatch.prefill(model, prompt, policy, budget, None)
    out = [int(logits.argmax(-1))]
    for _ in range(n - 1):
        out.append(int(batch.step([out[-1]]).argmax(-1)))
    return out


@pytest.mark.parametrize("policy, budget", [("h2o", 8), ("h2o", 64), ("tova", 12), ("full", None)])
def test_rows_joining_and_leaving_mid_decode_each_equal_their_answer_alone(policy, budget):
    model = tiny_model("llama-gqa")
    from kvevict.attention import ATTN_NAME, register

    register()
    model.set_attn_implementation(ATTN_NAME)
    torch.manual_seed(5)
    prompts = [torch.randint(1, 128, (n,)).tolist() for n in (30, 9, 21)]
    want = [_alone(model, p, policy, budget, 16) for p in prompts]
    got = decode_joining(lambda p: DecodeBatch.prefill(model, p, policy, budget, None), prompts, (4, 7), 16, 30)
    assert got == want


@pytest.mark.parametrize("storage", [{"kv_bits": 8, "group": 8}, {"evicted_bits": 4, "evicted_budget": 12, "group": 8}])
def test_rows_join_with_packed_and_two_tier_storage(storage):
    import kvevict

    model = tiny_model("llama-gqa")
    torch.manual_seed(6)
    prompts = [torch.randint(1, 128, (n,)).tolist() for n in (26, 11)]

    def start(p):
        cache = kvevict.make_cache(model, "h2o", 8, **storage)
        with torch.no_grad():
            logits = model(torch.tensor([p]), cache=cache, use_cache=True).logits[:, -1]
        return DecodeBatch(model, cache, torch.ones(1, len(p), dtype=torch.long), torch.tensor([len(p)])), logits

    def alone(p):
        batch, logits = start(p)
        out = [int(logits.argmax(-1))]
        with torch.no_grad():
            for _ in range(9):
                out.append(int(batch.step([out[-1]]).argmax(-1)))
        return out

    want = [alone(p) for p in prompts]
    batch, logits = start(prompts[0])
    got = [[int(logits.argmax(-1))], []]
    with torch.no_grad():
        for _ in range(3):
            got[0].append(int(batch.step([got[0][-1]]).argmax(-1)))
        other, logits = start(prompts[1])
        assert batch.can_join(other)
        batch.join(other)
        got[1].append(int(logits.argmax(-1)))
        for _ in range(6):
            logits = batch.step([got[0][-1], got[1][-1]])
            got[0].append(int(logits[0].argmax()))
            got[1].append(int(logits[1].argmax()))
        batch.keep([1])
        for _ in range(3):
            got[1].append(int(batch.step([got[1][-1]]).argmax(-1)))
    assert got == want


# -- per-row policies and budgets in one cache ---------------------------------------------------


def _start(model, prompt, policy, budget, **kw):
    """A batch of one row, prefilled alone in its own cache, and its last logits."""
    import kvevict

    cache = kvevict.make_cache(model, policy, budget, **kw)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[:, -1]
    return DecodeBatch(model, cache, torch.ones(1, len(prompt), dtype=torch.long), torch.tensor([len(prompt)])), logits


def _kept(layer, row):
    """Per KV head, the sorted positions a row keeps in a layer's first tier."""
    t = layer.tiers[0]
    return [sorted(t.pos[row, h][t.valid[row, h]].tolist()) for h in range(t.pos.shape[1])]


def test_rows_with_budgets_4_and_8_in_one_cache_keep_their_own_newest_4_and_8():
    # recency with no sinks and a 1-token window ranks by position: the budget newest tokens stay
    model = tiny_model("llama-gqa")
    torch.manual_seed(7)
    prompts = [torch.randint(1, 128, (n,)).tolist() for n in (13, 10)]
    a, la = _start(model, prompts[0], "recency", 4, recent=1, sinks=0)
    b, lb = _start(model, prompts[1], "recency", 8, recent=1, sinks=0)
    assert a.can_join(b)
    a.join(b)
    last = [int(la.argmax(-1)), int(lb.argmax(-1))]
    with torch.no_grad():
        for _ in range(5):
            last = a.step(last).argmax(-1).tolist()
    for layer in a.cache.layers:
        assert layer.tiers[0].budget == 8  # the tier is as wide as the larger budget, for both rows
        assert _kept(layer, 0) == [list(range(18 - 4, 18))] * 2  # 13 prompt + 5 fed tokens
        assert _kept(layer, 1) == [list(range(15 - 8, 15))] * 2
        assert layer.tiers[0].caps.tolist() == [4, 8]


MIXED = [
    ("h2o", 8, {}),
    ("tova", 12, {}),
    ("recency", 4, {"recent": 1, "sinks": 1}),
    ("h2o", 16, {"recent": 3}),
    ("roco", 10, {}),
    ("snapkv", 10, {"window": 4, "recent": 2}),
]


@pytest.mark.parametrize("storage", [{}, {"kv_bits": 8, "group": 8}, {"evicted_bits": 4, "group": 8}])
def test_mixed_policies_and_budgets_in_one_cache_each_equal_a_batch_of_one(storage):
    """Six rows, five policies (SnapKV's pooled scores included), five budgets, joining mid-decode and leaving when done: each
    row's tokens, logits and kept positions equal its own batch-1 cache's. Two-tier storage sizes
    each row's second tier by its own prompt, so the second tier is ragged too."""
    model = tiny_model("llama-gqa")
    torch.manual_seed(8)
    prompts = [torch.randint(1, 128, (n,)).tolist() for n in (30, 9, 21, 17, 12, 25)]
    steps = [14, 12, 10, 4, 6, 9]  # the widest row (16) leaves first
    joins = {2: 1, 3: 2, 5: 3, 6: 4, 7: 5}  # step -> row that joins then

    def alone(i):
        policy, budget, kw = MIXED[i]
        batch, logits = _start(model, prompts[i], policy, budget, **kw, **storage)
        out, lg = [int(logits.argmax(-1))], [logits[0]]
        with torch.no_grad():
            for _ in range(steps[i] - 1):
                logits = batch.step([out[-1]])
                out.append(int(logits.argmax(-1)))
                lg.append(logits[0])
        return out, torch.stack(lg), [_kept(layer, 0) for layer in batch.cache.layers]

    want = [alone(i) for i in range(len(prompts))]
    policy, budget, kw = MIXED[0]
    batch, logits = _start(model, prompts[0], policy, budget, **kw, **storage)
    rows, got, lgs, kept = [0], {0: [int(logits.argmax(-1))]}, {0: [logits[0]]}, {}
    with torch.no_grad():
        for step in range(40):
            if step in joins:
                i = joins[step]
                policy, budget, kw = MIXED[i]
                other, logits = _start(model, prompts[i], policy, budget, **kw, **storage)
                assert batch.can_join(other)
                batch.join(other)
                rows.append(i)
                got[i], lgs[i] = [int(logits.argmax(-1))], [logits[0]]
            done = [r for r in rows if len(got[r]) == steps[r]]
            for r in done:
                kept[r] = [_kept(layer, rows.index(r)) for layer in batch.cache.layers]
            if done:
                batch.keep([k for k, r in enumerate(rows) if r not in done])
                rows = [r for r in rows if r not in done]
            if not rows:
                break
            if step == 7:  # six rows, five budgets, five policies: one forward
                assert rows == [0, 1, 2, 3, 4, 5] and len(batch.cache.layers[0].rows.kinds) == 6
                assert batch.cache.layers[0].tiers[0].caps.tolist() == [8, 12, 4, 16, 10, 10]
            if step == 9:  # it left: the storage narrowed to the widest remaining budget
                assert rows == [0, 1, 2, 4, 5] and batch.cache.layers[0].tiers[0].caps.tolist() == [8, 12, 4, 10, 10]
                assert batch.cache.layers[0].budget == batch.cache.layers[0].tiers[0].pos.shape[-1] == 12
            logits = batch.step([got[r][-1] for r in rows])
            for k, r in enumerate(rows):
                got[r].append(int(logits[k].argmax()))
                lgs[r].append(logits[k])
    for i, (tokens, logits, kept_alone) in enumerate(want):
        assert got[i] == tokens, i
        torch.testing.assert_close(torch.stack(lgs[i]), logits, rtol=1e-4, atol=1e-4)
        assert kept[i] == kept_alone, i


def test_rows_whose_policies_need_different_attention_parameters_do_not_share_a_cache():
    model = tiny_model("llama-gqa")
    snap, _ = _start(model, list(range(1, 20)), "snapkv", 16, window=4)
    expected, _ = _start(model, list(range(1, 20)), "expected", 16, window=8)
    h2o, _ = _start(model, list(range(1, 20)), "h2o", 16)
    assert not snap.can_join(expected)  # both read the last queries' window: 4 against 8
    assert snap.can_join(h2o) and expected.can_join(h2o)


def test_adaptive_rows_with_different_budgets_and_policies_share_a_cache_as_alone():
    """Ada-KV rows (one slot pool per layer shared by the heads) of budgets 6, 10 and 14 and two
    policies in one cache: the pool is as wide as the largest row's, each row's tokens and kept
    (head, position) pairs equal its own cache's; an adaptive row never joins a per-head one."""
    model = tiny_model("llama-gqa")
    torch.manual_seed(12)
    kinds = [("ada-h2o", 6), ("ada-tova", 14), ("ada-h2o", 10)]
    prompts = [torch.randint(1, 128, (n,)).tolist() for n in (24, 11, 17)]

    def pairs(layer, row):
        t = layer.tiers[0]
        return sorted((int(h), int(p)) for h, p, v in zip(t.head[row, 0], t.pos[row, 0], t.valid[row, 0]) if v)

    def alone(i):
        batch, logits = _start(model, prompts[i], *kinds[i])
        out = [int(logits.argmax(-1))]
        with torch.no_grad():
            for _ in range(7):
                out.append(int(batch.step([out[-1]]).argmax(-1)))
        return out, [pairs(layer, 0) for layer in batch.cache.layers]

    want = [alone(i) for i in range(3)]
    batch, logits = _start(model, prompts[0], *kinds[0])
    got = [[int(logits.argmax(-1))]]
    plain, _ = _start(model, prompts[1], "h2o", 6)
    assert not batch.can_join(plain)
    with torch.no_grad():
        for i in (1, 2):
            other, logits = _start(model, prompts[i], *kinds[i])
            assert batch.can_join(other)
            batch.join(other)
            got.append([int(logits.argmax(-1))])
        heads = model.config.num_key_value_heads
        assert batch.cache.layers[0].tiers[0].caps.tolist() == [6 * heads, 14 * heads, 10 * heads]
        for _ in range(7):
            logits = batch.step([g[-1] for g in got])
            for g, row in zip(got, logits):
                g.append(int(row.argmax()))
    for i, (tokens, kept) in enumerate(want):
        assert got[i] == tokens, i
        assert [pairs(layer, i) for layer in batch.cache.layers] == kept, i
