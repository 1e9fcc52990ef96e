from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import Candidates, Policy
from .registry import register


@register("oracle")
@dataclass
class Oracle(Policy):
    """An offline upper bound that knows the future: Belady's rule for a KV cache. One full-cache
    pass over the whole sequence records the attention every key receives from every later
    query; when evicting at time T the oracle keeps the keys the future will attend most,

        score_T(i) = sum_{t > T} a_t(i)    (from the full-cache run, in blocks of ``block`` queries)

    No policy can know more, so its quality bounds what any eviction could reach at this budget.
    Build it with ``Oracle.record(model, input_ids)`` (the sequence the cache will then see:
    prompt plus continuation); ``kvevict generate --policy oracle`` does both passes for you.
    """

    future: list | None = field(default=None, repr=False)  # per layer: (b, hkv, n_blocks + 1, n) suffix sums
    block: int = 16
    recent: int | None = 0
    name = "oracle"

    def __post_init__(self):
        if self.future is None:
            raise ValueError(
                "the oracle needs the future: build it with "
                "kvevict.policies.oracle.Oracle.record(model, input_ids), or use "
                "kvevict.generate.generate(..., policy='oracle') which records it first."
            )

    @classmethod
    @torch.no_grad()
    def record(cls, model, input_ids, attention_mask=None, block: int = 16, **params) -> "Oracle":
        from ..record import record_attention_blocks

        if block < 1:
            raise ValueError(f"block must be >= 1 query, got {block}.")
        blocks = record_attention_blocks(model, input_ids, block, attention_mask)
        if attention_mask is not None:  # keys indexed by real position, as the cache's slots are
            order = torch.argsort(attention_mask.to(torch.int8), dim=1, stable=True, descending=True)
            idx = order.view(order.shape[0], 1, 1, -1)
            blocks = [b.gather(-1, idx.expand(-1, b.shape[1], b.shape[2], -1)) for b in blocks]
        # suffix sums over blocks, with a zero row past the end: future[:, :, k] = sum of blocks >= k
        future = [torch.nn.functional.pad(b.flip(2).cumsum(2).flip(2), (0, 0, 0, 1)) for b in blocks]
        return cls(future=future, block=block, **params)

    def score(self, c: Candidates):
        assert self.future is not None  # __post_init__ refuses an oracle without one
        fut = self.future[c.layer_idx].to(c.pos.device)
        b, h, nb, n = fut.shape
        if c.pos.shape[0] != b:
            raise ValueError(f"the oracle was recorded for batch size {b}, the cache runs {c.pos.shape[0]}.")
        nxt = ((c.newest + 1) // self.block).clamp(max=nb - 1)  # first block of queries after T
        rows = fut.gather(2, nxt.view(b, 1, 1, 1).expand(b, h, 1, n)).squeeze(2)  # (b, h, n)
        beyond = c.pos >= n  # tokens past the recorded sequence have no known future
        return c.lookup(rows).masked_fill(beyond, 0.0)
