"""Packed key/value storage (8/4/2 bits) and mixed precision under eviction."""

import pytest
import torch
from transformers import DynamicCache

import kvevict
from conftest import tiny_model
from kvevict.storage import Storage
from kvevict.storage.codes import dequantize, quantize, step_byte, step_value


def _logits(model, ids, cache, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask, cache=cache).logits


def _stream(model, cache, prompt, steps):
    """Logits of the prompt's last token and of each single-token step after it."""
    out = [_logits(model, prompt, cache)[:, -1]]
    out += [_logits(model, steps[:, i : i + 1], cache)[:, -1] for i in range(steps.shape[1])]
    return torch.stack(out)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("group", [8, 32])
def test_round_trip_is_within_half_a_step(bits, group):
    torch.manual_seed(bits)
    x = torch.randn(2, 3, 50, 64) * torch.rand(1, 1, 1, 64) * 5  # channels of very different scales
    x[0, 0, 0, :group] += 7  # a group of one sign: its range is stretched to 0
    codes, zero, step = quantize(x, bits, group)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == 64 * bits // 8  # really packed
    # one step byte and one zero byte per group
    assert step.shape[-1] == zero.shape[-1] == 64 // group and step.dtype == zero.dtype == torch.uint8
    back = dequantize(codes, zero, step, bits, group, torch.float32)
    err = (back - x).abs().view(2, 3, 50, 64 // group, group)
    s = step_value(step)
    assert (err <= s.unsqueeze(-1) / 2 * (1 + 1e-6)).all()
    # the step is the group's range (stretched to hold 0) over the levels, rounded up by at most
    # one 3-bit mantissa step (12.5%)
    g = x.view(2, 3, 50, 64 // group, group)
    want = (g.amax(-1).clamp(min=0) - g.amin(-1).clamp(max=0)) / ((1 << bits) - 1)
    assert (s >= want).all() and (s <= want * 1.125 + 2**-16).all()


def test_the_step_byte_is_the_smallest_step_that_covers():
    v = torch.logspace(-6, 4, 5000)
    s = step_value(step_byte(v))
    assert (s >= v).all() and (s[v >= 2**-16] <= v[v >= 2**-16] * 1.125).all()  # 2^-16: the smallest step
    assert torch.equal(step_value(step_byte(s)), s)  # every step byte's value is exact in fp32
    assert torch.equal(s.to(torch.bfloat16).float(), s) and torch.equal(s[s < 6e4].half().float(), s[s < 6e4])


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_zero_is_exact_and_a_constant_group_within_half_a_step(bits):
    x = torch.full((1, 1, 3, 16), -2.5)
    x[..., 8:] = torch.tensor([0.0, 1.0, 0.5]).view(1, 1, 3, 1)  # each token: its second group constant
    codes, zero, step = quantize(x, bits, 8)
    back = dequantize(codes, zero, step, bits, 8, torch.float32)
    assert torch.equal(back[0, 0, 0, 8:], x[0, 0, 0, 8:])  # an all-zero group (padding, say) is exact
    assert ((back - x).abs() <= step_value(step).repeat_interleave(8, -1) / 2).all()


H2O_STAT = 2  # H2O's one statistic, its attention sum, in float16


def _slot_bytes(head_dim, bits, group, stats_bytes):
    """Bytes of one slot of one KV head, counted by hand: K and V codes, a step byte and a zero
    byte per group, int16 position, the statistics' bytes."""
    codes, groups = head_dim * bits // 8, head_dim // group
    return 2 * (codes + 2 * groups) + 2 + stats_bytes


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_kv_bytes_is_exact_for_packed_storage(bits):
    model = tiny_model("llama-mha")  # head_dim 16, 4 KV heads, 3 layers
    cfg = model.config
    budget, batch, n_layers, heads = 10, 2, cfg.num_hidden_layers, cfg.num_key_value_heads
    cache = kvevict.make_cache(model, "h2o", budget=budget, kv_bits=bits, group=8)
    _logits(model, torch.randint(0, 128, (batch, 30)), cache)
    expected = (
        (budget * heads * _slot_bytes(16, bits, 8, H2O_STAT) + 8 + Storage(kv_bits=bits).row_bytes(heads, 16))
        * n_layers
        * batch
    )
    assert cache.kv_bytes() == expected
    ptr = [layer.keys.data_ptr() for layer in cache.layers]
    assert all(layer.keys.dtype == torch.uint8 for layer in cache.layers)
    for _ in range(20):
        _logits(model, torch.randint(0, 128, (batch, 1)), cache)
    assert cache.kv_bytes() == expected and [layer.keys.data_ptr() for layer in cache.layers] == ptr
    # mixed: a second tier of evicted_budget slots at evicted_bits
    mixed = kvevict.make_cache(model, "h2o", budget=budget, kv_bits=8, group=8, evicted_bits=2, evicted_budget=6)
    _logits(model, torch.randint(0, 128, (batch, 30)), mixed)
    two = (budget * _slot_bytes(16, 8, 8, H2O_STAT) + 6 * _slot_bytes(16, 2, 8, H2O_STAT)) * heads
    assert mixed.kv_bytes() == (two + 8 + Storage(kv_bits=8, evicted_bits=2).row_bytes(heads, 16)) * n_layers * batch


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2"])
def test_int8_with_a_covering_budget_stays_close_to_the_full_cache(arch):
    model = tiny_model(arch)
    torch.manual_seed(3)
    prompt, steps = torch.randint(0, 128, (2, 24)), torch.randint(0, 128, (2, 6))
    ref = _stream(model, DynamicCache(config=model.config), prompt, steps)
    errors = {}
    for bits in (16, 8, 4):
        cache = kvevict.make_cache(model, "h2o", budget=30, kv_bits=bits, group=8)
        errors[bits] = (_stream(model, cache, prompt, steps) - ref).abs().max().item()
    assert errors[16] < 1e-3 and errors[8] < 5e-3  # the stated tolerance: max |logit difference|
    assert errors[16] < errors[8] < errors[4]  # fewer bits, more error: quantization really happens


def test_int8_on_smollm2_stays_close_to_the_full_cache(real_model):
    model, tok = real_model
    ids = tok("The quick brown fox jumps over the lazy dog. " * 12, return_tensors="pt")["input_ids"]
    steps = tok(" It was a sunny day and the fox", return_tensors="pt")["input_ids"]
    model.set_attn_implementation("sdpa")
    ref = _stream(model, DynamicCache(config=model.config), ids, steps)
    cache = kvevict.make_cache(model, "h2o", budget=ids.shape[1] + steps.shape[1], kv_bits=8)
    got = _stream(model, cache, ids, steps)
    assert (got - ref).abs().max().item() < 0.25  # stated tolerance; logits span ~30, measured 0.11
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # int8 + step and zero bytes per 32 + pos/stat: 140 bytes a slot and KV head, against 256 at 16 bits
    assert cache.kv_bytes() < 0.57 * cache.full_kv_bytes()
    assert cache.kv_bytes() < 0.285 * cache.full_kv_bytes(dtype_bytes=None)  # and against the fp32 model's own


def test_mixed_precision_with_a_covering_low_bit_tier_loses_no_token():
    model = tiny_model("llama-gqa")
    torch.manual_seed(4)
    prompt, steps = torch.randint(0, 128, (2, 30)), torch.randint(0, 128, (2, 8))
    cache = kvevict.make_cache(model, "h2o", budget=10, recent=4, kv_bits=None, evicted_bits=16, evicted_budget=40)
    got = _stream(model, cache, prompt, steps)
    for layer in cache.layers:
        hi, lo = layer.tiers
        assert hi.filled == 10 and lo.filled == 38 - 10  # every token is somewhere
        both = torch.cat([hi.pos, lo.pos[:, :, : lo.filled]], dim=-1).sort(-1).values
        assert torch.equal(both, torch.arange(38).expand_as(both))
    # fp16 for the demoted tokens: as good as the full cache up to fp16 rounding, unlike dropping them
    ref = _stream(model, DynamicCache(config=model.config), prompt, steps)
    dropped = _stream(model, kvevict.make_cache(model, "h2o", budget=10, recent=4), prompt, steps)
    assert (got - ref).abs().max().item() < 1e-3 < (dropped - ref).abs().max().item()


def test_the_low_bit_tier_is_capped_and_keeps_what_the_policy_ranks_highest():
    model = tiny_model("llama-gqa")
    cache = kvevict.make_cache(model, "h2o", budget=8, recent=2, evicted_bits=4, evicted_budget=5, group=8)
    _logits(model, torch.randint(0, 128, (1, 20)), cache)
    for _ in range(30):  # a long stream: memory stays flat, every tier full, nothing kept twice
        before = cache.kv_bytes()
        _logits(model, torch.randint(0, 128, (1, 1)), cache)
        assert cache.kv_bytes() == before
    for layer in cache.layers:
        hi, lo = layer.tiers
        assert (hi.filled, lo.filled) == (8, 5)
        assert lo.valid.all()
        for h in range(hi.pos.shape[1]):
            assert not set(hi.pos[0, h].tolist()) & set(lo.pos[0, h].tolist())


def test_packed_storage_on_a_padded_batch_equals_each_row_alone():
    model = tiny_model("llama-gqa")
    torch.manual_seed(5)
    a, b = torch.randint(1, 128, (1, 20)), torch.randint(1, 128, (1, 14))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 6, dtype=torch.long), b], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    kw = dict(policy="h2o", budget=10, recent=3, kv_bits=4, group=8, evicted_bits=2, evicted_budget=6)
    out = model.generate(
        ids,
        attention_mask=mask,
        cache=kvevict.make_cache(model, **kw),
        max_new_tokens=8,
        min_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
    )
    for row, x in ((0, a), (1, b)):
        alone = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            cache=kvevict.make_cache(model, **kw),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
        )
        assert torch.equal(out[row, -8:], alone[0, -8:])


