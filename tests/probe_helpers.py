"""A probe (``kvevict.probe``) of random weights for the tests' tiny models."""

import torch

from kvevict.plans import signature
from kvevict.probe import Probe


def tiny_probe(model, seed=0, scale=0.3) -> Probe:
    """A probe of random weights with the tiny model's shapes."""
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(seed)
    feats = cfg.num_key_value_heads * (d + d // 2)
    weights = [
        torch.randn(feats + 1, cfg.num_key_value_heads, generator=g) * scale for _ in range(cfg.num_hidden_layers)
    ]
    return Probe(weights, signature(model))
