from dataclasses import dataclass

import torch

from .base import INF, Candidates, Policy
from .registry import register


@register("roco")
@dataclass
class RoCo(Policy):
    """RoCo (Ren & Zhu, 2024, "On the Efficacy of Eviction Policy for KV-Constrained Generative
    Language Model Inference"): MAS importance with a variance-based eviction scope.

        MAS(i) = sum_t a_t(i) / n_i,    std(i) = sqrt(sum_t a_t(i)^2 / n_i - MAS(i)^2)

    The eviction scope is the ``n - recent`` candidates of lowest std (their attention has settled);
    the ``recent`` most volatile ones and the ``young`` newest tokens (too few observations for a
    std) are protected. Within the scope the lowest MAS is evicted. n_i comes from positions
    (``Candidates.seen``). Defaults follow EasyKV's decoding: ``recent`` = 30% of the budget,
    ``young`` = 10.
    """

    young: int = 10
    name = "roco"
    stats = ("sum", "sq")
    adaptable = False  # the std scope takes the top ``recent`` of each head's row

    def recent_for(self, budget: int) -> int:
        return max(1, int(0.3 * budget)) if self.recent is None else self.recent

    def score(self, c: Candidates):
        return c.stats["sum"] / c.seen()

    def protected(self, c: Candidates):
        n = c.seen()
        mas = c.stats["sum"] / n
        std = (c.stats["sq"] / n - mas.square()).clamp(min=0.0).sqrt()
        young = c.pos > c.newest - min(self.young, self.recent_for(c.budget))
        std = torch.where(young | ~c.valid, -INF, std)  # young and empty slots take no std protection
        k = min(self.recent_for(c.budget), std.shape[-1])
        keep = torch.zeros_like(young)
        if k:
            keep.scatter_(-1, std.topk(k, dim=-1).indices, True)
        return self.pinned(c, keep | young)
