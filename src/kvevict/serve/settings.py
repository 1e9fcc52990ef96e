"""Server-wide settings: the defaults a request falls back on, and the batching limits."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Settings:
    model_id: str  # the name /v1/models lists and requests must ask for
    policy: str = "h2o"  # default kv_policy ("full" = no eviction)
    budget: int | float = 0.2  # default kv_budget: int tokens per layer & KV head, or fraction of the prompt
    recent: int | None = None  # default recent window (None: the policy's default)
    max_tokens: int = 128  # when a request gives no max_tokens
    max_tokens_limit: int = 4096  # the most a request may ask for
    max_batch: int = 8  # sequences decoded together
    batch_wait_s: float = 0.01  # how long the scheduler waits for more requests before a batch starts
    # A float budget resolves to a token count per prompt, and only equal counts share a batch;
    # rounding the count up to a multiple of budget_round lets prompts of similar length batch.
    budget_round: int = 1
