from dataclasses import dataclass

from .base import Candidates, Policy
from .registry import register


@register("h2o", "aas")
@dataclass
class H2O(Policy):
    """Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023), "AAS" in the RoCo paper.

    score(i) = sum_t a_t(i): the attention probability key i received from every query that saw
    it (prefill and decoding), summed over the query heads of its KV group. Keep the ``recent``
    newest tokens plus the ``budget - recent`` highest scores; when full, evict greedily the
    lowest-scoring non-recent token of each (sequence, KV head), one per step.
    """

    name = "h2o"
    stats = ("sum",)

    def score(self, c: Candidates):
        return c.stats["sum"]
