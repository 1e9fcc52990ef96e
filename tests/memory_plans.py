"""``kvevict.memory.plan_memory`` with the slot's shape and the way to spend given as keywords,
so a test reads as the arithmetic it checks: ``plan(0.2, 64, 64, 4, 2, floor=1, kind="int8")``."""

from dataclasses import fields

from kvevict.memory import Plan, SlotShape, Spending, plan_memory

_SPENDING = {f.name for f in fields(Spending)}


def plan(memory, head_dim_k: int, head_dim_v: int, dtype_bytes: int, stats_bytes: int, **keywords) -> Plan:
    spend = {k: keywords.pop(k) for k in list(keywords) if k in _SPENDING}
    keywords["windows"] = tuple(keywords.get("windows") or ())
    shape = SlotShape(head_dim_k, head_dim_v, dtype_bytes, stats_bytes, **keywords)
    return plan_memory(memory, shape, Spending(**spend))
