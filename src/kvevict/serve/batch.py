"""Rows sharing one cache, stepped one token at a time; rows join and leave between steps.

Rows are prefilled together when they share a policy and budget (``DecodeBatch.prefill_many``:
left-padded, the padding masked and never stored by an evicting cache), then join a running
batch (``join``; an EvictingCache takes rows of any policies and budgets, see ``kvevict.rows``): the shorter side's history is left-padded, and the 2-D attention mask
plus per-row positions keep each row equal to what it gets alone (kvevict's attention never lets a
pad take part, see tests/test_core.py). A row that ends leaves at once (``keep``): the cache's
``batch_select_indices`` copies the kept rows into new storage and frees the old, and padding
columns no remaining row needs are cut off.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..cache import EvictingCache, make_cache
from ..generate import dynamic_kv_bytes


class DecodeBatch:
    def __init__(self, model, cache, mask: torch.Tensor, next_pos: torch.Tensor):
        self.model, self.cache = model, cache
        self.mask = mask  # (rows, columns seen): 1 = a real token of that row
        self.next_pos = next_pos  # (rows,) the position of each row's next token

    @classmethod
    def prefill(
        cls,
        model,
        prompt: list[int],
        policy: str,
        budget_tokens: int | None,
        recent: int | None,
        kv_bits: int | None = None,
        pages=None,
    ):
        """One prompt into a fresh cache (a budgeted one stores ``kv_bits`` per channel, in pages of
        ``pages`` when given: ``kvevict.storage.Pools``); returns (batch of one row, its last logits (1, vocab))."""
        return cls.prefill_many(model, [prompt], policy, budget_tokens, recent, kv_bits, pages)

    @classmethod
    def prefill_many(
        cls,
        model,
        prompts: list[list[int]],
        policy: str,
        budget_tokens: int | None,
        recent: int | None,
        kv_bits: int | None = None,
        pages=None,
        all_logits: bool = False,
    ):
        """Prompts of one policy and budget into one fresh cache in one forward, left-padded to the
        longest (a short prompt's padding is masked, and an evicting cache stores none of it);
        returns (the batch of their rows, each row's last logits (rows, vocab)). One forward over
        many short prompts uses the CPU's matrix units far better than one per prompt. ``all_logits``:
        the logits at every position instead (rows, longest, vocab), for echo's prompt logprobs."""
        if policy == "full":
            # kvevict attention is exact with a DynamicCache, so the model keeps one implementation
            cache = DynamicCache(config=model.config)
        else:
            # one eviction a step: rows joined at other lengths evict apart, so a row's answer is
            # the one it gets alone with slack=1, whatever batch it is in
            cache = make_cache(model, policy, budget_tokens, recent=recent, kv_bits=kv_bits, pages=pages, slack=1)
        n = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (n - len(p)) + list(p) for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        kw = {}
        if not bool(mask.all()):  # positions count real tokens only, as generate's do
            kw = {"attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}
        out = model(ids, cache=cache, use_cache=True, logits_to_keep=0 if all_logits else 1, **kw)
        logits = out.logits if all_logits else out.logits[:, -1]
        return cls(model, cache, mask, torch.tensor([len(p) for p in prompts])), logits

    @classmethod
    def resume(cls, model, cache, length: int) -> "DecodeBatch":
        """One row over a copy of ``cache``, which holds a prompt's first ``length`` tokens (a
        stored prefix, ``prefix_store``): the copy's storage is its own, ``cache`` is not changed."""
        mask = torch.ones(1, length, dtype=torch.long)
        return cls(model, copy.deepcopy(cache), mask, torch.tensor([length]))

    def copy_cache(self):
        """A copy of this batch's cache that nothing done to the batch changes (paged storage: pages
        of its own in the same pools)."""
        return copy.deepcopy(self.cache)

    def extend(self, tokens: list[int]) -> torch.Tensor:
        """Feed one row more of its prompt in one forward (the rest after a stored prefix): its
        positions go on from the row's own, and an evicting cache keeps its budget by its policy
        over them as over any prompt chunk; return the last logits (1, vocab)."""
        if self.size != 1 or not tokens:
            raise ValueError("extend feeds one row at least one token.")
        n = len(tokens)
        self.mask = torch.cat([self.mask, self.mask.new_ones(1, n)], dim=1)
        out = self.model(
            torch.tensor([tokens], dtype=torch.long),
            attention_mask=self.mask,
            position_ids=self.next_pos[:, None] + torch.arange(n),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.next_pos = self.next_pos + n
        return out.logits[:, -1]

    @property
    def size(self) -> int:
        return self.mask.shape[0]

    def step(self, tokens: list[int]) -> torch.Tensor:
        """Feed one token per row; return the next logits (rows, vocab)."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.size, 1)], dim=1)
        out = self.model(
            torch.tensor(tokens, dtype=torch.long)[:, None],
            attention_mask=self.mask,
            position_ids=self.next_pos[:, None],
            cache=self.cache,
            use_cache=True,
        )
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1]

    def can_join(self, other: "DecodeBatch") -> bool:
        if isinstance(self.cache, DynamicCache) and isinstance(other.cache, DynamicCache):
            return True
        return (
            isinstance(self.cache, EvictingCache)
            and isinstance(other.cache, EvictingCache)
            and hasattr(self.cache, "append_rows")
            and self.cache.can_append(other.cache)
        )

    def join(self, other: "DecodeBatch") -> None:
        """Append ``other``'s rows after this batch's (``can_join`` must be true)."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        if isinstance(self.cache, DynamicCache):
            for mine, theirs in zip(self.cache.layers, other.cache.layers):
                mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
                mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)])
        else:
            self.cache.append_rows(other.cache)
        self.mask = torch.cat([_left_pad(self.mask, width, dim=1), _left_pad(other.mask, width, dim=1)])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])

    def keep(self, rows: list[int]) -> None:
        """Drop every row not in ``rows`` (indices into the current batch), freeing its storage."""
        index = torch.tensor(rows, dtype=torch.long)
        self.cache.batch_select_indices(index)
        self.mask, self.next_pos = self.mask[index], self.next_pos[index]
        # columns that are padding in every remaining row: nobody needs them any more
        cut = int(self.mask.any(0).long().argmax())
        if cut and isinstance(self.cache, DynamicCache):
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, cut:], layer.values[:, :, cut:]
            self.mask = self.mask[:, cut:]

    def kv_bytes(self) -> int:
        """Bytes of K/V storage the whole batch holds now."""
        return cache_bytes(self.cache)


def cache_bytes(cache) -> int:
    """Bytes of K/V storage a cache holds: an EvictingCache's ``kv_bytes``, a DynamicCache's tensors."""
    if isinstance(cache, EvictingCache):
        return cache.kv_bytes()
    return dynamic_kv_bytes(cache)


def _left_pad(t: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    short = width - t.shape[dim]
    if not short:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [short, 0]
    return F.pad(t, pad)
