"""Decode timing, interleaved: every round visits every (context, batch, cache) configuration once,
in a rotated order, so that a noisy minute on the shared machine hits all of them alike; ratios
are taken between configurations of the same round."""

from __future__ import annotations

import gc
import statistics
import time

import torch

from .caches import CacheSpec, expand, prefill, state_bytes, use_attention
from .machine import load_average
from .stats import summary


class BaseCaches:
    """Batch-1 pre-filled caches, built once per (cache, context) and copied for every run."""

    def __init__(self, model, decode_tokens: int, seed: int, log=print):
        self.model, self.decode_tokens, self.seed, self.log = model, decode_tokens, seed, log
        self._caches: dict[tuple[CacheSpec, int], object] = {}
        self.prefill_seconds: dict[str, float] = {}

    def get(self, spec: CacheSpec, context: int):
        key = (spec, context)
        if key not in self._caches:
            t0 = time.perf_counter()
            self._caches[key] = prefill(self.model, spec, context, self.decode_tokens, self.seed)
            dt = time.perf_counter() - t0
            self.prefill_seconds[f"{spec.label} ctx={context}"] = round(dt, 3)
            self.log(f"  filled {spec.label:>16} ctx={context:<6} in {dt:6.1f} s")
        return self._caches[key]


@torch.no_grad()
def time_decode(model, spec: CacheSpec, base, batch: int, steps: int, token: int = 1) -> tuple[list[float], int]:
    """Seconds of each of ``steps`` decode steps (after one untimed warm-up step) from a copy of
    ``base`` at ``batch``, and the bytes the cache held at the end."""
    use_attention(model, spec)
    cache = expand(base, batch)
    ids = torch.full((batch, 1), token, dtype=torch.long)
    gc.collect()
    model(ids, cache=cache, use_cache=True)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model(ids, cache=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
    held = state_bytes(cache)
    del cache
    gc.collect()
    return times, held


def run_interleaved(
    model, bases: BaseCaches, points: list[tuple[int, int, CacheSpec]], repeats: int, steps: int, log=print
) -> list[dict]:
    """Time every (context, batch, spec) point ``repeats`` times, round-robin, rotating the order
    inside each (context, batch) group every round. Returns one record per point."""
    groups: dict[tuple[int, int], list[CacheSpec]] = {}
    for c, b, spec in points:
        groups.setdefault((c, b), []).append(spec)
    for (c, _), specs in groups.items():  # fill every base cache before timing anything
        for spec in specs:
            bases.get(spec, c)
    rounds: dict[tuple[int, int, CacheSpec], list[list[float]]] = {p: [] for p in points}
    held: dict[tuple[int, int, CacheSpec], int] = {}
    for r in range(repeats):
        t_round = time.perf_counter()
        for (c, b), specs in groups.items():
            k = r % len(specs)
            for spec in specs[k:] + specs[:k]:
                times, held[(c, b, spec)] = time_decode(model, spec, bases.get(spec, c), b, steps)
                rounds[(c, b, spec)].append(times)
        log(f"  round {r + 1}/{repeats} done in {time.perf_counter() - t_round:.1f} s, load {load_average()}")
    out = []
    for (c, b, spec), per_round in rounds.items():
        medians = [statistics.median(t) for t in per_round]  # the mean of the two middle values when even
        every = [x for t in per_round for x in t]
        out.append(
            {
                "context": c,
                "batch": b,
                "cache": spec.label,
                "kind": spec.kind,
                "budget": spec.budget,
                "kept_tokens": spec.kept_tokens(c),
                "state_bytes": held[(c, b, spec)],
                "step_s": summary(every),
                "round_median_step_s": medians,
                "tokens_per_s": b / summary(every)["median"],
            }
        )
    return out


def add_ratios(records: list[dict], baseline: str = "stock") -> None:
    """Per record: speed-up over the baseline cache at the same (context, batch), as the median
    over rounds of the round-wise ratio (both timed in the same round) with its min and max."""
    base = {(r["context"], r["batch"]): r for r in records if r["cache"] == baseline}
    for r in records:
        ref = base.get((r["context"], r["batch"]))
        if ref is None:
            continue
        ratios = [rb / rr for rb, rr in zip(ref["round_median_step_s"], r["round_median_step_s"])]
        r[f"speedup_vs_{baseline}"] = summary(ratios)
