"""Ada-KV's shared budget as a layer feature (Feng et al., 2024): the h KV heads of a layer share
one row of h x B slots per sequence instead of B each, so a head that needs more tokens takes them
from one that needs fewer. Each slot records whose head it is (``Tier.head``, one byte), attention
lets a head see its own slots only, and a head's statistics are read from its own row."""

from __future__ import annotations

import torch


def cat_slots(parts: list) -> torch.Tensor:
    """The tiers' per-slot tensors side by side, as attention reads the tiers (first tier first)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


class HeadPool:
    def __init__(self, heads: int, device):
        if heads > 256:
            raise ValueError(f"adaptive budgets record a slot's head in one byte: at most 256 KV heads, got {heads}.")
        self.heads, self.device = heads, device
        self._ids: torch.Tensor | None = None  # (1, h, 1) 0 .. h - 1, made at the first step
        self._whose: torch.Tensor | None = None  # this forward's slots' head ids, from visible to pooled

    def _head_ids(self) -> torch.Tensor:
        """(1, h, 1): 0 .. h - 1, made once (traced: made in the graph, never kept)."""
        if torch.compiler.is_compiling():
            return torch.arange(self.heads, device=self.device).view(1, -1, 1)
        if self._ids is None:
            self._ids = torch.arange(self.heads, device=self.device).view(1, -1, 1)
        return self._ids

    def visible(self, tiers: list, valid_past: torch.Tensor | None, padded: bool, keep: bool = False) -> torch.Tensor:
        """(b, h, n_past): each head sees its own slots only (and, padded, the real ones: ``valid_past``).
        ``keep``: the slots' head ids laid side by side are kept for this forward's ``pooled``."""
        whose = cat_slots([t.head[:, :, : t.filled] for t in tiers])
        if keep:
            self._whose = whose
        mine = whose == self._head_ids()
        return mine & valid_past if padded and valid_past is not None else mine

    def pooled(self, stats: dict, new: dict, n_past: int, tiers: list) -> tuple[dict, dict]:
        """Each stored slot's statistics from its own head's row, and the new tokens laid out head
        after head in one row ((b, h, m) -> (b, 1, h x m)), with their head ids."""
        b, h, m = new["pos"].shape
        whose, self._whose = self._whose, None  # as ``visible`` laid them out this forward
        if whose is None or whose.shape[-1] != n_past:
            whose = cat_slots([t.head[:, :, : t.filled] for t in tiers])
        whose = whose.long()  # (b, 1, n_past)
        stats = {n: stats[n][..., :n_past].gather(1, whose) for n in tiers[0].stat_names}
        new = {n: t.reshape(b, 1, h * m, *t.shape[3:]) for n, t in new.items()}
        ids = self._head_ids().view(1, 1, h)
        new["head"] = (ids if m == 1 else ids.view(-1).repeat_interleave(m).view(1, 1, -1)).expand(b, 1, h * m)
        return stats, new
