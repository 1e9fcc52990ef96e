"""One decode step's attention on a GPU: the Triton kernel over packed int8 / int4 pages against
dense bf16 SDPA, Llama-3-8B-shaped (32 query heads, 8 KV heads, head dim 128), 32K context,
batch 8, random data (speed does not depend on the values). Target: int4 <= 0.5x dense (packed
int4 pages read in at most half the time of the dense bf16 cache they replace).

    python benchmarks/triton_decode.py                  # needs a CUDA GPU; exits 0 without one
    python benchmarks/triton_decode.py --tiny           # tiny shapes; on a CPU in triton's interpreter

Times one layer's attention (``--iters`` calls between CUDA events, after a warm-up), in
``--rounds`` interleaved rounds (each round visits every configuration, in a rotated order), and
reports the median ms per layer, x ``--layers``, and the median of the per-round ratios to dense;
twice: launched one by one from Python (the host's launch overhead included where the GPU waits
for it), and the same ``--iters`` calls replayed from a CUDA graph (the GPU's time alone, as a
serving engine that captures its decode step sees it).
Configurations: "dense bf16 SDPA" (torch's scaled_dot_product_attention with each KV head's
query heads as its query rows: no mask, no copy of K/V per query head; out only), "triton bf16"
(the kernel over the same dense pages: out and pg), "triton int8" and "triton int4" (packed
pages, ``--group`` channels per zero/step), "triton int4 out only" (no pg: no scores saved, no
probability pass, as for a policy that collects no statistics), "triton int4 paged P" (the cache's layout: pools of
P-slot pages, each row's pages in a random order behind its page table), "torch int4 (copy)" (the
torch reference: dequantize into a float copy, then attend), and, with ``--splits`` / ``--warps``,
int4 at other keys per program, warps per program, keys per tile (``--blocks``), without
prefetching (``--prefetch 1,0``), registers per thread capped (``--regs``), codes converted
rather than made from their bits (``--magic 1,0``), the products transposed (``--trans 1,0``) and
out only (``--pg 1,0``);
"triton intN registers" dequantizes every channel in registers before the products
(``factored=False``). Each row's output is checked first (max abs error reported): the dense rows
against SDPA, the packed rows against SDPA in fp32 over the exact dequantized values. Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

TINY = dict(context=100, batch=2, heads=4, kv_heads=2, head_dim=64, layers=2, iters=2, rounds=2)


def make_run(bits, group, k, v, n, table=None, page=0):
    from kvevict.kernels.runs import Run

    return Run(bits, group, k, v, n, table, page)


def paged(parts: tuple, page: int, table: torch.Tensor) -> tuple:
    """(b, h, n, w) rectangles -> pools (pages, h, page, w), row i's page j at table[i, j]."""
    b, h, n, _ = parts[0].shape
    cols = table.shape[1]
    pools = []
    for x in parts:
        x = torch.nn.functional.pad(x, (0, 0, 0, cols * page - n))  # the last page's unused slots
        pool = torch.empty(b * cols, h, page, x.shape[-1], dtype=x.dtype, device=x.device)
        pool[table.flatten()] = x.reshape(b, h, cols, page, -1).permute(0, 2, 1, 3, 4).reshape(b * cols, h, page, -1)
        pools.append(pool)
    return tuple(pools)


def build(args, device):
    """{name: (fn, kv bytes, reference out or None)}: every configuration's one-layer call."""
    from kvevict.kernels.triton_decode import decode_attention_triton

    b, hq, hkv, d, n = args.batch, args.heads, args.kv_heads, args.head_dim, args.context
    g, scale, dt = hq // hkv, d**-0.5, torch.bfloat16
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

    def triton_call(runs, split=args.split, warps=None, block=None, factored=True, prefetch=True, **tune):
        return lambda: decode_attention_triton(
            q,
            runs,
            k_new,
            v_new,
            None,
            scale,
            split=split,
            warps=warps,
            block=block,
            factored=factored,
            prefetch=prefetch,
            **tune,
        )

    configs["triton bf16"] = (
        triton_call([make_run(32, 1, (keys,), (values,), n)]),
        keys.nbytes + values.nbytes,
        dense().view(b, hq, 1, d),
    )
    for bits in (8, 4):
        configs.update(packed_configs(args, bits, (q, k_new, v_new, keys, values), triton_call, gen))
    return configs


