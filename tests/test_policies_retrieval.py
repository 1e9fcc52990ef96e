"""The retrieval policies (key norm, KVzip) on hand-built inputs with hand-computed kept
sets, through the real attention and cache, and their errors."""

import pytest
import torch
from transformers import DynamicCache

import kvevict
from conftest import tiny_model
from kvevict.attention import _Segments, attend
from kvevict.policies import Candidates, make_policy
from kvevict.policies.kvzip import KVzip
from kvevict.storage import Piece


def candidates(stats, n, budget, newest=None):
    return Candidates(
        stats={k: torch.tensor(v, dtype=torch.float32).view(1, 1, -1) for k, v in stats.items()},
        pos=torch.arange(n).view(1, 1, -1),
        valid=torch.ones(1, 1, n, dtype=torch.bool),
        newest=torch.tensor(n - 1 if newest is None else newest).view(1, 1, 1),
        budget=budget,
        layer_idx=0,
    )


def piece(keys):
    """A past piece of stored keys (values: the keys again; only the statistics are checked)."""
    return Piece(n=keys.shape[2], keys=lambda: keys, values=lambda: keys)


def kept(policy, c):
    return set(policy.priority(c).topk(c.budget, dim=-1).indices.flatten().tolist())


def test_knorm_keeps_the_lowest_key_norms_and_the_recent_window():
    norms = [9.0, 1.0, 5.0, 2.0, 7.0, 8.0]
    # recent=1 protects key 5 (norm 8); of the rest the two lowest norms, keys 1 (1.0) and 3 (2.0)
    assert kept(make_policy("knorm", recent=1), candidates({"knorm": norms}, 6, 3)) == {1, 3, 5}
    assert kept(make_policy("knorm", recent=0), candidates({"knorm": norms}, 6, 3)) == {1, 2, 3}


def test_attention_writes_the_key_norm_once():
    torch.manual_seed(1)
    b, hkv, g, d = 1, 2, 2, 4
    kp, kn = torch.randn(b, hkv, 3, d), torch.randn(b, hkv, 2, d)
    seg = _Segments(
        pieces=[piece(kp)],
        pos_past=None,
        valid_past=None,
        k_new=kn,
        v_new=torch.randn_like(kn),
        pos_new=torch.tensor([[3, 4]]),
        valid_new=None,
    )
    _, st = attend(torch.randn(b, hkv * g, 2, d), seg, d**-0.5, None, None, ("knorm",))
    assert torch.equal(st["knorm"][..., :3], torch.zeros(b, hkv, 3))  # stored keys: already counted
    assert torch.allclose(st["knorm"][..., 3:], kn.norm(dim=-1))


def test_knorm_cache_keeps_what_the_rule_says_on_a_real_prefill():
    model = tiny_model("llama-gqa")
    torch.manual_seed(2)
    ids = torch.randint(0, 128, (2, 30))
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=full)
    budget, recent = 10, 4
    cache = kvevict.make_cache(model, "knorm", budget=budget, recent=recent)
    with torch.no_grad():
        model(ids, cache=cache)
    for layer, ref in zip(cache.layers, full.layers):
        norms = ref.keys.norm(dim=-1)[..., : 30 - recent]  # (b, hkv, 26): the eviction scope
        low = norms.topk(budget - recent, dim=-1, largest=False).indices
        want = torch.cat([low, torch.arange(30 - recent, 30).expand(2, low.shape[1], recent)], -1)
        assert torch.equal(layer.pos.sort(-1).values, want.sort(-1).values)


def test_kvzip_keeps_the_keys_reconstruction_reads_and_every_generated_token():
    pol = KVzip(scores=[torch.tensor([[[0.9, 0.1, 0.4, 0.8, 0.2]]])], recent=0)
    # 5 recorded context keys + 2 generated ones (positions 5, 6: past the record, ranked first)
    c = candidates({}, 7, 4)
    assert kept(pol, c) == {0, 3, 5, 6}
    assert kept(pol, candidates({}, 5, 3)) == {0, 2, 3}


