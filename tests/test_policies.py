"""Every policy's choice on hand-built attention, the statistics the attention collects,
every policy x prefill mode on a padded GQA batch, block prefill's peak, exactness."""

import pytest
import torch
from transformers import DynamicCache

import kvevict
from conftest import tiny_model
from kvevict.attention import _Segments, attend
from kvevict.policies import Candidates, make_policy
from kvevict.storage import stat_bytes
from probe_helpers import tiny_probe

# Attention of 6 queries over 6 keys (one head, causal, rows sum to 1), built by hand.
A = torch.tensor(
    [
        [1.00, 0.00, 0.00, 0.00, 0.00, 0.00],
        [0.50, 0.50, 0.00, 0.00, 0.00, 0.00],
        [0.60, 0.10, 0.30, 0.00, 0.00, 0.00],
        [0.40, 0.10, 0.10, 0.40, 0.00, 0.00],
        [0.50, 0.05, 0.05, 0.10, 0.30, 0.00],
        [0.30, 0.25, 0.02, 0.03, 0.19, 0.21],
    ]
)


def stats_of(a, history=None, window=None):
    """The statistics of kvevict.attention, written out from their definitions for one head."""
    t = torch.arange(a.shape[0])
    seen = (t[:, None] >= t[None, :]).float()
    hit = (a >= 1.0 / (t[:, None] + 1)).float() * seen
    age = (a.shape[0] - 1 - t).float()
    gamma = 1 - 1 / history if history else 1.0
    w = a.shape[0] if window is None else window
    return {
        "sum": a.sum(0),
        "sq": a.square().sum(0),
        "count": seen.sum(0),
        "last": a[-1],
        "hits": hit.sum(0),
        "hits_ema": (hit * gamma ** age[:, None]).sum(0),
        "obs": a[-w:].sum(0),
    }


def kept(policy, budget, **kw):
    st = stats_of(A, **kw)
    st.pop("count")  # MAS and RoCo read n_i from positions (Candidates.seen), not from a statistic
    c = Candidates(
        stats={k: v.view(1, 1, -1) for k, v in st.items()},
        pos=torch.arange(6).view(1, 1, -1),
        valid=torch.ones(1, 1, 6, dtype=torch.bool),
        newest=torch.tensor(5).view(1, 1, 1),
        budget=budget,
        layer_idx=0,
    )
    return set(policy.priority(c).topk(budget, dim=-1).indices.flatten().tolist())


@pytest.mark.parametrize(
    "name, params, budget, expected, why",
    [
        ("h2o", dict(recent=1), 3, {0, 1, 5}, "sums 3.3 1.0 .47 .53 .49: evict keys 2, 4, 3"),
        ("mas", dict(recent=1), 3, {0, 4, 5}, "means .55 .2 .1175 .177 .245: evict 2, 3, 1"),
        ("tova", dict(), 3, {0, 1, 5}, "last row .3 .25 .02 .03 .19 .21, no window: evict 2, 3, 4"),
        ("aqas", dict(recent=1), 4, {0, 1, 4, 5}, "above-uniform votes 6 2 0 1 2: evict 2, 3"),
        ("scissorhands", dict(recent=1, history=2), 3, {0, 4, 5}, "decayed votes 1.97 1.06 0 .25 1.5"),
        ("recency", dict(recent=1, sinks=1), 3, {0, 4, 5}, "sink 0 + newest; evict 1, 2, 3"),
        ("roco", dict(recent=2, young=1), 3, {0, 1, 5}, "std protects 0 (.222) and 1 (.164); scope 2,3,4"),
        ("snapkv", dict(recent=1, window=2, kernel=1), 3, {0, 4, 5}, "last 2 rows .8 .3 .07 .13 .49"),
        ("snapkv", dict(recent=1, window=2, kernel=3), 3, {0, 1, 5}, "pooled .55 .39 .167 .23 .277"),
    ],
)
def test_policy_choice_on_hand_built_attention(name, params, budget, expected, why):
    pol = make_policy(name, **params)
    extra = {k: params[k] for k in ("history", "window") if k in params}
    assert kept(pol, budget, **extra) == expected, why


