"""Rectangular storage: one (b, h, n) tensor per key, value and bookkeeping field, every row of a
batch as wide as the widest (``kvevict.storage.paged`` holds each row's own pages instead).
``DenseStore`` keeps keys and values in the model's dtype or float16; ``PackedStore`` in packed
integer codes (``kvevict.storage.codes``). Reading happens in pieces of at most ``CHUNK`` slots, so at
most one chunk of a layer exists in full precision at a time."""

from __future__ import annotations

import torch

from ..kernels.runs import Run
from ..kernels.store import dequantize_from, quantize_into, quantize_pair
from .codes import dequantize
from .interface import Piece

CHUNK = 2048  # slots dequantized at once when attention reads a packed store
_BITS_AS_INT16 = (torch.float16, torch.bfloat16)


def make_store(b, h, n, dk, dv, dtype, device, bits=None, group: int = 32):
    if bits in (None, 16):
        return DenseStore(b, h, n, dk, dv, torch.float16 if bits == 16 else dtype, dtype, device)
    return PackedStore(b, h, n, dk, dv, dtype, device, bits, group)


def trailing(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (b, h, j) index or mask viewed with ``like``'s trailing dims (head_dim for keys/values) as 1."""
    return t.view(*t.shape, *([1] * (like.dim() - 3)))


def expand_index(idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (b, h, j) slot index expanded over ``like``'s trailing dims, for gather / scatter on dim 2."""
    return trailing(idx, like).expand(*idx.shape, *like.shape[3:])


def scatter(store: torch.Tensor, idx: torch.Tensor, src: torch.Tensor, take=None) -> None:
    """store[b, h, idx[b, h, j]] = src[b, h, j] where take (b, h, j) is True (None: everywhere)."""
    full = expand_index(idx, store)
    if take is not None:
        src = torch.where(trailing(take, store), src, store.gather(2, full))
    if store.dtype in _BITS_AS_INT16:
        # torch's CPU scatter_ copies a float16 / bfloat16 tensor whole on every call (the decode
        # step paid it per layer); the same bytes viewed as int16 are written in place, bit for bit.
        store, src = store.view(torch.int16), src.view(torch.int16)
    store.scatter_(2, full, src)


class DenseStore:
    bits: int | None = None  # 16 for float16 storage, None for the model's dtype

    def __init__(self, b, h, n, dk, dv, dtype, compute_dtype, device):
        self.compute_dtype = compute_dtype
        self.keys = torch.zeros(b, h, n, dk, dtype=dtype, device=device)
        self.values = torch.zeros(b, h, n, dv, dtype=dtype, device=device)
        if dtype == torch.float16:
            self.bits = 16

    @classmethod
    def over(cls, keys, values, compute_dtype) -> "DenseStore":
        """A store reading the given (b, h, n, d) tensors (a paged store's rows laid out in a rectangle)."""
        self = cls.__new__(cls)
        self.compute_dtype, self.keys, self.values = compute_dtype, keys, values
        if keys.dtype == torch.float16:
            self.bits = 16
        return self

    def ensure(self, fills) -> None:
        """Every row's slots below its fill exist already: the rectangle is ``capacity`` wide."""

    def resize(self, n: int, fn) -> None:
        self.map_batch(fn)

    def disown(self) -> None:
        """A rectangle's rows are copied when appended to another cache: nothing to hand over."""

    def write(self, idx, k, v, take=None) -> None:
        scatter(self.keys, idx, k.to(self.keys.dtype), take)
        scatter(self.values, idx, v.to(self.values.dtype), take)

    def read(self, idx):
        """Keys and values of slots ``idx`` (b, h, m), in the compute dtype."""
        return tuple(t.gather(2, expand_index(idx, t)).to(self.compute_dtype) for t in (self.keys, self.values))

    def pieces(self, n: int) -> list[Piece]:
        k, v = self.keys[:, :, :n], self.values[:, :, :n]
        if k.dtype == self.compute_dtype:  # views: no copy at all
            return [Piece(n, lambda: k, lambda: v)]
        if torch.compiler.is_compiling():  # one piece: a loop over n's spans would make n a constant of the graph
            return [Piece(n, lambda: k.to(self.compute_dtype), lambda: v.to(self.compute_dtype))]

        def piece(s, e):
            return Piece(
                e - s, lambda: k[:, :, s:e].to(self.compute_dtype), lambda: v[:, :, s:e].to(self.compute_dtype)
            )

        return [piece(s, e) for s, e in _spans(n)]

    def run(self, n: int):
        """Slots [0, n) as stored, for a fused decode kernel (views, no copy)."""
        return Run(self.bits or 32, 0, (self.keys[:, :, :n],), (self.values[:, :, :n],), n)

    def map_batch(self, fn) -> None:
        self.keys, self.values = fn(self.keys), fn(self.values)

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class _Packed:
    """One of K or V: codes (b, h, n, d * bits / 8), zeros and steps (b, h, n, d / group), all uint8."""

    def __init__(self, b, h, n, d, device, bits, group):
        self.d, self.bits, self.group = d, bits, group
        self.codes = torch.zeros(b, h, n, d * bits // 8, dtype=torch.uint8, device=device)
        self.zero = torch.zeros(b, h, n, d // group, dtype=torch.uint8, device=device)
        self.step = torch.zeros(b, h, n, d // group, dtype=torch.uint8, device=device)

    def tensors(self):
        return self.codes, self.zero, self.step


class PackedStore:
    def __init__(self, b, h, n, dk, dv, compute_dtype, device, bits, group):
        self.bits, self.group, self.compute_dtype = bits, group, compute_dtype
        self.k = _Packed(b, h, n, dk, device, bits, group)
        self.v = _Packed(b, h, n, dv, device, bits, group)

    @classmethod
    def over(cls, parts: list, bits: int, group: int, compute_dtype) -> "PackedStore":
        """A store reading the given codes, zeros and steps of K then V (each (b, h, n, width))."""
        self = cls.__new__(cls)
        self.bits, self.group, self.compute_dtype = bits, group, compute_dtype
        self.k, self.v = _Packed.__new__(_Packed), _Packed.__new__(_Packed)
        for part, (codes, zero, step) in ((self.k, parts[:3]), (self.v, parts[3:])):
            part.bits, part.group, part.d = bits, group, codes.shape[-1] * 8 // bits
            part.codes, part.zero, part.step = codes, zero, step
        return self

    ensure = DenseStore.ensure
    resize = DenseStore.resize
    disown = DenseStore.disown

    def write(self, idx, k, v, take=None) -> None:
        stores = (*self.k.tensors(), *self.v.tensors())
        if quantize_into(stores, idx, k, v, self.bits, self.group, take) is not NotImplemented:
            return  # one fused call: quantized straight into the slots
        for store, src in zip(stores, quantize_pair(k, v, self.bits, self.group)):
            scatter(store, idx, src, take)

    def _deq(self, part: _Packed, sl) -> torch.Tensor:
        return dequantize(part.codes[sl], part.zero[sl], part.step[sl], self.bits, self.group, self.compute_dtype)

    def read(self, idx):
        got = dequantize_from([*self.k.tensors(), *self.v.tensors()], idx, self.bits, self.group, self.compute_dtype)
        if got is not NotImplemented:
            return got
        out = []
        for part in (self.k, self.v):
            got = [t.gather(2, expand_index(idx, t)) for t in part.tensors()]
            out.append(dequantize(*got, self.bits, self.group, self.compute_dtype))
        return tuple(out)

    def pieces(self, n: int) -> list[Piece]:
        def piece(s, e):
            sl = (slice(None), slice(None), slice(s, e))
            return Piece(e - s, lambda: self._deq(self.k, sl), lambda: self._deq(self.v, sl))

        return [piece(s, e) for s, e in _spans(n)]

    def run(self, n: int):
        """Slots [0, n) as stored (packed codes, zeros, steps), for a fused decode kernel: views, no copy."""
        return Run(
            self.bits,
            self.group,
            tuple(t[:, :, :n] for t in self.k.tensors()),
            tuple(t[:, :, :n] for t in self.v.tensors()),
            n,
        )

    def map_batch(self, fn) -> None:
        for part in (self.k, self.v):
            part.codes, part.zero, part.step = (fn(t) for t in part.tensors())

    def nbytes(self) -> int:
        return sum(t.nbytes for part in (self.k, self.v) for t in part.tensors())

    @property
    def keys(self):  # the packed codes: what "the key storage" is for this store
        return self.k.codes

    @property
    def values(self):
        return self.v.codes


def _spans(n: int):
    return [(s, min(n, s + CHUNK)) for s in range(0, n, CHUNK)]


class RectField:
    """A per-slot bookkeeping tensor as one (b, h, capacity) rectangle, with ``PagedField``'s
    interface (kvevict.storage.paged) so that a tier treats both alike; its rectangle is the storage."""

    def __init__(self, t: torch.Tensor, empty):
        self.t, self.empty = t, empty

    @property
    def dtype(self):
        return self.t.dtype

    def rect(self, n: int) -> torch.Tensor:
        return self.t

    def write(self, idx, src, take=None) -> None:
        scatter(self.t, idx, src.to(self.t.dtype), take)

    def map_batch(self, fn) -> None:
        self.t = fn(self.t)

    def resize(self, n: int, fn=None) -> None:
        """``fn``: the tier's cut-or-pad; new slots are ``empty``."""
        old = self.t.shape[-1]
        self.t = fn(self.t) if fn is not None else self.t[..., :n].clone()
        if n > old:
            self.t[..., old:] = self.empty

    def astype(self, pools, dtype) -> "RectField":
        return RectField(self.t.to(dtype), self.empty)

    def nbytes(self) -> int:
        return self.t.nbytes

    def ensure(self, fills) -> None:
        """Slots are allocated with the rectangle (``resize``)."""

    def sync(self) -> None:
        """The rectangle is the storage: nothing to write back."""

    def drop_view(self) -> None:
        pass

    def disown(self) -> None:
        pass
