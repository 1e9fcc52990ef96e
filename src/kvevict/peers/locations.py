"""Where the peers' environments live: one folder per peer under a root of the user's choosing
(``kvevict peers setup --into DIR`` creates them; see kvevict.peers.environments).

Each peer is found, first match wins, at

1. its own variable: ``$KVEVICT_KVPRESS_PYTHON``, ``$KVEVICT_VLLM_PYTHON``, ``$KVEVICT_LLAMA_BENCH``
   (the interpreter or program itself, anywhere);
2. ``$KVEVICT_PEERS/<peer>/...``, the root given to ``setup --into``;
3. the default root, ``$KVEVICT_CACHE/peers`` (``~/.cache/kvevict/peers``);
4. for kvpress only, ``.venv-kvpress/`` in a source checkout (the layout of earlier releases).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT_ENV = "KVEVICT_PEERS"
PEERS = ("kvpress", "vllm", "llamacpp")
# peer -> (its own variable, path of its program inside the peer's folder)
LAYOUT = {
    "kvpress": ("KVEVICT_KVPRESS_PYTHON", Path("kvpress", "bin", "python")),
    "vllm": ("KVEVICT_VLLM_PYTHON", Path("vllm", "bin", "python")),
    "llamacpp": ("KVEVICT_LLAMA_BENCH", Path("llama.cpp", "build", "bin", "llama-bench")),
}
SETUP_HINT = (
    "kvevict peers setup --into DIR --only {peer}, then export KVEVICT_PEERS=DIR (see docs/results/performance.md)"
)


def default_root() -> Path:
    root = os.environ.get("KVEVICT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvevict")
    return Path(root, "peers")


def peers_root() -> Path:
    """The root ``setup`` writes to when given no ``--into``, and the second place looked in."""
    env = os.environ.get(ROOT_ENV)
    return Path(env).expanduser() if env else default_root()


def candidates(peer: str) -> list[Path]:
    """Every place ``peer`` is looked for, in order."""
    if peer not in LAYOUT:
        raise ValueError(f"unknown peer {peer!r}; known: {', '.join(PEERS)}.")
    var, rel = LAYOUT[peer]
    out = [Path(os.environ[var]).expanduser()] if os.environ.get(var) else []
    if os.environ.get(ROOT_ENV):
        out.append(Path(os.environ[ROOT_ENV]).expanduser() / rel)
    out.append(default_root() / rel)
    if peer == "kvpress":
        out.append(Path(__file__).resolve().parents[3] / ".venv-kvpress" / "bin" / "python")
    return out


def find(peer: str) -> Path | None:
    """The peer's program, or None when none of ``candidates(peer)`` exists. A variable naming a
    missing file is not skipped over: the user asked for that one."""
    var = LAYOUT[peer][0] if peer in LAYOUT else None
    paths = candidates(peer)
    if var and os.environ.get(var):
        return paths[0] if paths[0].exists() else None
    return next((p for p in paths if p.exists()), None)


def hint(peer: str) -> str:
    return SETUP_HINT.format(peer=peer)
