"""Write the observatory's figures, numbers (JSON), summary (markdown) and keep map (HTML)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from . import analyses, plots
from .keepmap import keep_html, kept_share
from .observe import observe


def inspect_text(
    model, tokenizer, text: str, out_dir, policy: str = "h2o", budget=0.2, tokens: int = 2048, chunk: int = 64
) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :tokens]
    rec = observe(model, ids)
    sp = analyses.sparsity(rec)
    slopes = {i: analyses.power_law_slope(st.acc) for i, st in rec.layers.items()}
    overlap = {i: [o for _, o in analyses.heavy_hitter_overlap(rec, i)] for i in rec.layers}
    mid = sorted(rec.layers)[len(rec.layers) // 2]
    settle = [
        analyses.settle_ratio(analyses.running_std(rec.layers[mid].traces[j], i)) for j, i in enumerate(rec.tracked)
    ]
    plots.plot_sparsity(rec, out / "sparsity.png")
    plots.plot_power_law(rec, out / "power_law.png")
    plots.plot_stability(rec, out / "heavy_hitters.png")
    plots.plot_std(rec, out / "attention_std.png", mid)
    share = kept_share(model, ids, policy, budget, chunk)
    toks = [tokenizer.decode([t]) for t in ids[0].tolist()]
    (out / "kept.html").write_text(
        keep_html(toks, share, f"{policy} at budget {budget}: kept tokens"), encoding="utf-8"
    )

    def mean(xs):
        xs = [x for x in xs if not math.isnan(x)]
        return sum(xs) / len(xs) if xs else math.nan

    result = {
        "tokens": rec.n,
        "sparsity": sp,
        "mean_sparsity": mean(sp.values()),
        "power_law_slope": slopes,
        "heavy_hitter_overlap": overlap,
        "mean_overlap_late": mean([o[-1] for o in overlap.values() if o]),
        "std_settle_ratio_layer": mid,
        "std_settle_ratio": settle,
        "policy": policy,
        "budget": budget,
        "mean_kept_share": share.mean().item(),
    }
    (out / "inspect.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    (out / "summary.md").write_text(summary_md(result), encoding="utf-8")
    return result


def summary_md(r: dict) -> str:
    sp = r["sparsity"]
    lines = [
        f"# Attention observatory ({r['tokens']} tokens)",
        "",
        f"- sparsity (share of scores < 1% of their row max), mean over layers: {r['mean_sparsity']:.1%}; "
        f"min {min(sp.values()):.1%} (layer {min(sp, key=sp.get)}), max {max(sp.values()):.1%} (layer {max(sp, key=sp.get)})",
        "- power-law slope of accumulated attention (log score vs log rank), per layer: "
        + ", ".join(f"{i}: {s:.2f}" for i, s in r["power_law_slope"].items()),
        f"- heavy-hitter (top 10%) overlap between the last two checkpoints, mean over layers: {r['mean_overlap_late']:.2f}",
        f"- running attention std, layer {r['std_settle_ratio_layer']}: movement in the second half / first half "
        "per tracked token: " + ", ".join(f"{x:.2f}" for x in r["std_settle_ratio"]),
        f"- {r['policy']} at budget {r['budget']}: mean share of (layer, head) caches holding a token {r['mean_kept_share']:.1%} "
        "(kept.html)",
        "",
        "![sparsity](sparsity.png) ![power law](power_law.png) ![heavy hitters](heavy_hitters.png) "
        "![std](attention_std.png)",
        "",
    ]
    return "\n".join(lines)
