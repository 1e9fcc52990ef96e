"""Greedy answers under a kvpress press, run by the kvpress environment's Python (kvpress pins an
older transformers), so this file imports nothing from kvevict; it reads kvevict's press table
(``kvevict/peers/kvpress_presses.py``) from its folder. Reads one JSON job on stdin:

    {"model_dir", "press", "compression_ratio", "threads", "samples": [{"id", "ids", "max_new"}]}

and prints one JSON line per sample: {"id", "new_ids", "kv_tokens", "seconds"}. The press
compresses the prompt once at the end of its prefill (all but the last token, which generate then
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
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=cache,
                do_sample=False,
                max_new_tokens=s["max_new"],
                pad_token_id=job.get("pad_token_id", 0),
            )
        print(
            json.dumps(
                {
                    "id": s["id"],
                    "new_ids": out[0, ids.shape[1] :].tolist(),
                    "kv_tokens": kept,
                    "seconds": round(time.perf_counter() - t0, 3),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main(json.loads(sys.stdin.read()))
