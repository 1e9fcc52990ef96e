"""The compiled CPU backend: ``decode_cpu.cpp`` built at first use with torch's
``cpp_extension.load_inline`` (-O3, the widest vector ISA the running CPU has, threads from torch's
own pool over (sequence, KV head)). Installing kvevict never needs a compiler: when the build
fails, or there is no compiler, ``load`` raises (the same error on every later call, with no new
try) and the dispatcher falls back to the torch reference (saying so once).

Each build has its own folder, named for what the module depends on (``build_name``): torch's
version and location, the Python environment and interpreter, the ISA, the flags and the source.
Two environments on one machine then never rebuild each other's module."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

from .runs import Run

_KIND = {8: 0, 4: 1, 2: 2}
_DENSE_KIND = {torch.float32: 3, torch.float16: 4, torch.bfloat16: 5}
# sums may be reassociated (vector reductions are a tree, not 16 dependent adds); not -ffast-math:
# masked scores are -inf and must stay so
_REASSOCIATE = ["-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
_NO_MASK = torch.empty(0, 0, 0, dtype=torch.bool)
_NO_TABLE = torch.empty(0, 0, dtype=torch.long)
_NO_BIAS = torch.empty(0, dtype=torch.float32)
_LDFLAGS = ["-fopenmp"]
_SOURCES = ("decode_cpu.cpp", "store_cpu.cpp")  # one module: decode attention, and the store path (kernels.store)


def _isa_flags() -> tuple[str, list[str]]:
    """Compiler flags for the vector ISA the CPU running this process has (torch's own runtime
    check), so the build never uses an instruction this machine lacks."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap.startswith("AVX512"):
        return "avx512", [
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mavx2",
            "-mfma",
            "-mf16c",
            "-mprefer-vector-width=512",
        ]
    if cap == "AVX2":
        return "avx2", ["-mavx2", "-mfma", "-mf16c"]
    return "generic", []


