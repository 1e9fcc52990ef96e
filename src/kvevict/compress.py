"""Compress once, ask many: a context compressed alone, query-agnostically, then any number of
questions asked of it, each read whole after it in a fork that shares the compressed part.

    ctx = kvevict.compress(model, tok, context, memory=0.2)
    ctx.ask("What is the pass key?")                    # one answer
    ctx.ask(["Who wrote it?", "When?"])                 # one batched forward, left-padded
    fork = ctx.fork(batch=2); model.generate(**ctx.inputs(questions), cache=fork)

This is the protocol of kvpress's pipeline and of KVzip (Kim et al. 2025, "query-agnostic"): the
cache is made before any question is known, so no policy can look at it (a policy that observes
the prompt's question, ``+q``, is refused; SnapKV-like policies observe the context's own last
tokens). The question's tokens and the answer's are never evicted (``kvevict.fork``).
"""

from __future__ import annotations

import time

import torch

from .attention import ATTN_NAME, register
from .cache import DEFAULT_BUDGET, EvictingCache
from .default_policy import PROMPT_POLICY
from .fork import ForkCache, parent_view
from .generate import Plan, Result, build_cache, spec_budget, spec_params, storage_label, warn_if_long
from .policies import policy_class
from .prefill import check_mode
from .spec import FULL, CacheSpec

_MARK = "@@kvevict-question@@"  # where the question goes in the chat template's text


def encode_context(tokenizer, context, sep: str = "\n\n") -> tuple[torch.Tensor, str]:
    """(the context's ids (1, n), the text every question is followed by). A text is a user
    message's start: with a chat template, everything the template puts before the message's
    content, then ``context + sep``; a question is then read as ``question + the template's end``
    (its generation prompt included), as kvpress's pipeline splits a chat. Without a template: the
    tokenizer's own ids of ``context + sep`` and the question as it is. Token ids (a 1-D tensor, a
    (1, n) tensor or a list of ints) are the context as given."""
    if isinstance(context, str):
        if not context.strip():
            raise ValueError("the context is empty: give compress() a non-empty text (or token ids).")
        if tokenizer is None:
            raise ValueError("a context as text needs a tokenizer: give compress() one, or the context's token ids.")
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": context + sep + _MARK}], add_generation_prompt=True, tokenize=False
            )
            if _MARK not in text:
                raise ValueError(
                    "this tokenizer's chat template drops the message's end; give the context as token ids."
                )
            head, _, tail = text.partition(_MARK)
            return tokenizer(head, add_special_tokens=False, return_tensors="pt")["input_ids"], tail
        return tokenizer(context + sep, return_tensors="pt")["input_ids"], ""
    return _ids(context, "the context"), ""


