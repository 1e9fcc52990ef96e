"""Per-layer attention statistics of one text, collected by an attention function registered
through transformers' AttentionInterface under its own name. Queries are processed in chunks
(at most ``_CHUNK_ELEMENTS`` scores at once), so no n x n matrix is ever built.

For each layer, with a_t(i) the attention query t gives key i averaged over query heads:
  sparsity  = share of (head, query, visible key) scores below 1% of their row's maximum
              (H2O paper, Sec. 3: "over 95% of attention scores are sparse")
  acc[i]    = sum_t a_t(i), the accumulated attention (H2O's heavy-hitter score)
  snapshots = acc restricted to the queries seen so far, at checkpoints t_1 < t_2 < ..., to
              measure how stable the top-k heavy hitters are as the text goes on
  traces    = a_t(i) for all t >= i for a few tracked keys, from which RoCo's running standard
              deviation std_i(t) = std(a_i(i), ..., a_t(i)) is computed
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..attention import kvevict_mask

OBSERVE_NAME = "kvevict_observe"
_CHUNK_ELEMENTS = 1 << 22
SPARSE_THRESHOLD = 0.01


@dataclass
class LayerStats:
    below: float = 0.0  # scores below 1% of their row max (visible keys only)
    visible: float = 0.0
    acc: torch.Tensor | None = None  # (n,)
    snapshots: dict = field(default_factory=dict)  # checkpoint t -> acc over queries < t, keys < t
    traces: torch.Tensor | None = None  # (n_tracked, n): a_t(i) for tracked keys i (0 before i)


class Recorder:
    def __init__(self, n: int, checkpoints: list[int], tracked: list[int]):
        self.n, self.checkpoints, self.tracked = n, sorted(checkpoints), list(tracked)
        self.layers: dict[int, LayerStats] = {}


_active: Recorder | None = None


def observe_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None, **kwargs
):
    """Exact causal softmax attention (one unpadded sequence) that also records statistics."""
    rec = _active
    b, hq, q, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    if b != 1 or q != n:
        raise ValueError("the observatory runs one unpadded sequence in a single forward pass.")
    g = hq // hkv
    scale = scaling if scaling is not None else d**-0.5
    st = rec.layers.setdefault(module.layer_idx, LayerStats()) if rec is not None else None
    if st is not None:
        st.acc = torch.zeros(n)
        st.traces = torch.zeros(len(rec.tracked), n)
    qg = query.view(b, hkv, g, q, d)
    out = torch.empty(b, hkv, g, q, value.shape[-1], dtype=query.dtype)
    step = max(1, _CHUNK_ELEMENTS // (hq * n))
    # chunk ends include the checkpoints, so acc at each checkpoint is exact
    ends = sorted({min(q, s + step) for s in range(0, q, step)} | set(rec.checkpoints if rec else []))
    s = 0
    idx = torch.arange(n)
    for e in ends:
        if e <= s or e > q:
            continue
        scores = torch.matmul(qg[:, :, :, s:e], key[:, :, None, :e].transpose(-1, -2)).float() * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        causal = idx[:e].view(1, -1) <= idx[s:e].view(-1, 1)  # (c, e)
        if sliding_window is not None:
            causal &= idx[s:e].view(-1, 1) - idx[:e].view(1, -1) < sliding_window
        scores.masked_fill_(~causal, float("-inf"))
        probs = torch.softmax(scores, -1)
        out[:, :, :, s:e] = torch.matmul(probs.to(value.dtype), value[:, :, None, :e])
        if st is not None:
            rowmax = probs.amax(-1, keepdim=True)
            st.below += ((probs < SPARSE_THRESHOLD * rowmax) & causal).sum().item()
            st.visible += causal.sum().item() * hq
            mean_heads = probs[0].mean(dim=(0, 1))  # (c, e): averaged over all query heads
            st.acc[:e] += mean_heads.sum(0)
            rows = [j for j, i in enumerate(rec.tracked) if i < e]  # keys this chunk can see
            if rows:
                st.traces[rows, s:e] = mean_heads[:, [rec.tracked[j] for j in rows]].T
            if e in rec.checkpoints:
                st.snapshots[e] = st.acc[:e].clone()
        s = e
    return out.view(b, hq, q, -1).transpose(1, 2).contiguous(), None


def register() -> None:
    AttentionInterface.register(OBSERVE_NAME, observe_attention)
    AttentionMaskInterface.register(OBSERVE_NAME, kvevict_mask)


@torch.no_grad()
def observe(model, ids: torch.Tensor, n_checkpoints: int = 16, n_tracked: int = 8) -> Recorder:
    """Run ``ids`` (1, n) through ``model`` once with the observing attention; restore the
    model's attention implementation afterwards."""
    global _active
    n = ids.shape[1]
    if n < 16:
        raise ValueError(f"the text is too short to observe ({n} tokens); give at least 16.")
    checkpoints = sorted({max(2, round(n * (k + 1) / n_checkpoints)) for k in range(n_checkpoints)})
    tracked = sorted({round(n * k / (2 * n_tracked)) for k in range(1, n_tracked + 1)})  # first half
    rec = Recorder(n, checkpoints, tracked)
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(OBSERVE_NAME)
    _active = rec
    try:
        model(ids, use_cache=False)
    finally:
        _active = None
        model.set_attn_implementation(previous)
    return rec