def test_query_counts_come_from_positions():
    """MAS / RoCo's n_i (queries that saw key i) equals newest - pos_i + 1: the counter's definition."""
    c = Candidates(
        stats={},
        pos=torch.arange(6).view(1, 1, -1),
        valid=torch.ones(1, 1, 6, dtype=torch.bool),
        newest=torch.tensor(5).view(1, 1, 1),
        budget=3,
        layer_idx=0,
    )
    assert torch.equal(c.seen(), stats_of(A)["count"].view(1, 1, -1))


def test_random_policy_protects_recent_and_is_seeded():
    sets = [kept(make_policy("random", recent=2, seed=s), 4) for s in range(40)]
    assert all({4, 5} <= s and len(s) == 4 for s in sets)
    assert {frozenset(s) for s in sets} == {frozenset({a, b, 4, 5}) for a in range(4) for b in range(a + 1, 4)}
    assert kept(make_policy("random", recent=2, seed=7), 4) == kept(make_policy("random", recent=2, seed=7), 4)


def test_attention_statistics_match_their_definitions():
    torch.manual_seed(0)
    b, hkv, g, q, d = 2, 2, 3, 7, 8
    query, key, value = torch.randn(b, hkv * g, q, d), torch.randn(b, hkv, q, d), torch.randn(b, hkv, q, d)
    seg = _Segments(
        pieces=[],
        pos_past=None,
        valid_past=None,
        k_new=key,
        v_new=value,
        pos_new=torch.arange(q).view(1, -1),
        valid_new=None,
    )
    out, st = attend(
        query, seg, d**-0.5, None, None, ("sum", "sq", "last", "hits", "hits_ema", "obs"), observe=3, gamma=0.5
    )
    scores = (query.view(b, hkv, g, q, d) @ key.unsqueeze(2).transpose(-1, -2)) * d**-0.5
    causal = torch.ones(q, q, dtype=torch.bool).tril()
    p = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # (b, hkv, g, q, q)
    ref_out = (p @ value.unsqueeze(2)).view(b, hkv * g, q, d).transpose(1, 2)
    assert torch.allclose(out, ref_out, atol=1e-6)
    a = p.sum(2)  # summed over the group: (b, hkv, q, q)
    for bi in range(b):
        for h in range(hkv):
            ref = stats_of(a[bi, h] / g, history=2, window=3)  # stats_of compares a/g with 1/n_t
            assert torch.allclose(st["sum"][bi, h], ref["sum"] * g, atol=1e-5)
            assert torch.allclose(st["sq"][bi, h], ref["sq"] * g * g, atol=1e-5)
            assert torch.allclose(st["last"][bi, h], ref["last"] * g, atol=1e-6)
            assert torch.allclose(st["obs"][bi, h], ref["obs"] * g, atol=1e-5)
            assert torch.equal(st["hits"][bi, h], ref["hits"])
            assert torch.allclose(st["hits_ema"][bi, h], ref["hits_ema"])


ALL = sorted({cls.name for cls in kvevict.POLICIES.values()})


def _policy(name, model, ids, mask=None):
    """The policy by name; the oracle first records the future of this very batch, KVzip its
    reconstruction of it (unpadded prompts only)."""
    if name.startswith("kvzip"):
        if mask is not None:
            pytest.skip("kvzip records unpadded prompts only (its own test checks the error)")
        probe = {"probe": tiny_probe(model)} if name == "kvzip-probe" else {}  # a tiny model has none of its own
        return kvevict.POLICIES[name].record(
            model, lambda *a, **k: {"input_ids": torch.tensor([[7, 8, 9]])}, ids, **probe
        )
    if name != "oracle":
        return name
    from kvevict.policies.oracle import Oracle

    return Oracle.record(model, ids, attention_mask=mask)


def _padded_batch():
    torch.manual_seed(5)
    lens = (36, 22, 30)
    ids = torch.randint(1, 128, (3, max(lens)))
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        mask[i, max(lens) - n :] = 1
    return ids, mask


