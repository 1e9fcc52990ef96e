"""One decode batch: left-padded prompts sharing one cache, stepped one token at a time.

Left padding + the 2-D attention mask + per-sequence positions make each sequence's tokens equal
to what it gets alone (kvevict's padding-aware cache never keeps a pad over a real token, see
tests/test_core.py). Finished or abandoned sequences are dropped from the cache's batch dimension
(``batch_select_indices``), which copies the kept rows into new storage and frees the old.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..cache import EvictingCache, make_cache
from ..generate import dynamic_kv_bytes


class DecodeBatch:
    def __init__(self, model, prompts: list[list[int]], policy: str, budget_tokens: int | None,
                 recent: int | None, pad_id: int):
        self.model = model
        b, width = len(prompts), max(len(p) for p in prompts)
        self.ids = torch.full((b, width), pad_id, dtype=torch.long)
        self.mask = torch.zeros((b, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            self.ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            self.mask[i, width - len(p):] = 1
        if policy == "full":
            # kvevict attention is exact with a DynamicCache, so the model keeps one implementation
            self.cache = DynamicCache(config=model.config)
        else:
            self.cache = make_cache(model, policy, budget_tokens, recent=recent)
        self.next_pos = None

    @property
    def size(self) -> int:
        return self.mask.shape[0]

    def prefill(self) -> torch.Tensor:
        """Run the prompts; return the last logits (batch, vocab)."""
        pos = (self.mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(self.ids, attention_mask=self.mask, position_ids=pos, past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1)
        self.next_pos = pos[:, -1] + 1
        self.ids = None
        return out.logits[:, -1]

    def step(self, tokens: list[int]) -> torch.Tensor:
        """Feed one token per sequence; return the next logits (batch, vocab)."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.size, 1)], dim=1)
        out = self.model(torch.tensor(tokens, dtype=torch.long)[:, None], attention_mask=self.mask,
                         position_ids=self.next_pos[:, None], past_key_values=self.cache, use_cache=True)
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1]

    def keep(self, rows: list[int]) -> None:
        """Drop every sequence not in ``rows`` (indices into the current batch), freeing its storage."""
        index = torch.tensor(rows, dtype=torch.long)
        self.cache.batch_select_indices(index)
        self.mask, self.next_pos = self.mask[index], self.next_pos[index]

    def kv_bytes(self) -> int:
        """Bytes of K/V storage the whole batch holds now."""
        if isinstance(self.cache, EvictingCache):
            return self.cache.kv_bytes()
        return dynamic_kv_bytes(self.cache)

    def token_bytes(self) -> int:
        """Bytes one token of one sequence takes in a full cache (all layers, K and V)."""
        total = 0
        for layer in self.cache.layers:
            if layer.is_initialized:
                k, v = layer.keys, layer.values
                total += k.shape[1] * (k.shape[-1] + v.shape[-1]) * k.element_size()
        return total

    def num_kv_entries_per_token(self) -> int:
        """Layers x KV heads: how many cache entries one token takes."""
        return sum(layer.keys.shape[1] for layer in self.cache.layers if layer.is_initialized)
