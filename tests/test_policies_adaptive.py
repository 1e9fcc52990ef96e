"""Ada-KV head-adaptive budgets (one pool of kv_heads x budget slots per sequence and
layer, shared by the heads) and question-aware prefill, on hand-built inputs with hand-computed
kept sets, through the real attention and cache, and their errors."""

import pytest
import torch
from transformers import DynamicCache

import kvevict
from conftest import tiny_model
from kvevict.policies import Candidates, make_policy
from kvevict.storage import stat_bytes
from kvevict.storage.codes import slot_bytes
from tiny_chat_model import char_tokenizer


def pooled(scores, budget, newest=None, prompt_len=None):
    """Candidates of H heads laid out head after head in one row, as an adaptive tier holds them."""
    h, n = len(scores), len(scores[0])
    return Candidates(
        stats={"sum": torch.tensor(scores, dtype=torch.float32).view(1, 1, -1)},
        pos=torch.arange(n).repeat(h).view(1, 1, -1),
        valid=torch.ones(1, 1, h * n, dtype=torch.bool),
        newest=torch.tensor(n - 1 if newest is None else newest).view(1, 1, 1),
        budget=budget,
        layer_idx=0,
        head=torch.arange(h).repeat_interleave(n).view(1, 1, -1),
        heads=h,
        prompt_len=None if prompt_len is None else torch.tensor(prompt_len).view(1, 1, 1),
    )


def kept(policy, c, total):
    """(head, position) of the ``total`` candidates of highest priority."""
    top = policy.priority(c).topk(total, dim=-1).indices.flatten()
    return {(int(c.head.flatten()[i]), int(c.pos.flatten()[i])) for i in top}


# head 0 attends sharply to its old tokens, head 1 spreads thinly; position 4 is the recent window
SCORES = [[9.0, 8.0, 7.0, 6.0, 0.0], [1.0, 0.5, 0.2, 0.1, 0.0]]


@pytest.mark.parametrize(
    "floor, want",
    [
        # 2 heads x budget 3 = 6 slots: both recent tokens, then the 4 best scores of either head
        (0.0, {(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 4)}),
        # floor 0.5 of (3 - 1 recent) = 1 ranked token per head: head 1 keeps its best (pos 0)
        (0.5, {(0, 0), (0, 1), (0, 2), (0, 4), (1, 0), (1, 4)}),
        # floor 1: each head its whole budget, as uniform per-head eviction would keep
        (1.0, {(0, 0), (0, 1), (0, 4), (1, 0), (1, 1), (1, 4)}),
    ],
)
def test_adaptive_keeps_the_top_scores_of_all_heads_with_a_floor(floor, want):
    pol = make_policy("ada-h2o", recent=1, floor=floor)
    assert kept(pol, pooled(SCORES, budget=3), total=6) == want


def test_adakv_pools_snapkv_scores_within_each_head():
    # kernel 3: a candidate's score is the mean of its own head's neighbours, never the other head's
    pol = make_policy("adakv", recent=0, kernel=3, floor=0.0)
    obs = [[0.0, 0.0, 9.0, 0.0], [3.0, 0.0, 0.0, 0.0]]
    c = pooled(obs, budget=2)
    c.stats = {"obs": c.stats["sum"]}
    got = pol.score(c).view(2, 4)
    assert torch.allclose(got, torch.tensor([[0.0, 3.0, 3.0, 4.5], [1.5, 1.0, 0.0, 0.0]]))


