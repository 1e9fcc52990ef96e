"""The Triton decode kernel's split program compiled for an NVIDIA GPU on any machine, no GPU
needed (triton's wheel carries ptxas and cuobjdump), and its main loop's SASS counted by
instruction: how much work one tile of keys costs a thread, where no GPU is lent to time it
(``benchmarks/triton_decode.py`` times it where one is). The shape is ``triton_decode.py``'s
(Llama-3-8B-shaped attention, int4 codes, 32 channels per group, a bf16 query)::

    python benchmarks/triton_sass.py                          # today's defaults, sm_90
    python benchmarks/triton_sass.py '{"fold": false, "vpairs": false}' --out runs/sass.json

The JSON object names ``kvevict.kernels.triton_decode.plan``'s switches (``Switches``' fields). The
counts depend on the installed triton (the kernel's layouts are its choice): the report names its
version. It reaches into triton's compiler the way triton's own launcher does (its argument
specialization: 16-byte alignment, ints equal to 1), which is not a public interface: tested with
triton 3.6 and 3.9.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

LINE = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+(?:\.[A-Z0-9_]+)*)", re.M)
BRANCH = re.compile(r"^\s+/\*([0-9a-f]+)\*/[^\n]*?\bBRA\s+(0x[0-9a-f]+)", re.M)
# what the kernel work is judged by: the instruction classes the notes in docs/results/performance.md name
CLASSES = {
    "moves": ("IMAD.MOV", "MOV"),
    "barriers": ("BAR",),
    "mma": ("HMMA", "HGMMA"),
    "shared memory": ("LDS", "STS", "LDSM", "STSM"),
    "byte permutes": ("PRMT",),
    "logic": ("LOP3",),
    "shifts": ("SHF",),
    "paired half adds": ("HADD2",),
    "local (spills)": ("LDL", "STL"),
}


def split_launch(switches: dict, sm90: bool = True):
    """(kernel, args, kwargs) of the split program of one decode step at the profiled shape, laid
    out by ``plan`` on CPU tensors, its interpreter switch off (the GPU's program). Where the
    switches do not name ``trans``, plan's choice on the target: transposed on sm_90 in tiles of 64
    keys or more (``trans_default``; the CPU tensors here would make plan say no)."""
    from kvevict.kernels.runs import Run
    from kvevict.kernels.triton_decode import plan
    from kvevict.storage.codes import quantize

    b, hq, hkv, d, n = 2, 32, 8, 128, 4096  # batch and length are runtime values: the program is the same
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, 1, d, generator=gen).bfloat16()
    k_new, v_new = (torch.randn(b, hkv, 1, d, generator=gen).bfloat16() for _ in range(2))
    kq, vq = (quantize(torch.randn(b, hkv, n, d, generator=gen).bfloat16(), 4, 32) for _ in range(2))
    trans = sm90 and (switches.get("block") or 128) >= 64
    _, _, launches = plan(
        q, [Run(4, 32, kq, vq, n)], k_new, v_new, None, d**-0.5, **{"split": 2048, "trans": trans, **switches}
    )
    la = launches[0]
    kwargs = {**la.kwargs, "EMU": False}
    if switches.get("regs"):  # plan leaves the register cap out on a CPU (the interpreter has none)
        kwargs["maxnreg"] = switches["regs"]
    return la.kernel, la.args, kwargs


def compile_for(kernel, args, kwargs, arch: int):
    """The kernel compiled for sm_``arch`` with the specialization its launcher would give these
    arguments."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    try:
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, spec, opts = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, opts)
    except (AttributeError, TypeError, ValueError) as e:
        raise SystemExit(
            f"triton {triton.__version__}'s launcher internals are not the ones this tool knows "
            f"(tested: triton 3.6, 3.9): {e}"
        ) from None
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def sass_of(compiled) -> tuple[str, dict]:
    """(the SASS, {"registers", "stack"} a thread) of the compiled program."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        raise SystemExit(f"this triton has no cuobjdump at {tool}: cannot disassemble.")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        Path(path).write_bytes(compiled.asm["cubin"])
        sass, res = (
            subprocess.run([str(tool), flag, path], capture_output=True, text=True, check=True).stdout
            for flag in ("-sass", "-res-usage")
        )
    use = re.search(r"REG:(\d+) STACK:(\d+)", res)
    return sass, {"registers": int(use.group(1)), "stack": int(use.group(2))} if use else {}


def loop_counts(sass: str) -> tuple[int, collections.Counter]:
    """Instructions of the longest backward branch's body (the loop over the key tiles), by opcode."""
    span = None
    for at, to in BRANCH.findall(sass):
        lo, hi = int(to, 16), int(at, 16)
        if lo < hi and (span is None or hi - lo > span[1] - span[0]):
            span = (lo, hi)
    if span is None:
        raise SystemExit("no loop found in the program's SASS.")
    ops = collections.Counter(op for at, op in LINE.findall(sass) if span[0] <= int(at, 16) <= span[1])
    return sum(ops.values()), ops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("switches", nargs="?", default="{}", help="JSON object of plan()'s switches")
    p.add_argument("--arch", type=int, default=90, help="compute capability, 90 = H100")
    p.add_argument("--out", default=None, help="also write the counts here as JSON")
    args = p.parse_args(argv)
    try:
        switches = json.loads(args.switches)
    except json.JSONDecodeError as e:
        raise SystemExit(f"the switches must be a JSON object ({e}).") from None
    if not isinstance(switches, dict):
        raise SystemExit(f"the switches must be a JSON object, got {args.switches!r}.")
    from kvevict.kernels.triton_decode import unknown_switches

    why = unknown_switches(switches)
    if why:
        raise SystemExit(why)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("TRITON_INTERPRET is set: unset it (the interpreter compiles nothing).")
    import triton

    compiled = compile_for(*split_launch(switches, sm90=args.arch == 90), arch=args.arch)
    sass, usage = sass_of(compiled)
    total, ops = loop_counts(sass)
    # an opcode is in a class by its first word (LDS.128: LDS) or its first two (IMAD.MOV.U32: IMAD.MOV)
    classes = {
        name: sum(n for op, n in ops.items() if op.split(".")[0] in prefixes or ".".join(op.split(".")[:2]) in prefixes)
        for name, prefixes in CLASSES.items()
    }
    meta = compiled.metadata
    result = {
        "triton": triton.__version__,
        "arch": args.arch,
        "switches": switches,
        "kernel": meta.name,
        **usage,
        "shared_bytes": meta.shared,
        "loop_instructions": total,
        "classes": classes,
        "opcodes": dict(ops.most_common()),
    }
    print(f"{meta.name} for sm_{args.arch}, triton {triton.__version__}, switches {switches or 'defaults'}")
    print(
        f"{usage.get('registers')} registers, {usage.get('stack')} bytes of stack a thread; {meta.shared} bytes "
        "of shared memory a program"
    )
    print(f"one tile of keys (the main loop), per thread: {total} instructions")
    for name, n in classes.items():
        print(f"  {name:<18} {n:>5}")
    print("  most frequent: " + ", ".join(f"{op} {n}" for op, n in ops.most_common(8)))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
