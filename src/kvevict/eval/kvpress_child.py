"""Greedy answers under a kvpress press, run by the kvpress environment's Python (kvpress pins an
older transformers), so this file imports nothing from kvevict; it reads kvevict's press table
(``kvevict/peers/kvpress_presses.py``) from its folder. Reads one JSON job on stdin:

    {"model_dir", "press", "compression_ratio", "threads", "samples": [{"id", "ids", "max_new"}]}

and prints one JSON line per sample: {"id", "new_ids", "kv_tokens", "seconds"}. The press
compresses the prompt once at the end of its prefill (all but the last token, which ``greedy`` then
feeds), question included, as kvevict's own prefill does; decoding appends to the cache.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))
from kvpress_presses import PRESSES  # noqa: E402  (our name -> kvpress class table)

EXTRA = {"adakv_snapkv": ("AdaKVPress", "sdpa"), "kvzip": ("KVzipPress", "sdpa")}


def make_press(kvpress, name, ratio):
    cls, attn = {**PRESSES, **EXTRA}[name]
    if name == "adakv_snapkv":  # Ada-KV's head-adaptive budgets over SnapKV's score (Feng et al. 2024)
        return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio)), attn
    return getattr(kvpress, cls)(compression_ratio=ratio), attn


def greedy(model, cache, ids, max_new: int, eos) -> list[int]:
    """Greedy answer ids once ``ids[:, :-1]`` sits in ``cache``, compressed: the prompt's last
    token, then each new one, fed one at a time at its own position (the prompt's length onwards,
    not the cache's), stopping after an ``eos`` id, as kvpress's own pipeline decodes.
    ``model.generate`` cannot take such a cache: it reads the cache's length as the prompt's
    processed length and feeds the prompt's tokens past it again, at shifted positions, which
    refills most of what the press removed."""
    import torch

    n, tok, out = ids.shape[1], ids[:, -1:], []
    for i in range(max_new):
        logits = model(tok, past_key_values=cache, use_cache=True, position_ids=torch.tensor([[n - 1 + i]])).logits
        out.append(int(logits[0, -1].argmax()))
        if out[-1] in eos:
            break
        tok = torch.tensor([[out[-1]]])
    return out


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def main(job):
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import kvpress
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(job["threads"])
    press, attn = make_press(kvpress, job["press"], job["compression_ratio"])
    dtype = getattr(torch, job.get("dtype", "float32"))
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=dtype, attn_implementation=attn).eval()
    for s in job["samples"]:
        ids = torch.tensor([s["ids"]])
        t0 = time.perf_counter()
        cache = DynamicCache()
        with torch.no_grad():
            with press(model):
                model(ids[:, :-1], past_key_values=cache, use_cache=True, logits_to_keep=1)
            kept = cache.get_seq_length()
            new_ids = greedy(model, cache, ids, s["max_new"], eos_ids(model))
        print(
            json.dumps(
                {
                    "id": s["id"],
                    "new_ids": new_ids,
                    "kv_tokens": kept,
                    "seconds": round(time.perf_counter() - t0, 3),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main(json.loads(sys.stdin.read()))
