"""An independent, slow H2O reference for the tests: the stock DynamicCache keeps every key, and a
registered eager attention masks out the keys H2O has evicted, per (sequence, layer, KV head),
tracking accumulated scores in plain Python. Written from the paper's rule, not from kvevict.
``slack`` s: a decode step that finds more than ``budget`` tokens evicts down to budget - s + 1 at
once (the prompt, down to the budget)."""

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask


class H2OReference:
    NAME = "h2o_reference"

    def __init__(self, budget, recent, slack=1):
        self.budget, self.recent, self.slack = budget, recent, slack
        self.state = {}  # (layer, batch, head) -> {"kept": set(positions), "score": {pos: float}}
        AttentionInterface.register(self.NAME, self.attention)
        AttentionMaskInterface.register(self.NAME, eager_mask)

    def attention(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        b, hq, q, d = query.shape
        hkv, n = key.shape[1], key.shape[2]
        g = hq // hkv
        out = torch.zeros(b, q, hq, d)
        for bi in range(b):
            for h in range(hkv):
                st = self.state.setdefault((module.layer_idx, bi, h), {"kept": set(), "score": {}})
                for qi in range(q):
                    t = n - q + qi  # this query's position (index in the full cache)
                    visible = [j for j in range(t + 1) if j in st["kept"] or j > n - q - 1]
                    if q > 1:  # prefill: the whole prompt is visible (evicted only afterwards)
                        visible = list(range(t + 1))
                    if attention_mask is not None:
                        visible = [j for j in visible if attention_mask[bi, 0, qi, j] == 0]
                    if not visible:
                        continue
                    for gi in range(g):
                        head = h * g + gi
                        s = (query[bi, head, qi] @ key[bi, h, visible].T) * scaling
                        p = torch.softmax(s.double(), -1)
                        out[bi, qi, head] = p.float() @ value[bi, h, visible]
                        for j, pj in zip(visible, p.tolist()):
                            st["score"][j] = st["score"].get(j, 0.0) + pj
                # after the layer's attention: add the new tokens, then evict down to the budget
                real = [j for j in range(n - q, n) if attention_mask is None or attention_mask[bi, 0, -1, j] == 0]
                st["kept"].update(real)
                last = n - 1
                keep = self.budget if q > 1 or len(st["kept"]) <= self.budget else self.budget - self.slack + 1
                while len(st["kept"]) > keep:
                    old = [j for j in st["kept"] if j <= last - self.recent]
                    victim = min(old, key=lambda j: st["score"][j])
                    st["kept"].discard(victim)
        return out, None