def packed_configs(args, bits: int, tensors: tuple, triton_call, gen) -> dict:
    """``build``'s configurations of the keys and values packed at ``bits``; for int4 also out only,
    paged, the torch reference's copy and the ``--splits`` ... ``--pg`` sweep (``sweep_configs``).
    ``tensors``: (q, k_new, v_new, keys, values)."""
    from kvevict.kernels.reference import decode_attention_reference
    from kvevict.storage.codes import dequantize, quantize

    q, k_new, v_new, keys, values = tensors
    (b, hkv, n, d), hq = keys.shape, q.shape[1]
    scale, qg = d**-0.5, q.view(b, hkv, hq // hkv, d)
    kq, vq = quantize(keys, bits, args.group), quantize(values, bits, args.group)
    # the exact dequantized values, in fp32: every path's error against them
    kd, vd = (
        torch.cat([dequantize(*x, bits, args.group, torch.float32), y.float()], 2)
        for x, y in ((kq, k_new), (vq, v_new))
    )
    ref = torch.nn.functional.scaled_dot_product_attention(qg.float(), kd, vd, scale=scale).reshape(b, hq, 1, d)
    del kd, vd
    nbytes = sum(t.nbytes for t in kq + vq)
    run = make_run(bits, args.group, kq, vq, n)
    configs = {f"triton int{bits}": (triton_call([run]), nbytes, ref)}
    # every channel dequantized in registers before the products (the path before factoring)
    configs[f"triton int{bits} registers"] = (triton_call([run], factored=False), nbytes, ref)
    if bits != 4:
        return configs
    # out only, what a policy that collects no statistics asks for (and all SDPA computes)
    configs["triton int4 out only"] = (triton_call([run], pg=False), nbytes, ref)
    # the cache's own layout: pages of PAGE slots through a page table
    cols = -(-n // args.page)  # each row's pages scattered in a random order, as a pool gives them out
    table = torch.randperm(b * cols, generator=gen, device=keys.device).view(b, cols)
    pk, pv = paged(kq, args.page, table), paged(vq, args.page, table)
    configs[f"triton int4 paged {args.page}"] = (
        triton_call([make_run(4, args.group, pk, pv, n, table, args.page)]),
        nbytes,
        ref,
    )
    # no fused kernel: dequantize into a float copy, then attend (the torch reference)
    configs["torch int4 (copy)"] = (
        lambda run=run: decode_attention_reference(q, [run], k_new, v_new, None, scale),
        nbytes,
        ref,
    )
    configs.update({name: (fn, nbytes, ref) for name, fn in sweep_configs(args, run, triton_call).items()})
    return configs


def sweep_configs(args, run, triton_call) -> dict:
    """{name: fn}: int4 at every combination of the ``--splits`` ... ``--pg`` lists but the defaults
    (those are "triton int4" and "triton int4 out only")."""
    configs = {}
    for split, warps, block, prefetch, regs, magic, fold, vpairs, trans, pg in itertools.product(
        args.splits,
        args.warps,
        args.blocks,
        args.prefetch,
        args.regs,
        args.magic,
        args.fold,
        args.vpairs,
        args.trans,
        args.pg,
    ):
        if (split, warps, block, prefetch, regs, magic, fold, vpairs, trans) == (
            args.split,
            None,
            None,
            True,
            None,
            True,
            True,
            True,
            None,
        ):
            continue  # "triton int4" and "triton int4 out only"
        name = (
            f"int4 s{split or '-'} w{warps or '-'} b{block or '-'}{'' if prefetch else ' no-pf'}"
            f"{f' r{regs}' if regs else ''}{'' if magic else ' no-magic'}{'' if fold else ' no-fold'}"
            f"{'' if vpairs else ' no-vpairs'}{' trans' if trans else ' no-trans' if trans is False else ''}"
            f"{'' if pg else ' out-only'}"
        )
        tune = dict(regs=regs, magic=magic, fold=fold, vpairs=vpairs, trans=trans, pg=pg)
        configs[name] = triton_call([run], split, warps, block, prefetch=prefetch, **tune)
    return configs


def time_call(fn, iters: int, cuda: bool, graph=None, host=None) -> float:
    """ms per call, averaged over ``iters`` calls after one warm-up call; with ``graph`` (a CUDA
    graph of ``iters`` calls, ``capture``), its replay: the GPU's time without the host's launches.
    ``host`` (a list, CUDA): gets the host's ms per call to launch them (where it exceeds the GPU's
    time, launched one by one is the host's time)."""
    if graph is not None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if host is not None:
            host.append((time.perf_counter() - t0) * 1000 / iters)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1000 / iters


def capture(fn, iters: int):
    """A CUDA graph of ``iters`` calls of ``fn`` (warmed up first), as a serving engine captures a
    decode step to take the host's launch overhead off it."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    torch.cuda.synchronize()
    return graph


def parse(argv=None) -> argparse.Namespace:
    """The command line, its sweep lists checked and parsed (``p.error`` names a bad one)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=32768, help="stored tokens per sequence")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=32, help="one layer is timed; this multiplies it")
    p.add_argument("--group", type=int, default=32, help="channels per zero/step group")
    p.add_argument("--split", type=int, default=None, help="keys per Triton program (default: from the GPU)")
    p.add_argument("--page", type=int, default=32, help="slots per page of the paged int4 configuration")
    p.add_argument("--splits", default="", help="comma-separated splits to sweep for int4 (0 = auto)")
    p.add_argument("--warps", default="", help="comma-separated warps per program to sweep for int4 (0 = default)")
    p.add_argument("--blocks", default="", help="comma-separated keys per tile to sweep for int4 (0 = default)")
    p.add_argument("--prefetch", default="1", help="comma-separated 1 / 0: sweep int4 with and without prefetch")
    p.add_argument("--regs", default="", help="comma-separated registers per thread to sweep for int4 (0 = compiler's)")
    p.add_argument(
        "--magic", default="1", help="comma-separated 1 / 0: sweep int4 with codes made from their bits or converted"
    )
    p.add_argument(
        "--fold",
        default="1",
        help="comma-separated 1 / 0: sweep int4 with the codes' bias taken off with the zeros or per code",
    )
    p.add_argument(
        "--vpairs",
        default="1",
        help="comma-separated 1 / 0: sweep int4 with values paired along the tokens or the channels",
    )
    p.add_argument(
        "--trans",
        default="",
        help="comma-separated 1 / 0: sweep int4 with the products transposed (the codes the first operand) "
        "or not (default: plan's choice for the GPU)",
    )
    p.add_argument("--pg", default="1", help="comma-separated 1 / 0: sweep int4 with the statistics (pg) or out only")
    p.add_argument("--iters", type=int, default=20, help="calls per timing")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (runs on a CPU in triton's interpreter)")
    p.add_argument("--out", default="runs/triton_decode.json")
    args = p.parse_args(argv)
    sizes = {"splits": [args.split], "warps": [None], "blocks": [None], "regs": [None]}  # 0 = the default
    flags = {"prefetch": [True], "magic": [True], "fold": [True], "vpairs": [True], "trans": [None], "pg": [True]}
    for name, default in {**sizes, **flags}.items():
        got = []
        for x in filter(None, getattr(args, name).split(",")):
            if not x.isdigit() or (name in flags and x not in ("0", "1")):
                p.error(f"--{name} takes comma-separated {'1 / 0' if name in flags else 'whole numbers'}, got {x!r}.")
            got.append(bool(int(x)) if name in flags else int(x) or None)
        setattr(args, name, got or default)
    return args


def main(argv=None) -> int:
    args = parse(argv)
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
            print(
                "This benchmark times GPU kernels and there is no CUDA device here; nothing to time "
                "(--tiny runs tiny shapes in triton's CPU interpreter, to check that it runs)."
            )
            return 0
        from kvevict.kernels.triton_decode import interpreting

        if not interpreting():  # the interpreter must be on before triton is first imported: start afresh
            env = dict(os.environ, TRITON_INTERPRET="1")
            argv = sys.argv[1:] if argv is None else list(argv)
            os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)
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
        ms, gms, host = measure(args, configs, cuda)
    rows = table_rows(args, configs, errors, (ms, gms, host), cuda)
    report(args, rows, cuda, triton.__version__)
    return 0


