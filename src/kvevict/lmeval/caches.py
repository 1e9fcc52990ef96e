"""A fresh cache per batch of lm-eval requests, and the bytes it held."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import DynamicCache

from ..cache import make_cache
from ..generate import dynamic_kv_bytes
from ..policies import policy_class

# make_cache arguments that describe the storage, not the policy (kept apart from a recorded policy)
_STORAGE = ("memory", "kv_bits", "evicted_bits", "compact", "group", "evicted_budget", "slack")


def needs_prompt(policy: str) -> bool:
    """Whether the policy scores the prompt in a pass of its own before the cache exists (kvzip)."""
    found = policy_class(policy) if policy != "full" else None
    return found is not None and found[0].needs_prompt


def new_cache(model, tokenizer, settings, kind: str, prompt=None):
    """The stock DynamicCache for ``policy=full`` (SDPA attention), else ``make_cache`` with the
    settings and the policy requests of type ``kind`` run (``Settings.policy_for``). A policy that
    scores its prompt first (kvzip, kvzip-pool) is recorded on ``prompt`` (1, p), unpadded, as
    ``kvevict.generate`` does before decoding."""
    if settings.policy == "full":
        model.set_attn_implementation("sdpa")
        return DynamicCache(config=model.config)
    params = settings.cache_params()
    policy = settings.policy_for(kind, model)
    if needs_prompt(policy):
        if prompt is None or prompt.shape[0] != 1:
            raise ValueError(f"{policy} records one unpadded prompt per cache; run it with batch_size=1.")
        storage = {k: params.pop(k) for k in _STORAGE if k in params}
        cls, implied = policy_class(policy)
        policy = cls.record(model, tokenizer, prompt, **{**implied, **params})
        params = storage
    return make_cache(model, policy, settings.budget, **params)


def held_bytes(cache) -> tuple[int, int]:
    """(bytes the cache holds, bytes a full cache of the model's dtype would hold for the same tokens)."""
    if isinstance(cache, DynamicCache):
        n = dynamic_kv_bytes(cache)
        return n, n
    return cache.kv_bytes(), cache.full_kv_bytes()


@dataclass
class ByteLog:
    """Per request (per window for ``loglikelihood_rolling``): its share of its batch's cache (the
    batch's bytes over its rows, left padding included), taken when the batch's last token has gone
    through the cache."""

    kv: dict = field(default_factory=dict)  # request type -> [bytes per request]
    full: dict = field(default_factory=dict)

    def add(self, kind: str, cache, rows: int) -> None:
        kv, full = held_bytes(cache)
        self.kv.setdefault(kind, []).extend([kv / rows] * rows)
        self.full.setdefault(kind, []).extend([full / rows] * rows)

    def summary(self) -> dict:
        out = {}
        for kind, kv in self.kv.items():
            full = self.full[kind]
            out[kind] = {
                "requests": len(kv),
                "kv_bytes_mean": sum(kv) / len(kv),
                "kv_bytes_max": max(kv),
                "full_kv_bytes_mean": sum(full) / len(full),
                "full_kv_bytes_max": max(full),
                "kv_share": sum(kv) / sum(full) if sum(full) else None,
            }
        return out
