"""Rows of one tier with budgets of their own (continuous batching): each row's cap, the slots past
it unavailable, never written and never ranked (``Tier.caps``).

A batch that joins rows of different budgets is as wide as the widest. A row of a smaller budget
is ranked on its own slots only, in a group of the rows that share its cap, so a score that mixes
neighbours (SnapKV's pooling) is the same as in a tier of the row's own width, and the row keeps
exactly the tokens it keeps alone.
"""

from __future__ import annotations

import torch

from .policies import Candidates
from .rows import rows_of


class RowCaps:
    """(b,) each row's own number of slots, on the device; read on the host once per batch change
    (``index``), never per step."""

    def __init__(self, caps: torch.Tensor):
        self.tensor = caps
        self.host: list[int] | None = None  # ``tensor`` on the host, once indexed
        self._groups: list = []  # (cap, row indices on the device, rows) per cap
        self._cols: dict = {}  # (cap, capacity, candidates) -> the columns a cap group ranks

    def index(self) -> None:
        """Read the caps and group the rows by cap (one host read per batch change)."""
        caps = self.host = self.tensor.tolist()
        self._cols = {}
        self._groups = [
            (cap, torch.tensor(rows, device=self.tensor.device), rows)
            for cap in sorted(set(caps))
            for rows in [[i for i, c in enumerate(caps) if c == cap]]
        ]

    def priority(self, policy, c: Candidates, capacity: int) -> torch.Tensor:
        """The policy's priority of every candidate, each cap group ranked on its own slots and the
        new entries; slots past a row's cap +inf (never a victim)."""
        out = torch.full(c.pos.shape, float("inf"), device=c.pos.device)
        n = c.pos.shape[-1]
        for cap, idx, rows in self._groups:
            key = (cap, capacity, n)
            if key not in self._cols:  # a pure function of its key: built once per batch change, not per step
                self._cols[key] = torch.cat([torch.arange(min(cap, capacity)), torch.arange(capacity, n)]).to(
                    c.pos.device
                )
            cols = self._cols[key]
            part = torch.full((len(rows), *c.pos.shape[1:]), float("inf"), device=c.pos.device)
            part[:, :, cols] = policy.priority(rows_of(c, idx, cols), rows)
            out.index_copy_(0, idx, part)
        return out
