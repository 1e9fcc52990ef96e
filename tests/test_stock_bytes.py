"""Every bytes ratio is a share of what a stock transformers cache holds in 16 bits
(sliding-window layers at their window), and a memory budget picks the policy too."""

import copy
import math

import pytest
import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

import kvevict
from conftest import tiny_model
from kvevict.generate import dynamic_kv_bytes, generate
from kvevict.memory import MIN_TOKENS, MemoryPlan, plan_for_model
from kvevict.policies import make_policy
from kvevict.stock import stock_kv_bytes, stock_windows
from kvevict.storage import Storage

SMALL = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def gemma3():
    """Gemma 3's layout: five sliding layers (window 16) to one global one."""
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(**SMALL, num_hidden_layers=6, head_dim=8, sliding_window=16)
    return Gemma3ForCausalLM(cfg).eval()


def mistral_sliding():
    """Mistral-style: ``sliding_window`` and no ``layer_types`` (every layer slides)."""
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(**SMALL, num_hidden_layers=2, sliding_window=12)).eval()


MODELS = {"llama-gqa": lambda: tiny_model("llama-gqa"), "gemma3": gemma3, "mistral-sliding": mistral_sliding}


def _feed(model, cache, ids, steps=5):
    """The prompt, then ``steps`` decoding steps (one token each), as generate feeds a cache."""
    with torch.no_grad():
        model(ids, cache=cache)
        for t in range(steps):
            model(ids[:, t : t + 1], cache=cache)
    return cache


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("arch", list(MODELS))
def test_full_kv_bytes_is_what_the_stock_cache_holds_at_16_bits(arch, dtype):
    model = MODELS[arch]().to(dtype)
    ids = torch.randint(0, 128, (2, 40))
    stock = _feed(model, DynamicCache(config=model.config), ids)
    held = dynamic_kv_bytes(stock)  # the stock cache's own tensors, in 16 bits here
    cache = _feed(model, kvevict.make_cache(model, "h2o", budget=64), ids)
    assert cache.full_kv_bytes() == held == cache.full_kv_bytes(dtype_bytes=None)
    assert stock_kv_bytes(model.config, 45, batch=2) == held
    every = sum(2 * layer.dims[0] * layer.seen * (layer.dims[1] + layer.dims[2]) * 2 for layer in cache.layers)
    sliding = any(w is not None for w in stock_windows(model.config))
    assert sliding == (arch != "llama-gqa") and (held < every if sliding else held == every)


def test_an_fp32_model_is_counted_at_16_bits_with_its_own_dtype_beside():
    model = gemma3()
    ids = torch.randint(0, 128, (1, 30))
    stock = _feed(model, DynamicCache(config=model.config), ids)
    cache = _feed(model, kvevict.make_cache(model, "h2o", budget=64), ids)
    assert cache.full_kv_bytes(dtype_bytes=None) == dynamic_kv_bytes(stock)  # fp32: 4 bytes a value
    assert cache.full_kv_bytes() * 2 == dynamic_kv_bytes(stock)
    r = generate(model, _CharTok(), ids, "full", None, max_new_tokens=3)
    assert r.kv_bytes == r.model_kv_bytes == 2 * r.full_kv_bytes  # the fp32 stock cache: 200% of 16 bits


class _CharTok:
    """Just what generate asks of a tokenizer when the prompt is token ids."""

    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


@pytest.mark.parametrize("memory", [0.7, 0.6, 0.4, 0.1])
def test_memory_fractions_hold_the_same_bytes_in_fp32_and_bf16(memory):
    # head_dim 16, groups of 8 channels: int8 from 44/64 of a 16-bit token, int8 + int4 for every token
    # from r4 = 28/64, three tiers (int8 top, int4 next, the rest evicted) from HEAD_FROM x r4, int4 below
    # (H2O's thresholds; MAS, the streaming pick, keeps three tiers further down)
    fp32 = tiny_model("llama-mha")
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 1200))  # long enough that the floor does not bind
    held = {}
    for name, model in (("fp32", fp32), ("bf16", bf16)):
        cache = _feed(model, kvevict.make_cache(model, "h2o", memory=memory, group=8), ids, steps=3)
        held[name] = (cache.kv_bytes(), cache.full_kv_bytes(), cache.layers[0].storage.label, cache.budget)
    assert held["fp32"] == held["bf16"]
    kv, full, label, _ = held["fp32"]
    assert label == {0.7: "int8", 0.6: "int8+int4", 0.4: "int8+int4", 0.1: "int4"}[memory]
    assert 0.75 * memory * full <= kv <= 1.02 * memory * full


