"""Greedy answers under a kvpress press, run by the kvpress environment's Python (kvpress pins an
older transformers), so this file imports nothing from kvevict; it reads kvevict's press table
(``kvevict/peers/kvpress_presses.py``) from its folder. Reads one JSON job on stdin:

    {"model_dir", "press", "compression_ratio", "threads", "dtype",
     "samples": [{"id", "ids", "max_new", "question"?, "compression_ratio"?}]}

and prints one JSON line per sample: {"id", "new_ids", "kv_tokens", "seconds"}. By default the press
compresses the whole prompt but its last token, question included, as kvevict's own prefill does.
A sample that gives ``question`` (its last N tokens) has its context pressed alone and the question
read after it unpressed, as kvpress's own pipeline and benchmarks do; its own ``compression_ratio``
then applies to the context. Decoding appends to the cache (``greedy``).
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))
from kvpress_presses import MASKING, PRESSES  # noqa: E402  (our name -> kvpress class table)


def make_press(kvpress, name, ratio):
    cls, attn = {**PRESSES, **MASKING}[name]
    if name.startswith("adakv_"):  # Ada-KV's head-adaptive budgets over another press's score (Feng et al. 2024)
        inner = getattr(kvpress, PRESSES[name.removeprefix("adakv_")][0])
        return kvpress.AdaKVPress(inner(compression_ratio=ratio)), attn
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


def answer(model, press, ids, max_new: int, eos, question: int = 0, cache=None):
    """(new ids, tokens in the cache when the answer starts). ``press(model)`` is entered for the
    prefill of ``ids[:, :-1]``, or, given ``question`` > 0, of the context ``ids[:, :-question]``
    alone, the question's tokens then prefilled unpressed (all but the last, which ``greedy`` feeds)
    at their own positions. ``cache``: a fresh DynamicCache unless given."""
    import torch
    from transformers import DynamicCache

    cut = ids.shape[1] - (question or 1)
    cache = DynamicCache() if cache is None else cache
    with press(model):
        model(ids[:, :cut], past_key_values=cache, use_cache=True, logits_to_keep=1)
    if question > 1:
        pos = torch.arange(cut, ids.shape[1] - 1)[None]
        model(ids[:, cut:-1], past_key_values=cache, use_cache=True, position_ids=pos, logits_to_keep=1)
    kept = cache.get_seq_length()
    return greedy(model, cache, ids, max_new, eos), kept


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def main(job):
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import kvpress
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(job["threads"])
    attn = {**PRESSES, **MASKING}[job["press"]][1]
    dtype = getattr(torch, job.get("dtype", "float32"))
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=dtype, attn_implementation=attn).eval()
    for s in job["samples"]:
        ids = torch.tensor([s["ids"]])
        press, _ = make_press(kvpress, job["press"], s.get("compression_ratio", job["compression_ratio"]))
        t0 = time.perf_counter()
        with torch.no_grad():
            new_ids, kept = answer(model, press, ids, s["max_new"], eos_ids(model), s.get("question", 0))
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
