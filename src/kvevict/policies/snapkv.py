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
    With ``question=N`` (make_cache) the window is exactly the question's N tokens, which stay.
    """

    window: int = 64
    kernel: int = 5
    name = "snapkv"
    stats = ("obs",)
    independent = False  # pooling mixes neighbours' scores

    def recent_for(self, budget: int) -> int:
        return min(self.observe(self.window), budget // 2) if self.recent is None else self.recent

    def attention_params(self) -> dict:
        return {"observe": self.observe(self.window)}

    def score(self, c: Candidates):
        return pool(c.stats["obs"], c, self.kernel)

    def check(self, budget: int) -> None:
        super().check(budget)
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be an odd positive pool size, got {self.kernel}.")


def pool(score: torch.Tensor, c: Candidates, kernel: int) -> torch.Tensor:
    """``score`` averaged over each candidate's ``kernel`` nearest neighbours in position order,
    within its own KV head (adaptive layers mix heads in one row); invalid candidates sort first
    and pool as zeros, as kvpress's padded pooling does."""
    pos = c.pos.masked_fill(~c.valid, -1)
    # heads apart by 2**40 (positions stay below it): no host read of the largest position per step
    key = pos if c.head is None else c.head.long() * (1 << 40) + pos
    order = key.argsort(-1)
    obs = score.gather(-1, order)
    # each output's window of neighbours as one view (zeros past either end), summed in order, left
    # to right, so each score is a fixed sum of its own neighbours, whatever the batch around it
    r, n = kernel // 2, obs.shape[-1]
    window = torch.nn.functional.pad(obs, (r, r)).unfold(-1, kernel, 1)  # (..., n, kernel)
    if c.head is None:  # every neighbour in range counts
        i = torch.arange(n, device=obs.device)
        count = ((i + r).clamp(max=n - 1) - (i - r).clamp(min=0) + 1).to(obs.dtype)
    else:  # a neighbour of another head (or past either end: no head, -1) is neither summed nor counted
        grp = c.head.long().gather(-1, order)
        near = torch.nn.functional.pad(grp, (r, r), value=-1).unfold(-1, kernel, 1)
        same = (near == grp.unsqueeze(-1)).to(obs.dtype)
        window, count = window * same, same.sum(-1)
    total = window[..., 0]
    for j in range(1, kernel):
        total = total + window[..., j]
    return torch.empty_like(obs).scatter_(-1, order, total / count)
