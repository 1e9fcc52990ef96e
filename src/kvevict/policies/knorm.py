from dataclasses import dataclass

from .base import Candidates, Policy
from .registry import register


@register("knorm")
@dataclass
class KeyNorm(Policy):
    """Key-norm eviction (Devoto et al., EMNLP 2024, "A Simple and Effective L2 Norm-Based Strategy
    for KV Cache Compression"; kvpress's ``KnormPress``): keys of low L2 norm draw high attention,
    so keep the lowest norms,

        score(i) = -||k_i||_2

    No attention is read: the norm is taken once, when the key is written (the "knorm" statistic),
    and never changes (RoPE is a rotation, so re-rotated compact keys keep it).
    """

    name = "knorm"
    stats = ("knorm",)

    def score(self, c: Candidates):
        return -c.stats["knorm"]
