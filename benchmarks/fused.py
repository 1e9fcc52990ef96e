"""Fused decode kernels against the torch path: one decode step of SmolLM2 over an H2O
cache at ``--context`` x ``--budget`` kept tokens, fp32 vs int8 vs int4 storage, each read by the
torch path (dequantize a chunk, then multiply) and by a fused kernel (``kvevict.kernels``), plus the
attention call alone (one layer's ``attend``, the statistics H2O needs included).

    python benchmarks/fused.py --context 8192 --budget 0.25 --batch 8 --threads 1 --out results/fused

Interleaved: every round times every (storage, path) once, the order rotated per round; ratios are
taken within a round against the first storage (fp32) on the first path (torch), and on the same
path, and reported as the median over rounds."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cachebench.caches import CacheSpec, expand, prefill, use_attention  # noqa: E402
from benchmarks.cachebench.decode import time_decode  # noqa: E402


def _attention_alone(layer, batch: int, reps: int) -> float:
    """Seconds of one ``attend`` call of one decode query over this layer's storage (median of reps)."""
    from kvevict.attention import _Segments, attend

    h, dk, dv = layer.dims
    hq = h * 3  # SmolLM2: 9 query heads on 3 KV heads
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, hq, 1, dk, generator=gen)
    k_new, v_new = torch.randn(batch, h, 1, dk, generator=gen), torch.randn(batch, h, 1, dv, generator=gen)
    tiers = layer.tiers
    seg = _Segments(
        pieces=[p for t in tiers for p in t.store.pieces(t.filled)],
        pos_past=None,
        valid_past=None,
        k_new=k_new,
        v_new=v_new,
        pos_new=torch.zeros(1, 1, dtype=torch.long),
        valid_new=None,
        runs=[t.store.run(t.filled) for t in tiers],
    )
    attend(q, seg, dk**-0.5, None, None, ("sum",))  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        attend(q, seg, dk**-0.5, None, None, ("sum",))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--budget", type=float, default=0.25, help="fraction of the context kept")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--storages", default="h2o,h2o/int8,h2o/int4")
    ap.add_argument("--paths", default="torch,cpu", help="kvevict.kernels backends to compare")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="timed decode steps per run")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvevict import load_model

    model = load_model(args.model)[0]
    specs = [CacheSpec(s, args.budget) for s in args.storages.split(",")]
    paths = args.paths.split(",")
    bases = {s: prefill(model, s, args.context, args.steps + 2) for s in specs}
    for s in specs:
        use_attention(model, s)
    layers = {s: expand(bases[s], args.batch).layers[0] for s in specs}
    points = [(s, p) for s in specs for p in paths]
    step = {pt: [] for pt in points}
    attn = {pt: [] for pt in points}
    for r in range(args.repeats):
        k = r % len(points)
        for s, p in points[k:] + points[:k]:
            os.environ["KVEVICT_KERNEL"] = p
            attn[(s, p)].append(_attention_alone(layers[s], args.batch, 5))
            times, _ = time_decode(model, s, bases[s], args.batch, args.steps)
            step[(s, p)].append(statistics.median(times))
        print(f"round {r + 1}/{args.repeats} done", flush=True)
    base = (specs[0], paths[0])
    rows = []
    for s, p in points:
        row = {"storage": s.kind, "path": p, "kept_tokens": s.kept_tokens(args.context)}
        for name, d in (("step", step), ("attention", attn)):
            row[f"{name}_ms"] = round(1e3 * statistics.median(d[(s, p)]), 3)
            row[f"{name}_round_s"] = d[(s, p)]
            for ref, label in ((base, "first"), ((specs[0], p), "first_same_path")):
                row[f"{name}_vs_{label}"] = round(statistics.median(a / b for a, b in zip(d[(s, p)], d[ref])), 3)
        rows.append(row)
        print(
            f"{s.kind:>10} {p:>6}  step {row['step_ms']:9.2f} ms ({row['step_vs_first']:.2f}x,"
            f" {row['step_vs_first_same_path']:.2f}x same path)   attention/layer {row['attention_ms']:8.3f} ms"
            f" ({row['attention_vs_first']:.2f}x, {row['attention_vs_first_same_path']:.2f}x same path)"
        )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        meta = {k: v for k, v in vars(args).items() if k != "out"}
        Path(args.out, "fused.json").write_text(json.dumps({"args": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
