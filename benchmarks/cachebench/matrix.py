"""The decode-step matrix (``python benchmarks/bench.py --sections matrix``): one decode step at each context x
batch x torch-thread count for the caches a user chooses between, each beside its bandwidth floor,
and the bytes each holds beside the stock cache's for a short chat and for the long prompts.

A decode step reads every weight once and every byte the cache holds once, so

    floor_s = (weight_bytes + batch x read_bytes_per_sequence) / copy_bandwidth(threads)

(H2O, Zhang et al. 2023, sec. 5; ``memory_math.floor_seconds``), with the copy
bandwidth measured in the same run at the same thread count. Timing is interleaved as in
``decode.py``: every round visits every point, the caches of a (threads, context, batch)
group in a rotated order, and ratios are taken within a round. Caches are filled once at batch 1
per context (``BaseCaches``) and copied to the batch.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from .caches import STOCK, CacheSpec, read_bytes, state_bytes
from .decode import time_decode
from .machine import load_average, measure_copy_bandwidth
from .memory_math import floor_seconds
from .stats import summary

CACHES = (
    "stock",
    "h2o@0.2",
    "h2o/fp16@0.2",
    "h2o/int8@0.2",
    "h2o/int4@0.2",
    "memory=0.2",
    "memory=0.1",
    "kvevict-full/fp16",
    "kvevict-full/int8",
    "kvevict-full/int4",
)
KERNEL_ENV = "KVEVICT_KERNEL"
# every-token storage pairs compared with llama.cpp's q8_0/f16 and q4_0/f16
PEER_PAIRS = {"q8_0": ("kvevict-full/int8", "kvevict-full/fp16"), "q4_0": ("kvevict-full/int4", "kvevict-full/fp16")}


def kernel_in_use() -> str:
    """What ran attention's inner loop: $KVEVICT_KERNEL when set (torch | cpu | auto), else the default."""
    return os.environ.get(KERNEL_ENV) or "default (KVEVICT_KERNEL not set)"


def parse_caches(labels: list[str]) -> list[CacheSpec]:
    specs = [CacheSpec.parse(x) for x in labels]
    if not any(s.kind == STOCK for s in specs):
        raise ValueError("--matrix-caches must include stock: every ratio is taken against it.")
    return specs


@torch.no_grad()
def chat_bytes(model, specs: list[CacheSpec], prompt: int = 50, new: int = 16, seed: int = 0) -> list[dict]:
    """Bytes each cache holds after a ``prompt``-token chat and ``new`` generated tokens (batch 1),
    built as a user builds it (fractions resolve on the prompt), beside the stock cache's."""
    from transformers import DynamicCache

    from kvevict.cache import make_cache

    from .caches import MEMORY, NO_EVICTION, use_attention

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=gen)
    one = torch.ones(1, 1, dtype=torch.long)
    out = []
    for spec in specs:
        use_attention(model, spec)
        if spec.kind == STOCK:
            cache = DynamicCache(config=model.config)
        elif spec.kind == MEMORY:
            cache = make_cache(model, memory=spec.budget)
        else:
            name, st = spec.storage()
            budget = prompt + new if name == NO_EVICTION else spec.budget  # every token, as in the decode fills
            cache = make_cache(
                model, "h2o" if name == NO_EVICTION else name, budget, kv_bits=st.kv_bits, evicted_bits=st.evicted_bits
            )
        model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        for _ in range(new):
            model(one, cache=cache, use_cache=True)
        out.append(
            {
                "cache": spec.label,
                "prompt": prompt,
                "new_tokens": new,
                "state_bytes": state_bytes(cache),
                "read_bytes": read_bytes(cache),
            }
        )
    stock = next(r for r in out if r["cache"] == STOCK)
    for r in out:
        r["vs_stock"] = r["state_bytes"] / stock["state_bytes"]
    return out


def long_bytes(bases, specs: list[CacheSpec], contexts: list[int]) -> list[dict]:
    """Bytes each pre-filled batch-1 cache holds at each context, beside the stock cache's."""
    out = []
    for c in contexts:
        rows = [
            {
                "cache": s.label,
                "context": c,
                "state_bytes": state_bytes(bases.get(s, c)),
                "read_bytes": read_bytes(bases.get(s, c)),
            }
            for s in specs
        ]
        stock = next(r for r in rows if r["cache"] == STOCK)
        for r in rows:
            r["vs_stock"] = r["state_bytes"] / stock["state_bytes"]
        out += rows
    return out


