"""A probe (``kvevict.probe``) of random weights for the tests' tiny models."""

import torch

from kvevict.plans import signature
from kvevict.probe import Probe


def tiny_probe(model, seed=0, scale=0.3, edges=()) -> Probe:
    """A probe of random weights with the tiny model's shapes (reading positions in ``edges``' bands)."""
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(seed)
    feats = cfg.num_key_value_heads * (d + d // 2) + (len(edges) + 1 if edges else 0)
    weights = [
        torch.randn(feats + 1, cfg.num_key_value_heads, generator=g) * scale for _ in range(cfg.num_hidden_layers)
    ]
    return Probe(weights, signature(model), edges=tuple(edges))
