"""What each policy keeps of one long real prompt: how many of the first 4 tokens, how many of
the last 10%, and the median kept position, averaged over layers and KV heads.

    python examples/what_policies_keep.py            # every registered policy
    python examples/what_policies_keep.py h2o,roco   # some
"""

import sys

import torch

import kvevict
from kvevict.data.essays import haystack
from kvevict.generate import encode_chat
from kvevict.policies.oracle import Oracle

torch.set_num_threads(2)
model, tok = kvevict.load_model("smollm2-135m")
text = haystack(tok, 2000)
ids = encode_chat(tok, [{"role": "user", "content": text + "\n\nSummarise the text above."}])
n = ids.shape[1]
budget = 0.2
print(f"prompt {n} tokens, budget {budget} -> {round(n * budget)} per layer & KV head; 30 layers x 3 KV heads")
print(f"{'policy':14s} {'first 4 kept':>12s} {'last 10% kept':>14s} {'median pos kept':>16s}")
for name in sys.argv[1].split(",") if len(sys.argv) > 1 else sorted({c.name for c in kvevict.POLICIES.values()}):
    pol = Oracle.record(model, ids) if name == "oracle" else name
    cache = kvevict.make_cache(model, pol, budget=budget)
    with torch.no_grad():
        model(ids, cache=cache, logits_to_keep=1)
    pos = [layer.pos[0] for layer in cache.layers]  # per layer (3, B_l)
    first = sum((p < 4).sum(-1).float().mean().item() for p in pos) / len(pos)
    tail = sum((p >= n - n // 10).sum(-1).float().mean().item() for p in pos) / len(pos)
    med = torch.cat([p.flatten() for p in pos]).float().median().item()
    print(f"{name:14s} {first:9.2f}/4 {tail:9.1f}/{n // 10} {med:16.0f}")
