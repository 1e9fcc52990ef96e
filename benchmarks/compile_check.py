"""Whether a full cache's decode step captures as one graph, counted (not timed):
per cache, the graph breaks of one step (``torch._dynamo.explain``), then over 4 x slack decode
steps under ``torch.compile`` the graph variants made and those made after the warm-up (the first
ranking, one turn-over and the next ranking: 2 x slack + 1 steps), which must be none; and the
CUDA graphs those steps would record: inductor's CUDA graph trees record one per graph and distinct
tuple of the graph's int inputs (``torch/_inductor/cudagraph_trees.py``, ``cudagraphify_impl``), so
an int input that changes every step (a host count) records a new CUDA graph every step, and so
does a static input whose storage moved since the graph's last call.

    python benchmarks/compile_check.py                                  # the shipped caches
    python benchmarks/compile_check.py --caches 'h2o@0.2;memory=0.2' --out results/compile.json

The model is ``step_ops``'s: a Qwen2 of random weights with Qwen2.5-1.5B's head shape, bfloat16. A
batch of ``--batch`` prompts of ``--prompt`` tokens is prefilled eagerly (every tier full), then
the decode step, the cache an argument as generate hands it and declared ``compileable()``, is
compiled by a backend that functionalizes it as inductor does and runs it eagerly (``CudaGraphRecorder``:
dynamo's capture is the same for every backend). Prints a table and writes JSON.
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


class CudaGraphRecorder:
    """A backend that compiles as AOTAutograd compiles for inductor (functionalized) and runs the
    graph eagerly, recording what decides CUDA graphs: per graph, each distinct tuple of its int
    inputs seen when called (one recording each); its inputs written in place that are not
    static addresses (CUDA graph trees skip such a graph: ``check_for_mutation``); the calls in
    which a static input's storage moved since the graph's last call (CUDA graph trees record the
    graph again: its static inputs are read where they were when recorded); and the tensors it
    reads from module globals (on a GPU a CPU one there makes inductor skip CUDA graphs for the
    graph, or split it: ``check_multiple_devices_or_any_cpu_nodes``)."""

    def __init__(self):
        self.keys: set = set()
        self.graphs = 0
        self.names: set = set()
        self.mutated: set = set()
        self.moves = 0  # calls in which a static input had moved
        self.moved: set = set()  # the names of those inputs
        self._ptrs: dict = {}  # each graph's static inputs' addresses at its last call
        self.globals: set = set()  # tensors read from module globals (a CPU one in a CUDA graph: skipped)

    def __call__(self, gm, example_inputs):
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._guards import TracingContext

        graph, self.graphs = self.graphs, self.graphs + 1
        at = [i for i, x in enumerate(example_inputs) if isinstance(x, (int, torch.SymInt))]
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self.globals.update(
            n for n, x in zip(names, example_inputs) if n.startswith("g_") and isinstance(x, torch.Tensor)
        )
        self.names.update(names[i] for i in at if i < len(names))

        static_at: list = []  # the static inputs among the call's arguments

        def fw(g, inputs):
            meta = TracingContext.get().fw_metadata
            static = set(meta.static_input_indices)
            lifted = len(inputs) - len(names)  # the module's parameters and buffers come first
            static_at.extend(i - lifted for i in sorted(static) if i >= lifted)
            for i, info in enumerate(meta.input_info):
                if (info.mutates_data or info.mutates_metadata) and i not in static:
                    self.mutated.add(names[i - lifted] if i >= lifted else f"parameter {i}")
            return g

        run = aot_module_simplified(gm, example_inputs, fw_compiler=fw)

        def call(*args):
            self.keys.add((graph, tuple(args[i] for i in at)))
            ptrs = [args[i].data_ptr() if isinstance(args[i], torch.Tensor) else None for i in static_at]
            last = self._ptrs.get(graph, ptrs)
            moved = [names[i] for i, a, b in zip(static_at, last, ptrs) if a != b]
            self.moves += bool(moved)
            self.moved.update(moved)
            self._ptrs[graph] = ptrs
            return run(*args)

        return call


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@torch.no_grad()
def check(model, spec: str, batch: int, prompt: int) -> dict:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    ids = torch.randint(2, model.config.vocab_size, (batch, prompt))
    cache = new_cache(model, spec).compileable()
    cache.set_prompt_length(prompt)
    tok = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
    slack = max(t.slack for layer in cache.layers for t in layer.tiers)
    seen = [prompt]

    def pos():  # counted here, as generate counts them: reading the cache's count is a host read
        seen[0] += 1
        return torch.full((batch, 1), seen[0] - 1)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(_step)(model, tok, pos(), cache)  # runs one step
    breaks = [f"{r.reason.splitlines()[0]} ({_where(r)})" for r in explained.break_reasons]
    torch._dynamo.reset()
    counters.clear()
    keys = CudaGraphRecorder()
    step = torch.compile(_step, backend=keys)
    steps, warm, late, late_records, late_moves = 4 * slack, 2 * slack + 1, 0, 0, 0
    for i in range(steps):
        before, recorded, moves = _graphs(), len(keys.keys), keys.moves
        tok = step(model, tok, pos(), cache)[:, -1:].argmax(-1)
        late += (_graphs() - before) if i >= warm else 0
        late_records += (len(keys.keys) - recorded) if i >= warm else 0
        late_moves += (keys.moves - moves) if i >= warm else 0
    return {
        "cache": spec,
        "slack": slack,
        "steps": steps,
        "graph_breaks": explained.graph_break_count,
        "break_reasons": breaks,
        "variants": _graphs(),
        "recompiles_after_warmup": late,
        "int_inputs": sorted(keys.names),
        "cuda_graph_records": len(keys.keys),
        "cuda_graph_records_after_warmup": late_records,
        "mutated_not_static": sorted(keys.mutated),
        "static_moves_after_warmup": late_moves,
        "static_moved": sorted(keys.moved),
        "global_tensors": sorted(keys.globals),
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
    p.add_argument("--out", default="compile_check.json")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model = build(a.layers)
    rows = [check(model, s, a.batch, a.prompt) for s in a.caches.split(";") if s]
    print(
        "| cache | slack | steps | graph breaks | graph variants | recompiles after warm-up "
        "| CUDA graphs recorded | of them after warm-up | int inputs | written in place, not static "
        "| static inputs moved, steps after warm-up |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| `{r['cache']}` | {r['slack']} | {r['steps']} | {r['graph_breaks']} | {r['variants']} "
            f"| {r['recompiles_after_warmup']} | {r['cuda_graph_records']} | {r['cuda_graph_records_after_warmup']} "
            f"| {len(r['int_inputs'])} | {len(r['mutated_not_static'])} | {r['static_moves_after_warmup']} |"
        )
        for why in r["break_reasons"]:
            print(f"|   break: {why} |")
    out = {"layers": a.layers, "batch": a.batch, "prompt": a.prompt, "torch": torch.__version__}
    Path(a.out).write_text(json.dumps({**out, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