def _ids(value, what: str) -> torch.Tensor:
    """Token ids as (1, n) int64, or a ValueError that says what to give."""
    if isinstance(value, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        value = torch.tensor([list(value)], dtype=torch.long)
    if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.dim() not in (1, 2):
        raise ValueError(f"{what} must be a text or token ids (a 1-D tensor, a (1, n) tensor or a list of ints).")
    ids = value.view(1, -1) if value.dim() == 1 else value
    if ids.shape[0] != 1:
        raise ValueError(f"{what} is one sequence: give ids of shape (1, n), got {tuple(ids.shape)}.")
    if ids.shape[1] == 0:
        raise ValueError(f"{what} is empty (0 tokens): give at least one token.")
    return ids.long()


# the score of a context given without its question, where none is named: no cheaper score kept as
# many needles with the question apart (docs/results/question-apart.md)
CONTEXT_POLICY = PROMPT_POLICY


def _resolve(policy, budget, memory, n: int, params: dict):
    """(policy, token budget, memory budget, label) of a compression: a spec's parts, kvzip-pool
    (query-agnostic, ``CONTEXT_POLICY``) where none is named, everything kept for ``full``."""
    if "question" in params:
        raise ValueError(
            "compress() keeps the question apart: the context is compressed before it is known (drop question=)."
        )
    label = policy if isinstance(policy, str) else None
    if isinstance(policy, str):
        spec = CacheSpec.parse(policy)
        if spec.question:
            raise ValueError(
                f"{policy!r} observes the prompt's question, which compress() never sees: drop the +q "
                "(the question is read whole after the compressed context anyway)."
            )
        budget, memory = spec_budget(spec, budget, memory)
        policy, budget = spec_params(spec, spec.policy, budget, params, n)
    if policy is None:
        policy = CONTEXT_POLICY
    if policy == "oracle":
        raise ValueError("the oracle needs the answer before it is generated; compress() cannot record it.")
    if policy == FULL:
        if budget is not None or memory is not None:
            raise ValueError("full keeps every token: drop budget= and memory= (or name a policy).")
        policy, budget = "h2o", n  # every token kept, in the model's dtype: the reference
    if budget is None and memory is None:
        budget = DEFAULT_BUDGET
    label = label or (policy if isinstance(policy, str) else getattr(policy, "name", str(policy)))
    return policy, budget, memory, label


@torch.no_grad()
def compress(
    model,
    tokenizer,
    context,
    policy=None,
    budget=None,
    memory=None,
    prefill_mode: str = "full",
    stride: int | None = None,
    sep: str = "\n\n",
    **policy_params,
) -> "CompressedContext":
    """The context (a text, or token ids) compressed alone into an ``EvictingCache``, ready to be
    asked any number of questions (``CompressedContext``). ``policy``, ``budget``, ``memory`` and
    the policy's parameters are ``make_cache``'s (a cache spec such as ``h2o/int4@0.2`` or
    ``kvzip-pool@memory=0.1`` included); a fractional budget is a share of the context. No policy
    named: ``kvzip-pool`` (KVzip, query-agnostic by design), recorded on the context. ``full``:
    every token kept in the model's dtype (the reference). ``prefill_mode`` / ``stride``: how the
    context enters (``kvevict.prefill``). ``sep``: the text between the context and a question."""
    check_mode(prefill_mode, stride)
    ids, suffix = encode_context(tokenizer, context, sep)
    ids = ids.to(getattr(model, "device", ids.device))
    policy, budget, memory, label = _resolve(policy, budget, memory, ids.shape[1], policy_params)
    found = policy_class(policy)
    if tokenizer is None and found is not None and found[0].needs_prompt:
        raise ValueError(f"{label} scores the context by asking the model to repeat it: give compress() a tokenizer.")
    warned = warn_if_long(model, ids.shape[1], policy, policy_params)
    start = time.perf_counter()
    plan = Plan(policy, budget, memory, None, prefill_mode, stride, warned, whole=True)
    built = build_cache(model, tokenizer, ids, plan, policy_params)
    if not isinstance(built.cache, EvictingCache):
        raise ValueError(f"compress() makes an evicting cache; {label!r} made a {type(built.cache).__name__}.")
    return CompressedContext(
        model, tokenizer, built.cache, ids, suffix, label, built.budget, time.perf_counter() - start
    )


class CompressedContext:
    """A context compressed once (``compress``): ``cache``, an ``EvictingCache`` of one row that
    nothing writes again, and what asking it needs. Each question goes into a fork
    (``kvevict.fork.ForkCache``) that reads the compressed part and keeps the question and its
    answer whole. ``kv_bytes()`` is the compressed part, held once whatever the number of forks."""

    def __init__(self, model, tokenizer, cache: EvictingCache, ids, suffix: str, label: str, budget, seconds: float):
        self.model, self.tokenizer, self.cache = model, tokenizer, cache
        self.ids = ids  # (1, n): the context's tokens
        self.suffix = suffix  # what follows every question (the chat template's end)
        self.label, self.budget, self.seconds = label, budget, seconds
        self.views = [parent_view(layer) for layer in cache.layers]  # read by every fork

    @property
    def length(self) -> int:
        """The context's tokens (the first question token's position)."""
        return self.ids.shape[1]

    def kv_bytes(self) -> int:
        return self.cache.kv_bytes()

    def full_kv_bytes(self, dtype_bytes=2) -> int:
        """A 16-bit stock cache's bytes for the context alone (``EvictingCache.full_kv_bytes``)."""
        return self.cache.full_kv_bytes(dtype_bytes)

    def fork(self, batch: int = 1, limit: int | None = None) -> ForkCache:
        """A fresh cache of ``batch`` rows over this context (see ``kvevict.fork``; ``limit``: the
        most tokens a row appends, where known). The model's attention is switched (back) to
        kvevict's, which reads it."""
        fork = ForkCache(self.cache, batch, self.views, limit)
        register()
        if self.model.config._attn_implementation != ATTN_NAME:  # another call may have switched it
            self.model.set_attn_implementation(ATTN_NAME)
        return fork

    def question_ids(self, question) -> torch.Tensor:
        """One question's ids (1, q): a text with the template's end after it, or token ids as given."""
        if isinstance(question, str):
            if self.tokenizer is None:
                raise ValueError("a question as text needs a tokenizer: give compress() one, or ask with token ids.")
            ids = self.tokenizer(question + self.suffix, add_special_tokens=False, return_tensors="pt")["input_ids"]
            return _ids(ids, "the question")
        if isinstance(question, torch.Tensor):
            return _ids(question, "the question")
        raise ValueError(
            f"a question is a string (or token ids as a tensor), got {type(question).__name__}; "
            "several questions: a list of them."
        )

    def inputs(self, questions) -> dict:
        """``model.generate``'s inputs for a fork of ``len(questions)`` rows: each row the context's
        ids, then its question left-padded to the longest (``attention_mask`` 0 on the padding)."""
        items = _question_list(questions)
        q_ids = [self.question_ids(q)[0] for q in items]
        width, pad = max(len(q) for q in q_ids), self._pad_id()
        ids = torch.full((len(q_ids), self.length + width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        ids[:, : self.length], mask[:, : self.length] = self.ids[0], 1
        for row, q in enumerate(q_ids):
            ids[row, ids.shape[1] - len(q) :], mask[row, ids.shape[1] - len(q) :] = q, 1
        dev = self.cache.layers[0].device
        return {"input_ids": ids.to(dev), "attention_mask": mask.to(dev)}

    @torch.no_grad()
    def ask(self, questions, max_new_tokens: int = 64, **generate_kwargs):
        """Greedy answers (text) to one question (a string: one answer) or several (a list: a list
        of answers, all in one batched forward per step); the compressed context is left as it was."""
        texts, _ = self._generate(questions, max_new_tokens, generate_kwargs)
        return texts[0] if isinstance(questions, (str, torch.Tensor)) else texts

    @torch.no_grad()
    def answer(self, question, max_new_tokens: int = 64) -> Result:
        """One question's answer as ``kvevict.generate.generate`` reports it: bytes held are the
        compressed context's plus the fork's, ``seconds`` the question's and answer's only (the
        compression took ``self.seconds``)."""
        start = time.perf_counter()
        texts, (fork, ids, out) = self._generate([question], max_new_tokens, {})
        cache = self.cache
        return Result(
            policy=self.label,
            budget=self.budget,
            text=texts[0],
            prompt_tokens=ids.shape[1],
            new_tokens=out.shape[1] - ids.shape[1],
            kv_bytes=self.kv_bytes() + fork.kv_bytes(),
            full_kv_bytes=fork.full_kv_bytes(),
            seconds=time.perf_counter() - start,
            storage=storage_label(cache),
            model_kv_bytes=fork.full_kv_bytes(dtype_bytes=None),
        )

    def _generate(self, questions, max_new_tokens, kwargs: dict):
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}.")
        if self.tokenizer is None:
            raise ValueError("answers are decoded to text: give compress() a tokenizer (or generate from fork()).")
        inputs = self.inputs(questions)
        width = inputs["input_ids"].shape[1] - self.length  # the longest question, padding included
        fork = self.fork(inputs["input_ids"].shape[0], limit=width + max_new_tokens)
        kwargs = {"do_sample": False, "pad_token_id": self._pad_id(), **kwargs}
        out = self.model.generate(**inputs, cache=fork, max_new_tokens=max_new_tokens, **kwargs)
        n = inputs["input_ids"].shape[1]
        texts = [self.tokenizer.decode(row[n:], skip_special_tokens=True).strip() for row in out]
        return texts, (fork, inputs["input_ids"], out)

    def _pad_id(self) -> int:
        tok, config = self.tokenizer, self.model.generation_config
        for pad in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None), config.pad_token_id, 0):
            if pad is not None:
                return int(pad[0] if isinstance(pad, list) else pad)
        return 0


def _question_list(questions) -> list:
    """One question or several as a list, or a ValueError that says what to give."""
    if isinstance(questions, (str, torch.Tensor)):
        return [questions]
    if (
        isinstance(questions, (list, tuple))
        and questions
        and all(isinstance(q, (str, torch.Tensor)) for q in questions)
    ):
        return list(questions)
    if isinstance(questions, (list, tuple)) and not questions:
        raise ValueError("no question given: ask at least one (a string, or a list of strings).")
    raise ValueError(
        f"questions must be a string or a list of strings (or token ids as tensors), got {type(questions).__name__}."
    )
