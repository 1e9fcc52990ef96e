"""The spec of fused decode attention, in plain torch: dequantize one chunk at a time, then
multiply (exactly what ``kvevict.attention.attend`` does for one query).

One query per sequence attends over the stored runs, in order, followed by its own key:

    s_i = (scale * q) . k_hat_i     (fp32 accumulate; k_hat = step * code + zero for packed runs)
    s_i = tanh(s_i / c) * c          (softcap c, when given)
    p = softmax(s) over the visible keys (masked keys: -inf),   out = sum_i p_i v_hat_i
    pg_i = sum over the query heads of key i's KV group of p_i   (GQA: query head j uses KV head j // g)

``summary`` = (k_bar, v_bar, log n), each (b, hkv, 1, ...): one more key, before the new one, that
stands for n evicted tokens (``kvevict.merge``): s = (scale * q) . k_bar (softcapped) + log n, its
value v_bar; it takes part in the softmax, and pg leaves it out (it is no stored slot).
"""

from __future__ import annotations

import torch

from ..storage.codes import dequantize

CHUNK = 2048  # slots dequantized at once, as kvevict.storage.rect reads a packed store


def _chunks(run, part: tuple, dtype):
    """(start, end, keys-or-values of slots [start, end) in ``dtype``) over the run."""
    for s in range(0, run.n, CHUNK):
        e = min(run.n, s + CHUNK)
        if run.packed:
            codes, zero, step = (t[:, :, s:e] for t in part)
            yield s, e, dequantize(codes, zero, step, run.bits, run.group, dtype)
        else:
            yield s, e, part[0][:, :, s:e].to(dtype)


def decode_attention_reference(q, runs, k_new, v_new, mask, scale, softcap=None, summary=None, pg=True):
    """Returns (out (b, hq, 1, d) in q's dtype, pg (b, hkv, n_total + 1) float32, or None when
    ``pg`` is False); see the module doc."""
    runs = [r.rect() for r in runs]  # paged runs: each row's pages in order
    b, hq, _, d = q.shape
    hkv = k_new.shape[1]
    g = hq // hkv
    dtype = q.dtype
    qs = (q * scale).reshape(b, hkv, g, d)  # scaling the query rows, as attend does
    parts = [torch.matmul(qs, keys.transpose(-1, -2)) for r in runs for _, _, keys in _chunks(r, r.k, dtype)]
    if summary is not None:
        parts.append(torch.matmul(qs, summary[0].reshape(b, hkv, 1, d).transpose(-1, -2)))
    parts.append(torch.matmul(qs, k_new.reshape(b, hkv, 1, d).transpose(-1, -2)))
    scores = torch.cat(parts, dim=-1).float()  # (b, hkv, g, n_total [+ 1] + 1)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    n_total = scores.shape[-1] - 1 - (summary is not None)
    if mask is not None:
        scores[..., :n_total].masked_fill_(~mask[:, :, None, :], float("-inf"))
    if summary is not None:
        scores[..., n_total] += summary[2].reshape(b, hkv, 1)
    probs = torch.softmax(scores, dim=-1)
    pc = probs.to(dtype)
    out = torch.matmul(pc[..., -1:], v_new.reshape(b, hkv, 1, -1))
    if summary is not None:
        out = out + pc[..., n_total : n_total + 1] * summary[1].reshape(b, hkv, 1, -1).to(dtype)
        probs = torch.cat([probs[..., :n_total], probs[..., -1:]], dim=-1)
    off = 0
    for r in runs:
        for s, e, values in _chunks(r, r.v, dtype):
            out = out + torch.matmul(pc[..., off + s : off + e], values)
        off += r.n
    return out.reshape(b, hq, 1, -1), probs.sum(2) if pg else None
