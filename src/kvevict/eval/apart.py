"""``kvevict eval --question apart``: kvevict's own caches under kvpress's protocol. Each sample's
prompt is cut where its question starts (``question_length``: the very tokens kvpress's
``--peer-question apart`` cuts); the context is compressed alone (``kvevict.compress``, no policy
sees the question) and the question is read whole after it in a fork, then answered.

Records of such cells carry the policy ``NAME/context`` (as kvpress's ``kvpress-NAME/context``) and
``"question": "apart"``. A cell holds what the same cell holds with the question inside: the
context keeps ``budget x n - q`` of the prompt's n tokens (a fraction ``context_share`` of the
context; an int budget: ``budget - q`` tokens), the question's q tokens are kept whole, so context
kept plus question is the budget's share of the prompt (a memory cell: the same share of the
context's 16-bit stock bytes, its policy ``kvzip-pool`` where none is named, query-agnostic)."""

from __future__ import annotations

import dataclasses
import time

from ..compress import CONTEXT_POLICY, compress
from ..generate import encode_chat
from ..policies import policy_class
from ..spec import CacheSpec
from .caches import memory_cell, memory_spec

APART = "/context"  # a record's policy suffix: the question read after the compressed context
QUESTION = ("inside", "apart")


def apart_label(policy: str) -> str:
    return policy + APART


def split_label(label: str) -> tuple[str, bool]:
    """(the cell's policy, whether its question is read apart) of a record's policy label."""
    if isinstance(label, str) and label.endswith(APART) and not label.startswith("kvpress-"):
        return label[: -len(APART)], True
    return label, False


def protocol(label: str) -> str:
    """ "apart" or "inside": the protocol a record's policy label names (kvpress's own included)."""
    return "apart" if isinstance(label, str) and label.endswith(APART) else "inside"


def check_question(question: str) -> str:
    if question not in QUESTION:
        raise ValueError(f"--question {question!r}: choose {' or '.join(QUESTION)}.")
    return question


def question_length(tokenizer, sample) -> int:
    """Tokens of the sample's question, the answer's start included: a task's ``question`` text
    ending its raw prompt (RULER), else the last paragraph of its chat (``question_tokens``)."""
    from ..generate import question_tokens, tokens_after

    prompt, question = sample.data["messages"], sample.data.get("question")
    if isinstance(prompt, str) and question and prompt.endswith(question):
        return tokens_after(tokenizer, prompt, prompt[: -len(question)])
    try:
        return question_tokens(tokenizer, prompt)
    except ValueError as err:
        raise ValueError(f"the question apart: sample {sample.id}: {err}") from None


def context_share(budget: float, n: int, q: int) -> float:
    """The share of the context (``n - q`` tokens) that keeps ``budget * n`` tokens of an
    ``n``-token prompt with its ``q`` question tokens held whole: (budget * n - q) / (n - q)."""
    if budget * n <= q:
        raise ValueError(
            f"budget {budget:g} of a {n}-token prompt is {budget * n:.0f} tokens, no more than its question "
            f"({q}): raise the budget, or keep the question inside."
        )
    return round((budget * n - q) / (n - q), 6)


def context_budget(budget, n: int, q: int):
    """A cell's budget for the context alone (see the module doc): an int budget less the question's
    tokens, a fraction (of the prompt, or of its stock bytes) as ``context_share``, bytes as given."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        return budget
    if isinstance(budget, int):
        if budget <= q:
            raise ValueError(f"a budget of {budget} tokens holds no more than the question ({q} tokens).")
        return budget - q
    return context_share(budget, n, q)


def check_fits(tokenizer, tasks, budgets, n_samples: int, first: int = 0) -> None:
    """A ValueError now, before the grid runs for hours, if some fractional budget holds no more
    tokens than some sample's question (``context_share``), for the tasks that read it apart."""
    for task in tasks:
        if getattr(task, "asks_last", False):
            for s in task.samples(tokenizer, n_samples)[first:]:
                n, q = encode_chat(tokenizer, s.data["messages"]).shape[-1], question_length(tokenizer, s)
                for budget in budgets:
                    if isinstance(budget, float):
                        context_share(budget, n, q)


def answer_apart(model, tokenizer, prompt, sample, cell: tuple, max_new: int, recorded: dict):
    """One apart cell's ``kvevict.generate.Result``: the context compressed alone, the question read
    after it. A policy that scores the prompt in a pass of its own (kvzip) is recorded on the context
    once per sample (``recorded``), shared by the cells; each cell's seconds include the recording,
    the compression and the answer."""
    policy, budget = cell
    ids = encode_chat(tokenizer, prompt)
    q = question_length(tokenizer, sample)
    n = ids.shape[1]
    if not 0 < q < n:
        raise ValueError(f"sample {sample.id}: its question ({q} tokens) leaves no context in {n} tokens.")
    context, question = ids[:, : n - q], ids[:, n - q :]
    budget = context_budget(budget, n, q)
    kw: dict = {"budget": budget}
    if memory_spec(policy):
        _, bits = memory_cell(policy, prompt_known=True, model=model, share=budget)
        kw = {k: v for k, v in bits.items() if v is not None}
        kw["memory"] = budget
        policy = CacheSpec.parse(policy).policy or CONTEXT_POLICY  # compress()'s: never a +q one-shot pick
    found = policy_class(policy)
    seconds = 0.0
    if found is not None and found[0].needs_prompt:
        key = (policy, APART)  # recorded on the context: not the whole prompt's recording
        if key not in recorded:
            t0 = time.perf_counter()
            recorded[key] = (found[0].record(model, tokenizer, context, **found[1]), time.perf_counter() - t0)
        policy, seconds = recorded[key]
    ctx = compress(model, tokenizer, context, policy, **kw)
    res = ctx.answer(question, max_new)
    return dataclasses.replace(res, policy=cell[0], seconds=res.seconds + ctx.seconds + seconds)
