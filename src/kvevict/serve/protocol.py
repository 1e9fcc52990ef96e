"""OpenAI request bodies -> validated ``GenRequest``; anything wrong is a ``BadRequest`` (HTTP 400)
whose message names the field and what to change.

Extra body fields (``extra_body`` in the openai client): ``kv_policy`` (a name of
``kvevict.POLICIES`` or ``"full"``, or a cache spec with its token budget: ``h2o@0.2``), ``kv_budget`` (int: tokens kept per layer and KV head; float in
(0, 1]: that fraction of this request's prompt), ``kv_recent`` (recent window), ``ignore_eos``,
``prefix_cache`` (false: neither reuse nor store prompt prefixes, ``prefix_store``).
A float budget is resolved against the request's own prompt, never below the server's
``min_budget`` (so a short chat is not cut to a handful of tokens), rounded up to a multiple of
``budget_round``; batching never changes it.

Log-probabilities (``kvevict.serve.logprobs``): chat takes ``logprobs: true`` and ``top_logprobs``
(0-20); completions take ``logprobs`` as the number of top tokens (0-20) and ``echo`` (the prompt
back before the completion, with ``logprobs`` its tokens' log-probabilities too, the first null).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..budget import check_budget, layer_budgets, resolve_budget
from ..policies import POLICIES
from ..spec import FULL, CacheSpec
from .budgeter import spec_policy
from .errors import BadRequest
from .logprobs import MAX_TOP
from .settings import Settings

ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass
class GenRequest:
    kind: str  # "chat" or "completion"
    prompt_ids: list[int]
    max_tokens: int
    policy: str  # "full" or a policy name
    budget: int | float | None  # as asked (None for full)
    budget_tokens: int | None  # resolved for this prompt (None for full)
    recent: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top tokens to list per token; None: no logprobs at all
    echo: bool = False  # completions: the prompt back first (its logprobs too with ``logprobs``)
    prompt_text: str | None = None  # what echo sends back: the prompt as given (token ids decoded)
    prefix_cache: bool = True  # may reuse a stored prompt prefix and store its own (``prefix_store``)
    # chat: the prompt's tokens before its newest message (stored as a prefix for the next turns),
    # when the earlier messages alone render to a token prefix of the prompt; else None
    prefix_len: int | None = None
    owner: str | None = None  # whose stored prefixes it may reuse: its API key's ``auth.key_id``, or None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def parse_chat(body, tokenizer, settings: Settings, context: int, layers: int = 1) -> GenRequest:
    body = _object(body)
    messages = _messages(body.get("messages"))
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest(
            "this model has no chat template (a base model): send a plain prompt to /v1/completions instead.",
            "messages",
        )
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    except Exception as err:  # a template that rejects the roles or their order
        raise BadRequest(f"the chat template refused these messages: {err}", "messages") from None
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    req = _request("chat", body, list(ids), settings, context, limit_name, layers)
    if settings.prefix_cache_memory and req.prefix_cache and len(messages) > 1:
        req.prefix_len = _earlier_turns(tokenizer, messages, req.prompt_ids)
    return req


def _earlier_turns(tokenizer, messages: list[dict], ids: list[int]) -> int | None:
    """How many of the prompt's tokens the messages before its newest render to, when they are
    the prompt's first tokens (a template may render or tokenize a turn's end otherwise once
    another follows: then None, and nothing of this request is stored)."""
    try:
        earlier = tokenizer.apply_chat_template(messages[:-1], tokenize=True, return_dict=True)["input_ids"]
    except Exception:  # a template that wants the conversation to end otherwise: no prefix, not an error
        return None
    n = len(earlier)
    return n if 0 < n < len(ids) and list(earlier) == ids[:n] else None


def parse_completion(body, tokenizer, settings: Settings, context: int, layers: int = 1) -> GenRequest:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    text = prompt if isinstance(prompt, str) else None
    if isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = len(tokenizer)
        if any(not 0 <= t < vocab for t in prompt):
            raise BadRequest(f"prompt token ids must be in [0, {vocab}).", "prompt")
        ids = prompt
    elif prompt is None:
        raise BadRequest("'prompt' is required: a string (or a list of token ids).", "prompt")
    else:
        raise BadRequest("'prompt' must be one string or one list of token ids; send one request per prompt.", "prompt")
    req = _request("completion", body, list(ids), settings, context, "max_tokens", layers)
    if req.echo:
        req.prompt_text = text if text is not None else tokenizer.decode(ids, skip_special_tokens=False)
    return req


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object.")
    return body


def _messages(messages) -> list[dict]:
    if messages is None:
        raise BadRequest("'messages' is required: a non-empty list of {role, content} objects.", "messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects.", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}] must be an object with a role in {list(ROLES)}.", f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones make sense for a text model
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise BadRequest(
                    f"messages[{i}].content parts must all be {{'type': 'text', 'text': ...}}.",
                    f"messages[{i}].content",
                )
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string.", f"messages[{i}].content")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


def _request(kind, body, ids, settings: Settings, context: int, limit_name: str, layers: int) -> GenRequest:
    if not ids:
        raise BadRequest("the prompt is empty.", "prompt" if kind == "completion" else "messages")
    n = body.get("n", 1)
    if n != 1:
        raise BadRequest("only n=1 is supported; send several requests instead.", "n")
    max_tokens = body.get(limit_name)
    if max_tokens is None:
        max_tokens = settings.max_tokens
    if (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, int)
        or not 1 <= max_tokens <= settings.max_tokens_limit
    ):
        raise BadRequest(
            f"'{limit_name}' must be an integer in [1, {settings.max_tokens_limit}], got {max_tokens!r}.", limit_name
        )
    if len(ids) + max_tokens > context:
        raise BadRequest(
            f"the prompt has {len(ids)} tokens and {limit_name}={max_tokens}: together more than the "
            f"model's {context} positions; shorten the prompt or lower {limit_name}.",
            limit_name,
        )
    policy, budget, recent, budget_tokens = _kv_fields(body, settings, len(ids), layers)
    logprobs, echo = (_chat_logprobs if kind == "chat" else _completion_logprobs)(body)
    return GenRequest(
        kind=kind,
        prompt_ids=ids,
        max_tokens=max_tokens,
        policy=policy,
        budget=budget,
        budget_tokens=budget_tokens,
        recent=recent,
        temperature=_number(body, "temperature", 0.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        seed=_seed(body.get("seed")),
        stop=_stop(body.get("stop")),
        stream=_bool(body, "stream"),
        include_usage=_bool(body.get("stream_options") or {}, "include_usage"),
        ignore_eos=_bool(body, "ignore_eos"),
        logprobs=logprobs,
        echo=echo,
        prefix_cache=_prefix_cache(body),
    )


def _prefix_cache(body) -> bool:
    """``prefix_cache``: false opts out of the server's prefix store (default true)."""
    v = body.get("prefix_cache", True)
    if v is None:
        return True
    if not isinstance(v, bool):
        raise BadRequest(
            f"'prefix_cache' must be true (reuse and store prompt prefixes, the default) or false, got {v!r}.",
            "prefix_cache",
        )
    return v