def test_a_memory_budget_picks_a_streaming_policy_or_a_prompt_scoring_one(tmp_path):
    from tiny_chat_model import save_tiny_chat_model

    model, tok = kvevict.load_model(str(save_tiny_chat_model(tmp_path / "m")))
    assert kvevict.make_cache(model, memory=0.2).policy.name == "mas"  # a cache for model.generate
    assert kvevict.make_cache(model, budget=0.2).policy.name == "h2o"  # a token budget's default
    assert kvevict.make_cache(model, "h2o", 0.2).layers[0].budget_spec == 0.2  # positional calls still work
    assert kvevict.make_cache(model, "tova", memory=0.2).policy.name == "tova"
    text = "Tell me about the fox and the crow. " * 12
    known = generate(model, tok, text, memory=0.2, max_new_tokens=4)  # the whole prompt, before decoding
    assert known.policy == "kvzip-sample"  # no probe for this model: KVzip over a sample of the prompt
    chunked = generate(model, tok, text, memory=0.2, max_new_tokens=4, prefill_mode="block", stride=32)
    assert chunked.policy == "mas"
    named = generate(model, tok, text, "snapkv", memory=0.2, max_new_tokens=4)
    assert named.policy == "snapkv"
    assert generate(model, tok, text, max_new_tokens=4).policy == "h2o"  # no memory: the token budget's default
    # kvzip-pool pools its budget over layers and heads: the label says the mean a layer and head keeps
    kept, seen = (int(x) for x in known.storage.split(", ")[1].removesuffix(" tokens").split(" of "))
    assert known.storage.startswith("int8+int4, ") and seen == known.prompt_tokens + known.new_tokens - 1
    assert known.budget < kept <= seen  # the budget is the int8 tier's; the label counts both tiers


@pytest.mark.parametrize("memory", [0.05, 0.1])
def test_mas_streams_in_three_tiers_where_h2o_keeps_int4_alone(memory):
    """Below 15% of a 16-bit cache the rule gives MAS (the streaming pick) three tiers and H2O int4 alone."""
    from kvevict.memory import HEAD_BYTES, head_from
    from kvevict.policies import make_policy
    from memory_plans import plan

    r8, r4 = (Storage(kv_bits=b).slot_bytes(64, 64, 4, 2) / 256 for b in (8, 4))
    mas = plan(memory, 64, 64, 4, 2, head_from=head_from(make_policy("mas")))
    h2o = plan(memory, 64, 64, 4, 2, head_from=head_from("h2o"))
    assert mas.storage.label == "int8+int4" and h2o.storage.label == "int4"
    head, tail = mas.budget.pair
    assert head * r8 == pytest.approx(HEAD_BYTES * memory) and head * r8 + tail * r4 == pytest.approx(memory)
    assert float(h2o.budget) == pytest.approx(memory / r4)
    assert plan(0.04, 64, 64, 4, 2, head_from=head_from("mas")).storage.label == "int4"  # below 5%: int4 alone


@pytest.mark.parametrize("memory", [0.05, 0.1, 0.2, 0.4])
def test_a_prompt_scoring_policy_keeps_int4_alone_only_on_a_sliding_model(memory):
    from kvevict.memory import PROMPT_HEAD_BYTES
    from memory_plans import plan

    r8, r4 = (Storage(kv_bits=b).slot_bytes(64, 64, 4, 0) / 256 for b in (8, 4))  # slots over a 16-bit token
    stream, scored = plan(memory, 64, 64, 4, 2), plan(memory, 64, 64, 4, 0, scores_prompt=True)
    if memory in (0.1, 0.2):  # three tiers: the top at int8 in half the bytes, the next at int4 in the rest
        assert scored.storage.label == "int8+int4"
        head, tail = scored.budget.pair
        assert head * r8 == pytest.approx(PROMPT_HEAD_BYTES * memory) and head * r8 + tail * r4 == pytest.approx(memory)
    else:  # 5% (below where tiers were measured) and 40% (over r4): evict, keep int8
        assert scored.storage == Storage(kv_bits=8) and float(scored.budget) == pytest.approx(memory / r8)
    # streaming: int4 alone at 5% and 10%; at 20% and 40% H2O's top at int8 and the next at int4
    assert stream.storage.kv_bits == (4 if memory <= 0.1 else 8) and 4 in (
        stream.storage.kv_bits,
        stream.storage.evicted_bits,
    )
    assert plan(0.8, 64, 64, 4, 0, scores_prompt=True) == plan(0.8, 64, 64, 4, 0)  # from r8 up: the same
    # a sliding model, below r4: int8 while its tokens could hold 90% of the global layers' tokens,
    # else int4, twice the tokens for its pool of layers (Gemma 3's multi-key needles at 4K)
    sliding = plan(memory, 64, 64, 4, 0, windows=(511, None), scores_prompt=True, floor=1)
    assert sliding.storage == Storage(kv_bits=8)
    for n in (600, 2000, 8000):
        b = sliding.budget._own(n)
        coarse = memory < r4 and b + min(511, b) < 0.9 * n
        assert sliding.budget.coarser(n) == coarse and sliding.budget.storage_for(n, sliding.storage).kv_bits == (
            4 if coarse else 8
        )
        if coarse:  # the int4 plan's tokens: the same bytes, solved per layer
            b4 = sliding.budget.resolve(n)
            assert (b4 + min(511, b4)) * r4 <= memory * (n + 511) < (b4 + 1 + min(511, b4 + 1)) * r4


