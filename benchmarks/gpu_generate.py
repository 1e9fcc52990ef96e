"""bf16 generation on one GPU at Qwen2.5-Coder-1.5B's shape (28 layers, 12 query / 2 KV heads, head
dim 128, vocabulary 151,936): budgeted caches against the stock transformers ``DynamicCache`` with
SDPA in eager mode (what most users run) and transformers' fast path, a ``StaticCache`` whose decode
step ``generate`` compiles (``static-compiled``: CUDA graphs on a GPU), each on the same random prompts.

    python benchmarks/gpu_generate.py --out results/gpu_generate.json     # needs a CUDA GPU
    python benchmarks/gpu_generate.py --tiny --device cpu                 # tiny shapes, any machine
    python benchmarks/gpu_generate.py --device cpu --model qwen2.5-coder-1.5b --contexts 4096 \
        --batches 1 --new 1 --check '' --fit-gib 0 --threads 1              # the prompt's time on a CPU

The weights are random (``--model`` may name a local folder with real ones): time and memory do
not depend on their values, and a 1.5B model's weights do not travel to a lent GPU machine. Per
context (``--contexts``), cache (``--caches``, ``stock`` or a cache spec) and batch (``--batches``):
the prompt's forward (all but its last token, ``logits_to_keep=1``), then ``--new`` greedy tokens
through ``model.generate`` (the answer's tokens/s), the cache's bytes, and the peak GPU memory above
the weights (``torch.cuda.max_memory_allocated``). Each configuration runs ``--rounds`` times, the
caches interleaved; the first round is a warm-up (Triton's compilation, the allocator's growth) and
the table gives the median of the others, with the ratio to stock in the same round.

Then, at ``--fit-context``, the largest batch each cache decodes in ``--fit-gib`` GiB of GPU memory,
weights included: the bytes a row holds after its prompt (measured by the allocator: every byte the
cache allocated for it) and the transient peak of a decode step give a predicted batch, which is
then run under ``torch.cuda.set_per_process_memory_fraction`` (prompts entered ``--fit-rows`` rows at
a time and appended; ``--new`` steps decoded); on an out-of-memory the batch shrinks by a tenth and
runs again. Writes JSON to ``--out`` after every configuration, so a cut run keeps what it did.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

# Qwen2.5-Coder-1.5B-Instruct's config.json, shapes only
QWEN_1_5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151645,
)
TINY = dict(QWEN_1_5B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, bos_token_id=0, eos_token_id=1)  # fmt: skip
STOCK = "stock"
# transformers' fast path: a StaticCache, its decode step compiled by generate itself (CUDA graphs
# on a GPU, ``mode="reduce-overhead"``); what a user who wants speed runs
STATIC = "static-compiled"
# a kvevict cache whose decode step generate compiles (fullgraph; CUDA graphs on a GPU); without
# the prefix a kvevict cache runs eager (generate would otherwise compile it on CUDA by itself)
COMPILED = "compiled:"
STATIC_ROOM = 512  # the most new tokens a StaticCache made by ``fill`` has room for


def build_model(args, device):
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if args.model:
        from kvevict.models import KNOWN_MODELS, load_model

        if args.model in KNOWN_MODELS:
            return load_model(args.model, dtype=torch.bfloat16)[0].to(device)
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(device).eval()
    shape = dict(TINY if args.tiny else QWEN_1_5B)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    config = Qwen2Config(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    return model.eval()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def allocated(device) -> int:
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


def new_cache(model, spec: str, pages=None, length: int = 0):
    """A stock ``DynamicCache``, a ``StaticCache`` of ``length`` positions, or a kvevict cache."""
    from transformers import DynamicCache, StaticCache

    if spec in (STOCK, STATIC):
        model.set_attn_implementation("sdpa")
        if spec == STATIC:
            return StaticCache(config=model.config, max_cache_len=length)
        return DynamicCache(config=model.config)
    from kvevict import make_cache

    return make_cache(model, spec.removeprefix(COMPILED), pages=pages).compileable(spec.startswith(COMPILED))


def cache_bytes(cache) -> int:
    if hasattr(cache, "kv_bytes"):
        return cache.kv_bytes()
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


@torch.no_grad()
def fill(model, spec, ids, pages=None):
    """A cache holding ``ids`` but their last token (generate feeds that one)."""
    cache = new_cache(model, spec, pages, length=ids.shape[1] + STATIC_ROOM)
    if hasattr(cache, "set_prompt_length"):
        cache.set_prompt_length(ids.shape[1])
    model(ids[:, :-1], cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def decode(model, cache, ids, new, compiled: bool = False):
    from transformers import CompileConfig, StaticCache

    from kvevict import EvictingCache

    # a StaticCache is compiled by generate on a GPU; elsewhere only when asked (a CPU check of the
    # script); a kvevict cache only when its name says ``compiled:``
    compile_config, extra = None, {}
    cuda = ids.device.type == "cuda"
    if isinstance(cache, EvictingCache) and compiled:
        compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead" if cuda else "default")
    elif isinstance(cache, EvictingCache):
        extra = {"disable_compile": True}
    elif isinstance(cache, StaticCache) and not cuda:
        compile_config = CompileConfig(mode="default")
    if compile_config is not None and not cuda:
        compile_config._compile_all_devices = True  # a flag, not a field, of transformers' CompileConfig
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=0,
        compile_config=compile_config,
        **extra,
    )


@torch.no_grad()
def one_run(model, spec, ids, new, device, weights) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    sync(device)
    t0 = time.perf_counter()
    cache = fill(model, spec, ids)
    sync(device)
    t1 = time.perf_counter()
    held = cache_bytes(cache)
    from torch._dynamo.utils import counters

    skips = counters["inductor"]["cudagraph_skips"]  # graphs CUDA graph trees declined (GPU: logged why)
    out = decode(model, cache, ids, new, spec.startswith(COMPILED))
    sync(device)
    t2 = time.perf_counter()
    peak = torch.cuda.max_memory_allocated() - weights if device.type == "cuda" else 0
    b = ids.shape[0]
    return {
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
        "tokens_per_s": b * (out.shape[1] - ids.shape[1]) / (t2 - t1),
        "cache_bytes_after_prompt": held,
        "cache_bytes_end": cache_bytes(cache),
        "peak_above_weights": peak,
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips,
    }


def append(big, small, start: int, batch: int):
    """Rows of ``small`` as rows ``start ...`` of a ``batch``-row cache (a budgeted cache's own
    ``append_rows``; a stock cache's keys and values copied into tensors made once at full size)."""
    if hasattr(small, "append_rows"):
        if big is None:
            return small
        big.append_rows(small)
        return big
    if big is None:
        for layer in small.layers:
            for name in ("keys", "values"):
                x = getattr(layer, name)
                whole = x.new_empty((batch, *x.shape[1:]))
                whole[: x.shape[0]] = x
                setattr(layer, name, whole)
        return small
    for a, b in zip(big.layers, small.layers):
        a.keys[start : start + b.keys.shape[0]] = b.keys
        a.values[start : start + b.values.shape[0]] = b.values
    return big


def fill_rows(model, spec, batch, rows, n, gen, device, pages=None):
    """A ``batch``-row cache of random ``n``-token prompts entered ``rows`` at a time, and the ids
    generate goes on from (their last token is what it feeds)."""
    cache = None
    for start in range(0, batch, rows):
        ids = torch.randint(0, model.config.vocab_size, (min(rows, batch - start), n), generator=gen, device=device)
        cache = append(cache, fill(model, spec, ids, pages), start, batch)
    return cache, torch.randint(0, model.config.vocab_size, (batch, n), generator=gen, device=device)


@torch.no_grad()
def fit(model, spec, args, device, weights, gen) -> dict:
    """The largest batch of ``args.fit_context``-token prompts this cache decodes within
    ``args.fit_gib`` GiB (weights included), predicted from one chunk of rows, then run."""
    from kvevict.storage import Pools

    limit = int(args.fit_gib * 2**30)
    n, rows = args.fit_context, args.fit_rows
    pages = None if spec == STOCK else Pools()

    def build(batch):
        return fill_rows(model, spec, batch, rows, n, gen, device, pages)

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    cache, ids = build(rows)
    per_row = (torch.cuda.memory_allocated() - base) / rows
    prefill_peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    decode(model, cache, ids, args.new, spec.startswith(COMPILED))
    step_peak = (torch.cuda.max_memory_allocated() - held) / rows  # a decode step's transient, per row
    del cache, ids
    room = limit - weights - prefill_peak  # the last chunk's prompt is entered beside the rows before it
    predicted = max(0, int(room // (per_row + step_peak)))
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(limit / total)
    tried, batch = [], predicted
    try:
        while batch > 0:
            torch.cuda.empty_cache()
            try:
                cache, ids = build(batch)
                t0 = time.perf_counter()
                out = decode(model, cache, ids, args.new, spec.startswith(COMPILED))
                sync(device)
                seconds = time.perf_counter() - t0
                tried.append({"batch": batch, "ran": True, "tokens_per_s": batch * (out.shape[1] - n) / seconds})
                break
            except torch.OutOfMemoryError:
                tried.append({"batch": batch, "ran": False})
                cache = ids = None
                batch = int(batch * 0.9)
    finally:
        cache = ids = None
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)
    return {
        "bytes_per_row": per_row,
        "step_peak_per_row": step_peak,
        "prefill_peak": prefill_peak,
        "predicted": predicted,
        "tried": tried,
        "largest": tried[-1]["batch"] if tried and tried[-1]["ran"] else 0,
    }


@torch.no_grad()
def check_backends(model, specs, device, gen, n=2048, batch=2, new=8) -> dict:
    """Each cache's greedy tokens and logits with the fused kernel (``KVEVICT_KERNEL=triton`` on a
    GPU) against the torch reference, the specification, on the same prompts."""
    from kvevict.kernels import ENV

    ids = torch.randint(0, model.config.vocab_size, (batch, n), generator=gen, device=device)
    fast = "triton" if device.type == "cuda" else "cpu"
    found, before = {}, os.environ.get(ENV)
    try:
        for spec in specs:
            got = {}
            for backend in ("torch", fast):
                os.environ[ENV] = backend
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    cache=fill(model, spec, ids),
                    do_sample=False,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    pad_token_id=0,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
                got[backend] = (out.sequences[:, n:], torch.stack(out.logits, 1).float())
            (ta, la), (tb, lb) = got["torch"], got[fast]
            same = int((ta == tb).long().cumprod(1).sum(1).min())  # tokens equal from the start, worst row
            found[spec] = {
                "backend": fast,
                "first_logits_max_abs_diff": float((la[:, 0] - lb[:, 0]).abs().max()),
                "logits_scale": float(la[:, 0].abs().max()),
                "tokens_equal_from_start": same,
                "of": new,
            }
            print(f"check {spec}: {found[spec]}", flush=True)
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
    return found


def table(rows, fits) -> str:
    lines = [
        "| context | cache | batch | prompt s | x stock | decode tok/s | x stock | cache MiB | peak MiB above weights |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['context']} | {r['cache']} | {r['batch']} | {r['prefill_s']:.3f} | {r['prefill_x']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {r['tps_x']:.2f} | {r['cache_bytes_end'] / 2**20:.1f} | "
            f"{r['peak_above_weights'] / 2**20:.0f} |"
        )
    if fits:
        lines += [
            "",
            "| cache | MiB a row | predicted batch | largest batch run | its tok/s |",
            "|---|---|---|---|---|",
        ]
        for spec, f in fits.items():
            tps = next((t["tokens_per_s"] for t in f["tried"] if t["ran"]), float("nan"))
            lines.append(
                f"| {spec} | {f['bytes_per_row'] / 2**20:.1f} | {f['predicted']} | {f['largest']} | {tps:.1f} |"
            )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default="",
        help="a known model or a local folder with real weights (default: random, Qwen-1.5B-shaped)",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny widths, and lengths unless given (a check that it runs)")
    p.add_argument("--layers", type=int, default=0, help="decoder layers of the random model (0: the shape's own)")
    p.add_argument("--contexts", default="8192,32704", help="prompt tokens (32,704 + 64 new = the 32K positions)")
    p.add_argument("--batches", default="8", help="batch sizes (8: the issue's targets; 1,8 for both)")
    p.add_argument(
        "--caches",
        default=f"{STOCK};{STATIC};memory=0.2;{COMPILED}memory=0.2",
        help=f"';'-separated: {STOCK} (DynamicCache, eager), {STATIC} (StaticCache, compiled), or cache specs "
        f"(eager; {COMPILED}SPEC: its decode step compiled by generate, CUDA graphs on a GPU)",
    )
    p.add_argument("--new", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--rounds", type=int, default=3, help="rounds per configuration, the first a warm-up")
    p.add_argument("--fit-context", type=int, default=8192)
    p.add_argument("--fit-gib", type=float, default=12.0)
    p.add_argument("--fit-rows", type=int, default=8, help="prompts entered at a time when filling a batch")
    p.add_argument(
        "--check",
        default="ada-snapkv@memory=0.2;h2o/int8@0.2;snapkv/int4@0.2",
        help="caches whose fused-kernel decode is first checked against the torch reference ('' skips)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads on a CPU (0: torch's default)")
    p.add_argument("--out", default="results/gpu_generate.json")
    args = p.parse_args(argv)
    if args.tiny:  # lengths not given on the command line become tiny too
        given = " ".join(argv if argv is not None else sys.argv[1:])
        for name, value in (("contexts", "64,128"), ("batches", "1,2"), ("new", 4), ("fit_context", 64)):
            if f"--{name.replace('_', '-')}" not in given:
                setattr(args, name, value)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    # every compiled cache kind, context and batch here compiles its own variants of the model's one
    # forward (2-5 each, compile_check.py), past dynamo's default of 8 per function
    torch._dynamo.config.recompile_limit = 256
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to time (--device cpu --tiny checks the script)")
        return 0
    model = build_model(args, device)
    weights = allocated(device)
    caches = [c.strip() for c in args.caches.split(";") if c.strip()]
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    gen = torch.Generator(device=device).manual_seed(0)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "args": vars(args),
        "weights_bytes": weights,
        "runs": [],
        "fit": {},
        "failed": {},
    }
    if args.check:
        specs = [c.strip() for c in args.check.split(";") if c.strip()]
        report["check"] = check_backends(model, specs, device, gen, n=256 if args.tiny else 2048)
        out.write_text(json.dumps(report, indent=1))
    rows = []
    for n in contexts:
        for b in batches:
            ids = torch.randint(0, model.config.vocab_size, (b, n), generator=gen, device=device)
            got = {c: [] for c in caches}
            for r in range(args.rounds):
                for c in caches[r % len(caches) :] + caches[: r % len(caches)]:  # each round its own order
                    if c in report["failed"]:
                        continue
                    try:
                        got[c].append(one_run(model, c, ids, args.new, device, weights))
                    except Exception as err:  # a compiled step that fails must not lose the others' run
                        if not c.startswith(COMPILED):
                            raise
                        report["failed"][c] = f"{n} tokens, batch {b}: {type(err).__name__}: {err}"[:800]
                        print(f"{c} failed: {report['failed'][c]}", flush=True)
                        continue
                    print(f"{n} tokens, batch {b}, round {r}: {c}: {got[c][-1]}", flush=True)
            timed = {c: v[1:] or v for c, v in got.items() if v}  # the warm-up round left out
            for c in timed:
                med = {k: statistics.median(x[k] for x in timed[c]) for k in timed[c][0]}
                stock = timed.get(STOCK)
                px = tx = float("nan")
                if stock:
                    px = statistics.median(x["prefill_s"] / s["prefill_s"] for x, s in zip(timed[c], stock))
                    tx = statistics.median(x["tokens_per_s"] / s["tokens_per_s"] for x, s in zip(timed[c], stock))
                rows.append({"context": n, "cache": c, "batch": b, **med, "prefill_x": px, "tps_x": tx, "runs": got[c]})
            report["runs"] = rows
            out.write_text(json.dumps(report, indent=1))
    if device.type == "cuda" and args.fit_gib > 0:
        for c in (
            c for c in caches if c != STATIC and c not in report["failed"]
        ):  # its rows are allocated whole: the stock cache's fit
            report["fit"][c] = fit(model, c, args, device, weights, gen)
            print(f"fit {c}: {report['fit'][c]}", flush=True)
            out.write_text(json.dumps(report, indent=1))
    print(table(rows, report["fit"]))
    print(f"weights {weights / 2**30:.2f} GiB; wrote {out}")
    if any(math.isnan(r["tps_x"]) for r in rows if STOCK in caches):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
