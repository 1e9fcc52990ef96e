"""The grid's summary: a markdown table per task and metric (mean and 95% CI per policy and
budget, n samples), the paired difference to the full cache, and PNG plots of score vs budget."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from ..plotting import pyplot
from . import records
from .apart import protocol
from .caches import FULL
from .intervals import Interval, aggregate, mean_ci
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
    lines = [
        f"# kvevict eval summary ({len(recs)} records)",
        "",
        "Cells: mean [95% CI] over n samples (t interval; Wilson for accuracies/exact match; "
        "perplexity = exp(mean NLL) with the interval of the mean NLL exponentiated). "
        "Budgets are fractions of the prompt (ppl: of the window).",
        "",
    ]
    for task_name, by_metric in table.items():
        task = TASKS.get(task_name)
        kinds = task.metrics if task else {}
        lines += [f"## {task_name}", ""]
        for metric, cells in by_metric.items():
            kind = kinds.get(metric, "mean")
            lines += _metric_table(metric, kind, cells)
        if task and task.primary in by_metric:
            primary_kind = kinds.get(task.primary, "mean")
            lines += _paired_table(task.primary, primary_kind, by_metric[task.primary])
            if plot_paired(
                task_name,
                task.primary,
                primary_kind,
                by_metric[task.primary],
                task.higher_is_better,
                Path(out_dir) / f"{task_name}-paired.png",
            ):
                lines += [f"![{task_name}: paired difference to the full cache]({task_name}-paired.png)", ""]
        plot_task(task_name, by_metric, kinds, Path(out_dir) / f"{task_name}.png")
        lines += [f"![{task_name}]({task_name}.png)", ""]
    md = "\n".join(lines)
    (Path(out_dir) / "summary.md").write_text(md, encoding="utf-8")
    return md


def protocol_line(policies) -> str:
    """How the rows of a table read their question: inside the compressed prompt, or apart (the
    context compressed alone, the question read whole after it: ``NAME/context`` rows)."""
    kinds = {protocol(p) for p in policies if p != FULL}
    if kinds == {"apart"}:
        return "Question: apart in every row but full (`/context`: the context compressed alone, the question read whole after it, as kvpress's pipeline does)."
    if kinds == {"apart", "inside"}:
        return "Question: inside the compressed prompt, but apart in `/context` rows (the context compressed alone, the question read whole after it, as kvpress's pipeline does)."
    return "Question: inside the compressed prompt in every row."


def _metric_table(metric, kind, cells):
    policies = [FULL] + sorted({p for p, _ in cells if p != FULL})
    budgets = sorted({b for p, b in cells if p != FULL}, key=_budget_sort)
    title = f"ppl = exp({metric})" if kind == "exp" else metric
    head = f"| {title} | " + " | ".join(str(b) for b in budgets) + " |"
    out = [protocol_line(policies), "", head, "|" + "---|" * (len(budgets) + 1)]
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


def paired_difference(cells, a: tuple, b: tuple) -> "Interval":
    """Mean and 95% t interval of the per-sample difference cell ``a`` - cell ``b`` (each a
    (policy, budget) key of ``cells``) over the samples both ran (pairing removes how hard each
    sample is)."""
    va, vb = cells.get(a, {}), cells.get(b, {})
    return mean_ci([va[s] - vb[s] for s in va if s in vb])


def paired_to_full(cells) -> dict[tuple, "Interval"]:
    """{(policy, budget): ``paired_difference`` policy - full} for every policy cell."""
    return {(p, b): paired_difference(cells, (p, b), (FULL, None)) for p, b in cells if p != FULL}


def _paired_table(metric, kind, cells):
    diffs = paired_to_full(cells)
    policies = sorted({p for p, _ in diffs})
    budgets = sorted({b for _, b in diffs}, key=_budget_sort)
    label = "NLL" if kind == "exp" else metric
    out = [
        f"Paired difference to the full cache ({label}, policy - full, same samples). {protocol_line(policies)}",
        "",
        "| policy | " + " | ".join(str(b) for b in budgets) + " |",
        "|" + "---|" * (len(budgets) + 1),
    ]
    for p in policies:
        row = []
        for b in budgets:
            ci = diffs.get((p, b))
            if ci is None or ci.n == 0:
                row.append("–")
                continue
            if kind == "proportion":  # a difference of two 0/1 scores lies in [-1, 1]
                ci.lo, ci.hi = max(-1.0, ci.lo), min(1.0, ci.hi)
            row.append(f"{ci.mean:+.3g} [{ci.lo:+.3g}, {ci.hi:+.3g}]" if ci.n > 1 else f"{ci.mean:+.3g}")
        out.append(f"| {p} | " + " | ".join(row) + " |")
    return out + [""]


def plot_paired(task_name, metric, kind, cells, higher_is_better, path):
    """Heatmap, policy x budget, of the paired difference to the full cache in ``metric``, coloured
    so that red is always worse than the full cache; cells whose 95% interval excludes 0 are
    printed in bold, with n."""
    plt = pyplot()

    diffs = {k: v for k, v in paired_to_full(cells).items() if v.n}
    if not diffs:
        return False
    policies = sorted({p for p, _ in diffs})
    budgets = sorted({b for _, b in diffs}, key=_budget_sort)
    sign = 1.0 if higher_is_better else -1.0  # plotted value > 0 means better than full
    grid = [[sign * diffs[(p, b)].mean if (p, b) in diffs else math.nan for b in budgets] for p in policies]
    mags = sorted(abs(v) for row in grid for v in row if not math.isnan(v))
    # scale to the 80th percentile so one far-off policy (random) does not wash out the rest; the
    # printed numbers carry the size
    lim = mags[int(0.8 * (len(mags) - 1))] or mags[-1] or 1.0
    fig, ax = plt.subplots(figsize=(1.3 * len(budgets) + 2.4, 0.36 * len(policies) + 1.4))
    ax.imshow(grid, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    for i, p in enumerate(policies):
        for j, b in enumerate(budgets):
            ci = diffs.get((p, b))
            if ci is None:
                continue
            clear = ci.n > 1 and (ci.lo > 0 or ci.hi < 0)
            dark = abs(grid[i][j]) > 0.6 * lim
            ax.text(
                j,
                i,
                f"{ci.mean:+.2g}\nn={ci.n}",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if dark else "black",
                fontweight="bold" if clear else "normal",
            )
    ax.set_xticks(range(len(budgets)), [str(b) for b in budgets])
    ax.set_yticks(range(len(policies)), policies)
    ax.set_xlabel("KV budget")
    label = "NLL" if kind == "exp" else metric
    ax.set_title(f"{task_name}: {label}, policy - full (blue: better, red: worse; bold: 95% CI excludes 0)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def plot_task(task_name, by_metric, kinds, path):
    """One panel per metric: score vs budget, one line per policy with its 95% CI as a band; the
    full cache as a dashed horizontal line."""
    plt = pyplot()

    metrics = list(by_metric)
    width = 4.2 * len(metrics) + 1.5  # + room for the legend on the right
    fig, axes = plt.subplots(1, len(metrics), figsize=(width, 3.4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        cells, kind = by_metric[metric], kinds.get(metric, "mean")
        full = aggregate(cells.get((FULL, None), {}).values(), kind)
        if full.n:
            ax.axhline(full.mean, color="black", ls="--", lw=1, label=f"full (n={full.n})")
            if full.n > 1:
                ax.axhspan(full.lo, full.hi, color="black", alpha=0.08)
        policies = sorted({p for p, _ in cells if p != FULL})
        colors = plt.get_cmap("tab20" if len(policies) > 10 else "tab10").colors
        for k, p in enumerate(policies):
            color = colors[k % len(colors)]
            if (p, None) in cells:  # no eviction (e.g. "full/int4"): a level, not a point on the budget axis
                ci = aggregate(cells[(p, None)].values(), kind)
                ax.axhline(ci.mean, color=color, ls=":", lw=1.2, label=f"{p} (n={ci.n})")
            bs = sorted((b for q, b in cells if q == p and b is not None), key=_budget_sort)
            if not bs:
                continue
            cis = [aggregate(cells[(p, b)].values(), kind) for b in bs]
            xs = [float(b) for b in bs]
            # 12 lines: colour alone is not enough, so the marker cycles too
            ax.plot(xs, [c.mean for c in cis], marker="os^vD<>ph*Xd"[k % 12], ms=4, lw=1.2, color=color, label=p)
            if all(c.n > 1 for c in cis) and len(policies) <= 4:  # bands of a dozen policies hide the lines
                ax.fill_between(xs, [c.lo for c in cis], [c.hi for c in cis], alpha=0.15, color=color)
        ax.set_xlabel("KV budget")
        ax.set_title(f"{task_name}: " + (f"ppl = exp({metric})" if kind == "exp" else metric))
        if kind == "exp":
            from matplotlib.ticker import FormatStrFormatter

            ax.set_yscale("log")
            for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
                axis(FormatStrFormatter("%g"))  # 25, 30, 40 rather than 3x10^1
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7)  # outside the panels: a dozen policies
    fig.tight_layout(rect=(0, 0, 1 - 1.5 / width, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
