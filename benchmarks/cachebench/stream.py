"""Endless streams: a long real text fed through the model block by block, every next token scored.

The H2O paper (Zhang et al., 2023, sec. 5) and StreamingLLM (Xiao et al., 2024) stream inputs far
longer than the training context through a fixed-size cache. Here each block of ``block`` tokens
goes through ``model(x, cache=cache)``; the negative log-likelihood of every next token
is kept, and at the end of each ``window``-token window we record

    ppl(window) = exp( mean_{t in window} -log p(x_{t+1} | cache, x_<=t) ),

the KV bytes the cache holds, and the process's resident memory. Caches compared: a policy with
compact positions at a fixed budget (the keys re-rotated to their rank, so no distance exceeds the
cache), recency with sinks under compact positions (StreamingLLM's sliding window), and the stock
DynamicCache, which grows with the stream and meets positions past the model's context length.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .child_measure import kv_bytes, rss_bytes

STOCK = "stock"


@dataclass
class StreamSettings:
    model: str = "smollm2-135m"
    tokens: int = 100_000
    budget: int = 1024
    block: int = 512
    window: int = 1024
    policies: list = field(default_factory=lambda: ["h2o", "recency"])  # both with compact positions
    stock_tokens: int = 12_288  # the stock cache only needs to go a little past the context length
    threads: int | None = None  # default: default_threads() (not every core)

    def check(self) -> None:
        for name in ("tokens", "budget", "block", "window", "stock_tokens", "threads"):
            v = getattr(self, name)
            if name == "threads" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"stream {name.replace('_', '-')} must be a positive int, got {v!r}.")
        if self.window < self.block or self.window % self.block:
            raise ValueError(f"the stream window ({self.window}) must be a multiple of the block ({self.block}).")


def stream_ids(tokenizer, tokens: int) -> torch.Tensor:
    """(1, tokens) ids of real text: half Paul Graham's essays, then Jane Austen's novels."""
    from kvevict.data.austen import austen
    from kvevict.data.essays import essays

    half = tokens // 2
    ess = tokenizer("\n\n".join(essays()), add_special_tokens=False)["input_ids"][:half]
    novels = "\n\n".join(text for _, text in austen())
    nov = tokenizer(novels[: (tokens - len(ess)) * 8], add_special_tokens=False)["input_ids"][: tokens - len(ess)]
    ids = ess + nov
    if len(ids) < tokens:
        raise ValueError(f"the essays and novels give {len(ids)} tokens, fewer than the {tokens} asked for.")
    return torch.tensor([ids])


def new_stream_cache(model, name: str, budget: int):
    """The stock DynamicCache (SDPA attention) or ``name``'s EvictingCache with compact positions."""
    from transformers import DynamicCache

    from kvevict.cache import make_cache

    if name == STOCK:
        model.set_attn_implementation("sdpa")
        return DynamicCache(config=model.config)
    return make_cache(model, name, budget, compact=True)


@torch.no_grad()
def run_stream(
    model, ids: torch.Tensor, cache, block: int, window: int, limit: int | None = None, log=None
) -> list[dict]:
    """Feed ``ids`` (1, n) through ``cache`` in ``block``-token forwards (up to ``limit`` tokens);
    one record per ``window`` tokens: end, ppl, kv_bytes, rss_bytes, seconds (since the start)."""
    n = ids.shape[1] if limit is None else min(limit, ids.shape[1])
    rows, nll_sum, count, start = [], 0.0, 0, time.perf_counter()
    for s in range(0, n - 1, block):
        e = min(n - 1, s + block)
        logits = model(ids[:, s:e], cache=cache, use_cache=True).logits[0].float()
        nll = torch.nn.functional.cross_entropy(logits, ids[0, s + 1 : e + 1], reduction="sum")
        nll_sum, count = nll_sum + nll.item(), count + (e - s)
        if e % window == 0 or e == n - 1:
            rows.append(
                {
                    "end": e,
                    "ppl": math.exp(nll_sum / count),
                    "kv_bytes": kv_bytes(cache),
                    "rss_bytes": rss_bytes(),
                    "seconds": time.perf_counter() - start,
                }
            )
            nll_sum, count = 0.0, 0
            if log:
                r = rows[-1]
                log(
                    f"  {e:>7} tokens  ppl {r['ppl']:8.2f}  KV {r['kv_bytes'] / 2**20:7.1f} MiB  "
                    f"RSS {r['rss_bytes'] / 2**20:7.0f} MiB  {r['seconds']:6.0f} s"
                )
    return rows


