"""One decode step's attention on a GPU: the Triton kernel over packed int8 / int4 pages against
dense bf16 SDPA, Llama-3-8B-shaped (32 query heads, 8 KV heads, head dim 128), 32K context,
batch 8, random data (speed does not depend on the values). Target (issue 18): int4 <= 0.5x dense.

    python -m kvevict.bench.triton_decode                  # needs a CUDA GPU; exits 0 without one
    python -m kvevict.bench.triton_decode --tiny           # tiny shapes; on a CPU in triton's interpreter

Times one layer's attention (``--iters`` calls between CUDA events, after a warm-up), in
``--rounds`` interleaved rounds (each round visits every configuration, in a rotated order), and
reports the median ms per layer, x ``--layers``, and the median of the per-round ratios to dense.
Configurations: "dense bf16 SDPA" (torch's scaled_dot_product_attention with each KV head's
query heads as its query rows: no mask, no copy of K/V per query head; out only), "triton bf16"
(the kernel over the same dense pages: out and pg), "triton int8" and "triton int4" (packed
pages, ``--group`` channels per zero/step). Each Triton row's output is checked against
dequantize-then-SDPA first (max abs error reported). Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

TINY = dict(context=100, batch=2, heads=4, kv_heads=2, head_dim=64, layers=2, iters=2, rounds=2)


def make_run(bits, group, k, v, n):
    try:
        from ..kernels.runs import Run
    except ImportError:  # the kernel reads runs by field (bits, group, k, v, n) only
        return SimpleNamespace(bits=bits, group=group, k=k, v=v, n=n)
    return Run(bits, group, k, v, n)


def build(args, device):
    """{name: (fn, kv bytes, reference out or None)}: every configuration's one-layer call."""
    from ..kernels.triton_decode import decode_attention_triton
    from ..store import dequantize, quantize

    b, hq, hkv, d, n = args.batch, args.heads, args.kv_heads, args.head_dim, args.context
    g, scale, dt = hq // hkv, d ** -0.5, torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, hq, 1, d, generator=gen, device=device, dtype=dt)
    k_new, v_new = (torch.randn(b, hkv, 1, d, generator=gen, device=device, dtype=dt) for _ in range(2))
    keys, values = (torch.randn(b, hkv, n, d, generator=gen, device=device, dtype=dt) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    k_all, v_all = torch.cat([keys, k_new], 2), torch.cat([values, v_new], 2)
    qg = q.view(b, hkv, g, d)  # the query heads of one KV head as its query rows

    def dense():
        return sdpa(qg, k_all, v_all, scale=scale)

    configs = {"dense bf16 SDPA": (dense, k_all.nbytes + v_all.nbytes, None)}

    def triton_call(runs):
        return lambda: decode_attention_triton(q, runs, k_new, v_new, None, scale, split=args.split)

    configs["triton bf16"] = (triton_call([make_run(32, 1, (keys,), (values,), n)]),
                              keys.nbytes + values.nbytes, dense().view(b, hq, 1, d))
    for bits in (8, 4):
        kq, vq = quantize(keys, bits, args.group), quantize(values, bits, args.group)
        kd, vd = (torch.cat([dequantize(*x, bits, args.group, dt), y], 2) for x, y in ((kq, k_new), (vq, v_new)))
        ref = sdpa(qg, kd, vd, scale=scale).view(b, hq, 1, d)
        del kd, vd
        configs[f"triton int{bits}"] = (triton_call([make_run(bits, args.group, kq, vq, n)]),
                                        sum(t.nbytes for t in kq + vq), ref)
    return configs


def time_call(fn, iters: int, cuda: bool) -> float:
    """ms per call, averaged over ``iters`` calls after one warm-up call."""
    fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1000 / iters


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=32768, help="stored tokens per sequence")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=32, help="one layer is timed; this multiplies it")
    p.add_argument("--group", type=int, default=32, help="channels per zero/step group")
    p.add_argument("--split", type=int, default=None, help="keys per Triton program (default: from the GPU)")
    p.add_argument("--iters", type=int, default=20, help="calls per timing")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (runs on a CPU in triton's interpreter)")
    p.add_argument("--out", default="runs/triton_decode.json")
    args = p.parse_args(argv)
    try:
        import triton
    except ImportError:
        print("triton is not installed (pip install 'kvevict[triton]'); nothing to time.")
        return 0
    cuda = torch.cuda.is_available()
    if args.tiny:
        for name, value in TINY.items():
            setattr(args, name, value)
    if not cuda:
        if not args.tiny:
            print("This benchmark times GPU kernels and there is no CUDA device here; nothing to time "
                  "(--tiny runs tiny shapes in triton's CPU interpreter, to check that it runs).")
            return 0
        from ..kernels.triton_decode import interpreting

        if not interpreting():  # the interpreter must be on before triton is first imported: start afresh
            env = dict(os.environ, TRITON_INTERPRET="1")
            argv = sys.argv[1:] if argv is None else list(argv)
            os.execve(sys.executable, [sys.executable, "-m", "kvevict.bench.triton_decode", *argv], env)
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}.")
    device = torch.device("cuda" if cuda else "cpu")
    with torch.inference_mode():
        configs = build(args, device)
        errors = {}
        for name, (fn, _, ref) in configs.items():
            if ref is not None:
                out, _ = fn()
                errors[name] = float((out.float() - ref.float()).abs().max())
        names = list(configs)
        ms = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                ms[name].append(time_call(configs[name][0], args.iters, cuda))
    dense = names[0]
    rows = []
    for name in names:
        ratios = [a / b for a, b in zip(ms[name], ms[dense])]
        med = statistics.median(ms[name])
        rows.append({"config": name, "ms_per_layer": round(med, 4), "ms_all_layers": round(med * args.layers, 3),
                     "ratio_to_dense": round(statistics.median(ratios), 3),
                     "kv_mib": round(configs[name][1] / 2**20, 1),
                     "max_abs_err": errors.get(name), "ms_per_layer_rounds": [round(x, 4) for x in ms[name]]})
    where = torch.cuda.get_device_name() if cuda else "CPU, triton interpreter (timings mean nothing)"
    result = {"device": where, "torch": torch.__version__, "triton": triton.__version__,
              "config": vars(args), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{where}; torch {torch.__version__}, triton {triton.__version__}")
    print(f"batch {args.batch}, context {args.context}, {args.heads} query / {args.kv_heads} KV heads, head dim "
          f"{args.head_dim}; one layer timed x {args.layers}; median of {args.rounds} rounds of {args.iters} calls")
    print(f"{'config':<16} {'ms/layer':>9} {'ms x' + str(args.layers):>9} {'ratio':>6} {'KV MiB':>8} {'max err':>8}")
    for r in rows:
        err = "" if r["max_abs_err"] is None else f"{r['max_abs_err']:.1e}"
        print(f"{r['config']:<16} {r['ms_per_layer']:>9.4f} {r['ms_all_layers']:>9.3f} {r['ratio_to_dense']:>6.3g} "
              f"{r['kv_mib']:>8} {err:>8}")
    int4 = next(r for r in rows if r["config"] == "triton int4")
    if cuda:
        print(f"target int4 <= 0.5x dense: {'met' if int4['ratio_to_dense'] <= 0.5 else 'NOT met'} "
              f"({int4['ratio_to_dense']:.3f}x)")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
