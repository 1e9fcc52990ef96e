"""One prompt in, one answer out, with the KV memory and time it took: what the CLI, the demo and
the server share."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from .cache import DEFAULT_BUDGET, make_cache
from .default_policy import PROBE_POLICY, PROMPT_POLICY, SAMPLE_POLICY, pick_policy
from .input_checks import max_positions, no_new_tokens, warn_past_positions
from .memory import parse_memory
from .policies import policy_class
from .policies.kvzip import past_recorded
from .policies.oracle import Oracle
from .prefill import check_mode, fill_from, prefill
from .spec import FULL, CacheSpec
from .stock import STOCK_BYTES

# make_cache parameters that describe the cache, not the policy
_CACHE_PARAMS = ("compact", "kv_bits", "group", "evicted_bits", "evicted_budget", "slack")


@dataclass
class Result:
    policy: str
    budget: object
    text: str
    prompt_tokens: int
    new_tokens: int
    kv_bytes: int
    full_kv_bytes: int  # what a stock cache holds for the same tokens in 16 bits (kvevict.stock)
    seconds: float
    storage: str = ""  # how the kept tokens are stored and how many, e.g. "int4, 730 of 1290 tokens"
    model_kv_bytes: int = 0  # the same stock cache in the model's own dtype

    def as_dict(self):
        return asdict(self)


def encode_chat(tokenizer, messages: list[dict] | str) -> torch.Tensor:
    """Token ids of a chat (list of messages) with the generation prompt, or of raw text. A tokenizer
    without a chat template (a base model such as gemma3-270m) gets the messages as plain text: their
    contents in order, one paragraph each, roles dropped (``plain_text``)."""
    if isinstance(messages, str):
        return tokenizer(messages, return_tensors="pt")["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(plain_text(messages), return_tensors="pt")["input_ids"]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return out["input_ids"]


def plain_text(messages: list[dict]) -> str:
    """A chat as a base model reads it: the contents of the messages, separated by blank lines (a
    last assistant message is the start of the answer, which the model goes on with)."""
    if not isinstance(messages, (list, tuple)) or not all(
        isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ValueError("messages must be a list of {'role': ..., 'content': str} dicts (or the prompt as text).")
    return "\n\n".join(m["content"] for m in messages)


def question_tokens(tokenizer, prompt) -> int:
    """Tokens of the prompt's question: the last paragraph (after the last blank line) of the last
    message, plus the chat template's tail, i.e. every token from where the question starts."""
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    text = msgs[-1]["content"]
    cut = text.rstrip().rfind("\n\n")
    if cut < 0:
        raise ValueError(
            "cannot tell the question from the prompt (no blank line before its last paragraph); "
            "pass question=N, the number of its last tokens to protect."
        )
    msgs[-1]["content"] = text[:cut]
    return tokens_after(tokenizer, prompt, msgs if not isinstance(prompt, str) else text[:cut])


def tokens_after(tokenizer, prompt, head) -> int:
    """Tokens of ``prompt`` (a chat or raw text) past those it shares from its start with ``head``
    (the same prompt cut before its question): the question's tokens, the template's tail included."""
    full, start = encode_chat(tokenizer, prompt)[0], encode_chat(tokenizer, head)[0]
    n = min(len(full), len(start))
    same = int((full[:n] == start[:n]).long().cumprod(0).sum())
    return len(full) - same


def _share(memory):
    """A memory budget as a share of a 16-bit stock cache (None for bytes or no budget)."""
    value = None if memory is None else parse_memory(memory)
    return value if isinstance(value, float) else None


def _observes(policy, model, share) -> bool:
    """Whether ``policy`` is the model's one-shot default at this share that scores the prompt by
    its question (``kvevict.default_policy.ONE_SHOT_OF``; kvzip-pool, -probe and -sample rank it whole, the
    question among the rest)."""
    return (
        isinstance(policy, str)
        and policy not in (PROMPT_POLICY, PROBE_POLICY, SAMPLE_POLICY)
        and policy == pick_policy(True, True, model, share)
    )


def _question_or_none(tokenizer, prompt) -> int | None:
    """The question's tokens, or None where the prompt has no blank line before it (the policy then
    observes its last ``window`` tokens, where a question at the end sits anyway)."""
    try:
        return question_tokens(tokenizer, prompt)
    except ValueError:
        return None


