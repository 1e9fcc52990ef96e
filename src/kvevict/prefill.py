"""How a prompt enters a budgeted cache (the RoCo paper's prefill modes).

- ``full``: one forward over the whole prompt; each layer attends over all of it, then keeps its
  budget (at most one layer holds the whole prompt at a time).
- ``token``: the greedy rule as each prompt token arrives, one eviction per token (stride 1).
- ``block``: the prompt goes in chunks of ``stride`` tokens; after each chunk ``stride`` tokens are
  evicted, so the KV memory peaks at budget + stride per layer whatever the prompt length.

transformers' own ``model.generate(ids, cache=cache, prefill_chunk_size=s)`` is the same
block prefill: its chunks lie on the same grid (0, s, 2s, ... from the cache's length), so it keeps
the same tokens as ``prefill(mode="block", stride=s)`` followed by ``generate``. generate cannot
tell the cache the prompt length, so a float budget needs ``cache.set_prompt_length(n)`` first.
"""

from __future__ import annotations

import torch

from .attention import take_handoff
from .cache import EvictingCache

MODES = ("full", "token", "block")


def check_mode(mode: str, stride: int | None) -> int | None:
    if mode not in MODES:
        raise ValueError(f"unknown prefill mode {mode!r}; choose one of {', '.join(MODES)}.")
    if mode == "token":
        return 1
    if mode == "block":
        if not isinstance(stride, int) or isinstance(stride, bool) or stride < 1:
            raise ValueError(f"block prefill needs a stride >= 1 tokens, got {stride!r}.")
        return stride
    return None


@torch.no_grad()
def prefill(
    model, cache, input_ids, attention_mask=None, mode: str = "full", stride: int | None = None, keep_last: int = 1
):
    """Feed ``input_ids`` into ``cache`` the ``mode`` way, so that ``model.generate(input_ids,
    cache=cache)`` continues from there. The chunks lie on a grid of ``stride`` tokens from
    the cache's length; every chunk that ends before the last ``keep_last`` tokens is fed, and the
    rest (the last chunk, which holds them) is left to generate, as ``prefill_chunk_size`` would.
    Returns the logits of the last fed token (or None for mode ``full``, where generate does it all)."""
    step = check_mode(mode, stride)
    if step is None:
        return None
    if isinstance(cache, EvictingCache):  # fractional budgets: of the whole prompt, not of its first chunk
        cache.set_prompt_length(input_ids.shape[1])
    n, end = input_ids.shape[1], input_ids.shape[1] - keep_last
    logits = None
    for start in range(cache.get_seq_length(), end, step):
        stop = min(n, start + step)
        if stop > end:
            break
        mask = None if attention_mask is None else attention_mask[:, :stop]
        logits = model(
            input_ids[:, start:stop], attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1
        ).logits
    return logits


@torch.no_grad()
def fill_from(cache, context) -> None:
    """Store the keys and values of ``context`` (a DynamicCache the model already ran the prompt
    into, e.g. to score it: ``KVzip.record(context=...)``) in the budgeted ``cache`` as the prompt's
    own forward would: each layer takes them in one chunk and evicts to its budget by its policy, so
    the prompt runs through the model once. A sliding layer of ``context`` holds its window only
    (the last W - 1 tokens): the budgeted layer takes those, its positions going on past the
    tokens before them (``EvictingLayer.skip``), which no later query could see. Only for a policy
    that reads no attention statistic (its scores were recorded); then ``model.generate(ids,
    cache=cache)`` goes on from the tokens given."""
    n = context.get_seq_length()
    cache.set_prompt_length(n)  # fractional budgets: of the prompt, not of a sliding layer's window
    for i, src in enumerate(context.layers):
        layer = cache.layers[i]
        k, v = src.keys, src.values
        skipped = n - k.shape[2]
        if skipped and (layer.window is None or k.shape[2] < layer.window - 1):
            raise ValueError(
                f"layer {i} of the context holds {k.shape[2]} of its {n} tokens, fewer than the budgeted "
                "layer's window keeps: fill from a cache that holds every token, or the window's."
            )
        cache.update(k, v, i)
        layer = take_handoff(layer.returned_keys)
        wanted, _ = layer.attention_request()
        if wanted:
            raise ValueError(
                f"{layer.policy.name} collects {', '.join(wanted)} from the prompt's attention; "
                "fill_from has none to give: run the prompt through the model instead."
            )
        if skipped:
            layer.skip(skipped)
        seg = layer.segments(v, None, k.shape[2])
        layer.absorb({}, seg.valid_new, seg.pos_new)
