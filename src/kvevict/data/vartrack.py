"""RULER's variable tracking (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?", task ``vt``): a value is bound to a variable, then passed along a
chain of assignments scattered through filler text; the question asks for every variable that
holds the value. Multi-hop tracing: each hop needs the key of the previous one."""

from __future__ import annotations

import random
import string
from dataclasses import dataclass


@dataclass
class VarTrackPrompt:
    messages: list[dict]
    answers: list[str]  # every variable holding the value


def _names(rng, n):
    out = set()
    while len(out) < n:
        out.add("".join(rng.choice(string.ascii_uppercase) for _ in range(5)))
    return sorted(out, key=lambda _: rng.random())


def vartrack_prompt(filler: str, n_hops: int = 4, n_chains: int = 2, seed: int = 0) -> VarTrackPrompt:
    """``n_chains`` chains of ``n_hops`` assignments (``VAR X = 12345.`` then ``VAR Y = X.`` ...),
    the statements spread in order over ``filler`` sentences; chain 0 is asked for."""
    if n_hops < 1 or n_chains < 1:
        raise ValueError(f"n_hops and n_chains must be >= 1, got {n_hops} and {n_chains}.")
    rng = random.Random(seed)
    names = _names(rng, n_hops * n_chains)
    chains = [names[c * n_hops : (c + 1) * n_hops] for c in range(n_chains)]
    values = [str(v) for v in rng.sample(range(10000, 99999), n_chains)]
    stmts = []
    for hop in range(n_hops):  # hop by hop, the chains interleaved, so every statement follows its source
        for c in range(n_chains):
            src = values[c] if hop == 0 else chains[c][hop - 1]
            stmts.append(f"VAR {chains[c][hop]} = {src}.")
    sentences = [s.strip().rstrip(".") + "." for s in filler.split(". ") if s.strip()]
    k = len(stmts)
    slots = sorted(rng.sample(range(len(sentences) + 1), k)) if len(sentences) + 1 >= k else list(range(k))
    out, si = [], 0
    for i, sent in enumerate(sentences + [""]):
        while si < k and slots[si] == i:
            out.append(stmts[si])
            si += 1
        if sent:
            out.append(sent)
    out += stmts[si:]
    question = (
        "Memorize and track the chain of variable assignments hidden in the following text.\n\n"
        + " ".join(out)
        + f"\n\nQuestion: Find all variables that are assigned the value {values[0]} in the text above. "
        "Answer: According to the chain(s) of variable assignment in the text above, the variables "
        f"assigned the value {values[0]} are:"
    )
    return VarTrackPrompt(messages=[{"role": "user", "content": question}], answers=chains[0])
