"""What a stock transformers cache holds: the denominator of every bytes ratio kvevict shows.

A ratio such as ``memory=0.2`` or "KV held 20% of full" is a share of what transformers' own
``DynamicCache`` would hold for the same tokens with 16-bit keys and values (2 bytes per value,
whatever the model's dtype), as KIVI, KVQuant, KVzip and kvpress state compression:

    stock_bytes = batch x sum over layers l of  kv_heads x (d_k + d_v) x 2 x kept_l(tokens)
    kept_l(n)   = min(n, window_l - 1)   on a sliding-window layer (DynamicSlidingWindowLayer
                                          keeps its last window - 1 tokens after each update)
                = n                      on every other layer

Which layers slide and how far comes from transformers itself (``get_layer_types_and_kwargs``, what
``DynamicCache(config=...)`` builds its layers from): Gemma 3's ``layer_types``, or Mistral-style
configs with ``sliding_window`` set and no ``layer_types`` (every layer slides).
"""

from __future__ import annotations

from .shape import config_text

STOCK_BYTES = 2  # bytes per key/value channel of the cache ratios are stated against (16 bits)


def text_config(config):
    """The config of the decoder whose layers a stock cache holds."""
    return config_text(config, decoder=True)


def stock_windows(config) -> list[int | None]:
    """Per decoder layer, the tokens a stock ``DynamicCache`` keeps at most (window - 1 on a
    sliding or chunked layer), or None where it keeps every token."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    cfg = text_config(config)
    n = cfg.num_hidden_layers
    try:
        types, kwargs = get_layer_types_and_kwargs(cfg)
    except (AttributeError, TypeError):  # a config without per-layer fields: every layer full
        return [None] * n
    out = []
    for kind, kw in zip(types, kwargs):
        window = kw.get("sliding_window") if kind in ("sliding_attention", "chunked_attention") else None
        out.append(max(1, int(window) - 1) if isinstance(window, int) and window > 0 else None)
    return (out + [None] * n)[:n]


def sliding_windows(config) -> list[int | None] | None:
    """``stock_windows`` for a model with sliding layers, None for one without (every layer full)."""
    windows = stock_windows(config)
    return windows if any(w is not None for w in windows) else None


def kept_tokens(windows: list[int | None], tokens: int) -> int:
    """Token slots a stock cache holds over all layers (per sequence and KV head) after ``tokens``."""
    return sum(tokens if w is None else min(tokens, w) for w in windows)


def stock_kv_bytes(config, tokens: int, batch: int = 1, dtype_bytes: int = STOCK_BYTES) -> int:
    """Bytes a stock ``DynamicCache`` holds for ``tokens`` tokens (padding included) of ``batch``
    sequences at ``dtype_bytes`` per value (see the module's formula)."""
    cfg = text_config(config)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return batch * heads * 2 * d * dtype_bytes * kept_tokens(stock_windows(cfg), tokens)
