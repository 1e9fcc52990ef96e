from dataclasses import dataclass

from .base import Candidates, Policy
from .registry import register


@register("scissorhands")
@dataclass
class Scissorhands(Policy):
    """Scissorhands (Liu et al., NeurIPS 2023), persistence of importance: a key that was important
    (attention above uniform) within the recent history will be important again. We count the
    above-uniform votes over a history window of about ``history`` queries, as an exponential
    window so no per-query history is stored:

        score(i) = sum_t gamma^(T-t) 1[a_t(i) >= G / n_t],   gamma = 1 - 1 / history
    """

    history: int = 128
    name = "scissorhands"
    stats = ("hits_ema",)

    def decay(self) -> float:
        return 1.0 - 1.0 / self.history

    def attention_params(self) -> dict:
        return {"gamma": self.decay()}

    def score(self, c: Candidates):
        return c.stats["hits_ema"]

    def check(self, budget: int) -> None:
        super().check(budget)
        if self.history < 1:
            raise ValueError(f"history must be >= 1 query, got {self.history}.")