def build_dir() -> str:
    """Where the builds' folders are: $TORCH_EXTENSIONS_DIR, else the kvevict cache folder."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    from ..fetch import cache_dir

    return str(cache_dir("torch_extensions"))


def build_name(
    isa: str, flags: list[str], source: str, torch_version: str, torch_path: str, prefix: str, python: str
) -> str:
    """The module's name and its build folder's: ``kvevict_decode_<isa>_<key>``, the key a short
    hash of everything the build depends on, so a module is only ever loaded where it was built."""
    depends = "\0".join([torch_version, torch_path, prefix, python, isa, " ".join(flags), source])
    return f"kvevict_decode_{isa}_{hashlib.sha256(depends.encode()).hexdigest()[:12]}"


def _build() -> tuple[str, str, list[str], str]:
    """(this environment's build name, its folder, the compiler flags, the source)."""
    isa, isa_flags = _isa_flags()
    flags = ["-O3", "-fopenmp", *_REASSOCIATE, *isa_flags]
    here = Path(__file__).parent
    source = "\n".join((here / f).read_text() for f in _SOURCES)
    name = build_name(
        isa, [*flags, *_LDFLAGS], source, torch.__version__, os.path.dirname(torch.__file__), sys.prefix, sys.version
    )
    return name, os.path.join(build_dir(), name), flags, source


def built() -> bool:
    """Whether this environment's module is already built (``load`` then only loads it)."""
    return _holds_module(_build()[1])


def _holds_module(folder: str) -> bool:
    return os.path.isdir(folder) and any(f.endswith((".so", ".pyd")) for f in os.listdir(folder))


_failure: list[Exception] = []  # the build's error: without a compiler every decode step would try again


@functools.lru_cache(maxsize=1)
def load():
    """The compiled module (built once per environment, then loaded from its build folder).
    Raises whatever the build raised when it cannot be built, at once on later calls."""
    if _failure:
        raise _failure[0]
    try:
        return _compile()
    except Exception as err:
        _failure.append(err)
        raise


def _compile():
    from torch.utils import cpp_extension

    name, folder, flags, source = _build()
    os.makedirs(folder, exist_ok=True)
    if not _holds_module(folder):
        logging.getLogger("kvevict.kernels").info(
            "kvevict: building the fused CPU decode kernel once into %s (about a minute)", folder
        )
        # the folder's name is a hash: this says which environment it is for
        Path(folder, "built_for.txt").write_text(
            f"torch {torch.__version__} ({os.path.dirname(torch.__file__)})\n"
            f"python {sys.version.split()[0]} ({sys.prefix})\n{flags}\n"
        )
    return cpp_extension.load_inline(
        name=name,
        cpp_sources=[source],
        functions=["decode", "rotate", "quantize", "quantize_into", "dequantize_from"],
        extra_cflags=flags,
        extra_ldflags=_LDFLAGS,
        build_directory=folder,
        verbose=False,
    )


def available() -> tuple[bool, str]:
    """(whether the compiled kernel can run here, why not)."""
    try:
        load()
    except Exception as err:  # no compiler, failed build, missing headers: all mean "use torch"
        return False, f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
    return True, ""


def _part(run: Run, part: tuple) -> list:
    if run.packed:
        return list(part)
    return [part[0]] * 3  # dense: zeros and steps unused


def decode_attention_cpu(q, runs, k_new, v_new, mask, scale, softcap=None, summary=None, pg=True):
    """The fused kernel; NotImplemented for what it does not handle (the reference then runs).
    ``summary`` (kvevict.merge) is one more dense slot before the new key, its log n a bias.
    ``pg=False``: pg None (the kernel sums it anyway: g adds a key, next to its value pass)."""
    b, hq, _, d = q.shape
    hkv, dv = k_new.shape[1], v_new.shape[-1]
    new = Run(32, 0, (k_new,), (v_new,), 1)
    if q.device.type != "cpu" or dv != d or hq % hkv or q.dtype not in _DENSE_KIND or k_new.dtype not in _DENSE_KIND:
        return NotImplemented
    extra, bias, bias_at = [], _NO_BIAS, -1
    if summary is not None:
        extra = [Run(32, 0, (summary[0].to(k_new.dtype).contiguous(),), (summary[1].to(v_new.dtype).contiguous(),), 1)]
        bias = summary[2].reshape(b, hkv).float().contiguous()
        bias_at = sum(r.n for r in runs)
    tensors, meta, tables = [], [], []
    for r in [*runs, *extra, new]:
        if r.n == 0:
            continue
        if r.packed:
            kind = _KIND[r.bits]
        elif r.k[0].dtype in _DENSE_KIND:
            kind = _DENSE_KIND[r.k[0].dtype]
        else:
            return NotImplemented
        parts = _part(r, r.k) + _part(r, r.v)
        if any(t.stride(-1) != 1 or t.device.type != "cpu" for t in parts):
            return NotImplemented
        tensors += parts
        meta += [kind, r.group, r.n, r.heads, r.page if r.paged else 0]
        tables.append(r.table.contiguous() if r.paged else _NO_TABLE)
    if mask is None:
        mask_t = _NO_MASK
    else:
        mask_t = mask if mask.stride(-1) == 1 else mask.contiguous()
    qs = q.reshape(b, hq, d)  # the kernel scales it in q's dtype first, as attend does
    if qs.stride(-1) != 1:
        qs = qs.contiguous()
    # traced (torch.compile), the kernel is an opaque custom op with a fake of its shapes; eager, a plain call
    decode = _decode_op if torch.compiler.is_compiling() else load().decode
    out, probs = decode(qs, float(scale), tensors, meta, tables, mask_t, float(softcap or 0.0), hkv, dv, bias, bias_at)
    if not pg:
        probs = None
    elif summary is not None:  # the mean slot is no stored slot: its column leaves pg
        probs = torch.cat([probs[..., :bias_at], probs[..., bias_at + 1 :]], dim=-1)
    return out.view(b, hq, 1, dv), probs


_SCHEMA = (
    "(Tensor q, float scale, Tensor[] tensors, SymInt[] meta, Tensor[] tables, Tensor mask, float softcap, int hkv, int dv, "
    "Tensor bias, int bias_at) -> (Tensor, Tensor)"
)


@torch.library.custom_op("kvevict::decode_cpu", mutates_args=(), schema=_SCHEMA)
def _decode_op(q, scale, tensors, meta, tables, mask, softcap, hkv, dv, bias, bias_at):
    """The compiled module's ``decode`` as a custom op, so that ``torch.compile(fullgraph=True)``
    keeps the fused kernel in its graph as one opaque call (the module itself cannot be traced)."""
    out, pg = load().decode(q, scale, tensors, meta, tables, mask, softcap, hkv, dv, bias, bias_at)
    return out, pg


@_decode_op.register_fake
def _decode_shapes(q, scale, tensors, meta, tables, mask, softcap, hkv, dv, bias, bias_at):
    """out (b, hq, dv) in q's dtype and pg (b, hkv, N) float32, N the runs' slots (``meta``: 5 ints a
    run, n third)."""
    n = sum(meta[2::5])
    return q.new_empty(q.shape[0], q.shape[1], dv), q.new_empty(q.shape[0], hkv, n, dtype=torch.float32)
