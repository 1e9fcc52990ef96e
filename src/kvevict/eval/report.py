"""The grid's summary: a markdown table per task and metric (mean and 95% CI per policy and
budget, n samples), the paired difference to the full cache, and PNG plots of score vs budget."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from . import records
from .caches import FULL
from .stats import aggregate, mean_ci
from .tasks import TASKS


def _budget_sort(b):
    return (isinstance(b, int), b if b is not None else -1)


def collect(recs: list[dict]):
    """{task: {metric: {(policy, budget): {sample: value}}}} over records with finite scores."""
    table = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for r in recs:
        for metric, v in r.get("scores", {}).items():
            if v is None or (isinstance(v, float) and math.isnan(v)):
                continue
            table[r["task"]][metric][(r["policy"], r["budget"])][r["sample"]] = v
    return table


def summarize(out_dir, model_name: str | None = None) -> str:
    """Write summary.md and one PNG per task into ``out_dir``; return the markdown."""
    recs = [r for r in records.load(out_dir).values() if model_name is None or r["model"] == model_name]
    table = collect(recs)
    lines = [f"# kvevict eval summary ({len(recs)} records)", "",
             "Cells: mean [95% CI] over n samples (t interval; Wilson for accuracies/exact match; "
             "perplexity = exp(mean NLL) with the interval of the mean NLL exponentiated). "
             "Budgets are fractions of the prompt (ppl: of the window).", ""]
    for task_name, by_metric in table.items():
        task = TASKS.get(task_name)
        kinds = task.metrics if task else {}
        lines += [f"## {task_name}", ""]
        for metric, cells in by_metric.items():
            kind = kinds.get(metric, "mean")
            lines += _metric_table(metric, kind, cells)
        if task and task.primary in by_metric:
            lines += _paired_table(task.primary, kinds.get(task.primary, "mean"), by_metric[task.primary])
        plot_task(task_name, by_metric, kinds, Path(out_dir) / f"{task_name}.png")
        lines += [f"![{task_name}]({task_name}.png)", ""]
    md = "\n".join(lines)
    (Path(out_dir) / "summary.md").write_text(md, encoding="utf-8")
    return md


def _metric_table(metric, kind, cells):
    policies = [FULL] + sorted({p for p, _ in cells if p != FULL})
    budgets = sorted({b for p, b in cells if p != FULL}, key=_budget_sort)
    title = f"ppl = exp({metric})" if kind == "exp" else metric
    head = f"| {title} | " + " | ".join(str(b) for b in budgets) + " |"
    out = [head, "|" + "---|" * (len(budgets) + 1)]
    for p in policies:
        if p == FULL:
            ci = aggregate(cells.get((FULL, None), {}).values(), kind)
            out.append(f"| full (n={ci.n}) | " + " | ".join(ci.fmt() for _ in budgets) + " |")
            continue
        row = []
        for b in budgets:
            ci = aggregate(cells.get((p, b), {}).values(), kind)
            row.append(ci.fmt() if ci.n <= 1 else f"{ci.fmt()} n={ci.n}")
        out.append(f"| {p} | " + " | ".join(row) + " |")
    return out + [""]


def _paired_table(metric, kind, cells):
    """Per-sample difference policy - full on the same samples (removes sample difficulty)."""
    full = cells.get((FULL, None), {})
    policies = sorted({p for p, _ in cells if p != FULL})
    budgets = sorted({b for p, b in cells if p != FULL}, key=_budget_sort)
    label = "NLL" if kind == "exp" else metric
    out = [f"Paired difference to the full cache ({label}, policy - full, same samples):", "",
           "| policy | " + " | ".join(str(b) for b in budgets) + " |", "|" + "---|" * (len(budgets) + 1)]
    for p in policies:
        row = []
        for b in budgets:
            vals = cells.get((p, b), {})
            diffs = [vals[s] - full[s] for s in vals if s in full]
            ci = mean_ci(diffs)
            if kind == "proportion":  # a difference of two 0/1 scores lies in [-1, 1]
                ci.lo, ci.hi = max(-1.0, ci.lo), min(1.0, ci.hi)
            row.append(f"{ci.mean:+.3g} [{ci.lo:+.3g}, {ci.hi:+.3g}]" if ci.n > 1 else (f"{ci.mean:+.3g}" if ci.n else "–"))
        out.append(f"| {p} | " + " | ".join(row) + " |")
    return out + [""]


def plot_task(task_name, by_metric, kinds, path):
    """One panel per metric: score vs budget, one line per policy with its 95% CI as a band; the
    full cache as a dashed horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = list(by_metric)
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        cells, kind = by_metric[metric], kinds.get(metric, "mean")
        full = aggregate(cells.get((FULL, None), {}).values(), kind)
        if full.n:
            ax.axhline(full.mean, color="black", ls="--", lw=1, label=f"full (n={full.n})")
            if full.n > 1:
                ax.axhspan(full.lo, full.hi, color="black", alpha=0.08)
        for p in sorted({p for p, _ in cells if p != FULL}):
            bs = sorted((b for q, b in cells if q == p), key=_budget_sort)
            cis = [aggregate(cells[(p, b)].values(), kind) for b in bs]
            xs = [float(b) for b in bs]
            ax.plot(xs, [c.mean for c in cis], marker="o", label=p)
            if all(c.n > 1 for c in cis):
                ax.fill_between(xs, [c.lo for c in cis], [c.hi for c in cis], alpha=0.15)
        ax.set_xlabel("KV budget")
        ax.set_title(f"{task_name}: " + (f"ppl = exp({metric})" if kind == "exp" else metric))
        if kind == "exp":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
