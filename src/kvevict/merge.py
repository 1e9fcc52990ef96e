"""What an evicting cache forgets, kept as one slot per (sequence, KV head): the mean key and mean
value of every token evicted so far, and how many there were.

Attention reads it as ``n`` copies of that mean token: with n tokens evicted, keys k_i, values v_i,

    k_bar = (1/n) sum_i k_i,    v_bar = (1/n) sum_i v_i,    logit = q . k_bar * scale + log n

so the summary takes softmax weight n exp(q . k_bar * scale), and its output share carries v_bar.
By Jensen's inequality n exp(q . k_bar) <= sum_i exp(q . k_i): the evicted tokens' attention mass
is kept in part instead of dropped to zero, which would hand it to the tokens kept. Merging evicted
tokens instead of dropping them is D2O's and CaM's idea (Wan et al. 2024, "D2O: Dynamic
Discriminative Operations for Efficient Generative Inference of LLMs"; Zhang et al. 2024, "CaM:
Cache Merging for Memory-efficient LLMs Inference"), which merge each evicted token into kept
ones; here every evicted token of a head goes into one slot, so no kept token's key or value
changes and a covering budget (nothing evicted: n = 0, the slot masked) stays exact.

Why (docs/results/ruler.md, "Dropped tokens and their attention mass"): on RULER's multi-query NIAH
SmolLM2 answers a numbered list of no numbers once about half of the haystack is dropped, whichever
tokens go, needles kept; with the same tokens replaced by copies of their mean it answers as
with the full cache.

The sums are float32 (2 x head_dim x 4 bytes + 4 for the count per row and KV head, counted in
``kv_bytes``). Keys are summed as stored, rotated at their own positions.
"""

from __future__ import annotations

import math

import torch


class Summary:
    """The evicted tokens' sums per (row, KV head): ``add`` what leaves, ``term`` for attention."""

    def __init__(self, b: int, h: int, dk: int, dv: int, device):
        self.k = torch.zeros(b, h, dk, dtype=torch.float32, device=device)
        self.v = torch.zeros(b, h, dv, dtype=torch.float32, device=device)
        self.n = torch.zeros(b, h, dtype=torch.float32, device=device)
        self.used = False  # on the host: whether anything was ever added (term reads no device flag)

    def add(self, gone: dict, shared: int) -> None:
        """Add the evicted entries ``gone`` (keys "k", "v", "pos" (b, h', m); "head" when ``shared``
        heads pool their slots, h' = 1); padding (position -1) adds nothing."""
        self.used = self.used or gone["pos"].shape[-1] > 0
        real = (gone["pos"] >= 0).float()  # (b, h', m)
        k, v = gone["k"].float() * real[..., None], gone["v"].float() * real[..., None]
        if shared > 1:  # pooled slots: each entry to its own head
            head = gone["head"].long()[:, 0]  # (b, m)
            self.k.scatter_add_(1, head[..., None].expand(-1, -1, k.shape[-1]), k[:, 0])
            self.v.scatter_add_(1, head[..., None].expand(-1, -1, v.shape[-1]), v[:, 0])
            self.n.scatter_add_(1, head, real[:, 0])
        else:
            self.k += k.sum(2)
            self.v += v.sum(2)
            self.n += real.sum(2)

    def term(self, dtype):
        """(mean key (b, h, 1, dk), mean value (b, h, 1, dv), log count (b, h, 1, 1), -inf where
        nothing was evicted), or None while nothing has been."""
        if not self.used:
            return None
        n = self.n.clamp(min=1.0)
        logn = torch.where(self.n > 0, n.log(), torch.full_like(n, -math.inf))
        n = n[..., None]
        return (self.k / n).to(dtype).unsqueeze(2), (self.v / n).to(dtype).unsqueeze(2), logn[..., None, None]

    def tensors(self) -> list:
        return [self.k, self.v, self.n]

    def map_batch(self, fn) -> None:
        self.k, self.v, self.n = fn(self.k), fn(self.v), fn(self.n)
        self.used = self.used or self.n.numel() > 0 and bool((self.n > 0).any())  # rows joined with theirs

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.n.nbytes
