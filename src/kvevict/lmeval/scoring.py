"""Teacher-forced scoring of continuations after a context, through a budgeted cache, in batches.

The context goes in first, left-padded, the ``prefill`` way (``full``: one forward over it, then
each layer keeps its budget; ``token`` / ``block``: chunks of 1 / ``stride`` tokens, evicting
after each). The continuation then follows ``step`` tokens per forward, right-padded, so the
policy goes on evicting between forwards as it would while decoding (``step=1``, the
loglikelihood requests, as ``kvevict.eval.streaming.continuation_logprob``) or while a long text
streams in (``step=chunk``, the rolling requests, as the streaming LM task):

    log p(y | x) = sum_t log softmax(f(y_t-1, kept cache))[y_t],   y_0 predicted from x's last token.

Positions count real tokens only (``cumsum(mask) - 1``), as ``generate`` does, so a padded row
scores what it scores alone; a padded batch shares one cache, so a float budget is a fraction of
the batch's padded length (``batch_size=1`` makes it each request's own).
"""

from __future__ import annotations

import torch

from ..cache import EvictingCache
from ..prefill import check_mode


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of shape (b, longest), the sequences aligned to the right."""
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, n - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, n - len(s) :] = 1
    return ids, mask


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(1) - 1).clamp(min=0)


@torch.no_grad()
def feed_context(model, cache, ids, mask, mode="full", stride=None, prompt_length=None, keep_last=0):
    """Feed ``ids`` (b, n), left-padded, into ``cache`` the ``mode`` way, in chunks on a grid of
    ``stride`` tokens; with ``keep_last`` the chunk holding the last ``keep_last`` tokens is left to
    ``generate`` (as ``kvevict.prefill`` and transformers' ``prefill_chunk_size`` do). Returns the
    logits of the last token fed (b, vocab), or None. ``prompt_length``: what a float budget is a
    fraction of (default n)."""
    n = ids.shape[1]
    step = check_mode(mode, stride) or n
    if isinstance(cache, EvictingCache) and (step < n or prompt_length is not None):
        cache.set_prompt_length(prompt_length or n)
    pos = positions(mask)
    logits = None
    for s in range(0, n, step):
        e = min(n, s + step)
        if e > n - keep_last:
            break
        out = model(
            ids[:, s:e],
            attention_mask=mask[:, :e],
            position_ids=pos[:, s:e],
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1]
    return logits


@torch.no_grad()
def score_continuations(model, cache, last_logits, ctx_mask, conts: list[list[int]], pad_id: int, step: int = 1):
    """[(sum of log p of each continuation's tokens, whether greedy decoding gives them all)] for a
    batch whose contexts (mask ``ctx_mask``) are in ``cache``; ``last_logits`` (b, vocab): the
    prediction after each context."""
    cont, cmask = right_pad(conts, pad_id)
    total = torch.zeros(len(conts), dtype=torch.float64)
    greedy = torch.ones(len(conts), dtype=torch.bool)

    def take(logits, targets, valid):
        nonlocal greedy
        lp = torch.log_softmax(logits.float(), dim=-1)
        tok = lp.gather(-1, targets[..., None])[..., 0]
        total.add_((tok.double() * valid).sum(1))
        greedy &= ((lp.argmax(-1) == targets) | ~valid.bool()).all(1)

    take(last_logits[:, None], cont[:, :1], cmask[:, :1])
    start = ctx_mask.sum(1, keepdim=True)  # each row's first continuation position
    length = cont.shape[1]
    for s in range(0, length - 1, step):
        e = min(length - 1, s + step)
        mask = torch.cat([ctx_mask, cmask[:, :e]], dim=1)
        pos = start + torch.arange(s, e)[None]
        out = model(cont[:, s:e], attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
        take(out.logits, cont[:, s + 1 : e + 1], cmask[:, s + 1 : e + 1])
    return [(float(t), bool(g)) for t, g in zip(total, greedy)]
