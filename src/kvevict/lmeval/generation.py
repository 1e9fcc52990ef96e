"""lm-eval's ``generate_until`` for one batch: left-padded prompts through a budgeted cache, then
``model.generate`` until a stop string, EOS or ``max_gen_toks`` new tokens."""

from __future__ import annotations

import torch

from .scoring import feed_context, left_pad

# lm-eval's generation keys that are not transformers' generate arguments
_SAMPLING = ("temperature", "top_p", "top_k")


def split_gen_kwargs(gen_kwargs: dict, default_max: int, eos_text: str | None) -> tuple[list[str], int, dict]:
    """(stop strings, max new tokens, keyword arguments for generate) from a request's gen_kwargs."""
    kw = dict(gen_kwargs or {})
    until = kw.pop("until", None) or []
    if isinstance(until, str):
        until = [until]
    if not isinstance(until, list) or not all(isinstance(u, str) for u in until):
        raise ValueError(f"gen_kwargs 'until' must be a string or a list of strings, got {until!r}.")
    until = [u for u in until if u]
    if eos_text and eos_text not in until:
        until.append(eos_text)
    max_new = kw.pop("max_gen_toks", default_max)
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise ValueError(f"gen_kwargs max_gen_toks must be an int >= 1, got {max_new!r}.")
    kw.setdefault("do_sample", False)
    if kw.get("temperature", None) == 0.0:
        kw["do_sample"] = False
    if not kw["do_sample"]:  # greedy: sampling knobs would only warn
        for k in _SAMPLING:
            kw.pop(k, None)
    return until, max_new, kw


def cut_at_stops(text: str, until: list[str]) -> str:
    """``text`` up to the first occurrence of any stop string."""
    cut = len(text)
    for stop in until:
        i = text.find(stop)
        if 0 <= i < cut:
            cut = i
    return text[:cut]


@torch.no_grad()
def generate_batch(
    model,
    tokenizer,
    cache,
    prompts: list[list[int]],
    until: list[str],
    max_new: int,
    gen_kwargs: dict,
    prefill: str = "full",
    stride=None,
) -> list[str]:
    """One continuation per prompt (token ids), cut at the first stop string. The prompts enter the
    cache the ``prefill`` way (``feed_context``), the last chunk and every new token through
    ``generate``, which stops each row at a stop string (``stop_strings``) or EOS."""
    pad = tokenizer.pad_token_id
    ids, mask = left_pad(prompts, pad)
    if prefill != "full":
        feed_context(model, cache, ids, mask, prefill, stride, keep_last=1)
    stops = {"stop_strings": until, "tokenizer": tokenizer} if until else {}
    out = model.generate(
        ids, attention_mask=mask, cache=cache, max_new_tokens=max_new, pad_token_id=pad, **stops, **gen_kwargs
    )
    texts = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    return [cut_at_stops(t, until) for t in texts]
