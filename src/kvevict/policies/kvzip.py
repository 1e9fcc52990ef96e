from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .base import Candidates, Policy
from .registry import register

# KVzip's reconstruction request, appended after the context (Kim et al. 2025, Sec. 3)
REPEAT = "\n\nRepeat the previous context exactly.\n"


@contextmanager
def past_recorded(cache) -> Iterator[None]:
    """Within it, the sliding layers of ``cache`` (a transformers DynamicCache) keep what passes out
    of their window until a crop (transformers' past recording), so a pass run on top of a context
    can be cropped off again; after it they are cut back to their window and left as they were."""
    sliding = [layer for layer in cache.layers if getattr(layer, "is_sliding", False)]
    was = [layer.record_past for layer in sliding]
    for layer in sliding:
        layer.activate_past_recording()
    try:
        yield
    finally:
        for layer, flag in zip(sliding, was):
            if layer.is_initialized:
                layer.crop(0)  # a sliding layer's crop(0) cuts it back to its window
            layer.record_past = flag


@register("kvzip")
@dataclass
class KVzip(Policy):
    """KVzip (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
    Reconstruction"): a key matters as much as the model needs it to repeat its context. One
    forward over ``[context, repeat request, context]`` (a full-cache pass, 2n + r tokens) records
    the attention the reconstruction queries R (the repeated copy) give each context key:

        score(i) = max_{t in R, g in G(i)} a_{t,g}(i)     (G(i): the query heads of i's KV group)

    a key read sharply by one reconstruction query (a needle's digits, copied once) keeps its place,
    where a sum would favour keys every query glances at (sinks, recent tokens). The score is fixed
    at prefill (query-agnostic: it never looks at the question). Tokens past the recorded context
    (the generated ones) have no such score: the newest ``generated x budget`` of them rank above
    every context token, older ones below, so a short answer evicts context as kvpress's growing
    cache would (it keeps every generated token), while a long one keeps a window of itself beside
    the best-scored half of the context instead of losing the context (measured on the
    ``continuation`` task, docs/results/retrieval.md). Build it with ``KVzip.record(model, tokenizer,
    input_ids)``; ``kvevict.generate.generate(..., policy="kvzip")`` records it first.

    ``adaptive=True`` (``ada-kvzip``) pools each layer's budget over its KV heads (Ada-KV);
    ``layers=True`` also gives each layer its share of the model's total, since the scores are known
    before the cache exists: with S the scores of every (layer, head, token) of the prompt, layer l
    of H heads gets

        B_l = lo + (L (B - lo)) x |{(h, i) of l in TopK(S, L H (B - lo))}| / (L H (B - lo))

    tokens per head (rounded, the total kept at L x B, a layer capped at the prompt's n;
    lo = recent + sinks + question + 1 so every layer keeps its window). ``kvzip-pool`` is both:
    KVzip's own allocation (kvpress ranks every layer's and head's scores together) with the
    memory freed.

    ``pool = k`` (odd) ranks each key by the best score among its k nearest positions, as SnapKV
    (Li et al., 2024) pools its observation scores so that a hit's neighbours stay with it:

        rank(i) = max_{|j - i| <= k // 2} score(j)

    so a needle's whole sentence (the key that names it, its digits) stays or goes together; the
    layers' budgets are shared out by the pooled ranks too. ``kvzip-span`` is ``kvzip-pool`` over
    15 positions. On RULER's niah_multiquery at 4K (SmolLM2, 20% of a 16-bit cache) it returned
    97% of the full cache's values on the first 40 samples where ``kvzip-pool`` returned 73% of
    the first 20 (keys kept one by one left four of them answering "1. 1.1.1..."); over 60 samples
    89% against 80%, and ``merge-kvzip-span`` (its evicted tokens kept as one mean slot per head,
    kvevict.merge) 105%. Text after a compressed context cost +3.6% perplexity against +1.5%:
    ``kvzip-pool``, unpooled, stays the memory plan's pick (docs/results/ruler.md).
    """

    scores: list | None = field(default=None, repr=False)  # per layer: (b, hkv, n) reconstruction attention
    recent: int | None = 8
    layers: bool = False  # pool the budget over layers too (see above)
    generated: float = 0.5  # share of the budget the newest generated tokens hold above the context
    pool: int = 1  # rank by the max score over this many neighbouring positions (odd; 1: the key's own)
    ranked: list | None = field(default=None, init=False, repr=False, compare=False)  # scores pooled
    name = "kvzip"
    needs_prompt = True  # generate() records the prompt before making the cache

    def __post_init__(self):
        if self.scores is None:
            raise ValueError(
                "kvzip scores a prompt before generation: build it with "
                "kvevict.policies.kvzip.KVzip.record(model, tokenizer, input_ids), or use "
                "kvevict.generate.generate(..., policy='kvzip'); it cannot score a text "
                "that streams in (the ppl task)."
            )
        if not 0.0 <= self.generated <= 1.0:
            raise ValueError(
                f"generated is the share of the budget the newest generated tokens hold, "
                f"in [0, 1]; got {self.generated}."
            )
        if not isinstance(self.pool, int) or self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(
                f"pool is the odd number of neighbouring positions a key is ranked over (1: its "
                f"own score alone); got {self.pool!r}."
            )
        self.ranked = [max_pool(s, self.pool) for s in self.scores]

    @staticmethod
    def tail(params: dict) -> int:
        """The prompt's last tokens ``record`` crops off a given context and runs again: none here
        (the pieces run after the context). A caller prefills those inside ``past_recorded``."""
        return 0

    @classmethod
    @torch.no_grad()
    def record(
        cls, model, tokenizer, input_ids, attention_mask=None, chunk: int = 4096, context=None, **params
    ) -> "KVzip":
        """Score ``input_ids`` by reconstruction, as KVzip's chunked scoring does (Kim et al. 2025,
        Sec. 3.3): the context is cached once, then each piece of ``chunk`` tokens is reconstructed
        on top of it, ``[repeat, piece]`` attending to the whole context, and a key's score is its
        max over the pieces. That costs O(chunk x n) attention per piece instead of O(n^2) at once,
        and keeps positions at n + r + chunk instead of 2n + r. The last piece takes in a remainder
        shorter than ``chunk / 2``: a short piece copied without the text before it is read less
        sharply (a pass key at the end of a 4,119-token prompt, in a 23-token piece, lost a digit).
        One piece is one pass over ``[context, repeat, context]``. ``context``: a DynamicCache that
        already holds ``input_ids`` (the caller's own prefill, kept to fill the budgeted cache from:
        ``kvevict.prefill.fill_from``), so the context is not run again; it is left as given. Its
        sliding layers may hold their window only (the stock cache's): a key out of it scores 0,
        as it is out of every reconstruction query's window."""
        from transformers import DynamicCache

        from ..record import record_attention_stats

        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("kvzip records unpadded prompts only: give it one prompt per batch.")
        if int(chunk) < 1:
            raise ValueError(
                f"kvzip's chunk is the number of context tokens reconstructed per pass (>= 1); got {chunk}."
            )

        n = input_ids.shape[1]
        rep = tokenizer(REPEAT, add_special_tokens=False, return_tensors="pt")["input_ids"].to(input_ids.device)
        rep = rep.expand(input_ids.shape[0], -1)
        starts = list(range(0, n, chunk))
        if len(starts) > 1 and n - starts[-1] < chunk / 2:
            starts.pop()  # the last piece takes in the short remainder
        if len(starts) == 1 and context is None:
            seq = torch.cat([input_ids, rep, input_ids], dim=1)
            # the queries after the context: the repeat request and the reconstruction
            stats = record_attention_stats(model, seq, ("max",), observe=seq.shape[1] - n)
            return cls(scores=[st["max"][..., :n] for st in stats], **params)
        if context is None:
            context = DynamicCache()
            record_attention_stats(model, input_ids, (), cache=context)
        elif context.get_seq_length() != n:
            raise ValueError(f"the context cache holds {context.get_seq_length()} tokens, the prompt has {n}.")
        scores = None
        with past_recorded(context):  # a piece's crop gives a sliding layer its window back
            for s, e in zip(starts, starts[1:] + [n]):
                piece = torch.cat([rep, input_ids[:, s:e]], dim=1)
                stats = record_attention_stats(model, piece, ("max",), cache=context, observe=piece.shape[1])
                context.crop(-piece.shape[1])  # the next piece reconstructs from the context alone
                got = [context_scores(st["max"], n, piece.shape[1]) for st in stats]
                scores = got if scores is None else [torch.maximum(a, b) for a, b in zip(scores, got)]
        return cls(scores=scores, **params)

    def score(self, c: Candidates):
        assert self.ranked is not None  # __post_init__ sets it
        s = self.ranked[c.layer_idx].to(c.pos.device)
        if c.pos.shape[0] != s.shape[0]:
            raise ValueError(f"kvzip was recorded for batch size {s.shape[0]}, the cache runs {c.pos.shape[0]}.")
        rows = c.lookup(s)
        # generated tokens: the newest ``generated x budget`` rank above every context token, older
        # ones below (scores are attention probabilities, >= 0), so a long answer keeps a window of
        # itself and the best of the context instead of pushing the whole context out
        window = c.pos > c.newest - max(1, int(self.generated * c.budget))
        gen = torch.where(window, rows.amax(-1, keepdim=True) + 1.0, torch.full_like(rows, -1.0))
        return torch.where(c.pos >= s.shape[-1], gen, rows)

    @property
    def prompt_tokens(self) -> int:
        """The recorded prompt's length: fractional budgets resolve against it for ``layer_budgets``."""
        assert self.scores is not None  # __post_init__ refuses a kvzip without them
        return self.scores[0].shape[-1]

    def layer_budgets(self, budget: int, num_layers: int, caps: list[int] | None = None) -> list[int]:
        """Budgets pooled over the layers: together they keep what ``budget`` per layer keeps, each
        layer at least its recent window and the rest won by score. ``caps``: the most each layer
        can hold (a sliding layer's window); the pool is then sum_l min(budget, cap_l), and what a
        capped layer wins past its cap goes to the others, by score, so the bytes planned are kept
        (a sliding model's global layers would otherwise win tokens its capped layers drop)."""
        if not self.layers or num_layers == 1:
            return [budget] * num_layers
        assert self.scores is not None and self.ranked is not None  # __post_init__ checks and pools them
        if len(self.scores) != num_layers:
            raise ValueError(f"kvzip was recorded on {len(self.scores)} layers, the cache has {num_layers}.")
        b, h, n = self.scores[0].shape
        fill = caps is not None  # without caps a layer past the prompt is cut and the total shrinks
        caps = [min(n, c) for c in caps] if caps else [n] * num_layers
        if budget >= max(caps):  # every layer can keep all it may hold
            return [budget] * num_layers
        lo = [min(budget, c, self.recent_for(budget) + self.sinks + self.question + 1) for c in caps]
        total = sum(min(budget, c) for c in caps)
        spare = total - sum(lo)  # tokens per head to share out, over all layers
        flat = torch.cat([s.float().flatten(1) for s in self.ranked], dim=1)  # (b, L h n)
        k = min(spare * h, flat.shape[1])
        won = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, flat.topk(k, dim=1).indices, True)
        share = won.view(b, num_layers, h * n).sum(-1).float().mean(0) / max(1, k)  # (L,)
        out = [x + round(spare * float(y)) for x, y in zip(lo, share)]
        out[int(share.argmax())] += total - sum(out)  # rounding: keep the total exact
        excess = sum(max(0, x - c) for x, c in zip(out, caps)) if fill else 0
        while excess > 0:  # water-filling: what a layer wins past its cap goes to the others, by score
            out = [min(x, c) for x, c in zip(out, caps)]
            room = [i for i in range(num_layers) if out[i] < caps[i]]
            if not room:
                break
            weight = sum(float(share[i]) for i in room)
            frac = {i: float(share[i]) / weight if weight > 0 else 1 / len(room) for i in room}
            give = {i: int(excess * frac[i]) for i in room}
            order = sorted(room, key=lambda i: -frac[i])
            for j in range(excess - sum(give.values())):  # the remainder: the best-scored layers first
                give[order[j % len(order)]] += 1
            for i in room:
                out[i] += give[i]
            excess = sum(max(0, x - c) for x, c in zip(out, caps))
        return [min(x, c) for x, c in zip(out, caps)]