@pytest.mark.parametrize("floor", [0.0, 0.5])
def test_adaptive_cache_keeps_the_joint_top_of_every_head_on_a_real_prefill(floor):
    model = tiny_model("llama-mha")  # 4 KV heads
    d = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():  # head 0's keys 3x longer: key norm ranks them all below the other heads'
        for block in model.model.layers:
            block.self_attn.k_proj.weight[:d] *= 3.0
    torch.manual_seed(6)
    n, budget, recent = 30, 10, 4
    ids = torch.randint(0, 128, (1, n))
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=full)
    cache = kvevict.make_cache(model, "ada-knorm", budget=budget, recent=recent, floor=floor)
    with torch.no_grad():
        model(ids, cache=cache)
    lengths = set()
    for layer, ref in zip(cache.layers, full.layers):
        score = -ref.keys[0].norm(dim=-1)[:, : n - recent]  # (h, scope): the last `recent` of each head stay
        h = score.shape[0]
        want = {(i, p) for i in range(h) for p in range(n - recent, n)}
        for i in range(h):  # the floor: each head's best int(floor x (budget - recent))
            want |= {(i, int(p)) for p in score[i].topk(int(floor * (budget - recent))).indices}
        rest = sorted(
            ((float(score[i, p]), i, p) for i in range(h) for p in range(n - recent) if (i, p) not in want),
            reverse=True,
        )
        want |= {(i, p) for _, i, p in rest[: h * budget - len(want)]}
        t = layer.tiers[0]
        got = {(int(a), int(b)) for a, b in zip(t.head.flatten(), t.pos.flatten())}
        assert got == want and len(got) == h * budget  # the layer's total, exactly
        lengths |= {sum(1 for a, _ in got if a == i) for i in range(h)}
    assert len(lengths) > 1  # the heads really hold different numbers of tokens


@pytest.mark.parametrize("kv_bits, evicted_bits", [(None, None), (4, None), (8, 4)])
def test_adaptive_memory_is_the_layer_total_not_heads_x_the_longest_head(kv_bits, evicted_bits):
    model = tiny_model("llama-gqa")
    cfg = model.config
    torch.manual_seed(7)
    n, budget, b = 40, 8, 2
    ids = torch.randint(0, 128, (b, n))
    cache = kvevict.make_cache(
        model,
        "adakv",
        budget=budget,
        kv_bits=kv_bits,
        evicted_bits=evicted_bits,
        evicted_budget=6 if evicted_bits else None,
    )
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        max_new_tokens=5,
        min_new_tokens=5,
        do_sample=False,
        pad_token_id=0,
    )
    assert out.shape == (b, n + 5)
    hkv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    group = cache.storage.group
    meta = 2 + 1 + stat_bytes(cache.policy.stats)  # position (int16), head id, the statistics
    per_layer = b * hkv * budget * (slot_bytes(d, d, kv_bits, group, 4) + meta) + b * (
        8 + cache.storage.row_bytes(hkv, d)
    )
    if evicted_bits:
        per_layer += b * hkv * 6 * (slot_bytes(d, d, evicted_bits, group, 4) + meta)
    assert cache.kv_bytes() == cfg.num_hidden_layers * per_layer
    # per-head storage would need heads x the longest head's tokens to hold the same kept sets
    for layer in cache.layers:
        t = layer.tiers[0]
        counts = torch.stack([(t.head == i).sum(-1) for i in range(hkv)], -1)  # (b, 1, hkv)
        assert bool((counts.sum(-1) == hkv * budget).all())
        longest = int(counts.max())
        assert longest > budget
        assert t.nbytes() < b * hkv * longest * (slot_bytes(d, d, kv_bits, group, 4) + meta - 1)


@pytest.mark.parametrize("name", ["adakv", "ada-h2o", "ada-tova", "ada-knorm", "ada-expected"])
@pytest.mark.parametrize("kv_bits", [None, 16])
def test_adaptive_with_a_covering_budget_equals_the_full_cache(name, kv_bits):
    model = tiny_model("llama-gqa")
    torch.manual_seed(8)
    ids, steps = torch.randint(0, 128, (2, 20)), torch.randint(0, 128, (2, 4))
    ref = DynamicCache(config=model.config)
    cache = kvevict.make_cache(model, name, budget=24, kv_bits=kv_bits)
    tol = 1e-4 if kv_bits is None else 2e-2  # float16 storage rounds the keys
    with torch.no_grad():
        for part in [ids] + [steps[:, i : i + 1] for i in range(4)]:
            r = model(part, cache=ref).logits
            g = model(part, cache=cache).logits
            assert (r - g).abs().max().item() < tol