def test_kvzip_keeps_a_window_of_a_long_answer_and_the_best_of_the_context():
    pol = KVzip(scores=[torch.tensor([[[0.9, 0.1, 0.4, 0.8, 0.2]]])], recent=0)
    # 4 generated tokens (5-8), budget 4: the newest half of the budget (7, 8) above the context,
    # the older ones (5, 6) below it, so the context's best two (0, 3) stay
    assert kept(pol, candidates({}, 9, 4)) == {0, 3, 7, 8}
    every = KVzip(scores=pol.scores, recent=0, generated=1.0)  # kvpress's rule: the answer first
    assert kept(every, candidates({}, 9, 4)) == {5, 6, 7, 8}
    with pytest.raises(ValueError, match="generated is the share"):
        KVzip(scores=pol.scores, generated=1.5)


def test_kvzip_pool_ranks_a_key_by_the_best_score_among_its_neighbours():
    scores = [torch.tensor([[[0.9, 0.1, 0.05, 0.0, 0.0, 0.0, 0.8, 0.02, 0.0, 0.3]]])]
    # pooled over 3: [0.9, 0.9, 0.1, 0.05, 0, 0.8, 0.8, 0.8, 0.3, 0.3]; the top five are the two hits
    # with their neighbours, where the keys' own scores keep 0.3 and the tail of the first hit
    assert kept(KVzip(scores=scores, recent=0, pool=3), candidates({}, 10, 5)) == {0, 1, 5, 6, 7}
    assert kept(KVzip(scores=scores, recent=0), candidates({}, 10, 5)) == {0, 1, 2, 6, 9}
    span = make_policy("kvzip-span", scores=scores, recent=0)  # 15 positions: keys 0-7 within 7 of key 0
    assert span.pool == 15 and torch.equal(span.ranked[0], torch.tensor([[[0.9] * 8 + [0.8] * 2]]))
    assert make_policy("kvzip-pool", scores=scores).pool == 1  # the memory plan's pick ranks keys alone
    with pytest.raises(ValueError, match="pool is the odd number"):
        KVzip(scores=scores, pool=4)


class _Tok:
    """A tokenizer stand-in: the repeat request is three fixed ids."""

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        return {"input_ids": torch.tensor([[7, 8, 9]])}


