"""The package's layering rule, read from the source: a core (cache, storage, attention, kernels,
policies, budgets and plans, models) that imports nothing of the outer ring (eval, serve, lmeval,
observatory, distributed, commands, data, peers, plotting, the CLI), and no import cycle anywhere,
counting the imports made inside functions too."""

import ast
from pathlib import Path

import kvevict

ROOT = Path(kvevict.__file__).parent
OUTER = ("eval", "serve", "lmeval", "observatory", "distributed", "commands", "data", "peers", "plotting", "cli")


def _modules() -> dict:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _graph(mods: dict) -> dict:
    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (
                    ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                    if node.level
                    else node.module
                )
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            graph[mod].update(t for t in targets if t in mods and t != mod)
    return graph


def _outer(mod: str) -> bool:
    return mod.split(".")[1:2] and mod.split(".")[1] in OUTER


def test_the_core_imports_nothing_of_the_outer_ring():
    graph = _graph(_modules())
    bad = {m: sorted(t for t in ts if _outer(t)) for m, ts in graph.items() if not _outer(m) and m != "kvevict"}
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_no_import_cycle():
    graph = _graph(_modules())
    graph["kvevict"] = set()  # the package's own __init__ re-exports; a submodule importing it is not a cycle
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_rule_sees_an_import_made_inside_a_function(tmp_path):
    pkg = tmp_path / "kvevict"
    (pkg / "eval").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "eval" / "__init__.py").write_text("")
    (pkg / "eval" / "runner.py").write_text("from ..cache import make_cache\n")
    (pkg / "cache.py").write_text("def make_cache():\n    from .eval import runner\n")
    global ROOT
    old, ROOT = ROOT, pkg
    try:
        graph = _graph(_modules())
    finally:
        ROOT = old
    assert "kvevict.eval.runner" in graph["kvevict.cache"] and "kvevict.cache" in graph["kvevict.eval.runner"]
