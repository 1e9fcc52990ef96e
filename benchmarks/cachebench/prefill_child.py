"""One prefill + short decode in a fresh process, so its peak RSS is its own.

    python benchmarks/cachebench/prefill_child.py '{"model": ..., "mode": "sdpa"|"eager"|"kvevict",
        "policy": "h2o", "budget": 0.2, "context": 8192, "decode_steps": 16, "threads": 2, "seed": 0}'

prints one JSON line: prefill seconds, decode seconds per step, RSS after loading the model, peak
RSS of the whole process (ru_maxrss) and the KV bytes held after the prefill. Every mode asks the
model for the last position's logits only (as ``generate`` does), so no mode pays for 8K x vocab
logits. Run as a script (its folder on sys.path): it imports its siblings by their plain names.
"""

from __future__ import annotations

import json
import sys

from child_measure import prefill_then_decode, rss_bytes  # this script's folder is on sys.path


def main(job: dict) -> dict:
    import torch
    from loading import load_for_bench  # a sibling, as child_measure
    from transformers import DynamicCache

    torch.set_num_threads(job["threads"])
    model = load_for_bench(job["model"])
    rss_loaded = rss_bytes()
    if job["mode"] == "kvevict":
        from kvevict.cache import make_cache

        cache = make_cache(model, job["policy"], job["budget"])
    else:
        model.set_attn_implementation(job["mode"])
        cache = DynamicCache(config=model.config)
    return prefill_then_decode(model, cache, job["context"], job["decode_steps"], job.get("seed", 0), rss_loaded)


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