@pytest.mark.parametrize("mode, stride", [("full", None), ("token", None), ("block", 4)])
@pytest.mark.parametrize("name", ALL)
def test_every_policy_and_prefill_mode_on_a_padded_gqa_batch(name, mode, stride):
    model = tiny_model("llama-gqa")
    ids, mask = _padded_batch()
    budget = 12
    params = {} if name in ("tova", "pyramidkv", "oracle") else {"recent": 4}
    cache = kvevict.make_cache(model, _policy(name, model, ids, mask), budget=budget, **params)
    kvevict.prefill(model, cache, ids, mask, mode=mode, stride=stride)
    out = model.generate(
        ids, attention_mask=mask, cache=cache, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0
    )
    assert out.shape == (3, ids.shape[1] + 10)
    cfg = model.config
    per_layer = [layer.budget for layer in cache.layers]
    assert sum(per_layer) == budget * cfg.num_hidden_layers
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    # per slot: key + value (fp32), position (int16; -1: empty or padding), 4 bytes per policy
    # statistic; per layer and sequence: its count of real tokens (int64); adaptive: the slot's head (uint8)
    slot = head_dim * 2 * 4 + 2 + stat_bytes(cache.policy.stats) + cache.policy.adaptive
    assert cache.kv_bytes() == sum(per_layer) * 3 * cfg.num_key_value_heads * slot + 8 * 3 * cfg.num_hidden_layers
    for layer in cache.layers:
        assert layer.valid.all()  # 12 real tokens always exist, so padding never holds a slot
        if mode != "full":
            assert layer.peak_entries <= layer.budget + (stride or 1)


@pytest.mark.parametrize("stride", [1, 8])
def test_block_prefill_of_20x_the_budget_peaks_at_budget_plus_stride(stride):
    model = tiny_model("llama-gqa")
    budget = 16
    ids = torch.randint(0, 128, (1, 20 * budget))
    cache = kvevict.make_cache(model, "h2o", budget=budget)
    kvevict.prefill(model, cache, ids, mode="block", stride=stride, keep_last=0)
    assert cache.get_seq_length() == 20 * budget
    assert cache.peak_entries() == budget + stride  # never more, and the bound is reached
    full = kvevict.make_cache(model, "h2o", budget=budget)
    kvevict.prefill(model, full, ids, mode="full")
    model(ids, cache=full)
    assert full.peak_entries() == 20 * budget  # full prefill holds the prompt in one layer


@pytest.mark.parametrize("name", ALL)
def test_every_policy_with_a_covering_budget_equals_the_full_cache(name):
    model = tiny_model("qwen2")
    torch.manual_seed(4)
    ids, steps = torch.randint(0, 128, (2, 20)), torch.randint(0, 128, (2, 4))
    ref_cache = DynamicCache(config=model.config)
    budget = 24 * 20 if name == "pyramidkv" else 24  # pyramid: the top layer gets budget / 20
    cache = kvevict.make_cache(model, _policy(name, model, torch.cat([ids, steps], 1)), budget=budget)
    assert min(layer.budget_spec for layer in cache.layers) >= 24
    with torch.no_grad():
        for part in [ids] + [steps[:, i : i + 1] for i in range(4)]:
            r = model(part, cache=ref_cache).logits
            g = model(part, cache=cache).logits
            assert (r - g).abs().max().item() < 1e-4


def test_pyramid_budgets_shrink_with_depth_and_keep_the_total():
    pol = make_policy("pyramidkv")
    b = pol.layer_budgets(100, 5)
    assert b == sorted(b, reverse=True) and sum(b) == 500 and b[-1] == 5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mode="chunky"), "unknown prefill mode 'chunky'"),
        (dict(mode="block"), "stride >= 1"),
        (dict(mode="block", stride=0), "stride >= 1"),
    ],
)
def test_bad_prefill_arguments(kwargs, message):
    model = tiny_model("llama-gqa")
    cache = kvevict.make_cache(model, "h2o", budget=8)
    with pytest.raises(ValueError, match=message):
        kvevict.prefill(model, cache, torch.randint(0, 128, (1, 20)), **kwargs)


