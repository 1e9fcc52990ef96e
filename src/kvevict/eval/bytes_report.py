"""Quality against bytes: each cell of the grid at the share of a 16-bit stock cache's bytes it
held (kv_bytes / full_kv_bytes, ``kvevict.stock``), its paired difference to the full cache with a
95% interval, and a Pareto plot (the cells no other cell beats on both axes).

    python -m kvevict.eval.bytes_report results/qpb [more folders...] --out docs/results/quality-per-byte

Records written before budgets were counted against a 16-bit stock cache (no ``bytes_basis``) counted a full cache in the model's dtype,
every layer at every token: their denominator is rescaled to 16 bits by ``--legacy-dtype-bytes``
(4: every such run of this project held SmolLM2, which has no sliding layers, in fp32).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..plotting import pyplot
from ..stock import STOCK_BYTES
from . import records
from .caches import FULL
from .report import collect, paired_difference
from .tasks import TASKS


def stock_share(rec: dict, legacy_dtype_bytes: int = 4) -> float:
    """kv_bytes over a 16-bit stock cache's bytes for the same tokens; an old record's full cache
    (model dtype, ``legacy_dtype_bytes`` per value) rescaled to 16 bits."""
    full = rec["full_kv_bytes"]
    if rec.get("bytes_basis") != records.BASIS:
        full = full * STOCK_BYTES / legacy_dtype_bytes
    return rec["kv_bytes"] / full


def byte_shares(recs: list[dict], legacy_dtype_bytes: int = 4) -> dict:
    """{(task, policy, budget): mean share of a 16-bit stock cache} over the records that carry both.
    A kvpress record (``kv_tokens``: the prompt tokens its press kept) counts as those tokens in 16
    bits over the prompt the full cache's record of the same sample saw: what kvpress holds on a
    GPU in bf16 (on the CPU it runs in fp32, twice that)."""
    acc: dict = {}
    prompts = {(r["task"], r["sample"]): r.get("prompt_tokens") for r in recs if r["policy"] == FULL}
    for r in recs:
        if r.get("kv_bytes") and r.get("full_kv_bytes"):
            acc.setdefault((r["task"], r["policy"], r["budget"]), []).append(stock_share(r, legacy_dtype_bytes))
        elif r.get("kv_tokens") and prompts.get((r["task"], r["sample"])):
            acc.setdefault((r["task"], r["policy"], r["budget"]), []).append(
                r["kv_tokens"] / prompts[(r["task"], r["sample"])]
            )
    return {k: sum(v) / len(v) for k, v in acc.items()}


def rows(recs: list[dict], legacy_dtype_bytes: int = 4) -> list[dict]:
    """One row per task and non-reference cell: bytes share, mean score, paired difference to full."""
    table, shares, out = collect(recs), byte_shares(recs, legacy_dtype_bytes), []
    for task_name, by_metric in table.items():
        task = TASKS.get(task_name)
        metric = getattr(task, "primary", None) or next(iter(by_metric))
        cells = by_metric[metric]
        ref = (FULL, None)
        if ref not in cells:
            continue
        for cell, values in cells.items():
            if cell == ref:
                continue
            diff = paired_difference(cells, cell, ref)
            if diff.n == 0:
                continue
            out.append(
                {
                    "task": task_name,
                    "metric": metric,
                    "policy": cell[0],
                    "budget": cell[1],
                    "bytes": shares.get((task_name, *cell)),
                    "mean": sum(values.values()) / len(values),
                    "ref_mean": sum(cells[ref][s] for s in values if s in cells[ref]) / max(1, diff.n),
                    "diff": diff.mean,
                    "lo": diff.lo,
                    "hi": diff.hi,
                    "n": diff.n,
                    "higher_is_better": getattr(task, "higher_is_better", True),
                }
            )
    return sorted(out, key=lambda r: (r["task"], r["bytes"] if r["bytes"] is not None else math.inf))


def pareto(task_rows: list[dict]) -> set:
    """Indices of the rows no other row beats on both bytes (lower) and quality (better)."""

    def better(a, b):  # a at most b's bytes and at least b's quality, strictly on one
        qa, qb = (a["diff"], b["diff"]) if a["higher_is_better"] else (-a["diff"], -b["diff"])
        return a["bytes"] <= b["bytes"] and qa >= qb and (a["bytes"] < b["bytes"] or qa > qb)

    have = [i for i, r in enumerate(task_rows) if r["bytes"] is not None]
    return {i for i in have if not any(better(task_rows[j], task_rows[i]) for j in have if j != i)}


def markdown(all_rows: list[dict]) -> str:
    lines = []
    for task_name in sorted({r["task"] for r in all_rows}):
        tr = [r for r in all_rows if r["task"] == task_name]
        front = pareto(tr)
        lines += [
            f"### {task_name} ({tr[0]['metric']}; full cache {tr[0]['ref_mean']:.4g})",
            "",
            "| cache | budget | bytes (of 16-bit stock) | mean | paired − full [95% CI] | n | Pareto |",
            "|---|---|---|---|---|---|---|",
        ]
        for i, r in enumerate(tr):
            share = "?" if r["bytes"] is None else f"{r['bytes']:.1%}"
            ci = "" if r["n"] < 2 else f" [{r['lo']:+.3g}, {r['hi']:+.3g}]"
            lines.append(
                f"| {r['policy']} | {r['budget'] if r['budget'] is not None else 'all tokens'} | {share} | "
                f"{r['mean']:.4g} | {r['diff']:+.3g}{ci} | {r['n']} | {'yes' if i in front else ''} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(all_rows: list[dict], path: Path) -> None:
    plt = pyplot()
    tasks = sorted({r["task"] for r in all_rows})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for ax, task_name in zip(axes[0], tasks):
        tr = [r for r in all_rows if r["task"] == task_name and r["bytes"] is not None]
        front = pareto(tr)
        for i, r in enumerate(tr):
            err = [[r["diff"] - r["lo"]], [r["hi"] - r["diff"]]] if r["n"] > 1 else None
            ax.errorbar(
                100 * r["bytes"],
                r["diff"],
                yerr=err,
                fmt="o" if i in front else "x",
                capsize=3,
                label=f"{r['policy']} @ {r['budget'] if r['budget'] is not None else 'all'}",
            )
        pts = sorted((100 * tr[i]["bytes"], tr[i]["diff"]) for i in front)
        if len(pts) > 1:
            ax.plot(*zip(*pts), "k--", lw=0.8)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xlabel("KV bytes held, % of a 16-bit stock cache")
        ax.set_ylabel(f"{tr[0]['metric'] if tr else ''} − full cache (paired)")
        ax.set_title(task_name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", help="eval output folders (records.jsonl)")
    p.add_argument("--out", required=True, help="path prefix: writes PREFIX.md and PREFIX.png")
    p.add_argument(
        "--legacy-dtype-bytes",
        type=int,
        default=4,
        choices=(2, 4),
        help="bytes per value of the full cache in records without a bytes_basis (default 4: fp32)",
    )
    args = p.parse_args(argv)
    recs = [r for f in args.folders for r in records.load(f).values()]
    if not recs:
        raise SystemExit(f"no records in {', '.join(args.folders)}")
    all_rows = rows(recs, args.legacy_dtype_bytes)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(all_rows)
    out.with_suffix(".md").write_text(text, encoding="utf-8")
    plot(all_rows, out.with_suffix(".png"))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
