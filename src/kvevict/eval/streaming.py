"""Teacher-forced scoring while the policy evicts as the text streams in.

The text goes through the model ``chunk`` tokens at a time (``model(ids_chunk, cache=
cache)``), so every chunk is predicted from what the policy kept of the earlier ones, as in the
H2O paper's streaming language modelling. The full cache runs in lockstep on the same chunks, so
next-token agreement (top-1 match, KL(full || policy)) needs no labels and no stored logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..generate import dynamic_kv_bytes, stock_kv_bytes16
from . import metrics
from .caches import FULL, new_cache


@dataclass
class StreamScore:
    nll: list = field(default_factory=list)  # per scored token
    top1: list = field(default_factory=list)
    kl: list = field(default_factory=list)
    kv_bytes: int = 0  # held at the end of the stream
    full_kv_bytes: int = 0  # a stock cache in 16 bits, same tokens (kvevict.stock)


@torch.no_grad()
def stream_compare(model, ids: torch.Tensor, cells: list[tuple[str, object]], chunk: int = 32):
    """Stream ``ids`` (1, n) through a full cache and one cache per (policy, budget) cell; return
    {cell: StreamScore} with per-token NLL of the next token, top-1 agreement and KL vs full."""
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
        raise ValueError("stream_compare needs ids of shape (1, n) with n >= 2.")
    n = ids.shape[1]
    ref_cache = new_cache(model, FULL, None)
    caches = {cell: new_cache(model, *cell, sequence=ids) for cell in cells if cell[0] != FULL}
    for cache in caches.values():  # the whole text is the prompt (sizes a mixed cache's low-bit tier)
        cache.set_prompt_length(n)
    # make_cache switched attention to kvevict, which is exact with the DynamicCache too
    scores = {cell: StreamScore() for cell in cells}
    for s in range(0, n - 1, chunk):
        e = min(n - 1, s + chunk)
        x, y = ids[:, s:e], ids[0, s + 1 : e + 1]
        ref = model(x, cache=ref_cache).logits[0]
        ref_nll = metrics.token_nll(ref, y)
        for cell in cells:
            sc = scores[cell]
            if cell[0] == FULL:
                sc.nll += ref_nll.tolist()
                sc.top1 += [1.0] * len(y)
                sc.kl += [0.0] * len(y)
                continue
            out = model(x, cache=caches[cell]).logits[0]
            sc.nll += metrics.token_nll(out, y).tolist()
            sc.top1 += metrics.top1_agreement(out, ref).tolist()
            sc.kl += metrics.kl_divergence(out, ref).clamp_min(0).tolist()
    held, full = dynamic_kv_bytes(ref_cache), stock_kv_bytes16(ref_cache)
    for cell, sc in scores.items():
        sc.full_kv_bytes = full
        sc.kv_bytes = held if cell[0] == FULL else caches[cell].kv_bytes()
    return scores


@torch.no_grad()
def continuation_logprob(model, context: torch.Tensor, continuation: torch.Tensor, policy: str, budget) -> float:
    """sum_t log p(continuation_t | context, continuation_<t): the context is prefilled (and, with
    a float budget, evicted down to that fraction of it, as in generation), then the continuation is
    fed one token at a time, so the policy keeps evicting as it would while decoding."""
    cache = new_cache(model, policy, budget, sequence=torch.cat([context, continuation], dim=1))
    logits = model(context, cache=cache).logits[0, -1]
    total = 0.0
    for i in range(continuation.shape[1]):
        tok = continuation[0, i]
        total += torch.log_softmax(logits.float(), -1)[tok].item()
        if i + 1 < continuation.shape[1]:
            logits = model(continuation[:, i : i + 1], cache=cache).logits[0, -1]
    return total