def test_adaptive_padded_batch_keeps_padding_out_and_rows_apart():
    model = tiny_model("qwen2")
    torch.manual_seed(9)
    lens = (26, 14)
    ids = torch.randint(1, 128, (2, max(lens)))
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        mask[i, max(lens) - n :] = 1
    cache = kvevict.make_cache(model, "ada-h2o", budget=8, recent=2)
    out = model.generate(
        ids, attention_mask=mask, cache=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0
    )
    alone = kvevict.make_cache(model, "ada-h2o", budget=8, recent=2)
    short = ids[1:, max(lens) - lens[1] :]
    out1 = model.generate(
        short,
        attention_mask=torch.ones_like(short),
        cache=alone,
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
    )
    assert torch.equal(out[1, max(lens) :], out1[0, lens[1] :])  # the padded row decodes as it would alone
    for layer in cache.layers:
        assert layer.valid.all()  # padding never holds a slot


def test_question_stays_and_is_what_snapkv_observes():
    model = tiny_model("llama-gqa")
    torch.manual_seed(10)
    n, q = 30, 5
    ids = torch.randint(0, 128, (1, n))
    cache = kvevict.make_cache(model, "snapkv", budget=10, question=q, recent=2)
    assert cache.policy.attention_params() == {"observe": q}
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
    )
    for layer in cache.layers:  # 12 tokens later the recent window has moved on; the question has not
        for row in layer.pos[0]:
            assert set(range(n - q, n)) <= set(row.tolist())
    plain = kvevict.make_cache(model, "snapkv", budget=10, recent=2)
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=plain,
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
    )
    assert any(not set(range(n - q, n)) <= set(row.tolist()) for layer in plain.layers for row in layer.pos[0])


def test_question_is_protected_past_the_recent_window():
    # 10 prompt tokens, the last 3 the question; 2 generated since (newest 11), recent 1
    pol = make_policy("h2o", recent=1, question=3)
    c = pooled([[5.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.1, 0.1, 0.0, 0.0]], budget=6, newest=11, prompt_len=10)
    c.head, c.heads = None, 1
    prio = pol.priority(c).flatten()
    assert set(torch.nonzero(prio == float("inf")).flatten().tolist()) == {7, 8, 9, 11}


def test_question_tokens_counts_the_last_paragraph_and_the_template_tail():
    from kvevict.generate import question_tokens

    tok = char_tokenizer()
    # "\n\n" (1: this tokenizer's regex skips newlines, so the pair is one <unk>) + "What?" (5)
    # + <|im_end|> (1) + "\n" (1) + <|im_start|> (1) + "assistant\n" (10)
    assert question_tokens(tok, [{"role": "user", "content": "Some text.\n\nWhat?"}]) == 19
    with pytest.raises(ValueError, match="pass question=N"):
        question_tokens(tok, [{"role": "user", "content": "no blank line"}])


def test_generate_with_a_question_spec_protects_it():
    from kvevict.generate import generate, question_tokens

    model, tok = tiny_model("llama-gqa"), char_tokenizer()
    msgs = [{"role": "user", "content": "abcdefghij" * 6 + "\n\nWhat is it?"}]
    spec = generate(model, tok, msgs, "snapkv+q", 0.8, 4)
    given = generate(model, tok, msgs, "snapkv", 0.8, 4, question=question_tokens(tok, msgs))
    assert spec.text == given.text and spec.policy == "snapkv+q"


