"""What one decode step asks of the device, counted (not timed): aten operators per layer, those of
them that launch work (every operator but views, which only relabel memory), and host reads
(``_local_scalar_dense``: ``.item()``, ``int(t)``, ``bool(t)``). On a GPU, where a small decode step
is bound by the host, the launches set the step's time and each host read stalls it until the
queue drains; counting them needs no GPU and gives the same number on any machine. A cache that
evicts in batches (``+slack=N``) ranks one step in N: the counts are averaged over 2 x N steps.

    python benchmarks/step_ops.py                                   # Qwen2.5-1.5B's heads, 4 layers
    python benchmarks/step_ops.py --caches 'stock;h2o@0.2' --out results/step_ops.json

The model is a Qwen2 of random weights with Qwen2.5-1.5B's head shape (2 KV heads of 128 channels,
6 queries each) and a narrow MLP; counts do not depend on widths. A batch of ``--batch`` prompts of
``--prompt`` tokens is prefilled, a few tokens decoded (every tier full), then one step counted.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if __package__ in (None, ""):  # run as a script: the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_generate import STOCK, TINY, new_cache  # noqa: E402

# each cache as shipped (a layer of 128 tokens or more evicts 16 at once) and evicting every step
_CACHES = (
    "h2o@0.2",
    "snapkv@0.2",
    "h2o/int8+int4@0.2",
    "ada-snapkv/int4@memory=0.2",
    "ada-snapkv@memory=0.2",
    "memory=0.2",
)
CACHES = ";".join([STOCK, *(f"{c}{s}" for c in _CACHES for s in ("+slack=1", ""))])


def is_view(func) -> bool:
    """An operator whose result aliases its input without writing it (view, slice, expand, ...)."""
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = self.launches = self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.launches += not is_view(func)
        self.host_reads += func.overloadpacket is torch.ops.aten._local_scalar_dense
        return func(*args, **(kwargs or {}))


def build(layers: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(TINY, num_hidden_layers=layers, hidden_size=256, head_dim=128, num_attention_heads=12)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**shape)).to(torch.bfloat16).eval()


@torch.no_grad()
def count(model, spec: str, batch: int, prompt: int) -> dict:
    ids = torch.randint(2, model.config.vocab_size, (batch, prompt))
    cache = new_cache(model, spec)
    if hasattr(cache, "set_prompt_length"):
        cache.set_prompt_length(prompt)
    tok = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
    for _ in range(3):
        tok = model(tok, cache=cache, use_cache=True).logits.argmax(-1)
    tiers = [t for layer in getattr(cache, "layers", []) for t in getattr(layer, "tiers", [])]
    steps = 2 * max([t.slack for t in tiers], default=1)
    with Count() as c:
        for _ in range(steps):  # the same token each step: the model alone is counted
            model(tok, cache=cache, use_cache=True)
    n = model.config.num_hidden_layers * steps
    return {
        "cache": spec,
        "steps": steps,
        "ops_per_layer": c.ops / n,
        "launches_per_layer": c.launches / n,
        "host_reads": c.host_reads / steps,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--caches", default=CACHES, help="';'-separated: stock or cache specs")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--out", default="step_ops.json")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model = build(a.layers)
    rows = [count(model, s, a.batch, a.prompt) for s in a.caches.split(";") if s]
    base = next((r for r in rows if r["cache"] == STOCK), None)
    print("| cache | ops / layer | launches / layer | x stock | host reads / step |\n|---|---|---|---|---|")
    for r in rows:
        if base:
            r["launches_x_stock"] = r["launches_per_layer"] / base["launches_per_layer"]
        x = f"{r['launches_x_stock']:.1f}" if base else ""
        print(
            f"| `{r['cache']}` | {r['ops_per_layer']:.0f} | {r['launches_per_layer']:.0f} | {x} | {r['host_reads']:g} |"
        )
    out = {"layers": a.layers, "batch": a.batch, "prompt": a.prompt, "torch": torch.__version__, "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
