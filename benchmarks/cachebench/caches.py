"""The caches a decode measurement starts from, pre-filled once at batch 1 and copied per run.

Decode cost does not depend on what the tokens say, only on how many keys each step reads and on
the cache's own work, so the prompts are synthetic token ids and the fills are built as cheaply as
possible while leaving every cache in exactly the state it has when decoding at context C:

- ``stock``: transformers' DynamicCache with SDPA, filled with C random keys/values per layer
  through its public ``update`` (what a C-token prefill would leave; no model pass needed).
- ``kvevict-full``: kvevict with an int budget above C + the decode steps, pre-filled with a real
  C-token forward pass (so its score statistics are real): kvevict's overhead with no eviction.
- ``<policy>@<fraction>``: kvevict under budget B = ceil(fraction x C), pre-filled with a real
  B-token forward pass. The cache is then full, so every decode step scores, picks a victim and
  overwrites its slot, exactly as after a C-token prompt: a step's work depends on B, not on how
  many tokens were evicted before (this saves ~30 s of 8K prefill per policy and budget).
- ``memory=<fraction>``: ``make_cache(model, memory=fraction)``, pre-filled with a real C-token
  forward pass (its plan depends on the prompt length and may keep every token in two tiers).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from kvevict.spec import FULL
from kvevict.spec import CacheSpec as Spec
from kvevict.storage import Storage

STOCK = "stock"
NO_EVICTION = "kvevict-full"
MEMORY = "memory"


@dataclass(frozen=True)
class CacheSpec:
    """One cache configuration: ``stock``, ``kvevict-full`` or a policy at a budget fraction."""

    kind: str
    budget: float | None = None

    @property
    def label(self) -> str:
        if self.kind == MEMORY:
            return f"memory={self.budget:g}"
        return self.kind if self.budget is None else f"{self.kind}@{self.budget:g}"

    @classmethod
    def parse(cls, label: str) -> "CacheSpec":
        """A benchmark's cache from its spec (``kvevict.spec``'s grammar, which reads the benchmark's
        own names too): 'stock' (= full), 'kvevict-full/int8' (= full/int8), 'h2o/int4@0.2', 'memory=0.1'."""
        spec = Spec.parse(label)
        if spec.is_stock:
            return cls(STOCK)
        if spec.policy == FULL:
            bits = "" if spec.storage == Storage() else "/" + spec.storage.label
            return cls(NO_EVICTION + bits)
        if spec.memory and spec.policy is None and isinstance(spec.budget, float):
            return cls(MEMORY, spec.budget)
        if spec.memory or spec.question or not isinstance(spec.budget, float):
            raise ValueError(
                f"cannot read the cache {label!r} as a benchmark's: write stock, kvevict-full[/STORAGE], "
                "POLICY[/STORAGE]@FRACTION (h2o/int4@0.2) or memory=FRACTION."
            )
        kind = spec.policy + ("" if spec.storage is None else "/" + (spec.storage.label or "fp"))
        return cls(kind, spec.budget)

    def storage(self) -> tuple[str, Storage]:
        """The policy (or ``kvevict-full``) and the storage this cache names."""
        spec = Spec.parse(self.kind)
        if spec.policy == FULL:
            return NO_EVICTION, spec.storage or Storage()
        return spec.policy, spec.storage or Storage()

    @property
    def is_policy(self) -> bool:
        return self.budget is not None

    def kept_tokens(self, context: int) -> int:
        """Tokens held per (sequence, KV head) while decoding at ``context``."""
        from kvevict.budget import resolve_budget

        if self.budget is None or self.kind == MEMORY:  # a memory plan keeps every token or says so itself
            return context
        return resolve_budget(float(self.budget), context)


def available_policies(requested: list[str]) -> tuple[list[str], list[str]]:
    """The requested policies that exist in ``kvevict.POLICIES`` now, and a note per missing one."""
    from kvevict import POLICIES

    have, notes = [], []
    for name in requested:
        try:
            known = Spec.parse(name).policy in POLICIES  # a policy, maybe with its storage: h2o/int4
        except ValueError:
            known = False
        if known:
            have.append(name.lower())
        else:
            notes.append(f"policy {name!r} is not in kvevict.POLICIES yet ({', '.join(sorted(POLICIES))}); skipped.")
    return have, notes


def specs_for(policies: list[str], budgets: list[float]) -> list[CacheSpec]:
    return [CacheSpec(STOCK), CacheSpec(NO_EVICTION)] + [CacheSpec(p, b) for p in policies for b in budgets]


def use_attention(model, spec: CacheSpec) -> None:
    """Route the model's attention for this cache: SDPA for the stock cache, kvevict otherwise."""
    from kvevict.attention import ATTN_NAME

    model.set_attn_implementation("sdpa" if spec.kind == STOCK else ATTN_NAME)  # "kvevict-full/int4" too


@torch.no_grad()
def prefill(model, spec: CacheSpec, context: int, decode_tokens: int, seed: int = 0):
    """A batch-1 cache in the state it has when decoding starts at ``context`` (see module doc)."""
    from transformers import DynamicCache

    from kvevict.cache import make_cache

    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    if spec.kind == STOCK:
        use_attention(model, spec)
        cache = DynamicCache(config=cfg)
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(model.parameters()).dtype
        for i in range(cfg.num_hidden_layers):
            k, v = (torch.randn(1, heads, context, head_dim, generator=gen, dtype=dtype) for _ in range(2))
            cache.update(k, v, i)
        return cache
    if spec.kind == MEMORY:
        cache = make_cache(model, memory=spec.budget)
        ids = torch.randint(0, cfg.vocab_size, (1, context), generator=gen)
        model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        return cache
    name, storage = spec.storage()  # "h2o/int4": the policy over 4-bit storage
    kw = {"kv_bits": storage.kv_bits, "evicted_bits": storage.evicted_bits}
    if name == NO_EVICTION:
        cache, n = make_cache(model, "h2o", context + decode_tokens + 1, **kw), context
    else:
        kept = n = spec.kept_tokens(context)
        if storage.evicted_bits is not None:  # mixed: the rest of the context fills the low-bit tier,
            kw["evicted_budget"] = max(1, context - kept)  # so the prompt really goes through
            n = context
        cache = make_cache(model, name, kept, **kw)
    ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen)
    model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def expand(cache, batch: int):
    """An independent copy of a batch-1 cache holding ``batch`` identical sequences."""
    out = copy.deepcopy(cache)
    if batch > 1:
        out.batch_repeat_interleave(batch)
    return out


def read_bytes(cache) -> int:
    """Bytes of K/V (and the bookkeeping kvevict keeps beside them) a decode step reads: the stock
    cache's keys and values, or kvevict's ``kv_bytes()``."""
    if hasattr(cache, "kv_bytes"):
        return cache.kv_bytes()
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


def state_bytes(cache) -> int:
    """Bytes of every tensor the cache's layers hold (keys, values and any bookkeeping: positions,
    validity, score statistics), each storage counted once."""
    seen: dict[int, int] = {}

    def visit(obj):
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v)
        elif type(obj).__module__ in ("kvevict.tier", "kvevict.storage.rect", "kvevict.storage.paged"):  # tiers, stores
            visit(list(vars(obj).values()))

    for layer in cache.layers:
        visit(list(vars(layer).values()))
    return sum(seen.values())