def test_bad_policy_parameters_are_clear():
    model = tiny_model("llama-gqa")
    with pytest.raises(ValueError, match="bad parameters for policy 'h2o'"):
        kvevict.make_cache(model, "h2o", budget=8, windowz=3)
    with pytest.raises(ValueError, match="kernel must be an odd"):
        kvevict.make_cache(model, "snapkv", budget=64, kernel=4)


@pytest.mark.parametrize("budget, cut", [(8, 24), (12, 30)])
def test_oracle_keeps_the_keys_the_future_attends_most(budget, cut):
    from kvevict.policies.oracle import Oracle

    model = tiny_model("llama-gqa")
    torch.manual_seed(6)
    ids = torch.randint(0, 128, (2, 48))
    oracle = Oracle.record(model, ids, block=1)
    model.set_attn_implementation("eager")  # the reference: explicit attention matrices of the full run
    with torch.no_grad():
        att = model(ids, output_attentions=True).attentions
    cache = kvevict.make_cache(model, oracle, budget=budget)
    with torch.no_grad():
        model(ids[:, :cut], cache=cache)
    g = model.config.num_attention_heads // model.config.num_key_value_heads
    for layer, a in zip(cache.layers, att):
        b, hq, n, _ = a.shape
        future = a.view(b, hq // g, g, n, n).sum(2)[:, :, cut:, :cut].sum(2)  # queries after the prefill
        want = future.topk(budget, dim=-1).indices.sort(-1).values
        assert torch.equal(layer.pos.sort(-1).values, want)


def test_oracle_without_a_recording_is_a_clear_error():
    with pytest.raises(ValueError, match="the oracle needs the future"):
        kvevict.make_cache(tiny_model("llama-gqa"), "oracle", budget=8)


@pytest.mark.parametrize("heads", [None, 3])
@pytest.mark.parametrize("kernel", [1, 3, 5, 7])
def test_snapkv_pool_is_each_candidates_mean_over_its_neighbours_in_its_own_head(heads, kernel):
    """SnapKV's pooling against its definition, element by element: in position order within each
    KV head (empty slots first), the mean of the scores of the ``kernel`` nearest, the window cut at
    either end and at the head's edge; and each row's result is the same alone as in a batch."""
    from kvevict.policies.snapkv import pool

    g = torch.Generator().manual_seed(kernel)
    b, h, n = 2, 2, 37
    pos = torch.stack([torch.randperm(n, generator=g) for _ in range(b * h)]).view(b, h, n)
    valid = torch.rand(b, h, n, generator=g) > 0.2
    head = None if heads is None else torch.randint(0, heads, (b, h, n), generator=g).to(torch.uint8)
    # empty slots score 0, as they hold: the order among them (a tie in position) changes no sum
    score = (torch.rand(b, h, n, generator=g) * 10).masked_fill(~valid, 0.0)
    c = Candidates(stats={}, pos=pos, valid=valid, newest=None, budget=n, layer_idx=0, head=head, heads=heads or 1)
    got = pool(score, c, kernel)
    r = kernel // 2
    for i in range(b):
        for j in range(h):
            grp = [0] * n if head is None else head[i, j].tolist()
            order = (torch.tensor(grp) * (1 << 40) + pos[i, j].masked_fill(~valid[i, j], -1)).argsort().tolist()
            for at, cand in enumerate(order):
                near = [order[k] for k in range(max(0, at - r), min(n, at + r + 1)) if grp[order[k]] == grp[cand]]
                want = sum(float(score[i, j, k]) for k in near) / len(near)
                assert got[i, j, cand].item() == pytest.approx(want, rel=1e-6), (i, j, cand)
    alone = Candidates(
        stats={}, pos=pos[1:], valid=valid[1:], newest=None, budget=n, layer_idx=0,
        head=None if head is None else head[1:], heads=heads or 1,
    )  # fmt: skip
    assert torch.equal(pool(score[1:], alone, kernel), got[1:])
