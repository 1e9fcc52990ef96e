"""Budgets in bytes: say how much memory the cache may hold, get tokens kept x bits per token.

``make_cache(model, memory=0.2)`` uses it. A memory budget is a fraction of what the full cache (the model's dtype) would hold for the
prompt (``0.2``, ``"20%"``), or bytes per sequence (``"64MiB"``, ``2**26``). ``plan`` turns it into
a storage and a token budget by the rule measured on SmolLM2 (docs/quality-per-byte.md):

  - from ~30% of the full bytes, every token at int8 (+0.0002 nats per token: lossless);
  - from ~17.4% (what int4 for every token costs) to 30%, every token still kept, in two tiers:
    the share f the policy ranks highest (H2O: heavy hitters + the recent window) at int8, the rest
    demoted to int4 (mixed precision, MiKV), f chosen so the two tiers fill the memory. At 20% this
    costs +0.002 nats per token, a fifth of int4 for every token and a seventh of plain H2O;
  - below 17.4%, evict with the policy and keep int4 for the tokens kept: at the same bytes this
    costs a third of plain H2O's NLL at 10% and a quarter at 5%. 2-bit storage (for every token,
    or for the demoted ones) costs +1 to +3 nats per token, or more than evicting: never chosen.

Per slot and KV head: ``Storage.slot_bytes`` (codes, fp16 zero and step per group, int32 position,
bool validity, the policy's fp32 statistics).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .storage import DEFAULT_GROUP, Storage

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(memory) -> float | int:
    """0.2 or '20%' -> 0.2 (fraction of the full cache's bytes); '64MiB' or 67108864 -> bytes (int)."""
    if isinstance(memory, bool):
        raise ValueError(f"memory must be a fraction in (0, 1], a percentage or a size such as '64MiB', got {memory!r}.")
    if isinstance(memory, str):
        text = memory.strip().lower().replace(" ", "")
        if text.endswith("%"):
            try:
                memory = float(text[:-1]) / 100
            except ValueError:
                memory = None
        else:
            m = re.fullmatch(r"([0-9]*\.?[0-9]+)([a-z]*)", text)
            if m and m.group(2) in _UNITS:
                value = float(m.group(1))
                memory = value if (not m.group(2) and value <= 1 and "." in text) else int(value * _UNITS[m.group(2)])
            else:
                memory = None
        if memory is None:
            raise ValueError(f"cannot read the memory budget {text!r}: write a fraction (0.2), a percentage (20%) "
                             "or a size (64MiB, 2GiB).")
    if isinstance(memory, float):
        if not 0.0 < memory <= 1.0:
            raise ValueError(f"a fractional memory budget is a share of the full cache's bytes, in (0, 1]; got {memory}.")
        return memory
    if isinstance(memory, int) and memory > 0:
        return memory
    raise ValueError(f"memory must be a fraction in (0, 1], a percentage or a size such as '64MiB', got {memory!r}.")


@dataclass(frozen=True)
class Plan:
    budget: float | int  # tokens kept at kv_bits: a fraction of the prompt, or tokens
    storage: Storage


def plan(memory, head_dim_k: int, head_dim_v: int, dtype_bytes: int, n_stats: int, layers_heads: int = 1,
         group: int = DEFAULT_GROUP, slot_extra: int = 0) -> Plan:
    """The storage and token budget for ``memory`` (see the module's rule). ``layers_heads``: layers x
    KV heads, to turn bytes per sequence into slots per (layer, KV head); ``slot_extra``: bytes a slot
    carries besides ``Storage.slot_bytes`` (Ada-KV's 1-byte head id)."""
    memory = parse_memory(memory)
    full = (head_dim_k + head_dim_v) * dtype_bytes  # one token of the full cache, per KV head

    def slot(bits) -> float:
        return Storage(kv_bits=bits, group=group).slot_bytes(head_dim_k, head_dim_v, dtype_bytes, n_stats) + slot_extra

    if isinstance(memory, int):  # bytes per sequence: as many int4 tokens as fit
        tokens = int(memory // (layers_heads * slot(4)))
        if tokens < 1:
            raise ValueError(f"{memory} bytes hold less than one 4-bit token per layer and KV head "
                             f"({layers_heads * slot(4):.0f} bytes); give more memory.")
        return Plan(tokens, Storage(kv_bits=4, group=group))
    ratio = {bits: slot(bits) / full for bits in (8, 4)}
    if memory >= ratio[8]:
        return Plan(min(1.0, memory / ratio[8]), Storage(kv_bits=8, group=group))
    if memory >= ratio[4]:
        # every token: the policy's top f at int8, the rest demoted to int4; f r8 + (1 - f) r4 = memory
        f = (memory - ratio[4]) / (ratio[8] - ratio[4])
        if f * 1000 < 1:
            return Plan(1.0, Storage(kv_bits=4, group=group))
        return Plan(f, Storage(kv_bits=8, group=group, evicted_bits=4, evicted_budget=1.0 - f))
    return Plan(memory / ratio[4], Storage(kv_bits=4, group=group))


def plan_for_model(model, memory, policy, group: int = DEFAULT_GROUP) -> Plan:
    """``plan`` with the model's shape: head dimension, dtype, layers x KV heads, the policy's statistics."""
    from .cache import _head_dim

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    d = _head_dim(model)
    if d is None:
        raise ValueError(f"cannot find the head dimension of {type(model).__name__} to plan a memory budget.")
    layers_heads = config.num_hidden_layers * (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_id = 1 if getattr(policy, "adaptive", False) else 0  # a pooled slot says whose head it is (Tier.head)
    return plan(memory, d, d, model.dtype.itemsize, len(policy.stats), layers_heads, group, head_id)
