"""Arithmetic of KV memory and of the memory-bandwidth floor of a decode step.

Decoding one token per sequence is memory-bound on a CPU: every step must read all weights once
and every kept key/value once, so

    floor_seconds = (weight_bytes + kept_kv_bytes) / bandwidth

is a lower bound on the step time (H2O, Zhang et al. 2023, sec. 5: a smaller cache means less
traffic per step and room for a larger batch). ``bandwidth`` is the measured copy bandwidth in the
STREAM convention: bytes read + bytes written per second.
"""

from __future__ import annotations


def kv_bytes_per_token(
    num_layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, v_head_dim: int | None = None
) -> int:
    """Bytes of keys + values one token occupies across all layers of one sequence."""
    v_dim = head_dim if v_head_dim is None else v_head_dim
    return num_layers * kv_heads * (head_dim + v_dim) * dtype_bytes


def model_kv_bytes_per_token(config, dtype_bytes: int = 4) -> int:
    """``kv_bytes_per_token`` read off a transformers config (Llama-style attributes)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return kv_bytes_per_token(cfg.num_hidden_layers, kv_heads, head_dim, dtype_bytes)


def copy_bandwidth(nbytes_copied: int, seconds: float) -> float:
    """Bytes per second of a copy of ``nbytes_copied`` bytes: it reads them and writes them."""
    if seconds <= 0:
        raise ValueError("a copy must take a positive time")
    return 2 * nbytes_copied / seconds


def floor_seconds(weight_bytes: int, kv_bytes: int, bandwidth: float) -> float:
    """Least time a decode step can take: weights read once plus the kept K/V read once."""
    if bandwidth <= 0:
        raise ValueError("bandwidth must be positive")
    return (weight_bytes + kv_bytes) / bandwidth


def max_batch(memory_bytes: int, bytes_per_sequence: int) -> int:
    """Largest number of sequences whose cache state fits in ``memory_bytes`` (0 if none fits)."""
    if bytes_per_sequence <= 0:
        raise ValueError("bytes_per_sequence must be positive")
    return int(memory_bytes // bytes_per_sequence)
