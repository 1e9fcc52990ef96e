"""Continuous batching in the cache: rows at different fill levels share one EvictingCache (and a
DynamicCache for the full policy); a row that joins or leaves mid-decode changes nobody's tokens."""

import pytest
import torch

from conftest import tiny_model
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
    got = [[] for _ in prompts]
    with torch.no_grad():
        batch, logits = DecodeBatch.prefill(model, prompts[0], policy, budget, None)
        rows, last = [0], {0: int(logits.argmax(-1))}
        got[0].append(last[0])
        for step in range(30):
            if step in (4, 7):  # a newcomer joins the running batch, at a different fill level
                i = 1 if step == 4 else 2
                other, logits = DecodeBatch.prefill(model, prompts[i], policy, budget, None)
                assert batch.can_join(other)
                batch.join(other)
                rows.append(i)
                last[i] = int(logits.argmax(-1))
                got[i].append(last[i])
            done = [r for r in rows if len(got[r]) == 16]
            if done:  # finished rows leave at once
                batch.keep([k for k, r in enumerate(rows) if r not in done])
                rows = [r for r in rows if r not in done]
            if not rows:
                break
            logits = batch.step([last[r] for r in rows])
            for k, r in enumerate(rows):
                last[r] = int(logits[k].argmax())
                got[r].append(last[r])
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
            logits = model(torch.tensor([p]), past_key_values=cache, use_cache=True).logits[:, -1]
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
