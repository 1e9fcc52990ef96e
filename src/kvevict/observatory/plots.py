"""The observatory's figures (matplotlib, Agg backend)."""

from __future__ import annotations

from ..plotting import pyplot
from . import analyses

plt = pyplot()


def _layers_to_show(rec, k: int = 4):
    ids = sorted(rec.layers)
    if len(ids) <= k:
        return ids
    return sorted({ids[round(j * (len(ids) - 1) / (k - 1))] for j in range(k)})


def plot_sparsity(rec, path):
    sp = analyses.sparsity(rec)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(list(sp), [100 * v for v in sp.values()])
    ax.set_xlabel("layer")
    ax.set_ylabel("% of scores < 1% of row max")
    ax.set_ylim(0, 100)
    ax.set_title(f"attention sparsity ({rec.n} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_power_law(rec, path):
    fig, ax = plt.subplots(figsize=(5, 3.8))
    for layer in _layers_to_show(rec):
        acc = rec.layers[layer].acc.sort(descending=True).values
        acc = acc[acc > 0]
        slope = analyses.power_law_slope(rec.layers[layer].acc)
        ax.loglog(range(1, len(acc) + 1), acc.tolist(), label=f"layer {layer} (slope {slope:.2f})")
    ax.set_xlabel("rank")
    ax.set_ylabel("accumulated attention")
    ax.set_title("accumulated attention, rank vs score")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_stability(rec, path, frac=0.1):
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for layer in _layers_to_show(rec):
        pts = analyses.heavy_hitter_overlap(rec, layer, frac)
        ax.plot([t for t, _ in pts], [o for _, o in pts], marker=".", label=f"layer {layer}")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("step t'")
    ax.set_ylabel(f"top-{frac:.0%} overlap with previous checkpoint")
    ax.set_title("heavy-hitter stability")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_std(rec, path, layer=None):
    layer = layer if layer is not None else sorted(rec.layers)[len(rec.layers) // 2]
    st = rec.layers[layer]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for j, i in enumerate(rec.tracked):
        std = analyses.running_std(st.traces[j], i)
        ax.plot(range(i, i + len(std)), std.tolist(), lw=1, label=f"token {i}")
    ax.set_yscale("log")
    ax.set_xlabel("step t")
    ax.set_ylabel("running std of a_t(i)")
    ax.set_title(f"attention std settles (layer {layer})")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
