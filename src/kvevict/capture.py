"""What a compileable layer prepares, eagerly, for the decode steps ``torch.compile`` captures
(``EvictingCache.compileable``), so that CUDA graphs can record them once and replay them.

CUDA graph trees (``mode="reduce-overhead"``) skip a graph that writes in place into a tensor they
did not allocate, unless it is marked a static address (``torch._dynamo.mark_static_address``, as
transformers' ``StaticLayer`` marks its keys and values), and record one graph per value of each
int input. So, after every eager forward and batch change of such a layer:

- every tensor a step writes in place is marked a static address (its slots, their bookkeeping,
  its rows' real tokens, the counts its compiled steps advance on the device:
  ``layer_state.Progress.owed``);
- each tier holds its budget's slots now (as a ``StaticCache`` holds its length), so a captured
  step never grows one: its shapes stay those it was traced with;
- a full tier's recent tier is made now, not by the first ranking inside a captured step;
- positions are widened to int32 where the model's positions can pass int16's 32,767: the widening
  waits on a count a captured step cannot read back.
"""

from __future__ import annotations

import torch

from .storage.layout import POS16_MAX


def wide_positions(max_positions: int | None) -> bool:
    """Whether a captured step needs int32 positions: the model's positions can pass 32,767
    (unknown counts as can). A model trained on at most 32,768 positions keeps int16."""
    return max_positions is None or max_positions > POS16_MAX + 1


def layer_tensors(layer) -> list[torch.Tensor]:
    """The tensors a decode step of ``layer`` writes in place: its tiers' and their recent tiers'
    slots, each row's real tokens and its device counts. (Marked unguarded, a moved one makes CUDA
    graphs record again, not dynamo recompile; what a step replaces rather than writes is left out:
    CUDA graphs own those as their outputs.)"""
    out: list[torch.Tensor] = []
    for tier in layer.tiers:
        for t in (tier, tier.recent):
            if t is not None:
                out.extend(t.slot_tensors())
    out.append(layer.n_real)
    if layer.progress.owed is not None:
        out.append(layer.progress.owed)
    return out


def prepare(layer) -> None:
    """Ready ``layer`` for captured decode steps (eagerly, after a forward or a batch change)."""
    if torch.compiler.is_compiling() or not layer.is_initialized:
        return
    for tier in layer.tiers:
        tier.reserve(tier.budget)  # a captured step never grows a tier (its shapes stay as traced)
        if tier.filled >= tier.budget:  # full: its next step ranks, and makes the recent tier
            tier.make_recent()
        if layer.wide_positions:  # the tier's and its recent tier's
            tier.widen_positions(POS16_MAX + 1)
    for t in layer_tensors(layer):
        torch._dynamo.mark_static_address(t, guard=False)