def measure(args, configs: dict, cuda: bool) -> tuple:
    """({name: ms per call, each round}, the same from a CUDA graph, {name: host ms per call}): the
    configurations timed in ``--rounds`` interleaved rounds, each round in a rotated order."""
    names = list(configs)
    graphs = {name: capture(configs[name][0], args.iters) for name in names} if cuda else {}
    ms = {name: [] for name in names}
    gms = {name: [] for name in names}
    host = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            ms[name].append(time_call(configs[name][0], args.iters, cuda, host=host[name]))
            if cuda:
                gms[name].append(time_call(configs[name][0], args.iters, cuda, graphs[name]))
    return ms, gms, host


def table_rows(args, configs: dict, errors: dict, times: tuple, cuda: bool) -> list:
    """One row a configuration: its medians, its ratios to the first (dense SDPA), its rounds."""
    ms, gms, host = times
    names = list(configs)
    dense = names[0]
    rows = []
    for name in names:
        ratios = [a / b for a, b in zip(ms[name], ms[dense])]
        med = statistics.median(ms[name])
        row = {
            "config": name,
            "ms_per_layer": round(med, 4),
            "ms_all_layers": round(med * args.layers, 3),
            "ratio_to_dense": round(statistics.median(ratios), 3),
            "kv_mib": round(configs[name][1] / 2**20, 1),
            "max_abs_err": errors.get(name),
            "ms_per_layer_rounds": [round(x, 4) for x in ms[name]],
        }
        if cuda:  # the same calls replayed from a CUDA graph: the GPU's time alone
            row.update(
                host_ms_per_call=round(statistics.median(host[name]), 4),
                graph_ms_per_layer=round(statistics.median(gms[name]), 4),
                graph_ratio_to_dense=round(statistics.median(a / b for a, b in zip(gms[name], gms[dense])), 3),
                graph_ms_per_layer_rounds=[round(x, 4) for x in gms[name]],
            )
        rows.append(row)
    return rows


