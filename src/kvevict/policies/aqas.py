from dataclasses import dataclass

from .base import Candidates, Policy
from .registry import register


@register("aqas")
@dataclass
class AQAS(Policy):
    """Accumulated quantised attention score (the RoCo paper's AQAS, after Scissorhands, Liu et al.
    2023): each query votes 1 for every key it attends above the uniform level,

        score(i) = sum_t 1[a_t(i) >= G / n_t]

    with n_t the number of keys query t sees and G the query heads of the KV group (a_t sums them).
    """

    name = "aqas"
    stats = ("hits",)

    def score(self, c: Candidates):
        return c.stats["hits"]
