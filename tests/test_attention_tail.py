"""A first prompt under a policy whose statistics come from its last queries only: SDPA gives the
earlier queries' output, and only the tail is scored. Both must equal the explicit attention."""

import pytest
import torch

from kvevict import attention
from kvevict.attention import attend, generic_segments
from kvevict.stats import NOT_FROM_PG, STATS, Stat


def _explicit(query, key, value, scale):
    """(b, q, hq, d) output and (b, hkv, q_query, n) probabilities summed over each KV group."""
    b, hq, q, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    k = key.repeat_interleave(g, 1).float()
    v = value.repeat_interleave(g, 1).float()
    scores = (query.float() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(torch.ones(q, q, dtype=torch.bool).triu(1), float("-inf"))
    probs = scores.softmax(-1)
    return (probs @ v).transpose(1, 2), probs.view(b, hkv, g, q, q).sum(2)


def _inputs(b=2, hq=4, hkv=2, q=37, d=16):
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(b, hq, q, d, generator=gen)
    key = torch.randn(b, hkv, q, d, generator=gen)
    value = torch.randn(b, hkv, q, d, generator=gen)
    return query, key, value


@pytest.mark.parametrize(
    "wanted, observe, tail",
    [(("obs",), 8, 8), (("max",), 5, 5), (("last",), 0, 1), (("knorm",), 0, 0), (("obs", "last"), 4, 4)],
)
def test_a_tail_policy_scores_only_its_tail_and_matches_explicit_attention(wanted, observe, tail, monkeypatch):
    query, key, value = _inputs()
    q, scale = query.shape[2], query.shape[-1] ** -0.5
    seg = generic_segments(key, value, q, None)
    assert attention._scored_tail(seg, q, 0, None, None, wanted, observe) == tail
    scored = []
    matmul = torch.matmul

    def counting(a, b):  # the score products the loop makes: one per chunk, its rows the queries scored
        if b.shape[-2] == query.shape[-1] and a.dim() == 4:
            scored.append(a.shape[-2] // (query.shape[1] // key.shape[1]))
        return matmul(a, b)

    monkeypatch.setattr(torch, "matmul", counting)
    out, stats = attend(query, seg, scale, None, None, wanted, observe=observe)
    monkeypatch.setattr(torch, "matmul", matmul)
    assert sum(scored) == tail
    want_out, pg = _explicit(query, key, value, scale)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-4)
    if "obs" in wanted:
        torch.testing.assert_close(stats["obs"], pg[:, :, q - observe :].sum(2), atol=1e-5, rtol=1e-4)
    if "max" in wanted:
        g = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(g, 1)
        probs = ((query @ k.transpose(-1, -2)) * scale).masked_fill(torch.ones(q, q).triu(1).bool(), -torch.inf)
        per_head = probs.softmax(-1).view(2, key.shape[1], g, q, q)[:, :, :, q - observe :]
        torch.testing.assert_close(stats["max"], per_head.amax(dim=(2, 3)), atol=1e-5, rtol=1e-4)
    if "last" in wanted:
        torch.testing.assert_close(stats["last"], pg[:, :, -1], atol=1e-5, rtol=1e-4)
    if "knorm" in wanted:
        torch.testing.assert_close(stats["knorm"], key.norm(dim=-1), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("wanted", [("sum",), ("obs", "sum"), ("sq",)])
def test_a_statistic_of_every_query_scores_every_query(wanted):
    query, key, value = _inputs()
    q = query.shape[2]
    seg = generic_segments(key, value, q, None)
    assert attention._scored_tail(seg, q, 0, None, None, wanted, 8) == q
    out, stats = attend(query, seg, query.shape[-1] ** -0.5, None, None, wanted, observe=8)
    want_out, pg = _explicit(query, key, value, query.shape[-1] ** -0.5)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-4)
    if "sum" in wanted:
        torch.testing.assert_close(stats["sum"], pg.sum(2), atol=1e-5, rtol=1e-4)


def test_padding_a_window_or_a_softcap_keep_the_explicit_path():
    query, key, value = _inputs()
    q = query.shape[2]
    seg = generic_segments(key, value, q, None)
    assert attention._scored_tail(seg, q, 0, 16, None, ("obs",), 8) == q  # a sliding window
    assert attention._scored_tail(seg, q, 0, None, 30.0, ("obs",), 8) == q  # a softcap
    assert attention._scored_tail(seg, q, 5, None, None, ("obs",), 8) == q  # keys stored before
    padded = attention.PaddingInfo(
        padding=torch.ones(2, q, dtype=torch.bool).index_fill_(1, torch.tensor([0]), False), kv_offset=0
    )
    seg = generic_segments(key, value, q, padded)
    assert attention._scored_tail(seg, q, 0, None, None, ("obs",), 8) == q


class _Peak(Stat):
    """max_t a_t(i): a statistic declared in a test, as kvevict.stats declares its own."""

    def start(self, f):
        return f.zeros()

    def add(self, col, ch):
        m = ch.pg.amax(2)
        torch.maximum(col[..., : m.shape[-1]], m, out=col[..., : m.shape[-1]])
        return col


@pytest.mark.parametrize("chunk_elements", [1 << 21, 64])
def test_a_declared_statistic_computes_itself_in_every_chunk(chunk_elements, monkeypatch):
    monkeypatch.setitem(STATS, "peak", _Peak("peak", "max_t a_t(i)", torch.float16))
    monkeypatch.setattr(attention, "_CHUNK_ELEMENTS", chunk_elements)  # 64: one query a chunk
    query, key, value = _inputs()
    q, scale = query.shape[2], query.shape[-1] ** -0.5
    seg = generic_segments(key, value, q, None)
    assert attention._scored_tail(seg, q, 0, None, None, ("peak", "last"), 8) == q  # it reads every query
    out, stats = attend(query, seg, scale, None, None, ("peak", "sum", "last"))
    want_out, pg = _explicit(query, key, value, scale)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(stats["peak"], pg.amax(2), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(stats["sum"], pg.sum(2), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(stats["last"], pg[:, :, -1], atol=1e-5, rtol=1e-4)


def test_what_a_statistic_needs_is_declared_with_it():
    assert NOT_FROM_PG == {"knorm", "expected"}  # from the keys, or the queries: no probabilities
    assert all(s.from_pg == bool(s.needs & {"pg", "probs"}) for s in STATS.values())
    assert {n for n, s in STATS.items() if "seen" in s.needs} == {"hits", "hits_ema"}
    assert {n for n, s in STATS.items() if s.needs & {"probs", "queries"}} <= {
        n for n, s in STATS.items() if not s.fused
    }
    assert {n: s.scored(8) for n, s in STATS.items() if s.scored(8) is not None} == {
        "obs": 8,
        "max": 8,
        "last": 1,
        "knorm": 0,
        "expected": 0,
    }


@pytest.mark.parametrize("wanted", [("sum",), ("sum", "sq"), ("max",), ("obs", "last")])
def test_bfloat16_probabilities_leave_the_output_as_float32_ones_rounded_and_the_statistics_float32(wanted):
    """A bfloat16 model's scores go through softmax in bfloat16 (its kernel computes in float32
    and rounds once): the output is what float32 probabilities rounded to bfloat16 give, bit for
    bit, and every statistic is summed in float32 to within bfloat16's rounding of the float32 one."""
    query, key, value = (x.bfloat16() for x in _inputs(q=41, d=32))
    q, scale = query.shape[2], query.shape[-1] ** -0.5
    seg = generic_segments(key, value, q, None)
    out, stats = attend(query, seg, scale, None, None, wanted, observe=q)
    # the former path: the chunk's scores copied to float32, softmax, the probabilities back to bfloat16
    b, hq, _, d = query.shape
    g = hq // key.shape[1]
    scores = (query * scale).view(b, 2, g * q, d) @ key.transpose(-1, -2)
    scores = scores.view(b, 2, g, q, q).masked_fill(torch.ones(q, q, dtype=torch.bool).triu(1), float("-inf"))
    probs = scores.float().softmax(-1)
    former = (probs.bfloat16().view(b, 2, g * q, q) @ value).view(b, hq, q, d).transpose(1, 2)
    assert torch.equal(out, former)
    for name in wanted:
        assert stats[name].dtype == torch.float32
    pg = probs.sum(2)
    want = {"sum": pg.sum(2), "sq": pg.square().sum(2), "max": probs.amax(dim=(2, 3)), "obs": pg.sum(2)}
    want["last"] = pg[:, :, -1]
    for name in wanted:
        assert torch.allclose(stats[name], want[name], rtol=2e-2, atol=1e-3), name
