"""``kvzip-sample``: KVzip's ranking for a model with no probe, its reconstruction run on a sample
of the prompt and the other keys scored by a probe fitted to that sample in the same call."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..probe import EDGES, EPS, features, fit
from ..record import record_attention_stats
from .kvzip import REPEAT, KVzipPooled, context_scores, past_recorded
from .probe import WINDOW, prefilled, raised, window_reads, window_tail
from .registry import register

SHARE = 0.25  # the prompt's share reconstructed (docs/results/probe.md, "A probe fitted on the prompt itself")
PIECE = 32  # tokens per reconstructed piece
RIDGE = 1.0  # the ridge per sampled key: shrinks the fit on a short prompt's few keys as much as on many


@register("kvzip-sample")
@dataclass
class KVzipSample(KVzipPooled):
    """KVzip pooled over heads and layers (``kvzip-pool``), its reconstruction run on a share of the
    prompt only. The prompt's keys S, in pieces of ``piece`` tokens spread evenly over it (a share
    ``share`` of them), are scored by KVzip's reconstruction (Kim et al. 2025): ``[repeat, pieces]``
    run once over the cached prompt, ``score(i) = max_{t, g in G(i)} a_{t,g}(i)``. Per layer, a
    ridge map from the keys' features (``kvevict.probe.features``: values, rotary pair norms, the
    position's bands) to those scores' logs is fitted on S (KVzap's probe, fitted on the prompt
    itself instead of calibration texts), and a key outside S gets

        s_i = max(exp(w . x_i + b), r_i)     (r_i: what the reconstruction queries read it)

    then each score is raised to the prompt's last ``window`` queries' reads (``kvzip-probe``'s).
    No probe file is needed; the pass costs about ``share`` of KVzip's."""

    name = "kvzip-sample"

    tail = staticmethod(window_tail)

    @classmethod
    @torch.no_grad()
    def record(
        cls,
        model,
        tokenizer,
        input_ids,
        attention_mask=None,
        chunk: int = 4096,
        context=None,
        share: float = SHARE,
        piece: int = PIECE,
        window: int = WINDOW,
        **params,
    ) -> "KVzipSample":
        """Score ``input_ids`` (see the class). ``context``: a DynamicCache that already holds them,
        as for ``kvevict.policies.probe.KVzipProbe.record`` (its sliding layers holding the last ``window`` tokens' past:
        see ``tail``), left holding them; without it the prompt runs once into a cache of every
        layer's keys. ``chunk`` is taken for the same call as KVzip's and unused."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("kvzip-sample records unpadded prompts only: give it one prompt per batch.")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share <= 1.0:
            raise ValueError(f"share is the prompt's share kvzip-sample reconstructs, in (0, 1]; got {share!r}.")
        if isinstance(piece, bool) or not isinstance(piece, int) or piece < 2:
            raise ValueError(f"piece is the tokens per reconstructed piece, an integer >= 2; got {piece!r}.")
        context = prefilled(model, input_ids, context)
        n = input_ids.shape[1]
        reads = window_reads(model, input_ids, context, window)  # first: it crops what the tail recorded
        measured, sampled = reconstructed(model, tokenizer, input_ids, context, share, piece)
        scores = [fitted(layer.keys, layer.values, s, sampled) for layer, s in zip(context.layers, measured)]
        return cls(scores=raised(model, n, scores, reads), **params)


def starts(n: int, share: float, piece: int) -> list[int]:
    """Where the reconstructed pieces begin: ``ceil(n share / piece)`` of them, centred in equal
    strides of the prompt (the whole of it at share 1, pieces overlapping where they must)."""
    piece = min(piece, n)
    k = max(1, math.ceil(n * share / piece))
    stride = n / k
    return [min(max(0, int((j + 0.5) * stride - piece / 2)), n - piece) for j in range(k)]


@torch.no_grad()
def reconstructed(model, tokenizer, input_ids, context, share: float, piece: int) -> tuple[list, torch.Tensor]:
    """(per layer (b, hkv, n) the most the reconstruction queries read each key, (n,) the keys fitted
    on): ``[repeat, piece_1, ..., piece_k]`` run once over ``context`` and cropped off again. A
    piece's first key is not fitted on: no query copies the token before it."""
    n = input_ids.shape[1]
    piece = min(piece, n)
    rep = tokenizer(REPEAT, add_special_tokens=False, return_tensors="pt")["input_ids"].to(input_ids.device)
    at = starts(n, share, piece)
    sampled = torch.zeros(n, dtype=torch.bool, device=input_ids.device)
    for s in at:
        sampled[s + 1 : s + piece] = True
    seq = torch.cat([rep.expand(input_ids.shape[0], -1)] + [input_ids[:, s : s + piece] for s in at], dim=1)
    with past_recorded(context):  # the crop gives a sliding layer its window back
        stats = record_attention_stats(model, seq, ("max",), cache=context, observe=seq.shape[1])
        context.crop(-seq.shape[1])
    return [context_scores(st["max"], n, seq.shape[1]) for st in stats], sampled


def fitted(keys: torch.Tensor, values: torch.Tensor, measured: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """One layer's scores (b, hkv, n): ``measured`` on the sampled keys, elsewhere the larger of it
    and the ridge map fitted on the sampled keys (see ``KVzipSample``). ``keys``/``values``: the
    last m of the n (a sliding layer's window); a key before them keeps its measured 0."""
    b, h, n = measured.shape
    m = keys.shape[2]
    x = features(keys, values, EDGES, n)  # (b, m, F)
    y = torch.log(measured[..., n - m :].float() + EPS).transpose(1, 2)  # (b, m, hkv)
    on = sampled[n - m :]
    rows = int(on.sum()) * b
    if rows < 2:  # a window with no sampled key: nothing to fit
        return measured
    w = fit([x[:, on].reshape(rows, -1)], [y[:, on].reshape(rows, h)], RIDGE * rows)[0].to(x.device)
    pred = (x @ w[:-1] + w[-1]).exp().transpose(1, 2).to(measured.dtype)  # (b, hkv, m)
    held = measured[..., n - m :]
    out = measured.clone()
    out[..., n - m :] = torch.where(on, held, torch.maximum(pred, held))
    return out