def run_stream_bench(settings: StreamSettings, out: Path, command: str = "", log=print) -> dict:
    """Every cache over the stream; writes stream.json, stream.md and stream.png under ``out``."""
    from kvevict.commands._common import default_threads
    from kvevict.models import load_model

    settings.check()
    settings.threads = settings.threads or default_threads()
    torch.set_num_threads(settings.threads)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(settings.model)
    ids = stream_ids(tok, settings.tokens)
    context = getattr(model.config, "max_position_embeddings", None)
    runs = {}
    for name in [*settings.policies, STOCK]:
        limit = min(settings.stock_tokens, settings.tokens) if name == STOCK else settings.tokens
        log(f"{name}: {limit} tokens in {settings.block}-token blocks")
        cache = new_stream_cache(model, name, settings.budget)
        runs[name] = run_stream(model, ids, cache, settings.block, settings.window, limit, log)
        del cache
    res = {"settings": asdict(settings), "command": command, "context_length": context, "runs": runs}
    (out / "stream.json").write_text(json.dumps(res, indent=1))
    (out / "stream.md").write_text(stream_table(res))
    from kvevict.plotting import available

    if available():
        stream_plot(res, out / "stream.png")
    return res


def stream_table(res: dict) -> str:
    """Markdown: per cache, ppl at a few points along the stream, and KV / RSS at its first and last window."""
    s = res["settings"]
    lines = [
        f"# Stream: {s['tokens']} tokens through {s['model']} (context {res['context_length']}), "
        f"budget {s['budget']}, {s['block']}-token blocks, {s['threads']} thread(s)",
        "",
        f"`{res['command']}`",
        "",
        "| cache | tokens | ppl first window | ppl median window | ppl last window | KV first / last MiB "
        "| RSS first / last MiB | seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in res["runs"].items():
        label = name if name == STOCK else f"{name} (compact, budget {s['budget']})"
        mid = statistics.median(r["ppl"] for r in rows)
        lines.append(
            f"| {label} | {rows[-1]['end'] + 1} | {rows[0]['ppl']:.1f} | {mid:.1f} | {rows[-1]['ppl']:.1f} "
            f"| {rows[0]['kv_bytes'] / 2**20:.1f} / {rows[-1]['kv_bytes'] / 2**20:.1f} "
            f"| {rows[0]['rss_bytes'] / 2**20:.0f} / {rows[-1]['rss_bytes'] / 2**20:.0f} "
            f"| {rows[-1]['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def stream_plot(res: dict, path: Path) -> Path:
    """Perplexity per window (log scale) and resident memory along the stream, one line per cache."""
    from kvevict.plotting import pyplot

    plt = pyplot()
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    s = res["settings"]
    for name, rows in res["runs"].items():
        x = [r["end"] / 1000 for r in rows]
        label = name if name == STOCK else f"{name}, compact, budget {s['budget']}"
        style = dict(color="black", linewidth=2) if name == STOCK else dict(linewidth=1.2)
        a.plot(x, [r["ppl"] for r in rows], label=label, **style)
        b.plot(x, [r["rss_bytes"] / 2**20 for r in rows], label=f"{label}: RSS", **style)
        b.plot(x, [r["kv_bytes"] / 2**20 for r in rows], linestyle="--", label=f"{label}: KV", **style)
    if res.get("context_length"):
        for ax in (a, b):
            ax.axvline(res["context_length"] / 1000, color="grey", linestyle=":", linewidth=1)
    a.set_yscale("log")
    a.set_ylabel(f"perplexity per {s['window']}-token window")
    a.legend(fontsize=8)
    a.grid(True, alpha=0.3)
    b.set_ylabel("MiB (solid: process RSS, dashed: KV)")
    b.set_xlabel("tokens streamed (thousands); dotted: the model's context length")
    b.legend(fontsize=7, ncol=2)
    b.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
