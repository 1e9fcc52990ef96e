"""The ``kvevict`` attention function and its mask function, registered through transformers'
public ``AttentionInterface`` / ``AttentionMaskInterface`` (no monkey-patching).

The attention returns what SDPA returns and, when the layer's cache is an eviction layer, hands
that layer the per-key attention statistics its policy asks for:

    sum[i]   = sum_t a_t(i)              (H2O's accumulated attention, AAS)
    sq[i]    = sum_t a_t(i)^2            (RoCo's variance)
    last[i]  = a_T(i)                    (TOVA / LTAS: last query only)
    obs[i]   = sum_{t in last w queries} a_t(i)   (SnapKV's observation window)
    hits[i]  = sum_t 1[a_t(i) >= G / n_t]         (AQAS: attention above uniform, quantised)
    hits_ema[i] = sum_t gamma^(T-t) 1[a_t(i) >= G / n_t]   (Scissorhands' history window, decayed)
    max[i]   = max over the last w queries and the group's heads of a_t,g(i)   (KVzip's score)
    knorm[i] = ||k_i||_2                     (key norm, taken once when the key is written)
    expected[i] = m * sum_g softmax_i(mu_g . k_i + 1/2 k_i^T diag(var_g) k_i)   (expected attention:
                 the last w queries of a forward of m queries as a Gaussian per query head g)

where a_t(i) is the softmax probability query t gives key i, summed over the query heads that
share key i's KV head (GQA). Each statistic computes itself (``kvevict.stats``: its ``Stat``
starts a column, adds each chunk of scored queries to it, finishes it); attention scores the
chunks and hands them over. Queries are processed in chunks, so at most ``chunk x n`` scores
exist at once; no ``n x n`` matrix is ever built, not even as a mask: our mask function passes the
2-D padding mask through instead of expanding it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .input_checks import check_mask_length, check_positions_follow
from .kernels import decode_attention, resolve_backend
from .stats import FUSED_CANNOT, Chunk, Collection
from .storage.interface import Piece
from .tail import scored_tail as _scored_tail
from .tail import sdpa_causal as _sdpa_causal

ATTN_NAME = "kvevict"


def fused_backend(query) -> str:
    """The decode-attention backend for these queries (``kvevict.kernels``; "torch": attend's own path)."""
    return resolve_backend(query.device.type)


# Scores held per query chunk (floats): 2**21 fp32 = 8 MiB, small enough to stay in cache.
_CHUNK_ELEMENTS = 1 << 21
# bfloat16 scores go through softmax as they are: its kernel computes in float32 and rounds once to
# bfloat16, the probabilities the output's matmul reads anyway, so the output is unchanged and two
# float32 copies of the chunk's scores are not made (float16's range would underflow small ones)
_SOFTMAX_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class PaddingInfo:
    """What the mask function hands attention: the 2-D padding mask (True = real token) and the
    position of the first key attention receives (non-zero for sliding-window caches)."""

    padding: torch.Tensor | None  # (batch, seen + q_length) bool, or None when nothing is padded
    kv_offset: int
    # a compileable cache's ``generate`` makes the masks before the forward, whose mask function
    # then gets this back: transformers reads ``ndim`` (2 would be a raw padding mask, 4 a mask made)
    ndim = 0

    def real_upto(self, n: int) -> torch.Tensor:
        """The padding mask for positions [0, n); tokens past its end are real."""
        padding = self.padding
        assert padding is not None, "real_upto reads a padding mask; None means nothing is padded"
        if padding.shape[-1] >= n:
            return padding[:, :n]
        return torch.nn.functional.pad(padding, (0, n - padding.shape[-1]), value=True)


def kvevict_mask(
    batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs
):
    """Mask function for ``AttentionMaskInterface``: keep the 2-D padding mask, build nothing. Given
    what it made already (generate makes a compileable cache's masks before the forward), that."""
    if isinstance(attention_mask, PaddingInfo):
        return attention_mask
    # compiled, kv_length is the host's count without the compiled steps (EvictingLayer.get_mask_sizes)
    if attention_mask is not None and attention_mask.dim() == 2 and not torch.compiler.is_compiling():
        check_mask_length(attention_mask.shape[-1], kv_offset + kv_length - q_length, q_length)
    padding = attention_mask
    if padding is not None and bool(padding.all()):
        padding = None  # the common unpadded case costs nothing later
    return PaddingInfo(padding=padding, kv_offset=kv_offset)


# The eviction layer that just ran ``update`` on this thread hands itself to the attention call
# that follows it in the same decoder layer: transformers does not pass the cache to attention.
_handoff = threading.local()


def hand_off(layer) -> None:
    if getattr(_handoff, "layer", None) is not None:
        raise RuntimeError(
            "kvevict: a cache layer was updated but no kvevict attention consumed it. The model must run "
            f"with attn_implementation='{ATTN_NAME}' (make_cache sets it; did something reset it?)."
        )
    _handoff.layer = layer


def take_handoff(key: torch.Tensor):
    layer = getattr(_handoff, "layer", None)
    _handoff.layer = None
    if layer is not None and layer.returned_keys is not key:
        raise ValueError(
            "kvevict: this model changes the cached keys between the cache update and attention, so its "
            "attention cannot be hooked for eviction. Use a standard decoder architecture (Llama, Qwen2, Mistral, ...)."
        )
    return layer


@dataclass
class _Segments:
    """Keys split into a past part (stored slots, any order) and the new tokens (in order). The
    past comes as pieces read one at a time (a packed store dequantizes one chunk at a time)."""

    pieces: list  # of kvevict.storage.Piece: consecutive runs of past slots
    pos_past: torch.Tensor | None  # (b|1, hkv|1, n_past) positions, for sliding windows
    valid_past: torch.Tensor | None  # (b, hkv|1, n_past) bool, None = all valid
    k_new: torch.Tensor  # (b, hkv, q, d), the queries' own keys
    v_new: torch.Tensor
    pos_new: torch.Tensor  # (b|1, q) positions of the new tokens
    valid_new: torch.Tensor | None  # (b, q) bool, None = all real
    runs: list | None = None  # the same past as kvevict.kernels.Run, as stored (decode: fused kernels)
    # the evicted tokens as one slot (kvevict.merge.Summary.term): mean key, mean value, log count
    summary: tuple | None = None
    # the new keys' norms in the model's basis, where the cache stores keys rotated (kvevict.keyspace)
    knorm_new: torch.Tensor | None = None
    # the queries in the stored keys' basis, rotated with the new keys (None: as the model made them)
    query: torch.Tensor | None = None


def generic_segments(key, value, q_len, info: PaddingInfo | None) -> _Segments:
    """Any cache that stores keys in order (DynamicCache, none): the last q keys are the new tokens.
    Positions count real tokens only (as generate's position ids do), so padding shifts nothing."""
    n = key.shape[2]
    kv_offset = info.kv_offset if info is not None else 0
    valid = pos = None
    if info is not None and info.padding is not None:
        pad = info.real_upto(kv_offset + n)
        pos = (pad.long().cumsum(1) - 1).clamp(min=0)[:, kv_offset:]
        valid = pad[:, kv_offset : kv_offset + n]
    else:
        pos = torch.arange(kv_offset, kv_offset + n, device=key.device).view(1, -1)
    np_ = n - q_len
    k_past, v_past = key[:, :, :np_], value[:, :, :np_]
    return _Segments(
        pieces=[Piece(np_, lambda: k_past, lambda: v_past)] if np_ else [],
        pos_past=pos[:, None, :np_],
        valid_past=None if valid is None else valid[:, None, :np_],
        k_new=key[:, :, np_:],
        v_new=value[:, :, np_:],
        pos_new=pos[:, np_:],
        valid_new=None if valid is None else valid[:, np_:],
    )


def kvevict_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None, **kwargs
):
    """SDPA-equivalent attention over (past slots + new tokens), collecting per-key statistics."""
    layer = take_handoff(key)  # first, so that a rejected call leaves no stale hand-off behind
    if dropout and module.training:
        raise ValueError("kvevict attention is for inference; call model.eval() (dropout must be off).")
    if kwargs.get("s_aux") is not None:
        raise ValueError("kvevict attention does not support attention sinks (s_aux) models such as gpt-oss.")
    if attention_mask is not None and not isinstance(attention_mask, PaddingInfo):
        raise ValueError(
            "kvevict attention got a prepared 4-D attention mask; pass a 2-D attention_mask "
            "(batch, length) as generate() does."
        )
    q_len = query.shape[2]
    if layer is not None and layer.layer_idx == 0:  # once per forward, before anything is stored
        check_positions_follow(layer, kwargs.get("position_ids"), attention_mask)
    if layer is not None:
        seg = layer.segments(value, attention_mask, q_len, query)
        wanted, params = layer.attention_request()
        if seg.query is not None:  # the stored keys' basis: same scores (kvevict.keyspace)
            query = seg.query
    else:
        seg = generic_segments(key, value, q_len, attention_mask)
        wanted, params = (), {}
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out, stats = attend(query, seg, scale, sliding_window, softcap, wanted, **params)
    if layer is not None:
        layer.absorb(stats, seg.valid_new, seg.pos_new)
    return out, None


