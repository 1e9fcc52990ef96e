"""Re-rotating cached keys for compact positions (StreamingLLM, Xiao et al., ICLR 2024).

Keys are cached after RoPE at their true positions p. RoPE rotations compose, R(p + delta) =
R(delta) R(p), so a cached key moves to position p + delta with one more rotation by delta:

    k' = k * cos(delta * theta) + rotate_half(k) * sin(delta * theta)

In compact mode the kept keys sit at their rank among the kept tokens and the queries right
after them, so the distances the model sees never exceed the cache size, however long the input.
"""

from __future__ import annotations

import torch

from .storage.interface import Piece


def rope_inv_freq(model) -> torch.Tensor:
    """The model's RoPE frequencies theta (head_dim / 2,), or a clear error if it has none."""
    for module in model.modules():
        per_kind = {
            n[: -len("_inv_freq")]: b
            for n, b in module.named_buffers(recurse=False)
            if n.endswith("_inv_freq") and not n.endswith("original_inv_freq")
        }
        kinds = sorted(per_kind)
        freqs = list(per_kind.values())
        if any(f.shape != freqs[0].shape or not torch.equal(f, freqs[0]) for f in freqs[1:]):
            # Gemma 3: local and global layers rotate with different bases
            raise ValueError(
                f"{type(model).__name__} rotates its {' and '.join(kinds)} layers with different RoPE "
                "frequencies; compact positions re-rotate keys with one, so they are not supported "
                "for it (drop compact=True; its context is config.max_position_embeddings)."
            )
        freq = freqs[0] if freqs else getattr(module, "inv_freq", None)
        if isinstance(freq, torch.Tensor) and freq.dim() == 1:
            return freq.detach().float().clone()
    raise ValueError(f"{type(model).__name__} has no rotary embedding (inv_freq); compact positions need RoPE.")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def shift_keys(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys (..., n, d) rotated at positions p, returned rotated at p + delta; delta (..., n)."""
    angles = delta.to(torch.float32).unsqueeze(-1) * inv_freq.to(keys.device)  # (..., n, d/2)
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(keys.dtype)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(keys.dtype)
    return keys * cos + rotate_half(keys) * sin


def compact_positions(pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Rank of each slot's token among the kept ones, by original position (invalid slots last)."""
    key = torch.where(valid, pos, torch.iinfo(pos.dtype).max)
    order = key.argsort(dim=-1, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(pos.shape[-1], device=pos.device).expand_as(order).contiguous())
    return ranks


class CompactPositions:
    """A layer's compact positions: each step the kept keys move to their rank r among the kept
    tokens and the new tokens follow at f, f + 1, ... (f kept); the shift d = (first new position)
    - f maps ranks onto the queries' own rotation, so each kept key is re-rotated by
    delta = r + d - p (``shift_keys``), piece by piece as attention reads it."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq

    def apply(
        self, pieces: list, pos_past: torch.Tensor, valid_past: torch.Tensor, n_real: torch.Tensor, keyspace=None
    ):
        """(pieces re-rotated, their compact positions); ``keyspace``: keys stored in a rotated basis
        are taken back to the model's, re-rotated by RoPE, and stored again."""
        f = pos_past.shape[-1]
        if not f:
            return pieces, pos_past
        compact = compact_positions(pos_past, valid_past) + (n_real - f).view(-1, 1, 1)
        delta, inv_freq = compact - pos_past, self.inv_freq

        def shift(k, d):
            if keyspace is None:
                return shift_keys(k, d, inv_freq)
            return keyspace.enter(shift_keys(keyspace.leave(k), d, inv_freq))

        def piece(p: Piece, d: torch.Tensor) -> Piece:  # its own closure over p and d
            return Piece(p.n, lambda: shift(p.keys(), d), p.values)

        out, o = [], 0
        for p in pieces:
            out.append(piece(p, delta[..., o : o + p.n]))
            o += p.n
        return out, compact