def report(args, rows: list, cuda: bool, triton_version: str) -> None:
    """The rows written to ``--out`` as JSON and printed as a table, with the int4 target's verdict."""
    where = torch.cuda.get_device_name() if cuda else "CPU, triton interpreter (timings mean nothing)"
    config = {k: v for k, v in vars(args).items() if k != "out"}  # what was measured, not where it went
    result = {"device": where, "torch": torch.__version__, "triton": triton_version, "config": config, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{where}; torch {torch.__version__}, triton {triton_version}")
    print(
        f"batch {args.batch}, context {args.context}, {args.heads} query / {args.kv_heads} KV heads, head dim "
        f"{args.head_dim}; one layer timed x {args.layers}; median of {args.rounds} rounds of {args.iters} calls"
    )
    print(
        f"{'config':<30} {'ms/layer':>9} {'ms x' + str(args.layers):>9} {'ratio':>6} {'host ms':>8} {'graph ms':>9} "
        f"{'ratio':>6} {'KV MiB':>8} {'max err':>8}"
    )
    for r in rows:
        err = "" if r["max_abs_err"] is None else f"{r['max_abs_err']:.1e}"
        graph = (
            f"{r['host_ms_per_call']:>8.4f} {r['graph_ms_per_layer']:>9.4f} {r['graph_ratio_to_dense']:>6.3g}"
            if cuda
            else f"{'':>8} {'':>9} {'':>6}"
        )
        print(
            f"{r['config']:<30} {r['ms_per_layer']:>9.4f} {r['ms_all_layers']:>9.3f} {r['ratio_to_dense']:>6.3g} "
            f"{graph} {r['kv_mib']:>8} {err:>8}"
        )
    if cuda:  # the int4 target, like for like (out only, as SDPA computes), and with the policies' pg
        for config, what in (("triton int4 out only", "out only, as SDPA"), ("triton int4", "with pg")):
            row = next(r for r in rows if r["config"] == config)
            for how, key in (("launched one by one", "ratio_to_dense"), ("from a CUDA graph", "graph_ratio_to_dense")):
                print(
                    f"target int4 ({what}) <= 0.5x dense, {how}: {'met' if row[key] <= 0.5 else 'NOT met'} "
                    f"({row[key]:.3f}x)"
                )
    print(f"written to {args.out}")


if __name__ == "__main__":
    sys.exit(main())
