from dataclasses import dataclass

from .base import Candidates, Policy
from .registry import register


@register("expected", "expected_attention")
@dataclass
class ExpectedAttention(Policy):
    """Expected attention (Devoto et al., 2025, "Expected Attention: KV Cache Compression by
    Estimating Attention from Future Queries Distribution"; kvpress's ``ExpectedAttentionPress``):
    future queries are modelled as a Gaussian fitted to the last ``window`` queries of each head,
    q ~ N(mu, diag(var)), and a key is worth the attention such a query is expected to give it:

        score(i) = sum_forwards m * sum_g softmax_i(mu_g . k_i / sqrt(d) + k_i^T diag(var_g) k_i / (2d))

    (E[exp(q.k)] of a Gaussian query, normalised over the keys; m = queries in the forward).
    No attention matrix is read. Unlike the paper we neither average RoPE over future positions
    nor weight by ||v_i||; while decoding (one query, var = 0) it adds that query's attention.
    """

    window: int = 64
    name = "expected"
    stats = ("expected",)

    def attention_params(self) -> dict:
        return {"observe": self.observe(self.window)}

    def score(self, c: Candidates):
        return c.stats["expected"]

    def check(self, budget: int) -> None:
        super().check(budget)
        if self.window < 1:
            raise ValueError(f"window must be >= 1 query, got {self.window}.")
