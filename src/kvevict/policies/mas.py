from dataclasses import dataclass

from .base import Candidates, Policy
from .registry import register


@register("mas")
@dataclass
class MAS(Policy):
    """Mean attention score (RoCo paper): accumulated attention divided by how many queries saw the
    key, score(i) = sum_t a_t(i) / n_i, which removes AAS's bias towards old tokens."""

    name = "mas"
    stats = ("sum", "count")

    def score(self, c: Candidates):
        return c.stats["sum"] / c.stats["count"].clamp(min=1.0)