def attend(query, seg: _Segments, scale, window, softcap, wanted=(), observe=0, gamma=1.0, block=0):
    """Chunked softmax attention. Returns output (b, q, hq, d) and a dict of per-key statistics
    over the concatenated keys [past, new] of shape (b, hkv, n_past + q), each computed by its
    declaration in ``kvevict.stats`` from the chunks of scored queries.

    observe: how many of the last queries count for "obs"; gamma: decay per query for "hits_ema";
    block: with "blocks" wanted, column sums per block of ``block`` query positions,
    shape (b, hkv, n_blocks, n_past + q) (the oracle's record of the future)."""
    b, hq, q, d = query.shape
    hkv = seg.k_new.shape[1]
    g = hq // hkv
    if q == 1 and seg.runs is not None and not FUSED_CANNOT & set(wanted) and fused_backend(query) != "torch":
        return _attend_fused(query, seg, scale, window, softcap, wanted, observe, gamma)
    n_past = sum(p.n for p in seg.pieces)
    n_all = n_past + q
    dev = query.device
    tail = _scored_tail(seg, q, n_past, window, softcap, wanted, observe)
    qs = (query * scale).view(b, hkv, g, q, d)  # scaling the few query rows beats scaling every score
    f = Collection(wanted, seg, qs, b, g, q, n_past, observe, gamma, block)
    if tail < q:  # the earlier queries need their output only: SDPA's, no scores kept
        out = _sdpa_causal(query, seg.k_new, seg.v_new, scale).reshape(b, hkv, g, q, d)
    else:
        out = torch.empty(b, hkv, g, q, d, dtype=query.dtype, device=dev)
    chunk = max(1, min(tail, _CHUNK_ELEMENTS // max(1, b * hq * n_all)))
    idx = torch.arange(q, device=dev)
    kn_t = seg.k_new.transpose(-1, -2)
    for s in range(q - tail, q, chunk):
        e = min(q, s + chunk)
        hidden = _hidden(seg, s, e, window, idx)
        probs, o = _score_chunk(qs, kn_t, seg, s, e, n_past, softcap, hidden)
        out[:, :, :, s:e] = o
        seen = _seen(hidden, e - s, n_past, s, e, dev) if "seen" in f.needs else None
        f.add(Chunk(f, s, e, probs=probs, seen=seen))
    return out.view(b, hq, q, d).transpose(1, 2).contiguous(), f.finish()


def _score_chunk(qs, kn_t, seg: _Segments, s, e, n_past, softcap, hidden):
    """Queries [s, e) over the past and new keys [0, e): their probabilities per query head
    (b, hkv, g, c, n_past + e) float32, the summary column left out, and their output (b, hkv, g, c, d).
    kn_t: the new keys, transposed (b, hkv, d, q); hidden: ``_hidden``'s masks."""
    b, hkv, g, _, d = qs.shape
    c = e - s
    # one GEMM per KV head for all its query heads; causal: this chunk sees new keys [0, e) only
    qc = qs[:, :, :, s:e].reshape(b, hkv, g * c, d)
    scores = torch.matmul(qc, kn_t[..., :e])
    if n_past:
        scores = torch.cat([torch.matmul(qc, p.keys().transpose(-1, -2)) for p in seg.pieces] + [scores], dim=-1)
    if seg.summary is not None:  # one more column, last: the evicted tokens' mean key
        scores = torch.cat([scores, torch.matmul(qc, seg.summary[0].transpose(-1, -2))], dim=-1)
    if scores.dtype not in _SOFTMAX_DTYPES:
        scores = scores.float()
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    extra = 0 if seg.summary is None else 1
    if seg.summary is not None:  # n copies of it: + log n after the softcap (-inf where nothing was evicted)
        scores[..., -1:] += seg.summary[2]
    s5 = scores.view(b, hkv, g, c, n_past + e + extra)
    hide_past, hide_new, later = hidden
    if hide_past is not None:
        s5[..., :n_past].masked_fill_(hide_past, float("-inf"))
    if hide_new is not None:
        s5[..., n_past : n_past + e].masked_fill_(hide_new, float("-inf"))
    if later is not None:  # causality only bites on the chunk's own diagonal block
        s5[..., n_past + s : n_past + e].masked_fill_(later, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b, hkv, g, c, n_past + e + extra)
    if seg.valid_new is not None:  # padding queries (fully masked rows give NaN) count for nothing
        probs = torch.where(seg.valid_new[:, None, None, s:e, None], probs, 0.0)
    pc = probs.to(qs.dtype).view(b, hkv, g * c, n_past + e + extra)
    o = torch.matmul(pc[..., n_past : n_past + e], seg.v_new[:, :, :e])
    if seg.summary is not None:
        o += pc[..., -1:] * seg.summary[1]
        probs = probs[..., :-1]  # the statistics are the kept keys'
    off = 0
    for p in seg.pieces:
        o += torch.matmul(pc[..., off : off + p.n], p.values())
        off += p.n
    return probs, o.view(b, hkv, g, c, d)


def _attend_fused(query, seg: _Segments, scale, window, softcap, wanted, observe, gamma):
    """``attend`` for one query over the layer's runs read as stored (``kvevict.kernels``): the
    kernel returns the output and pg, each key's probability summed over its KV group, from which
    the same statistics follow as in ``attend`` (one chunk of one query)."""
    assert seg.runs is not None, "the fused path reads the past as runs (attend checks it)"
    b, hq, _, d = query.shape
    hkv = seg.k_new.shape[1]
    n_past = sum(r.n for r in seg.runs)
    f = Collection(wanted, seg, None, b, hq // hkv, 1, n_past, observe, gamma)
    hidden = None if window is None else _hidden(seg, 0, 1, window, None)  # one query: no causal block
    visible = seg.valid_past if hidden is None or hidden[0] is None else ~hidden[0]
    mask = None
    if visible is not None:  # (b|1, hkv|1, [1, 1,] n_past) -> (b, hkv|1, n_past)
        mask = visible.reshape(visible.shape[0], visible.shape[1], n_past).expand(b, -1, -1)
    # a policy that collects nothing from probabilities (kvzip, recency, knorm) needs no pg: out only, as SDPA computes
    out, pg = decode_attention(
        query, seg.runs, seg.k_new, seg.v_new, mask, scale, softcap, summary=seg.summary, pg="pg" in f.needs
    )
    if seg.valid_new is not None:  # a padding query counts for nothing (attend: its probabilities are 0)
        real = seg.valid_new[:, -1].view(b, 1, 1)
        out = out * real.view(b, 1, 1, 1)
        pg = None if pg is None else pg * real
    if pg is not None:
        seen = None
        if "seen" in f.needs:
            seen = _seen(hidden or _hidden(seg, 0, 1, window, None), 1, n_past, 0, 1, query.device)
        f.add(Chunk(f, 0, 1, row=pg, seen=seen))
    return out.transpose(1, 2).contiguous(), f.finish()


def _hidden(seg: _Segments, s, e, window, idx):
    """What queries [s, e) must not see, as masks broadcastable to (b, hkv, g, c, keys), or None:
    past slots (invalid, or out of the sliding window), new keys [0, e) (padding, window), and
    ``later``: the (c, c) causal mask of the chunk's diagonal block, new keys [s, e)."""
    c = e - s
    hide_past = None
    if seg.valid_past is not None:
        hide_past = ~seg.valid_past[:, :, None, None, :]
    later = None
    if c > 1:
        later = (idx[:c].view(1, -1) > idx[:c].view(-1, 1)).view(1, 1, 1, c, c)
    hide_new = None if seg.valid_new is None else ~seg.valid_new[:, None, None, None, :e]
    if window is not None:
        qpos = seg.pos_new[:, s:e]
        qpos = qpos.view(qpos.shape[0], 1, 1, c, 1)
        if seg.pos_past is not None and seg.pos_past.shape[-1]:
            far = (qpos - seg.pos_past.unsqueeze(2).unsqueeze(2)) >= window
            hide_past = far if hide_past is None else hide_past | far
        far = (qpos - seg.pos_new[:, :e].view(seg.pos_new.shape[0], 1, 1, 1, e)) >= window
        hide_new = far if hide_new is None else hide_new | far
    return hide_past, hide_new, later


def _seen(hidden, c, n_past, s, e, dev):
    """(b|1, hkv|1, c, n_past + e) bool: which query of the chunk saw which key (for hits), from
    ``_hidden``'s masks."""
    hide_past, hide_new, later = hidden
    if later is not None:
        causal = torch.nn.functional.pad(later.view(1, 1, 1, c, c), (s, 0))
        hide_new = causal if hide_new is None else hide_new | causal
    parts = []
    for hide, n in ((hide_past, n_past), (hide_new, e)):
        if hide is None:
            parts.append(torch.ones(1, 1, c, n, dtype=torch.bool, device=dev))
        else:
            parts.append(~hide.squeeze(2).expand(-1, -1, c, n))
    bb = max(p.shape[0] for p in parts)
    hh = max(p.shape[1] for p in parts)
    return torch.cat([p.expand(bb, hh, c, -1) for p in parts], dim=-1)


def register() -> None:
    """Register the ``kvevict`` attention and mask functions (idempotent, no global patching)."""
    AttentionInterface.register(ATTN_NAME, kvevict_attention)
    AttentionMaskInterface.register(ATTN_NAME, kvevict_mask)
