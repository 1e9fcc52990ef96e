"""What a prefill child process measures, shared by kvevict's child (``prefill_child``) and the
kvpress peer (``kvpress_peer.py``, which runs in another virtual environment): so this module
imports only the standard library and torch, never kvevict."""

import contextlib
import os
import resource
import time


def rss_bytes() -> int:
    """Resident set size now (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def kv_bytes(cache) -> int:
    if hasattr(cache, "kv_bytes"):
        return cache.kv_bytes()
    return sum(
        layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if getattr(layer, "is_initialized", True)
    )


def cache_kwarg(model) -> str:
    """The keyword the installed transformers takes the cache by: ``cache`` from 5.24 on,
    ``past_key_values`` before (the kvpress peer's own venv pins transformers < 5.3)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def prefill_then_decode(
    model, cache, context: int, steps: int, seed: int, rss_loaded: int, around_prefill=contextlib.nullcontext
) -> dict:
    """Prefill ``context`` synthetic tokens (last-position logits only, as ``generate`` asks), then
    ``steps`` greedy decode steps; times, peak RSS and the K/V bytes held after the prefill."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=gen)
    kw = {cache_kwarg(model): cache}
    with torch.no_grad():
        t0 = time.perf_counter()
        with around_prefill():
            out = model(ids, **kw, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - t0
        peak_after_prefill = peak_rss_bytes()
        kv = kv_bytes(cache)
        nxt = out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(nxt, **kw, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        decode_s = (time.perf_counter() - t0) / max(1, steps)
    return {
        "prefill_s": prefill_s,
        "decode_step_s": decode_s,
        "rss_loaded_bytes": rss_loaded,
        "peak_rss_prefill_bytes": peak_after_prefill,
        "peak_rss_bytes": peak_rss_bytes(),
        "kv_bytes_after_prefill": kv,
        "threads": torch.get_num_threads(),
    }
