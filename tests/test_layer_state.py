"""An eviction layer's state, grouped by owner (``kvevict.layer_state``): a reset starts again from
what the layer was made with, and every per-row holder of the registry follows the rows."""

import torch

import kvevict
from conftest import tiny_model


def _steps(model, cache, ids, n):
    out = []
    with torch.no_grad():
        logits = model(ids, cache=cache, use_cache=True).logits[:, -1:]
        for _ in range(n):
            out.append(logits)
            logits = model(logits.argmax(-1), cache=cache, use_cache=True).logits
    return torch.cat(out, 1)


def test_a_reset_memory_plan_with_a_recent_tier_is_a_new_cache_again():
    model = tiny_model("qwen2").to(torch.bfloat16)  # a recent tier costs 2 bytes a value, as on real models
    torch.manual_seed(0)
    first, second = torch.randint(0, 128, (2, 2000)), torch.randint(0, 128, (2, 2000))
    spec = "h2o/int4@memory=0.25"
    cache = kvevict.make_cache(model, spec)
    cache.set_prompt_length(first.shape[1])  # resolves the budget before the first forward
    _steps(model, cache, first, 20)
    layer = cache.layers[0]
    assert layer.recent_cost > 0 and layer.tiers[0].recent is not None  # the plan gave slots to it
    cache.reset()
    assert not layer.is_initialized and layer.shape is None and layer.tiers == [] and layer.seen == 0
    fresh = kvevict.make_cache(model, spec)
    fresh.set_prompt_length(second.shape[1])
    cache.set_prompt_length(second.shape[1])
    assert torch.equal(_steps(model, cache, second, 20), _steps(model, fresh, second, 20))
    assert cache.kv_bytes() == fresh.kv_bytes()
    assert [x.recent_cost for x in cache.layers] == [x.recent_cost for x in fresh.layers]


def test_every_per_row_holder_follows_a_reordering_of_the_rows():
    model = tiny_model("qwen2")
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (3, 40))
    # packed keys (a per-row key centre), a question (per-row prompt ends), merged evictions (a
    # per-row mean slot), per-row policies and counts: every holder of the registry
    spec = "merge-h2o/int4@16"
    cache = kvevict.make_cache(model, spec, group=8, question=4)
    _steps(model, cache, ids, 3)
    layer = cache.layers[0]
    names = {type(h).__name__ for h, _ in layer._per_row()}
    assert names == {"RowTensor", "Rows", "Summary", "KeySpace"}
    before = [t.clone() for h, _ in layer._per_row() for t in h.tensors()]
    perm = torch.tensor([2, 0, 1])
    cache.reorder_cache(perm)
    after = [t for h, _ in layer._per_row() for t in h.tensors()]
    assert all(torch.equal(a, b[perm]) for a, b in zip(after, before))
    cache.reorder_cache(torch.argsort(perm))
    back = [t for h, _ in layer._per_row() for t in h.tensors()]
    assert all(torch.equal(a, b) for a, b in zip(back, before))
