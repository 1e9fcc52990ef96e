"""Whether a full cache's decode step captures as one graph, counted (not timed):
per cache, the graph breaks of one step (``torch._dynamo.explain``), then over 4 x slack decode
steps under ``torch.compile`` the graph variants made and those made after the warm-up (the first
ranking, one turn-over and the next ranking: 2 x slack + 1 steps), which must be none.

    python benchmarks/compile_check.py                                  # the shipped caches
    python benchmarks/compile_check.py --caches 'h2o@0.2;memory=0.2' --out results/compile.json

The model is ``step_ops``'s: a Qwen2 of random weights with Qwen2.5-1.5B's head shape, bfloat16. A
batch of ``--batch`` prompts of ``--prompt`` tokens is prefilled eagerly (every tier full), then
the decode step, the cache an argument as generate hands it, is compiled with the ``eager``
backend (``--backend`` to change it: dynamo's capture is the same). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_generate import new_cache  # noqa: E402
from benchmarks.step_ops import build  # noqa: E402

CACHES = "h2o@0.2;snapkv@0.2;memory=0.2;h2o/int4@memory=0.25;ada-snapkv/int4@memory=0.2"


def _step(model, tok, pos, cache):
    return model(tok, cache=cache, position_ids=pos, use_cache=True).logits


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@torch.no_grad()
def check(model, spec: str, batch: int, prompt: int, backend: str) -> dict:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    ids = torch.randint(2, model.config.vocab_size, (batch, prompt))
    cache = new_cache(model, spec)
    cache.set_prompt_length(prompt)
    tok = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
    slack = max(t.slack for layer in cache.layers for t in layer.tiers)

    def pos():
        return torch.full((batch, 1), cache.get_seq_length())

    torch._dynamo.reset()
    explained = torch._dynamo.explain(_step)(model, tok, pos(), cache)  # runs one step
    breaks = [f"{r.reason.splitlines()[0]} ({_where(r)})" for r in explained.break_reasons]
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(_step, backend=backend)
    steps, warm, late = 4 * slack, 2 * slack + 1, 0
    for i in range(steps):
        before = _graphs()
        tok = step(model, tok, pos(), cache)[:, -1:].argmax(-1)
        late += (_graphs() - before) if i >= warm else 0
    return {
        "cache": spec,
        "slack": slack,
        "steps": steps,
        "graph_breaks": explained.graph_break_count,
        "break_reasons": breaks,
        "variants": _graphs(),
        "recompiles_after_warmup": late,
    }


def _where(reason) -> str:
    frame = reason.user_stack[-1] if reason.user_stack else None
    return "?" if frame is None else f"{Path(frame.filename).name}:{frame.lineno}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--caches", default=CACHES, help="';'-separated cache specs")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt", type=int, default=400)
    p.add_argument("--backend", default="eager", help="torch.compile backend: eager, aot_eager, inductor")
    p.add_argument("--out", default="compile_check.json")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model = build(a.layers)
    rows = [check(model, s, a.batch, a.prompt, a.backend) for s in a.caches.split(";") if s]
    print("| cache | slack | steps | graph breaks | graph variants | recompiles after warm-up |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| `{r['cache']}` | {r['slack']} | {r['steps']} | {r['graph_breaks']} | {r['variants']} "
            f"| {r['recompiles_after_warmup']} |"
        )
        for why in r["break_reasons"]:
            print(f"|   break: {why} |")
    out = {"layers": a.layers, "batch": a.batch, "prompt": a.prompt, "backend": a.backend, "torch": torch.__version__}
    Path(a.out).write_text(json.dumps({**out, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
