from dataclasses import dataclass

import torch

from .base import Candidates, Policy
from .registry import register


@register("snapkv")
@dataclass
class SnapKV(Policy):
    """SnapKV (Li et al., 2024): the last ``window`` queries of the prompt (the observation window)
    predict what generation will attend to; their attention is smoothed along positions with an
    average pool of ``kernel`` so that neighbours of a hit survive with it:

        score(i) = avgpool_kernel( sum_{t in window} a_t(i) )   (pooled in position order)

    While decoding, every decode query joins the window (the prompt has no later queries).
    Defaults follow kvpress (window 64, kernel 5); the window itself is protected.
    """

    window: int = 64
    kernel: int = 5
    name = "snapkv"
    stats = ("obs",)
    independent = False  # pooling mixes neighbours' scores

    def recent_for(self, budget: int) -> int:
        return min(self.window, budget // 2) if self.recent is None else self.recent

    def attention_params(self) -> dict:
        return {"observe": self.window}

    def score(self, c: Candidates):
        order = c.pos.masked_fill(~c.valid, -1).argsort(-1)  # pool neighbours in position order
        obs = c.stats["obs"].gather(-1, order)
        b, h, n = obs.shape
        pooled = torch.nn.functional.avg_pool1d(obs.view(b * h, 1, n), self.kernel, stride=1,
                                                padding=self.kernel // 2, count_include_pad=False).view(b, h, n)
        return torch.empty_like(pooled).scatter_(-1, order, pooled)

    def check(self, budget: int) -> None:
        super().check(budget)
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be an odd positive pool size, got {self.kernel}.")
