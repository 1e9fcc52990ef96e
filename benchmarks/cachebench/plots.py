"""PNG plots of a bench run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from kvevict.plotting import pyplot


def _series(records, batch, value):
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r["batch"] == batch:
            out.setdefault(r["cache"], []).append((r["context"], value(r)))
    return {k: sorted(v) for k, v in out.items()}


def throughput_vs_context(records: list[dict], path: Path) -> Path:
    plt = pyplot()
    batches = sorted({r["batch"] for r in records})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4.2), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for label, pts in _series(records, b, lambda r: r["tokens_per_s"]).items():
            _line(ax, label, [c for c, _ in pts], [v for _, v in pts])
        _log_axes(ax, f"batch {b}", "decode tokens / s")
    axes[0][-1].legend(fontsize=7, loc="best")
    return _save(plt, fig, path)


def memory_vs_context(records: list[dict], path: Path) -> Path:
    plt = pyplot()
    b = min(r["batch"] for r in records)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, pts in _series(records, b, lambda r: r["state_bytes"] / r["batch"] / 2**20).items():
        _line(ax, label, [c for c, _ in pts], [v for _, v in pts])
    _log_axes(ax, "KV cache memory per sequence", "cache state per sequence (MiB)")
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def matrix_steps(records: list[dict], path: Path) -> Path:
    """Step time vs context per cache, one panel per (threads, batch), the floor of each dotted."""
    plt = pyplot()
    panels = sorted({(r["threads"], r["batch"]) for r in records})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
    for ax, (t, b) in zip(axes[0], panels):
        sub = [r for r in records if (r["threads"], r["batch"]) == (t, b)]
        for label in dict.fromkeys(r["cache"] for r in sub):
            pts = sorted(
                (r["context"], r["step_s"]["median"] * 1e3, r["floor_s"] * 1e3) for r in sub if r["cache"] == label
            )
            line = _line(ax, label, [p[0] for p in pts], [p[1] for p in pts])
            ax.plot([p[0] for p in pts], [p[2] for p in pts], linestyle=":", color=line.get_color(), linewidth=0.8)
        _log_axes(ax, f"batch {b}, {t} thread(s)", "ms per decode step (dotted: bandwidth floor)")
    axes[0][-1].legend(fontsize=6, loc="best")
    return _save(plt, fig, path)


def _line(ax, label: str, xs, ys):
    """One cache's curve; the stock cache's drawn thick and black, the baseline every other is read against."""
    (line,) = ax.plot(
        xs,
        ys,
        marker="o",
        label=label,
        linewidth=2.5 if label == "stock" else 1.2,
        color="black" if label == "stock" else None,
    )
    return line


def _log_axes(ax, title: str, ylabel: str) -> None:
    """Context on a log2 axis against a log y axis, with a grid."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
