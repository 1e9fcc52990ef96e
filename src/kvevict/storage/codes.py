"""Key/value storage of one cache tier: ``n`` slots per (sequence, KV head), written by index.

Two kinds behind one interface (``write``, ``read``, ``pieces``, ``map_batch``, ``nbytes``):

- ``DenseStore``: keys and values as they come (the model's dtype), or in float16 (``bits=16``).
- ``PackedStore``: ``bits`` = 8, 4 or 2. Each token's key and value is cut into groups of
  ``group`` channels along the head dimension; a group stores a step ``s``, a zero byte ``z`` and
  one code per channel. With L = 2^bits - 1 levels and U = 2^(8 - bits) zero units per step:

      s = up8((max(hi, 0) - min(lo, 0)) / L),        x_hat = s * (c - z / U),
      c = clamp(round(x / s + z / U), 0, L)

  The step is one byte, an unsigned float with 5 exponent and 3 mantissa bits (``STEP_BIAS``: 2^-16
  to 2^15 * 1.875) rounded up so the grid still covers the group; it is exact in float16, bfloat16
  and float32 and decodes with one shift and one add (``step_value``). The zero -z s / U sits on a
  grid of a U-th of a step (z < 256), placed so that the group's extreme of larger magnitude is
  stored exactly (to s / 2U): keys have outlier channels, and the queries weight them most (a zero
  point on whole steps instead, as torch's quint8 has, lost more NLL on SmolLM2 for the same mean
  squared error, in a variant not kept in the tree). |x - x_hat| <= s / 2. At 4 bits, head_dim 64
  and groups of 32: 64 bytes of codes and 8 of steps and zeros per token and KV head (fp16 zero and
  step took 16).
  Codes are bit-packed into uint8 (2 codes a byte at 4 bits, 4 at 2 bits): the memory
  really shrinks, there is no dequantized copy kept.
  Per-token groups (KIVI quantizes keys per channel, across tokens) because an evicting cache
  rewrites single slots: a group that spans tokens would have to be re-quantized, from already
  quantized values, every time one of its tokens is evicted. Dividing keys by a per-channel scale
  first (SmoothQuant-style) was measured and rejected: on SmolLM2 it doubled int4's NLL cost (the
  error of the outlier channels, which queries weight most, grows with their scale); see
  docs/results/quality-per-byte.md. Reading happens in ``pieces`` of at
  most ``CHUNK`` slots, so at most one chunk of a layer exists in full precision at a time.
"""

from __future__ import annotations

import torch

BITS = (16, 8, 4, 2)  # 32: the model's own dtype (DenseStore), spelled kv_bits=None


def check_bits(bits, name: str = "kv_bits") -> None:
    if bits is None:
        return
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(
            f"{name} must be one of {', '.join(map(str, BITS))} (or None for the model's dtype), got {bits!r}."
        )


def check_group(group, head_dim: int, bits) -> None:
    """``group`` (already a positive int, see Storage) against the head dimension."""
    if bits in (8, 4, 2) and head_dim % group:
        divisors = [g for g in (8, 16, 32, 64, 128) if head_dim % g == 0]
        raise ValueError(f"group={group} does not divide the head dimension {head_dim}; choose one of {divisors}.")
    per = 8 // bits if bits in (4, 2) else 1
    if bits in (4, 2) and head_dim % per:
        raise ValueError(f"{bits}-bit packing needs a head dimension divisible by {per}, got {head_dim}.")


STEP_BIAS = 16  # a step byte u holds 2^((u >> 3) - STEP_BIAS) * (1 + (u & 7) / 8)
_STEP_BASE = (127 - STEP_BIAS) << 23  # float32 bits of u = 0, less u << 20


def step_value(u: torch.Tensor) -> torch.Tensor:
    """Step bytes -> float32 steps: the byte is the top of a float32 (exponent and 3 mantissa bits)."""
    return ((u.to(torch.int32) << 20) + _STEP_BASE).view(torch.float32)


def step_byte(step: torch.Tensor) -> torch.Tensor:
    """float32 steps (>= 0) -> the smallest step byte >= each (2^-16 below that, clamped at the top)."""
    bits = step.float().clamp(min=0).view(torch.int32) + ((1 << 20) - 1)  # round the mantissa up
    return ((bits >> 20) - (_STEP_BASE >> 20)).clamp_(0, 255).to(torch.uint8)


def zero_units(bits: int) -> int:
    """U: zero bytes per step (a zero byte spans up to 255 / U <= L steps)."""
    return 1 << (8 - bits)


def quantize(x: torch.Tensor, bits: int, group: int):
    """x (..., d) -> packed codes (..., d * bits / 8), zeros and steps (..., d / group), uint8
    (see the module doc)."""
    d = x.shape[-1]
    g = x.float().reshape(*x.shape[:-1], d // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    levels, units = (1 << bits) - 1, zero_units(bits)
    step = step_byte((hi - lo) / levels)
    s = step_value(step)
    # the grid's bottom: at the minimum, or levels steps under the maximum when that is larger
    bottom = torch.where(hi > -lo, hi - levels * s, lo)
    z = (-bottom * units / s).round_().clamp_(0, 255)
    codes = (g / s.unsqueeze(-1) + (z / units).unsqueeze(-1)).round_().clamp_(0, levels)
    return pack(codes.to(torch.uint8).reshape(x.shape), bits), z.to(torch.uint8), step


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., d) codes < 2^bits -> (..., d * bits / 8) bytes; byte j holds channels j, j + w, j + 2w, ..."""
    if bits == 8:
        return codes
    per = 8 // bits
    parts = codes.chunk(per, dim=-1)
    out = parts[0].clone()
    for k in range(1, per):
        out |= parts[k] << (bits * k)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (bits * k)) & mask for k in range(8 // bits)], dim=-1)


def dequantize(codes, zero, step, bits: int, group: int, dtype) -> torch.Tensor:
    """x_hat = (s / U) * (U c - z), in ``dtype``: U c - z is an integer below 256 in magnitude and
    s / U a 4-bit mantissa, both exact in any float dtype, so the product is rounded once."""
    units = zero_units(bits)
    c = unpack(codes, bits).to(dtype)
    shape = c.shape
    c = c.view(*shape[:-1], shape[-1] // group, group)
    # in place on the fresh float codes: a broadcasting torch.addcmul into a new tensor is ~10x
    # slower on CPU (measured on (8, 3, 1639, 64): 47 ms against 4.3 ms, 1 thread)
    c.mul_(units).sub_(zero.to(dtype).unsqueeze(-1))
    return c.mul_((step_value(step) / units).to(dtype).unsqueeze(-1)).view(shape)


def slot_bytes(head_dim_k: int, head_dim_v: int, bits, group: int, dtype_bytes: int) -> float:
    """Bytes one slot of one (sequence, KV head) takes for its key and value in a store."""
    if bits is None:
        return (head_dim_k + head_dim_v) * dtype_bytes
    if bits == 16:
        return (head_dim_k + head_dim_v) * 2
    return sum(d * bits / 8 + 2 * (d // group) for d in (head_dim_k, head_dim_v))
