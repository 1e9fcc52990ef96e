"""What runs on a worker: the model it holds (loaded once) and the item function, found by path."""

from __future__ import annotations

import importlib
import traceback


def resolve(fn_path: str):
    """'package.module:function' -> the function."""
    if not isinstance(fn_path, str) or fn_path.count(":") != 1:
        raise ValueError(f"fn must be a 'package.module:function' path, got {fn_path!r}.")
    module, name = fn_path.split(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import {fn_path!r}: {err}") from None
    if not callable(fn):
        raise ValueError(f"{fn_path!r} is not callable.")
    return fn


class ModelHolder:
    """One worker's state: ``(model, tokenizer)`` loaded once (or None without a model), then
    ``fn(model, tokenizer, item)`` per item. Errors come back as data, so one bad item never kills
    the worker or the grid."""

    def __init__(self, model_name: str | None, threads: int | None = None, preloaded=None):
        if threads:
            import torch

            torch.set_num_threads(threads)
        if preloaded is not None:
            self.model, self.tokenizer = preloaded
        elif model_name is not None:
            from ..models import load_model

            self.model, self.tokenizer = load_model(model_name)
        else:
            self.model = self.tokenizer = None

    def run(self, fn_path: str, key: str, item: dict) -> tuple[str, list | None, str | None]:
        """-> (key, records, None) or (key, None, error text)."""
        try:
            out = resolve(fn_path)(self.model, self.tokenizer, item)
            records = out if isinstance(out, list) else [out]
            if not all(isinstance(r, dict) for r in records):
                raise TypeError(f"{fn_path} must return a dict or a list of dicts, got {type(out).__name__}.")
            return key, records, None
        except Exception as err:
            return key, None, f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=-3)}"


# A local worker process's holder (one per process, made by the pool's initializer).
_holder: ModelHolder | None = None


def init_process(model_name, threads) -> None:
    global _holder
    _holder = ModelHolder(model_name, threads)


def run_in_process(fn_path: str, key: str, item: dict):
    return _holder.run(fn_path, key, item)
