"""Fused decode attention over the cache's storage as stored (packed codes read in place), one
function with several backends.

``decode_attention(q, runs, k_new, v_new, mask, scale, softcap=None, backend=None)``: one new
query per sequence attends over the stored ``runs`` (in order) followed by its own key; returns
(out (b, hq, 1, d) in q's dtype, pg (b, hkv, n_total + 1) float32: each key's probability summed
over the query heads of its KV group). The semantics are ``reference.decode_attention_reference``.
``pg=False`` (a policy that collects no statistics): pg is None, and a backend that can skips
the work (the Triton kernel then saves no scores and makes no probability pass).

Backends: ``"torch"`` (the reference, always there), ``"cpu"`` (compiled at first use, fused: no
dequantized copy of the cache), ``"triton"`` (GPU, ``triton_decode``, registered by ``triton_ops`` when present).
Selection: ``backend=``, else ``$KVEVICT_KERNEL`` (torch | cpu | triton | auto), else auto: triton
for CUDA queries when it imports, cpu when the compiled extension builds, else torch. The first
call logs one line saying which path runs, and why when a wanted compiled path is missing. A
backend may return NotImplemented for inputs it does not handle; the reference then runs.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from .reference import decode_attention_reference
from .runs import Run

__all__ = ["Run", "decode_attention", "decode_attention_reference", "register_backend", "resolve_backend", "BACKENDS"]

log = logging.getLogger("kvevict.kernels")
ENV = "KVEVICT_KERNEL"


@dataclass
class Backend:
    fn: Callable  # (q, runs, k_new, v_new, mask, scale, softcap) -> (out, pg) | NotImplemented
    available: Callable[[], tuple[bool, str]]  # () -> (usable here, why not)
    device: str  # "cpu" or "cuda": the queries auto picks it for
    paged: bool = False  # reads paged runs (a page table per row); else they are laid out in rectangles first
    summary: bool = False  # takes ``summary=`` (the evicted tokens' mean slot, kvevict.merge)
    outonly: bool = False  # takes ``pg=False`` (returns pg None); else pg is computed and dropped


BACKENDS: dict[str, Backend] = {}
_logged: set = set()


def register_backend(
    name: str,
    fn: Callable,
    available: Callable[[], tuple[bool, str]],
    device: str,
    paged: bool = False,
    summary: bool = False,
    outonly: bool = False,
) -> None:
    BACKENDS[name] = Backend(fn, available, device, paged, summary, outonly)


def _cpu_fn(*args, **kwargs):
    from .cpu import decode_attention_cpu

    return decode_attention_cpu(*args, **kwargs)


def _cpu_available():
    from .cpu import available

    return available()


register_backend("torch", decode_attention_reference, lambda: (True, ""), "any", summary=True, outonly=True)
register_backend("cpu", _cpu_fn, _cpu_available, "cpu", paged=True, summary=True, outonly=True)


def _load_triton() -> None:
    """The triton backend, from ``triton_decode`` through ``triton_ops`` (both import without triton)."""
    mod = importlib.import_module(".triton_decode", __name__)
    got: dict = {}
    importlib.import_module(".triton_ops", __name__).register(got)  # {"triton": fn}: eager, or one op traced
    register_backend("triton", got["triton"], mod.available, "cuda", paged=True, summary=True, outonly=True)


_OPTIONAL = {"triton": _load_triton}  # backends whose module is imported when first asked for


def _backend(name: str) -> Backend | None:
    if name not in BACKENDS and name in _OPTIONAL:
        try:
            _OPTIONAL[name]()
        except ImportError:
            pass
    return BACKENDS.get(name)


def _say(key, level, line) -> None:
    if key not in _logged:
        _logged.add(key)
        log.log(level, line)


@torch.compiler.assume_constant_result
def resolve_backend(device_type: str = "cpu", backend: str | None = None) -> str:
    """The backend that will run for queries on ``device_type`` (logged once per outcome).
    Traced (``torch.compile``), it runs once, at tracing, and its answer is the graph's: a later
    change of ``$KVEVICT_KERNEL`` reaches only graphs compiled after it."""
    wanted = (backend or os.environ.get(ENV) or "auto").lower()
    choices = ("auto", "torch", *BACKENDS, *_OPTIONAL)
    if wanted not in choices:
        raise ValueError(
            f"kernel backend {wanted!r} is unknown; {ENV} (or backend=) must be one of "
            f"{', '.join(dict.fromkeys(choices))}."
        )
    if wanted == "torch":
        _say("torch", logging.INFO, "kvevict decode attention: torch reference (chosen)")
        return "torch"
    order = [wanted] if wanted != "auto" else ["triton", "cpu"]
    reasons = []
    for name in order:
        b = _backend(name)
        if b is None:
            reasons.append(f"{name}: not installed")
            continue
        if wanted == "auto" and b.device not in ("any", device_type):  # asked for by name: it may decline
            reasons.append(f"{name}: runs on {b.device}, the queries are on {device_type}")
            continue
        ok, why = b.available()
        if ok:
            _say(name, logging.INFO, f"kvevict decode attention: {name} fused kernel")
            return name
        reasons.append(f"{name}: {why}")
    level = logging.WARNING if wanted != "auto" else logging.INFO
    _say(
        ("fallback", wanted), level, f"kvevict decode attention: torch reference ({ENV}={wanted}: {'; '.join(reasons)})"
    )
    return "torch"


def decode_attention(q, runs: list, k_new, v_new, mask, scale, softcap=None, backend=None, summary=None, pg=True):
    """See the module doc. mask: (b, hkv|1, n_total) bool over the stored slots (True = visible)
    or None; the new key is always visible. ``summary``: the evicted tokens' mean slot (see
    ``reference``); a backend that does not take it leaves the call to the reference. ``pg=False``:
    out only (pg None)."""
    name = resolve_backend(q.device.type, backend)
    if name != "torch" and summary is not None and not BACKENDS[name].summary:
        _say(
            ("summary", name),
            logging.INFO,
            f"kvevict decode attention: torch reference for merged caches ({name} has no evicted-mean slot)",
        )
    if name != "torch" and (summary is None or BACKENDS[name].summary):
        if not BACKENDS[name].paged:
            runs = [r.rect() for r in runs]
        extra = {} if summary is None else {"summary": summary}
        if not pg and BACKENDS[name].outonly:
            extra["pg"] = False
        got = BACKENDS[name].fn(q, runs, k_new, v_new, mask, scale, softcap, **extra)
        if got is not NotImplemented:
            return got if pg else (got[0], None)
    return decode_attention_reference(q, runs, k_new, v_new, mask, scale, softcap, summary, pg=pg)
