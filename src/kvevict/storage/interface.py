"""The storage interface: what a tier asks of the store that holds its keys and values
(``SlotStore``) and of each bookkeeping field beside them (``SlotField``: positions, head ids, a
policy's statistics). Two implementations of each: one rectangle per layer (``kvevict.storage.rect``)
and per-row pages of shared pools (``kvevict.storage.paged``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

from ..kernels.runs import Run


@dataclass
class Piece:
    """A run of ``n`` consecutive slots as attention reads them: dequantized on demand."""

    n: int
    keys: Callable[[], torch.Tensor]  # () -> (b, h, n, dk) in the compute dtype
    values: Callable[[], torch.Tensor]


@runtime_checkable
class SlotStore(Protocol):
    """Keys and values of ``n`` slots per (sequence, KV head), written and read by slot index.
    ``bits``: None (the model's dtype), 16, 8, 4 or 2."""

    bits: int | None

    def write(self, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor, take: torch.Tensor | None = None) -> None:
        """Slots ``idx`` (b, h, j) take keys/values (b, h, j, d) where ``take`` (b, h, j) is True."""

    def read(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots ``idx`` in the compute dtype."""

    def pieces(self, n: int) -> list[Piece]:
        """The first ``n`` slots as attention's reference path reads them, dequantized on demand."""

    def run(self, n: int) -> Run:
        """The first ``n`` slots as stored, for the fused decode kernels (``kvevict.kernels``)."""

    def ensure(self, fills: list[int]) -> None:
        """Room for each row's ``fills`` slots (paged: the pages they need)."""

    def resize(self, n: int, fn: Callable) -> None:
        """``n`` slots per row (``fn`` cuts or pads a rectangle)."""

    def map_batch(self, fn: Callable) -> None:
        """Rows selected, reordered or repeated by ``fn`` (a function of a (b, ...) tensor)."""

    def disown(self) -> None:
        """The rows now belong to another cache (appended to it): give nothing back at collection."""

    def nbytes(self) -> int:
        """Every byte held for these rows."""


@runtime_checkable
class SlotField(Protocol):
    """One bookkeeping tensor per slot (b, h, n): positions, head ids or a statistic."""

    empty: object

    @property
    def dtype(self) -> torch.dtype: ...

    def rect(self, n: int) -> torch.Tensor:
        """The first ``n`` slots of every row as one (b, h, n) tensor the policy ranks."""

    def write(self, idx: torch.Tensor, src: torch.Tensor, take: torch.Tensor | None = None) -> None: ...

    def sync(self) -> None:
        """Write back what was changed in ``rect``'s tensor (paged: a copy of the pages)."""

    def ensure(self, fills: list[int]) -> None: ...

    def resize(self, n: int, fn: Callable | None = None) -> None: ...

    def map_batch(self, fn: Callable) -> None: ...

    def astype(self, pools, dtype: torch.dtype) -> "SlotField": ...

    def drop_view(self) -> None: ...

    def disown(self) -> None: ...

    def nbytes(self) -> int: ...