def context_scores(col: torch.Tensor, n: int, new: int) -> torch.Tensor:
    """(b, h, n): a piece's column over [the context's cached keys, the piece's own ``new``] as
    scores of the n context positions. A sliding layer's cache holds the last W - 1 only; the
    earlier ones were out of every reconstruction query's window, where attention gives 0. (``new``
    0: every column is a context key's, the last of the n.)"""
    held = col[..., : col.shape[-1] - new]
    return F.pad(held, (n - held.shape[-1], 0)) if held.shape[-1] < n else held


def max_pool(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``scores`` (..., n) -> the max over each position's k nearest, k odd (see KVzip's ``pool``)."""
    if k == 1:
        return scores
    x = scores.float().reshape(-1, 1, scores.shape[-1])
    return F.max_pool1d(x, k, stride=1, padding=k // 2).reshape(scores.shape).to(scores.dtype)


@register("kvzip-pool")
@dataclass
class KVzipPooled(KVzip):
    """KVzip with its budget pooled over the KV heads of a layer and over the layers (see KVzip)."""

    adaptive: bool = True
    layers: bool = True
    name = "kvzip-pool"


@register("kvzip-span")
@dataclass
class KVzipSpan(KVzipPooled):
    """``kvzip-pool`` with each key ranked by the best score among its 15 nearest positions (see
    KVzip's ``pool``): spans around the sharpest keys kept whole, for several needles at once."""

    pool: int = 15
    name = "kvzip-span"
