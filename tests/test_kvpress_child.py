"""The kvpress peer's decoding (``kvevict.eval.kvpress_child.greedy``), run here on a tiny model:
kvpress is not needed to decode after a press, only a DynamicCache it has shortened."""

import torch
from transformers import DynamicCache

from conftest import tiny_model
from kvevict.eval.kvpress_child import eos_ids, greedy


def _prefilled(model, ids, keep=None):
    """A DynamicCache of ``ids[:, :-1]``, cut to the positions ``keep`` in every layer (what a press leaves)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :-1], past_key_values=cache, use_cache=True)
    if keep is not None:
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
    return cache


def test_without_a_press_the_answer_is_generates_own():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.generate(ids, do_sample=False, max_new_tokens=8, min_new_tokens=8, eos_token_id=None)
        got = greedy(model, _prefilled(model, ids), ids, 8, set())
    assert got == want[0, ids.shape[1] :].tolist()


def test_after_a_press_the_cache_holds_what_it_kept_and_the_answer_only():
    """model.generate on a shortened cache fed the prompt's tokens past the cache's length again
    (here 14 of the 29): the press's savings undone. Each new token is fed once, at its own position."""
    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(1))
    keep = torch.tensor([0, 1, 2, 5, 8, 13, 17, 20, 24, 25, 26, 27, 28])  # 13 of the prompt's 29 first tokens
    cache = _prefilled(model, ids, keep)
    with torch.no_grad():
        got = greedy(model, cache, ids, 6, set())
    assert len(got) == 6 and cache.get_seq_length() == len(keep) + 6
    # the same answer as attention over exactly those keys at their own positions: a cache holding
    # them whole (nothing cut) but with the cut ones masked out of every query's view
    full = _prefilled(model, ids)
    mask = torch.zeros(1, 29 + 6, dtype=torch.long)
    mask[0, keep] = 1
    mask[0, 29:] = 1
    seq, out = ids[:, -1:], []
    with torch.no_grad():
        for i in range(6):
            logits = model(
                seq, past_key_values=full, attention_mask=mask[:, : 30 + i], position_ids=torch.tensor([[29 + i]])
            ).logits
            out.append(int(logits[0, -1].argmax()))
            seq = torch.tensor([[out[-1]]])
    assert got == out


def test_it_stops_after_an_end_token():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    first = greedy(model, _prefilled(model, ids), ids, 4, set())
    assert greedy(model, _prefilled(model, ids), ids, 4, {first[1]}) == first[:2]
    model.generation_config.eos_token_id = [5, first[0]]
    assert eos_ids(model) == {5, first[0]}