def spec_budget(spec: CacheSpec, budget, memory):
    """The token or memory budget of a call given a spec: the spec's own, unless the call gives one."""
    if spec.budget is None:
        if spec.memory and memory is None:
            raise ValueError(f"{spec} spends a memory budget: give memory= (or write it as {spec.policy}@memory=0.2).")
        return budget, memory
    if budget is not None or memory is not None:
        raise ValueError(f"{spec} names its budget already: drop budget= and memory=, or the @ part of the spec.")
    return (None, spec.budget) if spec.memory else (spec.budget, None)


def dynamic_kv_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


def stock_kv_bytes16(cache: DynamicCache) -> int:
    """The stock cache's keys and values at 16 bits (the denominator of every ratio, kvevict.stock)."""
    return sum(
        (layer.keys.numel() + layer.values.numel()) * STOCK_BYTES for layer in cache.layers if layer.is_initialized
    )


def _greedy(model, tokenizer, ids, cache, max_new_tokens) -> torch.Tensor:
    """Prompt + greedy continuation token ids, one sequence."""
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
    )


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompt,
    policy=None,
    budget=None,
    max_new_tokens=64,
    prefill_mode="full",
    stride=None,
    memory=None,
    question=None,
    cache=None,
    **policy_params,
) -> Result:
    """Greedy generation of one prompt (chat messages or raw text) under ``policy`` and ``budget``;
    ``policy="full"`` runs the stock transformers DynamicCache with SDPA as the reference. ``policy``
    may be a cache spec (``kvevict.spec``: ``snapkv+q/int8@0.2``, ``kvzip-pool@memory=0.1``) or a
    Policy; ``budget`` not given: 0.2 of the prompt.
    ``prefill_mode``: full, token or block (with ``stride``), see kvevict.prefill.
    ``memory``: a budget in bytes instead of ``budget`` (see ``make_cache``).
    ``policy`` not given: with ``memory``, the model's one-shot policy when the whole prompt enters
    at once (it is known before decoding: ``kvzip-pool``, or where measured better for the model and
    share, ``kvevict.default_policy.ONE_SHOT_OF``, a policy that observes the prompt's question) and ``mas``
    under token or block prefill (``kvevict.default_policy.pick_policy``); without, ``h2o``.
    ``question``: protect the prompt's last N tokens and observe them (``make_cache(question=N)``);
    True (or a spec with ``+q``) counts the question with ``question_tokens``.
    ``cache``: a compressed context (``kvevict.compress``): ``prompt`` is a question asked of it, read
    whole after it in a fork that leaves it as it was; it was made with its policy and budget.
    Switches the model's attention implementation: not for concurrent use on a shared model
    (the server runs every model call on one worker thread)."""
    if cache is not None:
        return _ask_compressed(cache, prompt, max_new_tokens, (policy, budget, memory, question, stride), policy_params)
    check_mode(prefill_mode, stride)
    spec, label, policy, budget, memory = _resolve_policy(model, policy, budget, memory, prefill_mode)
    question = _question_count(model, tokenizer, prompt, spec, policy, memory, question)
    ids = encode_chat(tokenizer, prompt) if not isinstance(prompt, torch.Tensor) else prompt
    if ids.shape[-1] == 0:
        raise ValueError(no_new_tokens(0))
    warned = warn_if_long(model, ids.shape[-1] + max_new_tokens - 1, policy, policy_params)
    if policy == "oracle":  # Belady needs the future: the full cache's own continuation, recorded
        policy, policy_params = _record_oracle(model, tokenizer, ids, max_new_tokens, policy_params)
    if spec is not None:
        policy, budget = spec_params(spec, policy, budget, policy_params, ids.shape[1] + max_new_tokens)
    start = time.perf_counter()
    built = build_cache(
        model, tokenizer, ids, Plan(policy, budget, memory, question, prefill_mode, stride, warned), policy_params
    )
    out = _greedy(model, tokenizer, ids, built.cache, max_new_tokens)
    seconds = time.perf_counter() - start
    return _result(tokenizer, label, built.policy, built.budget, built.cache, ids, out, seconds)


def _ask_compressed(context, question, max_new_tokens, given: tuple, policy_params: dict) -> Result:
    """``generate(..., cache=context)``: the question answered over a compressed context."""
    if not callable(getattr(context, "answer", None)):
        raise ValueError(
            f"cache= takes a compressed context (kvevict.compress(model, tok, context, ...)), got {type(context).__name__}."
        )
    if any(x is not None for x in given) or policy_params:
        raise ValueError(
            "a compressed context was made with its policy and budget: drop policy=, budget=, memory=, "
            "question= and the policy's parameters when asking it (cache=)."
        )
    return context.answer(question, max_new_tokens)