def test_a_fractional_memory_budget_never_cuts_a_short_prompt():
    model = tiny_model("llama-gqa")
    short = _feed(model, kvevict.make_cache(model, memory=0.05), torch.randint(0, 128, (1, 40)), steps=3)
    layer = short.layers[0]
    # kept whole at 16 bits, with room for an answer up to the floor
    assert short.budget == MIN_TOKENS and layer.evicted == 0 and layer.storage.kv_bits == 16
    assert int(layer.tiers[0].valid.sum()) == 43 * layer.dims[0]
    long = _feed(model, kvevict.make_cache(model, "h2o", memory=0.2), torch.randint(0, 128, (1, 1500)), steps=0)
    assert long.layers[0].storage.kv_bits == 4 and MIN_TOKENS < long.budget < 1500
    mid = _feed(model, kvevict.make_cache(model, "h2o", memory=0.05), torch.randint(0, 128, (1, 300)), steps=0)
    assert mid.budget == MIN_TOKENS and mid.layers[0].storage.kv_bits == 4  # the floor, at the plan's bits


@pytest.mark.parametrize("memory", [0.4, 0.6])  # three tiers (int8, int4, evicted); every token in two
def test_a_two_tier_plan_floors_the_tokens_of_both_tiers_together(memory):
    model = tiny_model("llama-mha")  # head_dim 16, groups of 8: r4 = 28/64, r8 = 46/64
    for n in (150, 300, 1200):
        cache = _feed(model, kvevict.make_cache(model, memory=memory, group=8), torch.randint(0, 128, (1, n)), steps=0)
        layer = cache.layers[0]
        share = sum(layer.budget_spec.pair)  # of the prompt, both tiers
        if share * n <= MIN_TOKENS:  # the floor sets the tokens: int4 buys none more, int8 alone holds them
            assert layer.storage.label == "int8" and len(layer.tiers) == 1 and layer.tiers[0].budget == MIN_TOKENS
            continue
        head, tail = (t.budget for t in layer.tiers)
        head += layer.recent_cost  # the int8 slots that hold a recent tier's bytes (Tier.recent)
        assert layer.storage.label == "int8+int4" and share <= 1.0
        # the floor bounds what both tiers keep, not the int8 tier alone
        assert head + tail == min(n, max(MIN_TOKENS, math.ceil(share * n - 1e-9)))
        assert head == pytest.approx(float(layer.budget_spec) / share * (head + tail), abs=1)
        if share * n >= MIN_TOKENS:  # the floor does not bind: the plan's bytes, up to a slot of rounding
            assert cache.kv_bytes() <= memory * cache.full_kv_bytes() + 2 * 64 * len(cache.layers) * layer.dims[0]


def test_a_sliding_model_plans_its_budget_in_bytes():
    model = gemma3()  # five layers of six keep at most 15 tokens in the stock cache
    p = plan_for_model(model, 0.3, make_policy("h2o"), group=8)
    assert isinstance(p.budget, MemoryPlan) and p.storage.kv_bits == 4
    windows = stock_windows(model.config)
    for n in (2000, 6000):
        b = p.budget.resolve(n)

        def slots(budget):  # a sliding layer holds min(window, budget)
            return sum(budget if w is None else min(w, budget) for w in windows)

        stock = sum(n if w is None else min(w, n) for w in windows)
        assert slots(b) * p.budget.ratio <= 0.3 * stock < slots(b + 1) * p.budget.ratio
        # under the share a dense model would keep: the stock cache it is a share of holds less
        assert MIN_TOKENS < b < float(p.budget) * n
    assert p.budget.resolve(100) == MIN_TOKENS  # a short prompt: the floor
    # three tiers are solved for every layer alike: a sliding model keeps int4 alone below r4,
    # even where a calibrated plan asks for int8 + int4
    for kind in (None, "int8+int4"):
        from memory_plans import plan

        assert plan(0.3, 8, 8, 4, 2, group=8, windows=windows, kind=kind).storage == Storage(kv_bits=4, group=8)
        assert plan(0.3, 8, 8, 4, 2, group=8, kind=kind).storage.label == "int8+int4"  # without sliding layers


