"""``kvzip-probe``: KVzip's ranking and pooled budgets with its scores predicted by the model's probe
(``kvevict.probe``) from the keys and values of the prompt's own prefill, not measured in a
reconstruction pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..probe import find, probe_path
from ..record import record_attention_stats
from ..stock import stock_windows
from .kvzip import KVzipPooled, context_scores
from .registry import register

WINDOW = 64  # the prompt's last queries whose reads join the probe's scores (SnapKV's window)


def window_tail(params: dict) -> int:
    """The prompt's last tokens a window-raised ``record`` (``kvzip-probe``, ``kvzip-sample``) crops
    off a given context and runs again: its ``window``."""
    return int(params.get("window", WINDOW))


@register("kvzip-probe")
@dataclass
class KVzipProbe(KVzipPooled):
    """KVzip pooled over heads and layers (``kvzip-pool``), each prompt key scored by the model's
    probe (``kvevict.probe``: ``s_i = exp(w . x_i + b)``, ``x_i`` its values, its keys' rotary
    pair norms and, in a probe fitted with them, its position's bands) instead of KVzip's
    reconstruction maxima, each raised to the most the prompt's last ``WINDOW`` queries read it (``record``'s ``window``). The scores come from the prefill's own
    cache and its last ``WINDOW`` tokens run once more, where KVzip's reconstruction runs the whole
    prompt again."""

    name = "kvzip-probe"

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
        probe=None,
        window: int = WINDOW,
        **params,
    ) -> "KVzipProbe":
        """Score ``input_ids`` with ``probe`` (default: the model's, ``kvevict.probe.find``).
        ``context``: a DynamicCache that already holds them (the caller's prefill, as for
        ``KVzip.record``; its sliding layers may hold their window only, their keys before it
        scoring 0, and must hold the last ``window`` tokens' past: see ``tail``); without it the
        prompt runs once into a cache of every layer's keys.
        ``chunk`` (KVzip's reconstruction piece) is taken for the same call and unused: nothing is
        reconstructed. ``window`` > 0: the prompt's last ``window`` tokens run again over the
        context, and a key's score is the larger of the probe's and the most any of those queries
        gives it (SnapKV's observation window, as a max):

            s_i = max(exp(w . x_i + b), max_{t in window, g in G(i)} a_{t,g}(i))

        so what the prompt's end asks for (a question inside it) is kept beside what the probe ranks."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("kvzip-probe records unpadded prompts only: give it one prompt per batch.")
        probe = probe if probe is not None else find(model)
        if probe is None:
            raise ValueError(
                f"kvzip-probe needs a probe fitted for this model: run `kvevict calibrate --probe --model ...` "
                f"(it writes {probe_path(model)}), or use kvzip-pool, which scores by reconstruction."
            )
        context = prefilled(model, input_ids, context)
        if len(context.layers) != len(probe.weights):
            raise ValueError(
                f"the probe was fitted on {len(probe.weights)} layers, the model has {len(context.layers)}: "
                "fit one for this model with `kvevict calibrate --probe`."
            )
        n = input_ids.shape[1]
        scores = [
            context_scores(probe.scores(i, layer.keys, layer.values, n), n, 0) for i, layer in enumerate(context.layers)
        ]
        return cls(scores=raised(model, n, scores, window_reads(model, input_ids, context, window)), **params)


def prefilled(model, input_ids, context=None):
    """``context`` checked to hold ``input_ids``; without one, a DynamicCache the prompt is run into."""
    from transformers import DynamicCache

    if context is None:
        context = DynamicCache()  # no config: a sliding layer keeps every key here, as KVzip scores them
        model.set_attn_implementation("sdpa")  # the stock cache's own attention, as generate's prefill
        model(input_ids, cache=context, use_cache=True, logits_to_keep=1)
    elif context.get_seq_length() != input_ids.shape[1]:
        raise ValueError(
            f"the context cache holds {context.get_seq_length()} tokens, the prompt has {input_ids.shape[1]}."
        )
    return context


def window_reads(model, input_ids, context, window: int) -> list | None:
    """Per layer (b, hkv, n), the most the prompt's last ``window`` queries read each key, those
    tokens run again over ``context`` (which holds the n tokens after, the window's keys and values
    computed a second time by the recording attention: equal up to rounding); None when the window
    is 0 or the whole prompt."""
    n = input_ids.shape[1]
    if not 0 < window < n:
        return None
    short = [
        i
        for i, layer in enumerate(context.layers)
        if getattr(layer, "is_sliding", False)
        and layer.keys.shape[2] < min(n - window, layer.sliding_window - 1) + window
    ]
    if short:  # checked first: a cache cropped half-way would be left broken
        raise ValueError(
            f"sliding layers {short} of the context hold their window only, so the last {window} tokens "
            "cannot be cropped off: prefill those inside kvevict.policies.kvzip.past_recorded(context), "
            "or give no context."
        )
    context.crop(-window)
    seen = record_attention_stats(model, input_ids[:, -window:], ("max",), cache=context, observe=window)
    return [context_scores(st["max"], n, 0) for st in seen]


def raised(model, n: int, scores: list, reads: list | None) -> list:
    """``scores`` (per layer (b, hkv, n)) raised to the window's ``reads`` (``window_reads``), and 0
    for a key out of a sliding layer's last window (in no cache)."""
    if reads is not None:
        scores = [torch.maximum(s, r.to(s.dtype)) for s, r in zip(scores, reads)]
    for s, w in zip(scores, stock_windows(model.config)):
        if w is not None and w < n:
            s[..., : n - w] = 0
    return scores