def test_eval_accepts_adaptive_and_question_specs():
    from kvevict.eval.caches import new_cache, policy_names

    assert policy_names("ada-h2o+q,h2o/int4+q,adakv", kvevict.POLICIES) == ["ada-h2o+q", "h2o/int4+q", "adakv"]
    with pytest.raises(ValueError, match="unknown policy 'ada-nope'"):
        policy_names("ada-nope", kvevict.POLICIES)
    with pytest.raises(ValueError, match="streams text"):
        new_cache(tiny_model("llama-gqa"), "h2o+q", 0.2)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: kvevict.make_cache(tiny_model(), "roco", budget=8, adaptive=True), "roco cannot take adaptive"),
        (lambda: kvevict.make_cache(tiny_model(), "ada-h2o", budget=8, floor=1.5), "floor must be a share"),
        (lambda: kvevict.make_cache(tiny_model(), "adakv", budget=8, compact=True), "compact positions"),
        (lambda: kvevict.make_cache(tiny_model(), "h2o", budget=8, question=-1), "question must be an int"),
        (lambda: kvevict.make_cache(tiny_model(), "h2o", budget=8, question=6), "more than the budget"),
        (lambda: kvevict.make_cache(tiny_model(), "ada-nope", budget=8), "unknown policy 'ada-nope'"),
    ],
)
def test_bad_adaptive_and_question_parameters_are_clear(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("policy", ["ada-h2o", "adakv"])
def test_adaptive_rows_join_a_running_batch_and_decode_as_alone(policy):
    from kvevict.attention import ATTN_NAME, register
    from kvevict.serve.batch import DecodeBatch

    model = tiny_model("llama-gqa")
    register()
    model.set_attn_implementation(ATTN_NAME)
    torch.manual_seed(11)
    prompts = [torch.randint(1, 128, (n,)).tolist() for n in (28, 10)]

    def alone(p):
        batch, logits = DecodeBatch.prefill(model, p, policy, 8, None)
        out = [int(logits.argmax(-1))]
        for _ in range(9):
            out.append(int(batch.step([out[-1]]).argmax(-1)))
        return out

    with torch.no_grad():
        want = [alone(p) for p in prompts]
        batch, logits = DecodeBatch.prefill(model, prompts[0], policy, 8, None)
        got = [[int(logits.argmax(-1))], []]
        for step in range(9):
            if step == 3:  # the second prompt joins at a different fill level
                other, logits = DecodeBatch.prefill(model, prompts[1], policy, 8, None)
                assert batch.can_join(other)
                batch.join(other)
                got[1].append(int(logits.argmax(-1)))
            rows = [r for r in (0, 1) if got[r] and len(got[r]) < 10]
            logits = batch.step([got[r][-1] for r in (0, 1) if got[r]])
            for k, r in enumerate(r for r in (0, 1) if got[r]):
                if r in rows:
                    got[r].append(int(logits[k].argmax()))
    assert got[0] == want[0] and got[1] == want[1][: len(got[1])]


@pytest.mark.parametrize("mode, stride", [("block", 8), ("token", None)])
def test_question_survives_chunked_prefill(mode, stride):
    model = tiny_model("qwen2")
    torch.manual_seed(12)
    n, q = 40, 4
    ids = torch.randint(0, 128, (1, n))
    cache = kvevict.make_cache(model, "ada-h2o", budget=8, question=q, recent=2)
    kvevict.prefill(model, cache, ids, mode=mode, stride=stride)  # fixes the prompt length first
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        max_new_tokens=8,
        min_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
    )
    for layer in cache.layers:
        t = layer.tiers[0]
        for h in range(model.config.num_key_value_heads):
            assert set(range(n - q, n)) <= set(t.pos[0, 0][t.head[0, 0] == h].tolist())


def test_cli_policy_check_knows_adaptive_and_question_specs():
    from types import SimpleNamespace

    from kvevict.commands._common import check_policy_args

    ok = SimpleNamespace(policy="ada-h2o+q", budget="0.2", prefill="full", stride=None)
    check_policy_args(ok)
    with pytest.raises(ValueError, match="unknown policy 'ada-nope'"):
        check_policy_args(SimpleNamespace(policy="ada-nope", budget="0.2", prefill="full", stride=None))


def test_the_floor_holds_for_every_head_when_one_has_fewer_candidates_than_it():
    """Ada-KV's floor lifts each head's best k. A head with fewer than k candidates must not undo
    another head's lift: its top-k is padded with other heads' entries at -inf (this lost head 0's
    second best, at 8.0, before)."""
    pol = make_policy("adakv", recent=0, floor=0.5)
    prio = torch.tensor([[[0.5, 1.0, 2.0, 3.0, 7.0, 8.0, 9.0]]])
    c = Candidates(
        stats={}, pos=torch.arange(7).view(1, 1, 7), valid=torch.ones(1, 1, 7, dtype=torch.bool),
        newest=torch.tensor([[[6]]]), budget=6, layer_idx=0,
        head=torch.tensor([[[1, 0, 0, 0, 0, 0, 0]]], dtype=torch.uint8), heads=2,
    )  # fmt: skip
    assert pol.floor_for(6) == 3
    inf = float("inf")
    assert pol._floored(prio, c).tolist() == [[[inf, 1.0, 2.0, 3.0, inf, inf, inf]]]
