"""What a cache is fed, checked before the model fails deep inside its attention (or silently
goes wrong): an empty prompt, a cache reused for a new prompt, a sequence past the model's
trained positions.

transformers' rule for a cache given to ``generate`` again: the ids (and the 2-D attention
mask) are the whole sequence so far, the tokens the cache has seen followed by new ones; generate
feeds only the tokens past the cache's length. Passing a new prompt to a used cache breaks that
rule: generate then feeds a meaningless slice of it, or nothing at all.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from types import FrameType
from typing import cast

import torch

from .shape import text_config

_NEW_CACHE = (
    "To continue the same sequence, pass all of it (the previous ids, e.g. generate's output, then "
    "the new tokens) with a mask as long; for a new prompt make a new cache (make_cache) or call "
    "cache.reset() first."
)


def no_new_tokens(seen: int) -> str:
    """The message for a forward that brings no token (transformers would fail reshaping 0 elements)."""
    if seen == 0:
        return "the prompt is empty (0 tokens): give a non-empty prompt."
    return (
        f"this call gives the model no new token: the cache has already seen {seen} tokens and the input is "
        f"no longer than that. {_NEW_CACHE}"
    )


def check_mask_length(mask_length: int, seen: int, new: int) -> None:
    """A 2-D attention mask covers the tokens the cache has seen plus the new ones, or the cache and
    the input describe different sequences (typically: a used cache given a new prompt)."""
    if mask_length != seen + new:
        raise ValueError(
            f"the attention mask covers {mask_length} tokens but the cache has seen {seen} and this call adds "
            f"{new}: the cache was filled with another sequence. {_NEW_CACHE}"
        )


def check_positions_follow(layer, position_ids, info) -> None:
    """Unpadded, the new tokens' positions go on from the tokens ``layer`` has seen (generate drops
    an all-ones mask, so this is what tells a used cache given a new prompt). A forward of several
    tokens is checked at once. A one-token forward is a decode step, which reads nothing back from
    the device: its positions are compared there and the verdict copied to the host without waiting
    (``layer.position_check``); the next forward reads it, so a wrong step fails the call before
    generate returns anything of it. A compiled step (``torch.compile``) checks nothing: the
    verdict is a host read, which a captured graph cannot make."""
    if torch.compiler.is_compiling():
        return
    pending = getattr(layer, "position_check", None)
    layer.position_check = None
    if pending is not None:
        pending.verdict()
    if position_ids is None or not layer.seen or layer._padded or (info is not None and info.padding is not None):
        return
    first = position_ids[..., 0]
    if position_ids.shape[-1] == 1:
        layer.position_check = _Deferred(first, layer.seen)
        return
    if bool((first != layer.seen).any()):
        _wrong(int(first.min()), layer.seen)


def _wrong(first: int, seen: int):
    raise ValueError(
        f"the new tokens start at position {first} but the cache has seen {seen} "
        f"tokens: the cache was filled with another sequence. {_NEW_CACHE}"
    )


class _Deferred:
    """A one-token step's positions check, read one forward later: the rows' first positions,
    copied to the host asynchronously (one copy, no comparison on the device)."""

    def __init__(self, first, seen: int) -> None:
        import torch

        cuda = first.device.type == "cuda"
        self.host = torch.empty(first.shape, dtype=first.dtype, pin_memory=cuda)
        self.host.copy_(first, non_blocking=cuda)
        self.done = torch.cuda.Event() if cuda else None
        if self.done is not None:
            self.done.record()
        self.seen = seen

    def verdict(self) -> None:
        if self.done is not None:
            self.done.synchronize()  # recorded a step ago: long finished, nothing queued since is waited on
        first = self.host.numpy()  # a host array: no device read
        if (first != self.seen).any():
            _wrong(int(first.min()), self.seen)


def max_positions(model) -> int | None:
    """The number of positions the model was trained on (config.max_position_embeddings), if it says."""
    config = text_config(model)
    n = getattr(config, "max_position_embeddings", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def warn_past_positions(positions: int, limit: int) -> None:
    """One line: the sequence needs ``positions`` positions, more than the ``limit`` the model knows.
    It names the user's own line: the first caller outside kvevict, torch and transformers (the
    check runs deep inside the model's forward, through their wrappers)."""
    warnings.warn(
        f"kvevict: this sequence needs {positions} positions, more than the model's {limit} "
        "(config.max_position_embeddings), past which its output degrades; use compact positions "
        "(make_cache(compact=True), --compact) or a shorter prompt.",
        stacklevel=_user_level(),
    )


def _user_level() -> int:
    """``warnings.warn``'s stacklevel of the first frame outside kvevict, torch, transformers and
    the ``kernels`` package transformers may wrap layers with."""
    import os
    import sys

    import torch
    import transformers

    # packages loaded from files (a module's __file__ is None only for namespaces and built-ins);
    # Hugging Face's ``kernels``, where transformers (5.25 on) wraps its layers' forwards with it
    hub = sys.modules.get("kernels")
    packages = (sys.modules[__package__], torch, transformers) + ((hub,) if getattr(hub, "__file__", None) else ())
    inside = tuple(str(Path(cast(str, m.__file__)).parent) + os.sep for m in packages)
    frame: FrameType | None = sys._getframe(1)
    level = 1  # the caller of _user_level, i.e. warn's own caller
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def positions_after(layer, new: int, limit: int) -> int | None:
    """Check an eviction layer about to receive ``new`` tokens against ``limit`` positions; warn once.
    Returns the limit to check next time (None once warned). ``layer.seen`` (padding included)
    bounds every row's positions, so the exact per-row count (a host sync) is read only near the end."""
    if layer.seen + new <= limit:
        return limit
    # positions count real tokens only; before the first forward the longest row is unpadded
    longest = new + (int(layer.n_real.max()) if layer.is_initialized else 0)
    if longest <= limit:
        return limit
    warn_past_positions(longest, limit)
    return None
