"""How many K/V bytes a request may hold, for admission: a request is admitted when the bytes of
every running batch, with it added, stay within ``Settings.kv_memory``; otherwise it waits.

Bytes per token are measured, not derived from a formula: one token through the model into a
``DynamicCache`` gives each layer's K + V bytes for this model, dtype and attention layout.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..cache import layer_budgets
from ..policies import make_policy


def layer_token_bytes(model) -> tuple[list[int], int]:
    """K + V bytes one token of one sequence takes in each decoder layer, and how many cache entries
    (layers x KV heads) it takes."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.zeros(1, 1, dtype=torch.long), past_key_values=cache, use_cache=True, logits_to_keep=1)
    layers = [layer for layer in cache.layers if layer.is_initialized]
    return [layer.keys.nbytes + layer.values.nbytes for layer in layers], sum(layer.keys.shape[1] for layer in layers)


class Budgeter:
    """Bytes per request and per batch, from the measured bytes per token of each layer."""

    def __init__(self, model):
        self.per_layer, self.entries_per_token = layer_token_bytes(model)
        self.token_bytes = sum(self.per_layer)  # one token of one sequence, every layer

    def row_bytes(self, policy: str, budget_tokens: int | None, recent: int | None, length: int) -> int:
        """The most bytes one sequence's storage holds: a full cache grows to ``length`` (prompt +
        max_tokens); a budgeted one is preallocated at its per-layer budgets (PyramidKV: a schedule)."""
        if policy == "full":
            return length * self.token_bytes
        pol = make_policy(policy, **({} if recent is None else {"recent": recent}))
        budgets = layer_budgets(pol, budget_tokens, len(self.per_layer))
        return sum(b * t for b, t in zip(budgets, self.per_layer))

    def batch_bytes(self, rows: list[int]) -> int:
        """The most a batch of rows sharing one cache can hold: every row at the widest row's
        storage (a full cache's rows are left-padded to the longest; budgeted rows share a budget)."""
        return len(rows) * max(rows, default=0)