def _top(v, name: str, hint: str = "") -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOP:
        raise BadRequest(f"'{name}' must be an integer in [0, {MAX_TOP}], got {v!r}{hint}.", name)
    return v


def _chat_logprobs(body) -> tuple[int | None, bool]:
    """Chat: ``logprobs`` true/false and ``top_logprobs`` (which needs it), as OpenAI's API."""
    wanted, top = _bool(body, "logprobs"), body.get("top_logprobs")
    if top is not None:
        _top(top, "top_logprobs")
        if not wanted:
            raise BadRequest("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
    if body.get("echo") not in (None, False):
        raise BadRequest(
            "'echo' is a /v1/completions field; chat has no echo (send the prompt to /v1/completions to score it).",
            "echo",
        )
    return (top or 0) if wanted else None, False


def _completion_logprobs(body) -> tuple[int | None, bool]:
    """Completions: ``logprobs`` is the number of top tokens (OpenAI's legacy API), ``echo`` a bool."""
    v = body.get("logprobs")
    if v is not None:
        _top(
            v,
            "logprobs",
            " (on /v1/completions it is how many top tokens to list; 'logprobs': true "
            "with 'top_logprobs' is /v1/chat/completions' form)",
        )
    if body.get("top_logprobs") is not None:
        raise BadRequest(
            "'top_logprobs' is a /v1/chat/completions field; on /v1/completions 'logprobs' "
            "itself is the number of top tokens.",
            "top_logprobs",
        )
    echo = _bool(body, "echo")
    if echo and _bool(body, "stream"):
        raise BadRequest("'echo' with 'stream' is not supported: send the request without 'stream'.", "echo")
    return v, echo


def _kv_fields(body, settings: Settings, prompt_len: int, layers: int):
    policy = body.get("kv_policy", settings.policy)
    if not isinstance(policy, str):
        raise BadRequest(f"'kv_policy' must be a string, got {policy!r}.", "kv_policy")
    policy = policy.lower()
    if policy in (FULL, "none"):
        return FULL, None, None, None
    known = ", ".join(["full", *sorted(POLICIES)])
    # a cache spec (kvevict.spec): NAME or NAME@BUDGET; its policy name first, as the request's error names it
    name = policy.partition("@")[0].partition("/")[0].removesuffix("+q")
    if name not in POLICIES and name != FULL:
        raise BadRequest(f"unknown kv_policy {name!r}; known policies: {known}.", "kv_policy")
    try:
        spec = CacheSpec.parse(policy)
    except ValueError as err:
        raise BadRequest(f"kv_policy: {err}", "kv_policy") from None
    if spec.memory or spec.storage is not None or spec.question or spec.slack is not None:
        raise BadRequest(
            "kv_policy names a policy and its token budget (h2o@0.2, h2o@512): the storage is the server's "
            "(--kv-bits), the server's memory is its --kv-memory, a request has no question to protect, "
            "and eviction's slack is the server's.",
            "kv_policy",
        )
    policy, budget = spec.policy, body.get("kv_budget", settings.budget)
    if spec.budget is not None:
        if body.get("kv_budget") is not None:
            raise BadRequest(
                f"kv_policy {policy!r} names its budget already: drop kv_budget or the @ part.", "kv_budget"
            )
        budget = spec.budget
    recent = body.get("kv_recent", settings.recent)
    try:
        check_budget(budget)
    except ValueError as err:
        raise BadRequest(f"kv_budget: {err}", "kv_budget") from None
    if recent is not None and (isinstance(recent, bool) or not isinstance(recent, int) or recent < 0):
        raise BadRequest(f"'kv_recent' must be a non-negative integer number of tokens, got {recent!r}.", "kv_recent")
    tokens = resolve_budget(budget, prompt_len)
    if isinstance(budget, float):
        tokens = max(tokens, settings.min_budget)
        tokens = -(-tokens // settings.budget_round) * settings.budget_round
    pol = spec_policy(policy, recent)
    per_layer = sorted(set(layer_budgets(pol, tokens, layers)))  # PyramidKV: every layer's own budget
    try:
        for b in per_layer:
            pol.check(b)
    except ValueError as err:
        spread = f"; its layers get {per_layer[0]} to {per_layer[-1]} tokens" if len(per_layer) > 1 else ""
        raise BadRequest(
            f"kv_budget={budget!r} ({tokens} tokens for this {prompt_len}-token prompt{spread}) does "
            f"not fit kv_policy {policy!r}: {err}",
            "kv_budget",
        ) from None
    return policy, budget, recent, tokens


def _number(body, name, default, lo, hi) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise BadRequest(f"'{name}' must be a number in [{lo:g}, {hi:g}], got {v!r}.", name)
    return float(v)


def _bool(body, name) -> bool:
    v = body.get(name, False) if isinstance(body, dict) else False
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be true or false, got {v!r}.", name)
    return v


def _seed(v):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'seed' must be an integer, got {v!r}.", "seed")
    if not -(2**63) <= v < 2**64:  # torch.Generator.manual_seed's range; outside it the whole batch would fail
        raise BadRequest(f"'seed' must be in [-2**63, 2**64), got {v}.", "seed")
    return v


def _stop(v) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("'stop' must be a non-empty string or a list of at most 4 of them.", "stop")
    return stops
