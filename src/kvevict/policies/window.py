"""Policies for sliding-window layers (Gemma 2/3, Mistral-style configs, any ``layer_types``).

A sliding layer's query at position t sees only keys at positions > t - W (W = the layer's
``sliding_window``), so once the newest token is at position T, a token at position
p <= T + 1 - W can never be attended again. The stock cache keeps the last W - 1 tokens of such a
layer; kvevict keeps at most that many, and fewer where the budget is smaller:

- budget >= W - 1: ``window_recency`` keeps exactly the last W - 1 tokens (no statistic per slot):
  the layer is then exact against the stock cache;
- budget < W - 1: the layer's own policy decides inside the window, ``Windowed``: a token the
  window has left ranks below every token still in it (it is evicted first, never demoted).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import INF, Candidates, Policy
from .recency import Recency


def window_recency(keep: int) -> Policy:
    """Keep the newest ``keep`` tokens, no sinks: score(i) = position(i)."""
    return Recency(recent=1 if keep > 1 else 0, sinks=0)


@dataclass
class Windowed:
    """``inner`` restricted to a sliding window of ``window`` positions:

        priority(i) = -inf                   if pos(i) <= newest + 1 - window (out of every later query's window)
                    = inner.priority(i)      otherwise.

    Everything else (statistics, attention parameters, checks) is the inner policy's."""

    inner: Policy
    window: int

    def __getattr__(self, name):
        if name.startswith("__") or name in ("inner", "window"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def priority(self, c: Candidates, *args):
        prio = self.inner.priority(c, *args)
        return prio.masked_fill(c.pos <= c.newest + 1 - self.window, -INF)