def test_batch_operations_on_packed_storage():
    model = tiny_model("llama-gqa")
    torch.manual_seed(6)
    ids = torch.randint(0, 128, (3, 16))
    cache = kvevict.make_cache(model, "h2o", budget=8, kv_bits=4, group=8, evicted_bits=2, evicted_budget=4)
    _logits(model, ids, cache)
    one = kvevict.make_cache(model, "h2o", budget=8, kv_bits=4, group=8, evicted_bits=2, evicted_budget=4)
    _logits(model, ids[2:3], one)
    cache.batch_select_indices(torch.tensor([2]))  # keep the third row only
    step = torch.randint(0, 128, (1, 1))
    assert torch.equal(_logits(model, step, cache), _logits(model, step, one))
    assert cache.kv_bytes() == one.kv_bytes()
    cache.batch_repeat_interleave(2)  # beam search: two copies of the row, each continuing alike
    step2 = torch.randint(0, 128, (1, 1))
    got = _logits(model, step2.expand(2, 1), cache)
    assert torch.equal(got[0], got[1]) and torch.allclose(got[:1], _logits(model, step2, one), atol=1e-5)
    cache.reorder_cache(torch.tensor([1, 0]))
    assert cache.kv_bytes() == 2 * one.kv_bytes()


def test_beam_search_and_compact_positions_run_on_packed_storage():
    model = tiny_model("llama-gqa")
    ids = torch.randint(0, 128, (1, 20))
    cache = kvevict.make_cache(
        model, "h2o", budget=8, kv_bits=4, group=8, evicted_bits=2, evicted_budget=8, compact=True
    )
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        num_beams=2,
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
    )
    assert out.shape == (1, 26)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(kv_bits=3), "kv_bits must be one of"),
        (dict(kv_bits=True), "kv_bits must be one of"),
        (dict(evicted_bits=5), "evicted_bits must be one of"),
        (dict(kv_bits=4, group=5), "does not divide the head dimension 8"),
        (dict(kv_bits=4, group=0), "group must be a positive"),
        (dict(evicted_budget=10), "give evicted_bits too"),
        (dict(evicted_bits=2, evicted_budget=1.5), "fraction of the prompt"),
    ],
)
def test_bad_storage_options_are_clear_errors(kw, match):
    model = tiny_model("llama-gqa")
    with pytest.raises(ValueError, match=match):
        kvevict.make_cache(model, "h2o", budget=8, **kw)


