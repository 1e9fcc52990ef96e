"""Server-wide settings: the defaults a request falls back on, and the limits of batching and memory."""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass
class Settings:
    model_id: str  # the name /v1/models lists and requests must ask for
    policy: str = "h2o"  # default kv_policy ("full" = no eviction)
    # default kv_budget: int tokens per layer & KV head, a fraction of the prompt, or None = the
    # server's per-sequence share of kv_memory (kv_memory / max_batch), so that a sequence is evicted
    # only when it outgrows the memory the server gives it; short chats are kept whole
    budget: int | float | None = None
    recent: int | None = None  # default recent window (None: the policy's default)
    max_tokens: int = 128  # when a request gives no max_tokens
    max_tokens_limit: int = 4096  # the most a request may ask for
    max_batch: int = 16  # sequences decoded together
    kv_memory: int = 2 * GiB  # K/V bytes the server may hold at once; requests that do not fit wait
    min_budget: int = 64  # a fractional budget keeps at least this many tokens (never a handful)
    # A float budget resolves to a token count per prompt; rounding it up to a multiple of
    # budget_round gives prompts of similar length one budget (rows of any budgets share a batch,
    # but each layer is as wide as the batch's largest: equal budgets waste no slots).
    budget_round: int = 1