def test_kvzip_record_is_the_attention_of_the_reconstruction_pass():
    model = tiny_model("llama-gqa")
    torch.manual_seed(3)
    ids = torch.randint(10, 128, (1, 12))
    pol = KVzip.record(model, _Tok(), ids)
    seq = torch.cat([ids, torch.tensor([[7, 8, 9]]), ids], 1)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        att = model(seq, output_attentions=True).attentions
    g = model.config.num_attention_heads // model.config.num_key_value_heads
    for s, a in zip(pol.scores, att):
        b, hq, m, _ = a.shape
        want = a.view(b, hq // g, g, m, m)[:, :, :, 12:, :12].amax(dim=(2, 3))  # queries after the context
        assert torch.allclose(s, want, atol=1e-5)


def test_kvzip_chunked_record_is_the_max_over_each_piece_reconstructed_from_the_whole_context():
    model = tiny_model("llama-gqa")
    with torch.no_grad():  # sharper attention, so that which queries see which piece shows in the max
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    torch.manual_seed(5)
    ids = torch.randint(10, 128, (1, 12))
    pol = KVzip.record(model, _Tok(), ids, chunk=5)  # pieces 0-4, 5-11: the 2-token rest joins the last
    one = KVzip.record(model, _Tok(), ids, chunk=8)  # a rest of 4 (>= 8 / 2) is a piece of its own: 0-7, 8-11
    model.set_attn_implementation("eager")
    g = model.config.num_attention_heads // model.config.num_key_value_heads
    want = None
    for s, e in ((0, 5), (5, 12)):
        seq = torch.cat([ids, torch.tensor([[7, 8, 9]]), ids[:, s:e]], 1)
        with torch.no_grad():
            att = model(seq, output_attentions=True).attentions
        got = []
        for a in att:
            b, hq, m, _ = a.shape
            got.append(a.view(b, hq // g, g, m, m)[:, :, :, 12:, :12].amax(dim=(2, 3)))
        want = got if want is None else [torch.maximum(x, y) for x, y in zip(want, got)]
    for s, w in zip(pol.scores, want):
        assert torch.allclose(s, w, atol=1e-5)
    assert all(
        torch.allclose(a, b, atol=1e-5)
        for a, b in zip(
            KVzip.record(model, _Tok(), ids, chunk=9).scores, KVzip.record(model, _Tok(), ids, chunk=12).scores
        )
    )
    assert not all(torch.allclose(a, b, atol=1e-5) for a, b in zip(one.scores, pol.scores))


def test_kvzip_through_generate_matches_full_with_a_covering_budget():
    model = tiny_model("llama-gqa")
    torch.manual_seed(4)
    ids = torch.randint(10, 128, (1, 16))
    from kvevict.generate import generate

    class Tok(_Tok):
        pad_token_id = 0

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids.tolist()))

    full = generate(model, Tok(), ids, "full", None, 6)
    zipped = generate(model, Tok(), ids, "kvzip", 32, 6)
    assert zipped.text == full.text and zipped.kv_bytes < full.kv_bytes * 32 / 16 + 1


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: make_policy("kvzip"), "kvzip scores a prompt before generation"),
        (lambda: kvevict.make_cache(tiny_model("llama-gqa"), "knorm", budget=8, recent=8), "recent=8 must be smaller"),
        (
            lambda: KVzip.record(
                tiny_model("llama-gqa"),
                _Tok(),
                torch.ones(2, 5, dtype=torch.long),
                attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1] * 5]),
            ),
            "unpadded prompts",
        ),
        (
            lambda: KVzip.record(tiny_model("llama-gqa"), _Tok(), torch.ones(1, 5, dtype=torch.long), chunk=0),
            "chunk is the number of context tokens",
        ),
    ],
)
def test_bad_retrieval_policy_parameters_are_clear(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_expected_attention_statistic_matches_its_definition():
    torch.manual_seed(5)
    b, hkv, g, q, d, w = 1, 2, 3, 6, 4, 4
    query, key = torch.randn(b, hkv * g, q, d), torch.randn(b, hkv, q, d)
    kp = torch.randn(b, hkv, 2, d)
    seg = _Segments(
        pieces=[piece(kp[:, :, :1]), piece(kp[:, :, 1:])],
        pos_past=None,
        valid_past=None,
        k_new=key,
        v_new=torch.randn_like(key),
        pos_new=torch.arange(2, 2 + q).view(1, -1),
        valid_new=None,
    )
    _, st = attend(query, seg, d**-0.5, None, None, ("expected",), observe=w)
    qs = query.view(b, hkv, g, q, d)[:, :, :, -w:] * d**-0.5
    mu, var = qs.mean(3), qs.var(3, unbiased=False)
    keys = torch.cat([kp, key], 2)
    for h in range(hkv):
        want = torch.zeros(q + 2)
        for gi in range(g):
            z = keys[0, h] @ mu[0, h, gi] + 0.5 * keys[0, h].square() @ var[0, h, gi]
            want += z.softmax(-1)
        assert torch.allclose(st["expected"][0, h], want * q, atol=1e-5)
    # one decoding query: var = 0, so the statistic is exactly that query's attention
    one = query[:, :, -1:]
    seg1 = _Segments(
        pieces=[piece(keys[:, :, :-1])],
        pos_past=None,
        valid_past=None,
        k_new=keys[:, :, -1:],
        v_new=keys[:, :, -1:],
        pos_new=torch.tensor([[7]]),
        valid_new=None,
    )
    _, s1 = attend(one, seg1, d**-0.5, None, None, ("expected", "sum"), observe=w)
    assert torch.allclose(s1["expected"], s1["sum"], atol=1e-5)


def test_expected_attention_keeps_the_highest_expectation():
    ea = [3.0, 0.2, 0.9, 0.1, 0.5, 0.3]
    assert kept(make_policy("expected", recent=1), candidates({"expected": ea}, 6, 3)) == {0, 2, 5}
    with pytest.raises(ValueError, match="window must be >= 1"):
        make_policy("expected", window=0).check(8)