@dataclass
class Plan:
    """How ``build_cache`` makes and fills a cache: the policy (a name or a Policy, ``full`` for the
    stock cache), its token or memory budget, the question it protects, how the prompt enters
    (``kvevict.prefill``), whether a long-sequence warning was given, and ``whole``: every prompt
    token stored (``kvevict.compress``), else all but the last, which ``model.generate`` feeds."""

    policy: object
    budget: object
    memory: object = None
    question: int | None = None
    prefill_mode: str = "full"
    stride: int | None = None
    warned: bool = False
    whole: bool = False


@dataclass
class Built:
    """``build_cache``'s cache, with the policy it ended with (kvzip recorded), the budget it was
    made with (a memory plan's, resolved) and the seconds the recording took."""

    cache: object
    policy: object
    budget: object
    record_seconds: float


def build_cache(model, tokenizer, ids: torch.Tensor, plan: Plan, policy_params: dict) -> Built:
    """A cache for ``ids`` (1, n) made and filled as ``plan`` says: a policy that scores the prompt
    in a pass of its own (kvzip) recorded on it first, then the prompt's tokens stored. The stock
    cache (``full``) is left empty (``model.generate`` fills it). ``policy_params`` is used up."""
    policy, policy_params, context, record_seconds = _record_prompt(
        model, tokenizer, ids, plan.policy, policy_params, plan.prefill_mode, plan.whole
    )
    cache, budget = _new_cache(model, policy, plan.budget, plan.memory, plan.question, plan.warned, policy_params)
    if context is not None:
        fill_from(cache, context)
        context = None  # its full-size keys and values go now, before decoding
    elif policy != FULL and plan.whole and plan.prefill_mode == "full":
        model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    elif policy != FULL:
        prefill(model, cache, ids, mode=plan.prefill_mode, stride=plan.stride, keep_last=0 if plan.whole else 1)
    return Built(cache, policy, budget, record_seconds)


def _resolve_policy(model, policy, budget, memory, prefill_mode):
    """(spec or None, the result's label, the policy, the token budget, the memory budget) of a
    call: a spec's parts, the defaults where the call gives none."""
    label = policy if isinstance(policy, str) else None
    spec = CacheSpec.parse(policy) if isinstance(policy, str) else None
    if spec is not None:
        budget, memory = spec_budget(spec, budget, memory)
        policy = spec.policy
    budget = DEFAULT_BUDGET if budget is None else budget
    share = _share(memory)
    if policy is None:
        policy = pick_policy(prompt_known=prefill_mode == "full", memory=memory is not None, model=model, share=share)
    label = label or (policy if isinstance(policy, str) else getattr(policy, "name", policy))
    return spec, label, policy, budget, memory


def _question_count(model, tokenizer, prompt, spec, policy, memory, question):
    """The ``question`` a cache protects: counted where asked (True, or a spec's ``+q``), or where
    the default one-shot policy observes it and the prompt tells it; else as given."""
    if (spec is not None and spec.question) or question is True:
        if isinstance(prompt, torch.Tensor):
            raise ValueError("question=True needs the prompt as text or messages; with token ids pass question=N.")
        return question_tokens(tokenizer, prompt)
    if (
        question is None
        and memory is not None
        and not isinstance(prompt, torch.Tensor)
        and _observes(policy, model, _share(memory))
    ):
        return _question_or_none(tokenizer, prompt)  # the default observes the question where it can tell it
    return question


def warn_if_long(model, fed: int, policy, policy_params) -> bool:
    """Warn, before a long prefill rather than after it, when ``fed`` positions (the last token is
    never fed) pass the model's own; whether it warned."""
    limit = max_positions(model)
    warned = bool(limit and fed > limit and (policy == FULL or not policy_params.get("compact")))
    if warned:
        assert limit is not None  # warned only with a limit
        warn_past_positions(fed, limit)
    return warned


def _record_oracle(model, tokenizer, ids, max_new_tokens, policy_params):
    """(the Oracle policy, the cache's parameters left): the full cache's greedy continuation,
    recorded for Belady."""
    model.set_attn_implementation("sdpa")
    full_seq = _greedy(model, tokenizer, ids, DynamicCache(config=model.config), max_new_tokens)
    compact = policy_params.pop("compact", False)
    policy = Oracle.record(model, full_seq, **policy_params)
    return policy, ({"compact": compact} if compact else {})


def spec_params(spec: CacheSpec, policy, budget, policy_params: dict, total: int):
    """(policy, budget) after a spec's storage and slack go into ``policy_params``; "full/int4"
    evicts nothing: h2o with room for all ``total`` tokens, the prompt's and the answer's."""
    if spec.storage is not None:  # "h2o/int4", "full/int4": a storage named with the policy
        policy_params.update(kv_bits=spec.storage.kv_bits, evicted_bits=spec.storage.evicted_bits)
        if policy == FULL:
            policy, budget = "h2o", total
    if spec.slack is not None:
        policy_params["slack"] = spec.slack
    return policy, budget


