"""The kvpress peer, run by the Python of its own virtual environment (kvpress 0.5.5 pins
transformers < 5.3, kvevict needs >= 5.24), so this file imports nothing from kvevict: the job
names the press's kvpress class (``kvevict.peers.kvpress_presses``, resolved by the caller).

    $KVEVICT_PEERS/kvpress/bin/python kvpress_peer.py '{"model_dir": ..., "press": "snapkv",
        "press_class": "SnapKVPress", "attn_implementation": "sdpa", "compression_ratio": 0.8,
        "context": 8192, "decode_steps": 16, "threads": 2, "seed": 0}'

prints one JSON line with the same fields as ``prefill_child.py``: the press compresses the
cache once, at the end of the prefill (kvpress's design); decoding then appends to a DynamicCache.
compression_ratio = 1 - kept fraction (kvevict budget 0.2 <-> compression_ratio 0.8).
"""

import json
import os
import sys

from child_measure import (  # this script's folder is on sys.path
    prefill_then_decode,
    rss_bytes,
)


def main(job):
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(job["threads"])
    cls_name, attn = job["press_class"], job["attn_implementation"]
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32, attn_implementation=attn).eval()
    rss_loaded = rss_bytes()
    press = getattr(kvpress, cls_name)(compression_ratio=job["compression_ratio"])
    res = prefill_then_decode(
        model,
        DynamicCache(),
        job["context"],
        job["decode_steps"],
        job.get("seed", 0),
        rss_loaded,
        around_prefill=lambda: press(model),
    )
    res["versions"] = {"kvpress": getattr(kvpress, "__version__", "?"), "transformers": transformers.__version__}
    return res


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
