from dataclasses import dataclass

import torch

from .base import Candidates, Policy
from .registry import register


@register("random")
@dataclass
class Random(Policy):
    """Random eviction (the RoCo paper's floor): score(i) ~ U(0, 1), drawn anew at each decision,
    outside the recent window. ``seed`` makes runs repeatable."""

    seed: int = 0
    name = "random"

    def __post_init__(self):
        self._gen = None

    def score(self, c: Candidates):
        if self._gen is None or self._gen.device != c.pos.device:
            self._gen = torch.Generator(device=c.pos.device).manual_seed(self.seed)
        return torch.rand(c.pos.shape, generator=self._gen, device=c.pos.device)