def _record_prompt(model, tokenizer, ids, policy, policy_params, prefill_mode, whole=False):
    """(policy, cache parameters, full-cache context or None, seconds): a policy that scores the
    prompt in a pass of its own (kvzip) recorded, its cost timed with the rest; others as given.
    ``whole``: the context cache holds every prompt token (else all but the last, which generate feeds)."""
    found = policy_class(policy)
    if found is None or not found[0].needs_prompt:
        return policy, policy_params, None, 0.0
    t0 = time.perf_counter()
    cache_params = {k: policy_params.pop(k) for k in _CACHE_PARAMS if k in policy_params}
    params = {**found[1], **policy_params}
    context = None
    ids_ctx = ids if whole else ids[:, :-1]
    if prefill_mode == "full" and ids_ctx.shape[1] > 0:
        # the prompt (but its last token, which generate feeds) runs once: scored on top of this
        # cache, which then fills the budgeted one (prefill.fill_from)
        context = DynamicCache(config=model.config)
        model.set_attn_implementation("sdpa")
        cut = ids_ctx.shape[1]
        if any(getattr(layer, "is_sliding", False) for layer in context.layers):
            cut -= min(cut, found[0].tail(params))  # a sliding layer can be cropped by what it recorded only
        if cut:
            model(ids_ctx[:, :cut], cache=context, use_cache=True, logits_to_keep=1)
        with past_recorded(context):  # the tail the record crops off and runs again: its past kept
            if cut < ids_ctx.shape[1]:
                model(ids_ctx[:, cut:], cache=context, use_cache=True, logits_to_keep=1)
            policy = found[0].record(model, tokenizer, ids_ctx, context=context, **params)
    else:
        policy = found[0].record(model, tokenizer, ids, **params)
    return policy, cache_params, context, time.perf_counter() - t0


def _new_cache(model, policy, budget, memory, question, warned: bool, policy_params: dict):
    """(the cache, the budget it was made with): the stock DynamicCache for full, else
    ``make_cache``; a memory budget reports what it was planned into (a pooled one: the layers' mean)."""
    if policy == FULL:
        model.set_attn_implementation("sdpa")
        return DynamicCache(config=model.config), budget
    if memory is not None:
        policy_params["memory"] = memory
    if question:
        policy_params["question"] = question
    cache = make_cache(model, policy, budget, **policy_params)
    if warned:
        cache.max_positions = None  # said once
    if memory is not None:
        specs = [layer.budget_spec for layer in cache.layers]
        budget = specs[0] if len(set(specs)) == 1 else round(sum(specs) / len(specs))
    return cache, budget


def _result(tokenizer, label, policy, budget, cache, ids, out, seconds: float) -> Result:
    new = out[0, ids.shape[1] :]
    if policy == FULL:  # the stock cache itself: its bytes, and the same tensors in 16 bits
        held = own = dynamic_kv_bytes(cache)
        full = stock_kv_bytes16(cache)
    else:
        held, full, own = cache.kv_bytes(), cache.full_kv_bytes(), cache.full_kv_bytes(dtype_bytes=None)
    return Result(
        policy=label,
        budget=None if policy == FULL else budget,
        text=tokenizer.decode(new, skip_special_tokens=True).strip(),
        prompt_tokens=ids.shape[1],
        new_tokens=len(new),
        kv_bytes=held,
        full_kv_bytes=full,
        seconds=seconds,
        storage="" if policy == FULL else storage_label(cache),
        model_kv_bytes=own,
    )


def storage_label(cache) -> str:
    """'int8+int4, 1068 of 1084 tokens': how the kept tokens are stored, and how many of the tokens
    seen a layer and KV head keeps, on average over the layers and KV heads (a pooled budget, as
    kvzip-pool's, gives layers and heads unequal shares)."""
    layers = [layer for layer in cache.layers if layer.is_initialized]
    kept = sum(
        int(t.valid[..., : t.filled].sum()) / (t.valid.shape[0] * layer.dims[0])
        for layer in layers
        for t in layer.tiers
    ) / max(1, len(layers))
    seen = layers[0].seen if layers else 0
    label = layers[0].storage.label if layers else cache.storage.label  # a short prompt's may differ
    return f"{label or 'model dtype'}, {round(kept)} of {seen} tokens"
