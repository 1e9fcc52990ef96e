"""The kvpress peer's decoding (``kvevict.eval.kvpress_child.greedy``), run here on a tiny model:
kvpress is not needed to decode after a press, only a DynamicCache it has shortened."""

import contextlib

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


@torch.no_grad()
def _masked_greedy(model, full, ids, mask, new):
    """Greedy ids after ``ids``, whose prompt (all but its last token) sits in ``full``, every step
    reading only the positions ``mask`` marks."""
    n, seq, out = ids.shape[1], ids[:, -1:], []
    for i in range(new):
        pos = torch.tensor([[n - 1 + i]])
        logits = model(seq, past_key_values=full, attention_mask=mask[:, : n + i], position_ids=pos).logits
        out.append(int(logits[0, -1].argmax()))
        seq = torch.tensor([[out[-1]]])
    return out


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
    assert got == _masked_greedy(model, full, ids, mask, 6)


def test_it_stops_after_an_end_token():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    first = greedy(model, _prefilled(model, ids), ids, 4, set())
    assert greedy(model, _prefilled(model, ids), ids, 4, {first[1]}) == first[:2]
    model.generation_config.eos_token_id = [5, first[0]]
    assert eos_ids(model) == {5, first[0]}


def _cut_on_exit(cache, keep):
    """A stand-in press: on leaving, the cache holds only the positions ``keep`` of its prefill."""

    @contextlib.contextmanager
    def press(model):
        yield
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]

    return press


def test_the_question_apart_is_read_whole_after_the_pressed_context():
    """question=N: only the context (all but the last N tokens) is pressed; the question's tokens
    follow it at their own positions, unpressed, as kvpress's pipeline reads them. Without a press it
    is the whole prompt's answer; with one, attention over the kept context keys and every question
    key, the question itself included."""
    from kvevict.eval.kvpress_child import answer

    model = tiny_model("qwen2")
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = greedy(model, _prefilled(model, ids), ids, 6, set())
        assert answer(model, lambda m: contextlib.nullcontext(), ids, 6, set(), question=5) == (want, 29)

        keep = torch.tensor([0, 1, 4, 9, 16, 20, 24])  # 7 of the context's 25 tokens
        cache = DynamicCache()
        got, kept = answer(model, _cut_on_exit(cache, keep), ids, 6, set(), question=5, cache=cache)
    assert kept == 7 + 4 and cache.get_seq_length() == 7 + 4 + 6
    # the reference: the context whole in the cache, the question and answer reading it masked
    full = DynamicCache()
    mask = torch.zeros(1, 29 + 6, dtype=torch.long)
    mask[0, keep] = 1
    mask[0, 25:] = 1
    with torch.no_grad():
        model(ids[:, :25], past_key_values=full, use_cache=True)
        model(ids[:, 25:29], past_key_values=full, attention_mask=mask[:, :29], position_ids=torch.arange(25, 29)[None])
    assert got == _masked_greedy(model, full, ids, mask, 6)


def test_every_press_name_resolves_and_adakv_wraps_the_named_score():
    from types import SimpleNamespace

    from kvevict.eval.kvpress_child import make_press
    from kvevict.eval.peer_kvpress import PRESSES

    def press(name):
        return lambda compression_ratio=0.0, **kw: (name, compression_ratio, kw)

    classes = ("SnapKVPress", "ExpectedAttentionPress", "KnormPress", "ObservedAttentionPress", "TOVAPress")
    fake = SimpleNamespace(**{c: press(c) for c in (*classes, "KVzipPress")}, AdaKVPress=lambda inner: ("Ada", inner))
    for name in PRESSES:  # every name the CLI takes is one the child can build
        make_press(fake, name, 0.5)
    assert make_press(fake, "adakv_expected_attention", 0.75) == (("Ada", ("ExpectedAttentionPress", 0.75, {})), "sdpa")
    assert make_press(fake, "adakv_snapkv", 0.5)[0] == ("Ada", ("SnapKVPress", 0.5, {}))
    assert make_press(fake, "observed_attention", 0.5) == (("ObservedAttentionPress", 0.5, {}), "eager")