@pytest.mark.parametrize(
    "bits, label", [((4, None), "int4"), ((8, None), "int8"), ((16, None), "fp16"), ((8, 4), "int8+int4")]
)
def test_a_memory_budget_is_spent_at_the_bits_the_caller_names(bits, label):
    from kvevict.memory import PROMPT_HEAD_BYTES
    from memory_plans import plan

    model = tiny_model("llama-mha")  # head_dim 16, groups of 8
    kv_bits, evicted_bits = bits
    cache = _feed(
        model,
        kvevict.make_cache(model, "h2o", memory=0.2, group=8, kv_bits=kv_bits, evicted_bits=evicted_bits),
        torch.randint(0, 128, (1, 1500)),
        steps=0,
    )
    layer = cache.layers[0]
    assert layer.storage.label == label
    # the bytes of the memory budget, whatever the bits: up to a slot of rounding per layer and head
    slack = 2 * 64 * len(cache.layers) * layer.dims[0]
    assert 0.2 * cache.full_kv_bytes() - slack <= cache.kv_bytes() <= 0.2 * cache.full_kv_bytes() + slack
    if label == "int8+int4":  # below r4: three tiers; a prompt-scoring policy's int8 tier holds its own share
        r8 = Storage(kv_bits=8, group=8).slot_bytes(16, 16, 4, 0) / 64
        scored = plan(0.2, 16, 16, 4, 0, group=8, scores_prompt=True, kind=label)
        assert float(scored.budget) * r8 == pytest.approx(PROMPT_HEAD_BYTES * 0.2)


def test_a_memory_budget_refuses_bits_it_cannot_plan():
    model = tiny_model("llama-mha")
    with pytest.raises(ValueError, match="kv_bits 16, 8 or 4"):
        kvevict.make_cache(model, memory=0.2, kv_bits=2)
    with pytest.raises(ValueError, match="leave evicted_budget out"):
        kvevict.make_cache(model, memory=0.2, kv_bits=8, evicted_bits=4, evicted_budget=0.3)
    with pytest.raises(ValueError, match="fractional memory budget"):
        kvevict.make_cache(model, memory="1MiB", kv_bits=8, evicted_bits=4)
    # bytes per sequence at int8: half the tokens int4 would give, about
    at8, at4 = (kvevict.make_cache(model, memory="1MiB", group=8, kv_bits=b).layers[0].budget_spec for b in (8, None))
    assert at8 < at4 < 2 * at8


@pytest.mark.parametrize("budget", [100, 300])  # under and over the sliding layers' 199 tokens
def test_kvzip_pooled_over_a_sliding_model_holds_what_its_budget_holds_layer_by_layer(budget):
    """KVzip pools a per-layer budget B over the layers by score. On a sliding model the pool is
    what B holds layer by layer, sum_l min(B, kept_l); a layer never passes what the stock cache
    keeps there, and what it would win past that goes to the others (it was dropped, and the
    global layers had won tokens the sliding ones could not hold: int4 at 20% of a 16-bit cache
    held 28% on Gemma 3)."""
    from kvevict.policies.kvzip import KVzipPooled

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**SMALL, num_hidden_layers=6, head_dim=8, sliding_window=200)).eval()
    n, windows = 600, stock_windows(model.config)
    # the sliding layers score highest: by score alone they would win more than their windows hold
    scores = [torch.rand(1, 2, n) * (1.0 if w is None else 10.0) for w in windows]
    cache = kvevict.make_cache(model, KVzipPooled(scores=scores), budget, kv_bits=8, group=8)
    caps = [n if w is None else min(n, w) for w in windows]
    budgets = [layer.budget_spec for layer in cache.layers]
    assert all(b <= c for b, c in zip(budgets, caps)) and sum(budgets) == sum(min(budget, c) for c in caps)
    assert len(set(budgets)) > 1  # pooled by score, not uniform
    _feed(model, cache, torch.randint(0, 128, (1, n)), steps=0)
    # slots allocated per sequence: kvzip-pool's row is shared by the layer's 2 KV heads
    held = [layer.tiers[0].capacity for layer in cache.layers]
    assert all(x <= 2 * b for x, b in zip(held, budgets)) and sum(held) <= 2 * sum(min(budget, c) for c in caps)