def run_matrix(
    model,
    bases,
    specs: list[CacheSpec],
    contexts: list[int],
    batches: list[int],
    threads: list[int],
    repeats: int,
    steps: int,
    weight_bytes: int,
    bandwidth_bytes: int = 256 * 2**20,
    log=print,
) -> dict:
    before = torch.get_num_threads()
    for c in contexts:  # fill every base cache before timing anything
        for spec in specs:
            bases.get(spec, c)
    per_seq = {(s, c): read_bytes(bases.get(s, c)) for s in specs for c in contexts}
    bandwidth = {}
    rounds: dict[tuple, list[list[float]]] = {}
    held: dict[tuple, int] = {}
    try:
        for t in threads:
            torch.set_num_threads(t)
            bandwidth[t] = measure_copy_bandwidth(bandwidth_bytes)
            log(f"  copy bandwidth at {t} thread(s): {bandwidth[t]['best'] / 1e9:.1f} GB/s")
        for r in range(repeats):
            t_round = time.perf_counter()
            for t in threads:
                torch.set_num_threads(t)
                for c in contexts:
                    for b in batches:
                        k = r % len(specs)
                        for spec in specs[k:] + specs[:k]:
                            times, held[(t, c, b, spec)] = time_decode(model, spec, bases.get(spec, c), b, steps)
                            rounds.setdefault((t, c, b, spec), []).append(times)
            log(
                f"  matrix round {r + 1}/{repeats} done in {time.perf_counter() - t_round:.1f} s, load {load_average()}"
            )
    finally:
        torch.set_num_threads(before)
    records = []
    for (t, c, b, spec), per_round in rounds.items():
        every = [x for ts in per_round for x in ts]
        step = summary(every)
        kv = b * per_seq[(spec, c)]
        floor = floor_seconds(weight_bytes, kv, bandwidth[t]["best"])
        records.append(
            {
                "threads": t,
                "context": c,
                "batch": b,
                "cache": spec.label,
                "kept_tokens": spec.kept_tokens(c),
                "step_s": step,
                "round_median_step_s": [statistics.median(x) for x in per_round],
                "tokens_per_s": b / step["median"],
                "read_bytes": kv,
                "state_bytes": held[(t, c, b, spec)],
                "floor_s": floor,
                "x_floor": step["median"] / floor,
            }
        )
    add_step_ratios(records)
    return {"records": records, "bandwidth": {str(t): bw for t, bw in bandwidth.items()}, "kernel": kernel_in_use()}


def add_step_ratios(records: list[dict], baseline: str = STOCK) -> None:
    """Per record: its step over the baseline's at the same (threads, context, batch), as the
    median [min, max] over rounds of the round-wise ratio (< 1: faster than the baseline)."""
    base = {(r["threads"], r["context"], r["batch"]): r for r in records if r["cache"] == baseline}
    for r in records:
        ref = base.get((r["threads"], r["context"], r["batch"]))
        if ref is not None:
            r[f"step_vs_{baseline}"] = summary(
                [x / y for x, y in zip(r["round_median_step_s"], ref["round_median_step_s"])]
            )


def pair_ratio(records: list[dict], num: str, den: str, threads: int, context: int, batch: int) -> dict | None:
    """Round-wise step ratio num/den at one point (None when either was not measured)."""
    got = {r["cache"]: r for r in records if (r["threads"], r["context"], r["batch"]) == (threads, context, batch)}
    if num not in got or den not in got:
        return None
    return summary([x / y for x, y in zip(got[num]["round_median_step_s"], got[den]["round_median_step_s"])])


def peer_comparison(records: list[dict], llama: dict | None) -> list[dict]:
    """kvevict's every-token int8/fp16 and int4/fp16 step ratios beside llama.cpp's q8_0/f16 and
    q4_0/f16 at the same context and threads (batch 1: llama-bench decodes one sequence)."""
    rows = []
    peer = {(x["context"], x["threads"], x["kv_type"]): x["step_ratio_vs_f16"] for x in (llama or {}).get("ratios", [])}
    points = sorted({(r["context"], r["threads"]) for r in records if r["batch"] == 1})
    for c, t in points:
        for kv, (num, den) in PEER_PAIRS.items():
            ours = pair_ratio(records, num, den, t, c, 1)
            if ours is None and (c, t, kv) not in peer:
                continue
            rows.append(
                {
                    "context": c,
                    "threads": t,
                    "pair": f"{num.split('/')[-1]}/{den.split('/')[-1]}",
                    "kvevict": ours,
                    "llamacpp_pair": f"{kv}/f16",
                    "llamacpp": peer.get((c, t, kv)),
                }
            )
    return rows
