"""Attention statistics of a full-cache forward, recorded per layer: what a policy that scores
the prompt in a pass of its own reads (KVzip's reconstruction maxima, the oracle's future attention).
The forward runs through an attention function registered under its own name (``kvevict_record``),
the stock cache holding every key, and the statistics are ``kvevict.attention.attend``'s."""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .attention import ATTN_NAME, attend, generic_segments, kvevict_mask

_RECORD = "kvevict_record"
_recorded: dict = {}


def _record_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None, **kwargs
):
    """Full-cache attention that keeps, per layer, the statistics asked of ``record_attention_stats``."""
    seg = generic_segments(key, value, query.shape[2], attention_mask)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out, stats = attend(query, seg, scale, sliding_window, softcap, _recorded["wanted"], **_recorded["params"])
    _recorded[module.layer_idx] = stats
    return out, None


def record_attention_stats(model, input_ids, wanted: tuple, attention_mask=None, cache=None, **params) -> list:
    """One full-cache forward over ``input_ids``; per layer, the dict of the ``wanted`` statistics
    (see ``attend``) over every key, in input order. With ``cache`` (a ``DynamicCache``)
    the forward continues that cache, which keeps the new tokens: the keys are the cache's, then
    the new ones."""
    AttentionInterface.register(_RECORD, _record_attention)
    AttentionMaskInterface.register(_RECORD, kvevict_mask)
    _recorded.clear()
    _recorded.update(wanted=tuple(wanted), params=params)
    model.set_attn_implementation(_RECORD)
    try:
        model(input_ids, attention_mask=attention_mask, cache=cache, use_cache=cache is not None, logits_to_keep=1)
    finally:
        model.set_attn_implementation(ATTN_NAME)
    n_layers = len([k for k in _recorded if isinstance(k, int)])
    return [_recorded.pop(i) for i in range(n_layers)]


def record_attention_blocks(model, input_ids, block: int, attention_mask=None) -> list:
    """Per layer (b, hkv, n_blocks, n) attention sums, blocks taken over real positions (padding
    excluded), keys in input order (the oracle's record of the future)."""
    return [st["blocks"] for st in record_attention_stats(model, input_ids, ("blocks",), attention_mask, block=block)]
