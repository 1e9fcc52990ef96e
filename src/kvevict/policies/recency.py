from dataclasses import dataclass

from .base import Candidates, Policy
from .registry import register


@register("recency", "streamingllm")
@dataclass
class Recency(Policy):
    """StreamingLLM (Xiao et al., ICLR 2024): keep the ``sinks`` first tokens (attention sinks) and
    the newest ones. score(i) = position(i): the oldest non-sink token goes first."""

    recent: int | None = 1
    sinks: int = 4
    name = "recency"

    def score(self, c: Candidates):
        return c.pos
