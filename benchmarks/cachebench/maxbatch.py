"""The paper's throughput mechanism: under a fixed KV memory budget a budgeted cache fits more
sequences, so one decode step serves more of them (H2O, Zhang et al. 2023, sec. 5.2)."""

from __future__ import annotations

from .caches import STOCK, CacheSpec, state_bytes
from .decode import BaseCaches, run_interleaved
from .memory_math import max_batch, model_kv_bytes_per_token
from .stats import summary


def per_sequence_bytes(bases: BaseCaches, spec: CacheSpec, context: int, decode_tokens: int) -> int:
    """Cache state one sequence needs until the end of the timed steps: the stock cache grows by
    one token per step; kvevict's budgeted storage is already full at its budget after the fill,
    and without eviction it grows a page at a time (counted here as a token at a time, + 1 page)."""
    held = state_bytes(bases.get(spec, context))
    if spec.kind == STOCK:
        held += decode_tokens * model_kv_bytes_per_token(bases.model.config)
    elif not spec.is_policy:
        from kvevict.storage import PAGE

        held += (decode_tokens + PAGE) * model_kv_bytes_per_token(bases.model.config)
    return held


def run_maxbatch(
    model,
    bases: BaseCaches,
    context: int,
    specs: list[CacheSpec],
    memory_bytes: int,
    repeats: int,
    steps: int,
    log=print,
) -> dict:
    sizes, notes = {}, []
    for spec in specs:
        per_seq = per_sequence_bytes(bases, spec, context, 1 + steps)
        sizes[spec] = (per_seq, max_batch(memory_bytes, per_seq))
        if sizes[spec][1] == 0:
            notes.append(f"{spec.label}: one sequence ({per_seq} B) does not fit in {memory_bytes} B; skipped.")
        else:
            log(f"  {spec.label:>16}: {per_seq / 2**20:8.1f} MiB per sequence -> batch {sizes[spec][1]}")
    points = [(context, b, spec) for spec, (_, b) in sizes.items() if b > 0]
    records = run_interleaved(model, bases, points, repeats, steps, log=log)
    by_label = {r["cache"]: r for r in records}
    stock = by_label.get(STOCK)
    for spec, (per_seq, b) in sizes.items():
        r = by_label.get(spec.label)
        if r is None:
            continue
        r["bytes_per_sequence"] = per_seq
        if stock is not None:
            # (b / step) / (b_stock / step_stock), round by round
            ratios = [
                (b / x) / (stock["batch"] / s) for s, x in zip(stock["round_median_step_s"], r["round_median_step_s"])
            ]
            r["throughput_vs_stock"] = summary(ratios)
    return {"context": context, "memory_bytes": memory_bytes, "records": records, "notes": notes}
