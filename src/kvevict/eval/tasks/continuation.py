"""Continuation perplexity: how well a compressed context supports predicting what follows it.

The ``ppl`` task streams its text through the cache, so a policy that must score the whole prompt
before the cache exists (KVzip, Kim et al. 2025, and ``kvzip-pool``) cannot run there. Here a window
of the same texts is split into a context of P tokens and a continuation of C tokens. Each cell
prefills the context into its cache as ``kvevict.generate`` does (one forward of the whole prompt;
a prompt-scoring policy records its scores on the context first), so a float budget is a fraction
of the context. The continuation is then scored teacher-forced, ``chunk`` tokens per forward, the
cache evicting as it would while decoding. Over the C predicted tokens x_{P+1..P+C}:

    nll  = -1/C sum_t log p(x_t | kept cache, x_{P+1..t-1})     (reported as perplexity exp(mean nll))
    nll_late: the same over the continuation's second half (as ``ppl``'s), where a policy that evicts
    context for the tokens it decodes (kvzip ranks them above every context token) has done so
    top1 = mean_t [argmax p_cell = argmax p_full],   kl = mean_t KL(p_full || p_cell)

The full cache, prefilled and fed the same way, is the reference, computed once per sample.
"""

from __future__ import annotations

import torch

from ...cache import EvictingCache
from ...generate import dynamic_kv_bytes, stock_kv_bytes16
from .. import metrics
from ..caches import FULL, new_cache
from .base import Sample
from .ppl import SOURCES, PerplexityTask


@torch.no_grad()
def continuation_logits(model, cache, context: torch.Tensor, continuation: torch.Tensor, chunk: int):
    """(C, vocab) logits predicting each continuation token: the last context position, then the
    continuation fed ``chunk`` tokens at a time (its last token predicts nothing and is not fed)."""
    if isinstance(cache, EvictingCache):
        cache.set_prompt_length(context.shape[1])
    out = [model(context, cache=cache, use_cache=True).logits[0, -1:]]
    c = continuation.shape[1]
    for s in range(0, c - 1, chunk):
        out.append(model(continuation[:, s : min(c - 1, s + chunk)], cache=cache, use_cache=True).logits[0])
    return torch.cat(out).float()


class ContinuationTask(PerplexityTask):
    """Windows of ``context + continuation`` tokens from ``ppl``'s sources (same sampling, so the
    ids say source, text and length); scores nll, top1 and kl over the continuation (see module)."""

    name = "continuation"
    metrics = {"nll": "exp", "nll_late": "exp", "top1": "mean", "kl": "mean"}
    primary = "nll"
    higher_is_better = False

    def __init__(self, context: int = 768, continuation: int = 256, chunk: int = 32, sources=SOURCES, texts=None):
        if context < 1 or continuation < 1 or chunk < 1:
            raise ValueError(
                f"continuation needs context, continuation and chunk >= 1 tokens, "
                f"got {context}, {continuation}, {chunk}."
            )
        super().__init__(tokens=context + continuation, chunk=chunk, sources=sources, texts=texts)
        self.context, self.continuation = context, continuation

    def samples(self, tokenizer, n):
        # ppl's ids end in the window length; name the split too, so another split never resumes this one
        return [
            Sample(id=f"{s.id.rsplit('-', 1)[0]}-{self.context}+{self.continuation}", data=s.data)
            for s in super().samples(tokenizer, n)
        ]

    @torch.no_grad()
    def evaluate(self, model, tokenizer, sample, cells, reference):
        ids = torch.tensor([sample.data["ids"]])
        ctx, cont = ids[:, : self.context], ids[:, self.context :]
        y = cont[0]
        order = [(FULL, None)] + [c for c in cells if c[0] != FULL]  # the reference first, always
        out, ref = {}, None
        for cell in order:
            cache = new_cache(model, *cell, sequence=ids, prompt=ctx, tokenizer=tokenizer)
            logits = continuation_logits(model, cache, ctx, cont, self.chunk)
            if ref is None:
                ref, full_bytes, ref_bytes = logits, stock_kv_bytes16(cache), dynamic_kv_bytes(cache)
            if cell not in cells:
                continue
            nll = metrics.token_nll(logits, y)
            out[cell] = {
                "scores": {
                    "nll": nll.mean().item(),
                    "nll_late": nll[len(y) // 2 :].mean().item(),
                    "top1": metrics.top1_agreement(logits, ref).mean().item(),
                    "kl": metrics.kl_divergence(logits, ref).clamp_min(0).mean().item(),
                },
                "output": None,
                "tokens": ids.shape[1],
                "context_tokens": self.context,
                "kv_bytes": ref_bytes if cell[0] == FULL else cache.kv_bytes(),
                "full_kv_bytes": full_bytes,
            }
            self._done(cell, out[cell])
        return out
