"""One cache per grid cell: the stock full cache (the reference) or an evicting one."""

from __future__ import annotations

from transformers import DynamicCache

from ..cache import make_cache

FULL = "full"


def new_cache(model, policy: str, budget, sequence=None):
    """``policy == "full"``: a DynamicCache (attention stays whatever it is: the kvevict attention
    is exact with it); otherwise ``make_cache(model, policy, budget)``. ``sequence`` (1, n): every
    token the cache will see, known in advance in teacher-forced scoring; the oracle is recorded on
    it (it cannot run without it)."""
    if policy == FULL:
        return DynamicCache(config=model.config)
    if policy == "oracle" and sequence is not None:
        from ..policies.oracle import Oracle

        return make_cache(model, Oracle.record(model, sequence), budget)
    return make_cache(model, policy, budget)


def policy_names(requested: str | list[str], known: dict) -> list[str]:
    """Policy names from ``"h2o,roco"`` or ``"all"`` (every registered policy, aliases once).
    Unknown names are a ValueError listing the known ones; 'full' is always run, never listed."""
    items = requested.split(",") if isinstance(requested, str) else list(requested)
    items = [p.strip().lower() for p in items if p.strip()]
    if items == ["all"]:
        seen, out = set(), []
        for name in sorted(known):
            cls = known[name]
            if cls in seen:
                continue
            seen.add(cls)
            out.append(getattr(cls, "name", name) if getattr(cls, "name", name) in known else name)
        return out
    bad = [p for p in items if p not in known and p != FULL]
    if bad:
        raise ValueError(f"unknown policy {', '.join(map(repr, bad))}; known policies: {', '.join(sorted(known))} "
                         "(or 'all'; the full cache is always included).")
    out = []
    for p in items:
        if p != FULL and p not in out:
            out.append(p)
    if not out:
        raise ValueError(f"give at least one policy; known policies: {', '.join(sorted(known))}.")
    return out
