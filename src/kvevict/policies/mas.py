from dataclasses import dataclass

from .base import Candidates, Policy
from .registry import register


@register("mas")
@dataclass
class MAS(Policy):
    """Mean attention score (RoCo paper): accumulated attention divided by how many queries saw the
    key, score(i) = sum_t a_t(i) / n_i, which removes AAS's bias towards old tokens. n_i comes from
    positions (``Candidates.seen``), so a slot holds H2O's bytes."""

    name = "mas"
    stats = ("sum",)

    def score(self, c: Candidates):
        return c.stats["sum"] / c.seen()