def test_memory_plans_follow_the_measured_rule():
    from kvevict.memory import HEAD_BYTES, HEAD_FROM, parse_memory
    from memory_plans import plan

    # SmolLM2's shape: head_dim 64, H2O (one statistic): per slot and KV head a 16-bit stock token is
    # 256 bytes, whatever the model's dtype; int8 140, int4 76 (codes + a step byte and a zero byte
    # per 32 channels + int16 position + float16 sum)
    def p(mem, dtype_bytes=4):
        return plan(mem, 64, 64, dtype_bytes, H2O_STAT)

    assert p(0.7).storage.kv_bits == 8 and p(0.7).budget == 1.0 and p(0.7).storage.evicted_bits is None
    mixed = p(0.5)  # every token: f at int8, 1 - f at int4, f * 140 + (1 - f) * 76 = 0.5 * 256
    assert (mixed.storage.kv_bits, mixed.storage.evicted_bits) == (8, 4)
    assert mixed.budget == pytest.approx((0.5 * 256 - 76) / (140 - 76))
    assert mixed.budget + mixed.storage.evicted_budget == pytest.approx(1.0)
    assert p(76 / 256).storage.kv_bits == 4 and p(76 / 256).budget == 1.0  # just int4 for every token
    three = p(0.2)  # under int4-for-everything: H2O's top at int8 in HEAD_BYTES of the bytes, the next at int4
    assert (three.storage.kv_bits, three.storage.evicted_bits) == (8, 4)
    assert three.budget == pytest.approx(HEAD_BYTES * 0.2 * 256 / 140)
    assert three.budget * 140 + three.storage.evicted_budget * 76 == pytest.approx(0.2 * 256)
    low = p(0.1)  # under HEAD_FROM x int4-for-everything: evict, keep int4
    assert 0.1 < HEAD_FROM * 76 / 256 and low.storage == Storage(kv_bits=4)
    assert low.budget == pytest.approx(0.1 * 256 / 76)
    for mem in (0.7, 0.5, 0.2, 0.05):  # a bf16 model plans the same shares as an fp32 one
        assert float(p(mem, 2).budget) == float(p(mem).budget) and p(mem, 2).storage == p(mem).storage
    tokens = plan("1MiB", 64, 64, 4, H2O_STAT, layers_heads=90)  # bytes per sequence -> int4 slots per layer and head
    assert tokens.budget == 2**20 // (90 * 76)
    assert parse_memory("20%") == pytest.approx(0.2) and parse_memory("2GiB") == 2**31 and parse_memory(0.3) == 0.3


