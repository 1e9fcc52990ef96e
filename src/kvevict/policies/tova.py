from dataclasses import dataclass

from .base import Candidates, Policy
from .registry import register


@register("tova", "ltas")
@dataclass
class TOVA(Policy):
    """Token Omission Via Attention (Oren et al., 2024), "LTAS" in the RoCo paper: only the last
    query's attention counts, score(i) = a_T(i). No recent window by default (TOVA has none)."""

    recent: int | None = 0
    name = "tova"
    stats = ("last",)

    def score(self, c: Candidates):
        return c.stats["last"]
