"""The model a bench runs on: a known kvevict name or a local folder (no tokenizer needed: the
bench feeds synthetic token ids)."""

from __future__ import annotations

from pathlib import Path


def load_for_bench(name_or_path: str, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from kvevict.models import KNOWN_MODELS, load_model

    if name_or_path in KNOWN_MODELS:
        return load_model(name_or_path, dtype=getattr(torch, dtype))[0]
    if not Path(name_or_path).is_dir():
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ValueError(f"unknown model {name_or_path!r}: give a local model folder or one of: {known}.")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(name_or_path, dtype=getattr(torch, dtype)).eval()


def model_folder(name_or_path: str) -> Path:
    """A folder with config + safetensors for ``name_or_path`` (what the kvpress venv loads)."""
    from kvevict.fetch import cache_dir
    from kvevict.models import KNOWN_MODELS, load_model

    if name_or_path not in KNOWN_MODELS:
        return Path(name_or_path)
    folder = cache_dir() / name_or_path
    if not (folder / "config.json").exists():
        load_model(name_or_path)  # converts the GGUF once into that folder
    return folder
