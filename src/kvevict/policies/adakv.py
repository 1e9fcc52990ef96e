from dataclasses import dataclass

from .registry import register
from .snapkv import SnapKV


@register("adakv", "ada-snapkv")
@dataclass
class AdaKV(SnapKV):
    """Ada-KV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
    Allocation for Efficient LLM Inference"), on SnapKV's score as in the paper (Ada-SnapKV).

    A layer with H KV heads and a budget of B tokens per head holds H x B entries in all, shared
    by the heads: the heads whose attention is concentrated give slots to those whose attention is
    spread. With s_{h,i} the score of token i in head h (any policy's; here SnapKV's pooled
    observation-window attention, comparable across heads since every head's attention sums to 1
    per query) the layer keeps

        K = TopK_{(h, i)}( s_{h,i}, H x B )      jointly over every head's candidates,
        B_h = |{i : (h, i) in K}| >= floor x (B - recent - sinks - question)   (the per-head safeguard)

    on top of each head's recent window, sinks and question (always kept). Any policy takes it with
    ``adaptive=True`` (``ada-h2o``, ``ada-kvzip``, ... in specs); RoCo cannot (its scope ranks a
    head's row).

    Storage (the memory is really saved, not masked): the layer's tier is one pool of H x B slots
    per sequence, each slot holding one head's key/value and that head's id (1 byte); attention
    reads the pool once per KV head with the other heads' slots masked (H times the score work of
    the pool, the same bytes). So a head may hold anywhere from its floor to most of the pool, and
    ``kv_bytes`` is exactly that of H x B slots (+ H x B head ids).
    """

    adaptive: bool = True
    name = "adakv"