def test_memory_plan_counts_the_head_id_of_head_adaptive_slots():
    from kvevict.memory import plan_for_model
    from kvevict.policies import make_policy

    model = tiny_model("llama-gqa")
    slots = {name: plan_for_model(model, "64KiB", make_policy(name)).budget for name in ("h2o", "ada-h2o")}
    c = model.config
    layers_heads = c.num_hidden_layers * c.num_key_value_heads
    d = c.hidden_size // c.num_attention_heads
    int4 = Storage(kv_bits=4).slot_bytes(d, d, 4, H2O_STAT)
    assert slots["h2o"] == 2**16 // (layers_heads * int4)
    assert slots["ada-h2o"] == 2**16 // (layers_heads * (int4 + 1))


@pytest.mark.parametrize("memory", [0.5, 0.2, 0.1, 0.05])
def test_a_memory_budget_holds_in_kv_bytes(memory):
    model = tiny_model("llama-mha")  # head_dim 16: overheads are large, yet the bound must hold
    cache = kvevict.make_cache(model, "h2o", memory=memory, group=8)
    # long enough that even 5% keeps more than the 128-token floor for short prompts
    _logits(model, torch.randint(0, 128, (2, 2000)), cache)
    # within the budget, up to one slot of rounding per layer and head
    slack = 2 * cache.layers[0].dims[0] * len(cache.layers) * (16 * 2 * 4)
    assert cache.kv_bytes() <= memory * cache.full_kv_bytes() + slack
    assert cache.kv_bytes() >= 0.6 * memory * cache.full_kv_bytes()  # and uses most of it


@pytest.mark.parametrize(
    "memory, match",
    [
        (0.0, "in \\(0, 1\\]"),
        (1.5, "in \\(0, 1\\]"),
        ("lots", "cannot read"),
        (True, "fraction"),
        ("10", "less than one 4-bit token"),
    ],
)
def test_bad_memory_budgets_are_clear_errors(memory, match):
    with pytest.raises(ValueError, match=match):
        kvevict.make_cache(tiny_model("llama-gqa"), "h2o", memory=memory)


def test_rank_statistics_are_float16_and_counters_float32():
    """H2O's sums (and every statistic only ranked) take 2 bytes a slot; counts stay exact past 2,048;
    MAS and RoCo read their query counts from positions and store none."""
    from kvevict.storage import stat_bytes

    model = tiny_model("llama-gqa")
    cache = kvevict.make_cache(model, "roco", budget=8)  # sum, sq
    _logits(model, torch.randint(0, 128, (1, 20)), cache)
    tier = cache.layers[0].tiers[0]
    assert {n: t.dtype for n, t in tier.stats.items()} == {"sum": torch.float16, "sq": torch.float32}
    assert stat_bytes(("sum", "sq")) == 6 and stat_bytes(kvevict.POLICIES["h2o"].stats) == 2
    assert stat_bytes(kvevict.POLICIES["mas"].stats) == 2
    f = tier.filled
    grow = {n: torch.zeros_like(t[..., :f], dtype=torch.float32) for n, t in tier.stats.items()}
    grow["sum"][..., 0] = 7e4
    tier.accumulate(grow, 0, 1.0, 1)
    # a sum past float16's range saturates, finite and still first
    assert (
        torch.isfinite(tier.stats["sum"]).all() and tier.stats["sum"][..., 0].eq(torch.finfo(torch.float16).max).all()
    )
    assert tier.candidates(None, 20, 8, 0).stats["sum"].dtype == torch.float32  # policies score in float32
    cache = kvevict.make_cache(model, "aqas", budget=8)  # hits: a counter
    _logits(model, torch.randint(0, 128, (1, 20)), cache)
    tier = cache.layers[0].tiers[0]
    assert tier.stats["hits"].dtype == torch.float32
    f = tier.filled
    tier.accumulate({"hits": torch.full_like(tier.stats["hits"][..., :f], 3000.0)}, 0, 1.0, 1)
    # a count past 2,048 stays exact
    assert (tier.stats["hits"][..., :f] >= 3000).all() and tier.stats["hits"][..., :f].frac().eq(0).all()
