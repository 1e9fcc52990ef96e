"""Where one decode step goes: model matmuls / attention / score bookkeeping / eviction.

Two views of the same configurations:
- wall-clock shares from exclusive timers around kvevict's code paths (and, for the stock cache,
  around transformers' SDPA call and DynamicCache.update, i.e. its torch.cat growth); whatever is
  not inside them is the model's own work (linear layers, norms, RoPE, Python dispatch);
- operator hot spots from torch.profiler: each top-level aten op charged to the innermost kvevict
  function that called it, as a share of all op time in the step (names the line to fix).
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict

import torch

from .caches import STOCK, CacheSpec, expand, use_attention
from .timers import ExclusiveTimers

# timer label -> category of the breakdown's table
CATEGORIES = {
    "attention": "attention",
    "cache write": "cache write / growth",
    "score bookkeeping": "score bookkeeping",
    "eviction": "eviction",
}
MODEL = "model (matmuls, norms, RoPE, dispatch)"


def instrument(timers: ExclusiveTimers) -> None:
    """Wrap every code path we know of; a renamed one is listed in ``timers.missing``."""
    from transformers import AttentionInterface
    from transformers.cache_utils import DynamicLayer

    from kvevict import POLICIES, attention, cache, stats, tier, turnover
    from kvevict.policies import Policy

    mapping = AttentionInterface._global_mapping
    timers.wrap_mapping(mapping, attention.ATTN_NAME, "attention", "attention.kvevict_attention")
    timers.wrap_mapping(mapping, "sdpa", "attention", "transformers sdpa_attention_forward")
    timers.wrap(DynamicLayer, "update", "cache write", "DynamicLayer.update (torch.cat)")
    timers.wrap(attention, "attend", "attention", "attention.attend")
    timers.wrap(stats.Collection, "add", "score bookkeeping", "stats.Collection.add")
    for fn in ("_chunk_mask", "_hidden", "_seen"):  # mask helpers (names vary across versions)
        if hasattr(attention, fn):
            timers.wrap(attention, fn, "attention", f"attention.{fn}")
    for fn, label in (("update", "cache write"), ("segments", "attention"), ("absorb", "score bookkeeping")):
        timers.wrap(cache.EvictingLayer, fn, label, f"cache.EvictingLayer.{fn}")
    for fn, label in (
        ("_replace_one", "eviction"),
        ("_replace_many", "eviction"),
        ("candidates", "eviction"),
        ("write", "cache write"),
    ):
        timers.wrap(tier.Tier, fn, label, f"tier.Tier.{fn}")
    timers.wrap(turnover.Turnover, "step", "eviction", "turnover.Turnover.step")
    for cls in {Policy, *POLICIES.values()}:
        for fn in ("priority", "score", "protected"):
            if fn in cls.__dict__:
                timers.wrap(cls, fn, "eviction", f"policies.{cls.__name__}.{fn}")


@torch.no_grad()
def wall_breakdown(model, spec: CacheSpec, base, batch: int, steps: int) -> dict:
    """Mean seconds per decode step, total and per category, over ``steps`` timed steps."""
    use_attention(model, spec)
    cache = expand(base, batch)
    ids = torch.ones(batch, 1, dtype=torch.long)
    gc.collect()
    with ExclusiveTimers() as timers:
        instrument(timers)
        model(ids, cache=cache, use_cache=True)  # warm-up
        timers.reset()
        t0 = time.perf_counter()
        for _ in range(steps):
            model(ids, cache=cache, use_cache=True)
        total = (time.perf_counter() - t0) / steps
        per_label = {k: v / steps for k, v in timers.seconds.items()}
        wrapped, missing = list(timers.wrapped), list(timers.missing)
    del cache
    parts = defaultdict(float)
    for label, s in per_label.items():
        parts[CATEGORIES.get(label, label)] += s
    parts[MODEL] = max(0.0, total - sum(parts.values()))
    return {
        "cache": spec.label,
        "batch": batch,
        "step_s": total,
        "parts_s": dict(parts),
        "shares": {k: v / total for k, v in parts.items()},
        "wrapped": wrapped,
        "not_found": missing,
    }


@torch.no_grad()
def op_hotspots(model, spec: CacheSpec, base, batch: int, steps: int = 2, top: int = 15) -> dict:
    """Top (kvevict function -> aten op) pairs by CPU time over ``steps`` profiled decode steps."""
    from torch.profiler import ProfilerActivity, profile

    use_attention(model, spec)
    cache = expand(base, batch)
    ids = torch.ones(batch, 1, dtype=torch.long)
    model(ids, cache=cache, use_cache=True)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(steps):
            model(ids, cache=cache, use_cache=True)
    del cache
    charged: dict[str, float] = defaultdict(float)
    total = 0.0
    for ev in prof.events():
        parent = ev.cpu_parent
        if not ev.name.startswith("aten::") or (parent is not None and parent.name.startswith("aten::")):
            continue  # only top-level ops: their time includes the ops they call
        total += ev.cpu_time_total
        charged[f"{_owner(ev)} -> {ev.name}"] += ev.cpu_time_total
    rows = sorted(charged.items(), key=lambda kv: -kv[1])[:top]
    return {
        "cache": spec.label,
        "batch": batch,
        "op_us_per_step": total / steps,
        "top": [{"where": k, "us_per_step": v / steps, "share": v / total if total else 0.0} for k, v in rows],
    }


def _owner(ev) -> str:
    """The innermost kvevict library frame above an op, else the innermost model (non-torch) frame."""
    node, fallback = ev.cpu_parent, None
    while node is not None:
        name = node.name
        if "kvevict/" in name and not any(x in name for x in ("/benchmarks/", "/commands/", "cli.py")):
            return name.split("kvevict/", 1)[1]
        if fallback is None and ".py(" in name and "torch/" not in name:
            fallback = name.rsplit("/", 1)[-1]
        node = node.cpu_parent
    return fallback or "model"


def run_breakdown(model, bases, context: int, batch: int, specs: list[CacheSpec], steps: int, log=print) -> dict:
    walls, spots = [], []
    for spec in specs:
        base = bases.get(spec, context)
        walls.append(wall_breakdown(model, spec, base, batch, steps))
        log(
            f"  breakdown {spec.label:>16}: {walls[-1]['step_s'] * 1e3:7.1f} ms/step  "
            + ", ".join(f"{k.split(' ')[0]} {v:.0%}" for k, v in walls[-1]["shares"].items())
        )
        if spec.kind != STOCK:
            spots.append(op_hotspots(model, spec, base, batch))
    return {"context": context, "batch": batch, "wall": walls, "hotspots": spots}
