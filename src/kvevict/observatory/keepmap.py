"""Which tokens a policy kept: stream a text through an EvictingCache, then read each layer's
kept positions (``layer.pos`` where ``layer.valid``) and colour every token of the text by the
share of (layer, KV head) caches that still hold it. Written as a standalone HTML page."""

from __future__ import annotations

import html
import math

import torch

from ..cache import make_cache


@torch.no_grad()
def kept_share(model, ids: torch.Tensor, policy: str, budget, chunk: int = 64) -> torch.Tensor:
    """(n,) share of (layer, KV head) pairs whose cache holds token i after the whole text has
    streamed through in ``chunk``-token steps (a float budget: that fraction of the text)."""
    n = ids.shape[1]
    tokens = budget if isinstance(budget, int) else max(1, math.ceil(budget * n))
    cache = make_cache(model, policy, tokens)
    for s in range(0, n, chunk):
        model(ids[:, s : s + chunk], cache=cache)
    counts, total = torch.zeros(n), 0
    for layer in cache.layers:
        pos = layer.pos[0][layer.valid[0]]  # kept positions of every KV head of this layer
        counts += torch.bincount(pos.flatten(), minlength=n)[:n].float()
        total += layer.pos.shape[1]
    return counts / total


def _colour(share: float) -> str:
    """Red (evicted everywhere) to green (kept everywhere)."""
    r, g = int(230 * (1 - share) + 25), int(200 * share + 40)
    return f"rgb({r},{g},90)"


def keep_html(tokens: list[str], share: torch.Tensor, title: str) -> str:
    spans = []
    for i, (t, s) in enumerate(zip(tokens, share.tolist())):
        text = html.escape(t).replace("\n", "↵<br>")
        spans.append(
            f'<span title="token {i}: kept by {s:.0%} of layer/head caches" '
            f'style="background:{_colour(s)}">{text}</span>'
        )
    kept = share.mean().item()
    return (
        f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font:14px/1.7 sans-serif;max-width:60em;margin:2em auto}"
        "span{border-radius:2px;white-space:pre-wrap}</style>"
        f"<h1>{html.escape(title)}</h1><p>Each token coloured by the share of (layer, KV head) caches "
        f"holding it at the end: <span style='background:{_colour(1)}'>kept everywhere</span> "
        f"… <span style='background:{_colour(0)}'>evicted everywhere</span>. "
        f"Mean share kept: {kept:.1%}. Hover a token for its share.</p><p>{''.join(spans)}</p>"
    )
