"""Rows of different lengths decoding together, three ways (``python benchmarks/row_pages.py``):

- ``pages``: one batch, each row its own pages of a shared pool (``kvevict.storage.paged``, the server's
  storage), one forward per step;
- ``rectangle``: one batch whose storage is as wide as its widest row, one forward per step;
- ``buckets``: what the server did before per-row pages: one batch per power-of-two range of
  pages (rows of up to 4 pages together), one forward per batch per step.

Every row runs H2O under a budget it never reaches (nothing is evicted), at ``--kv-bits``; the
rows' contexts are spread evenly from ``--lo`` to ``--hi`` tokens. Reported: the median decode step
over rounds (the layouts interleaved within each round), its ratio to ``pages``, and the K/V
bytes each layout holds. Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvevict.serve.batch import DecodeBatch
from kvevict.storage import PAGE, Pools, page_slots

SMALL = 4  # the old server's rule: rows of up to this many pages shared one batch


def bucket(tokens: int, budget: int) -> int:
    """The power-of-two range of a row's pages (the server's ``width_bucket`` before per-row pages)."""
    n = max(1, -(-page_slots(tokens, budget) // PAGE))
    return max(0, (n - 1).bit_length() - SMALL.bit_length() + 1)


@torch.no_grad()
def build(model, prompts, budget: int, kv_bits, layout: str) -> list[DecodeBatch]:
    """The layout's batches, every prompt prefilled alone and joined as the server joins rows."""
    pool = Pools() if layout == "pages" else None
    batches: dict = {}
    for p in prompts:
        one, _ = DecodeBatch.prefill(model, p, "h2o", budget, None, kv_bits, pool)
        key = bucket(len(p) + 1, budget) if layout == "buckets" else 0
        if key in batches:
            batches[key].join(one)
        else:
            batches[key] = one
    return list(batches.values())


@torch.no_grad()
def steps(batches: list[DecodeBatch], n: int) -> float:
    """Mean seconds of one decode step of every row (one forward per batch)."""
    t0 = time.perf_counter()
    for _ in range(n):
        for b in batches:
            b.step([1] * b.size)
    return (time.perf_counter() - t0) / n


def main(argv=None) -> int:
    from kvevict.models import load_model

    p = argparse.ArgumentParser(prog="python benchmarks/row_pages.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--lo", type=int, default=64, help="shortest row's context, tokens")
    p.add_argument("--hi", type=int, default=3072, help="longest row's context, tokens")
    p.add_argument("--budget", type=int, default=8192, help="H2O's budget (never reached)")
    p.add_argument("--kv-bits", type=lambda t: None if t == "none" else int(t), default=8)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="results/row_pages.json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model, _ = load_model(a.model)
    gen = torch.Generator().manual_seed(0)
    lengths = [round(a.lo + (a.hi - a.lo) * i / max(1, a.rows - 1)) for i in range(a.rows)]
    prompts = [torch.randint(10, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    layouts = ["pages", "rectangle", "buckets"]
    made = {name: build(model, prompts, a.budget, a.kv_bits, name) for name in layouts}
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for r in range(a.rounds):  # rotated order: a noisy minute hits every layout alike
        for name in layouts[r % 3 :] + layouts[: r % 3]:
            times[name].append(steps(made[name], a.steps))
    base = statistics.median(times["pages"])
    print(
        f"{a.rows} rows of {lengths[0]}-{lengths[-1]} tokens, H2O budget {a.budget}, kv_bits {a.kv_bits}, "
        f"{a.steps} steps x {a.rounds} rounds, {a.threads} thread(s)"
    )
    print(f"{'layout':>10} | {'batches':>7} | {'step ms':>8} | {'vs pages':>8} | {'K/V bytes held':>15}")
    rows = []
    for name in layouts:
        med = statistics.median(times[name])
        held = sum(b.kv_bytes() for b in made[name])
        rows.append(
            {
                "layout": name,
                "batches": len(made[name]),
                "step_s": times[name],
                "median_s": med,
                "vs_pages": med / base,
                "kv_bytes": held,
            }
        )
        print(f"{name:>10} | {len(made[name]):7d} | {med * 1e3:8.1f} | {med / base:7.2f}x | {held:15,d}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(a), "lengths": lengths, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
