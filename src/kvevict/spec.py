"""One grammar for naming a cache, parsed and printed here and nowhere else.

    SPEC    := "full"                           the stock transformers cache (the reference)
             | "full/" STORAGE                  every token kept, stored as STORAGE ("full/int4")
             | "memory=" SIZE                   a memory budget, the policy the plan picks
                                                (a spec whose budget a grid gives: "memory",
                                                "NAME@memory")
             | POLICY ["+q"] ["/" STORAGE] ["@" BUDGET]
             | SPEC "+slack=" N                 evicting N at once, every N steps (default 1)
    POLICY  := ["merge-"] ["ada-"] NAME         a registered policy (``kvevict.POLICIES``)
    "+q"    := the prompt's question protected and observed (``kvevict.generate.question_tokens``)
    STORAGE := KEPT ["+" EVICTED]               fp (the model's dtype), fp16, int8, int4, int2:
                                                "int8+int4" demotes evicted tokens to int4
    BUDGET  := TOKENS | SHARE | "memory=" SIZE  an int, a float in (0, 1] of the prompt, or bytes:
                                                a share of a 16-bit stock cache (0.2, 20%) or 64MiB

Examples: ``h2o@0.2``, ``snapkv+q/int8@512``, ``kvzip-pool@memory=0.2``, ``memory=0.1``,
``full/int4``, ``memory=0.2+slack=16``. A spec may leave its budget out (an eval grid gives it: ``CacheSpec.at``). Older
spellings still read: ``mem``, ``mem-NAME[/BITS]`` (eval grids), ``stock`` and ``kvevict-full``
(benchmarks), a trailing ``+q`` after the storage (``h2o/int4+q``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from os import PathLike

from .memory import parse_memory
from .policies import Policy
from .policies.registry import POLICIES, policy_class
from .storage import Pools
from .storage.config import Storage

FULL = "full"
QUESTION = "+q"
MEMORY = "memory="
SLACK = "+slack="
_LEGACY_MEMORY = "mem"  # eval grids: "mem", "mem-NAME", "mem-NAME/BITS" (budget = a memory share)
_LEGACY = {"stock": FULL, "none": FULL}

GRAMMAR = (
    "POLICY[+q][/STORAGE][@BUDGET], full[/STORAGE] or memory=SHARE: e.g. h2o@0.2, snapkv+q/int8@512, "
    "kvzip-pool@memory=0.2, memory=0.1, full/int4 (STORAGE: fp, fp16, int8, int4, int2 or KEPT+EVICTED "
    "such as int8+int4; BUDGET: tokens, a share of the prompt in (0, 1], or memory=SHARE / memory=64MiB; "
    "a trailing +slack=N evicts N tokens at once)"
)


@dataclass(frozen=True)
class CacheSpec:
    """A cache by name. policy: "full", a policy name (``ada-``/``merge-`` prefixes kept), or None
    (a memory budget's plan picks it). storage: None when not named (the model's dtype; for "full",
    the stock cache), else the ``Storage`` named. budget: tokens (int), a share of the prompt
    (float), or with ``memory`` a memory budget (a share of a 16-bit stock cache, or bytes).
    slack: tokens evicted at once (``make_cache``'s ``slack``), None when not named."""

    policy: str | None = FULL
    storage: Storage | None = None
    question: bool = False
    budget: int | float | str | None = None
    memory: bool = False
    slack: int | None = None

    def __post_init__(self):
        if self.policy is None and not self.memory:
            raise ValueError(f"a cache with no policy named is a memory budget's: write it as {MEMORY}SHARE.")
        if self.policy == FULL and (self.question or self.budget is not None or self.memory):
            raise ValueError(
                "the full cache keeps every token: it takes no budget and no +q "
                "(write full, or full/STORAGE for every token stored as STORAGE)."
            )
        if self.slack is not None and (self.policy == FULL or isinstance(self.slack, bool) or self.slack < 1):
            raise ValueError("+slack=N takes a positive int N and a cache that evicts (not full)")

    # -- reading and writing --------------------------------------------------------------------
    @classmethod
    def parse(cls, text) -> "CacheSpec":
        if isinstance(text, CacheSpec):
            return text
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"a cache spec must be a non-empty string, got {text!r}; write {GRAMMAR}.")
        raw = text.strip().lower()
        try:
            return _parse(raw)
        except ValueError as err:
            raise ValueError(f"cannot read the cache {text!r} ({err}); write {GRAMMAR}.") from None

    def __str__(self) -> str:
        return self._text() + ("" if self.slack is None else f"{SLACK}{self.slack}")

    def _text(self) -> str:
        if self.policy is None:
            head = ""
        else:
            head = self.policy + (QUESTION if self.question else "")
        if self.storage is not None:
            head += "/" + (self.storage.label or "fp")
        if self.budget is None:  # a grid gives it (``at``); "@memory": a memory budget's
            return (head + "@memory" if head else "memory") if self.memory else head
        size = MEMORY + _size_text(self.budget) if self.memory else _size_text(self.budget)
        return size if self.policy is None else f"{head}@{size}"

    # -- what callers ask of it -----------------------------------------------------------------
    @property
    def is_stock(self) -> bool:
        """The stock transformers cache: nothing of kvevict in the way."""
        return self.policy == FULL and self.storage is None

    def at(self, budget) -> "CacheSpec":
        """This spec with a grid's budget (a memory spec takes it as its memory budget)."""
        if self.policy == FULL:
            return self
        if self.budget is not None and budget is not None and self.budget != budget:
            raise ValueError(f"{self} names its budget already; give it without @BUDGET to sweep budgets.")
        return replace(self, budget=budget)

    def cache_kwargs(self) -> dict:
        """``make_cache`` keyword arguments this spec names (its storage bits, its budget)."""
        kw: dict = {}
        if self.storage is not None:
            kw.update(kv_bits=self.storage.kv_bits, evicted_bits=self.storage.evicted_bits)
        if self.budget is not None:
            kw["memory" if self.memory else "budget"] = self.budget
        if self.slack is not None:
            kw["slack"] = self.slack
        return kw


@dataclass(frozen=True)
class CacheRequest:
    """One ``make_cache`` call as an object: its arguments, in its order, each documented there
    (``params``: the policy's own keyword arguments). ``checked`` reads a spec string given as the
    policy into the budget, memory, bits and slack it names, and checks what needs no model."""

    policy: str | Policy | None = None
    budget: int | float | None = None
    recent: int | None = None
    compact: bool = False
    kv_bits: int | None = None
    group: int | None = None
    evicted_bits: int | None = None
    evicted_budget: int | float | None = None
    memory: int | float | str | None = None
    question: int | None = None
    plan: str | PathLike | bool | None = None
    pages: Pools | None = None
    keys: str | None = None
    slack: int | None = None
    params: dict = field(default_factory=dict)

    def checked(self) -> CacheRequest:
        """This request with its spec string read (``policy`` left a name, or None for a memory
        budget's pick), its slack, pages and recent window checked, ``recent`` handed to the
        policy's parameters; the errors are ``make_cache``'s, in its order."""
        req = self._spec_read() if isinstance(self.policy, str) else self
        check_slack(req.slack, req.budget if req.memory is None else None)
        if req.pages is not None and not isinstance(req.pages, Pools):  # before the model's attention is switched
            raise ValueError(
                f"pages must be a kvevict.storage.Pools (shared by the caches whose rows may be batched "
                f"together) or None; got {type(req.pages).__name__}."
            )
        if req.recent is None:
            return req
        if isinstance(req.recent, bool) or not isinstance(req.recent, int):
            raise ValueError(f"recent must be an int number of tokens, got {req.recent!r}.")
        return replace(req, params={**req.params, "recent": req.recent})

    def _spec_read(self) -> CacheRequest:
        """The policy, budget, memory, bits and slack of the spec string ``policy``; what it names
        must not be given again as an argument."""
        text = self.policy
        spec = CacheSpec.parse(text)
        if spec.policy == FULL:
            raise ValueError(
                f"{text!r} keeps every token: use transformers' DynamicCache for the full cache, or a "
                "policy with a budget that covers the sequence (make_cache(model, 'h2o/int4@4096'))."
            )
        if spec.question:
            raise ValueError(
                f"{text!r}: +q needs the prompt's text to count its question: use kvevict.generate.generate, "
                "or pass question=N (the prompt's last N tokens)."
            )
        named = spec.cache_kwargs()
        twice = sorted(k for k in named if getattr(self, k) is not None)
        if twice:
            raise ValueError(f"{text!r} names {', '.join(twice)} already: drop the argument or that part of the spec.")
        if spec.memory and spec.budget is None and self.memory is None:
            raise ValueError(f"{text!r} spends a memory budget: give memory= or write {spec.policy or ''}@memory=0.2.")
        return replace(self, policy=spec.policy, **named)


def check_slack(slack, budget=None) -> int | None:
    """``slack`` as an int >= 1, or None (each layer's ``default_slack``); an int ``budget`` (tokens)
    must hold it. A share of the prompt or a memory budget is known at the prompt: a layer left
    fewer slots turns over all of them."""
    if slack is None:
        return None
    if isinstance(slack, bool) or not isinstance(slack, int) or slack < 1:
        raise ValueError(
            f"slack must be a positive int number of slots evicted at once (1: one per step, e.g. 16), got {slack!r}."
        )
    if isinstance(budget, int) and not isinstance(budget, bool) and slack > budget:
        raise ValueError(
            f"slack={slack} frees more slots at once than the budget of {budget} tokens holds: "
            f"give a slack of at most {budget}, or a larger budget."
        )
    return slack


def _parse(raw: str) -> CacheSpec:
    head, mark, slack = raw.rpartition(SLACK)
    if mark:
        if not slack.isdigit() or int(slack) < 1:
            raise ValueError(f"+slack= takes a positive int number of tokens, got {slack!r}")
        return replace(_parse(head), slack=int(slack))
    raw = _LEGACY.get(raw, raw)
    if raw == "kvevict-full" or raw.startswith("kvevict-full/"):  # benchmarks: kvevict, nothing evicted
        return CacheSpec(FULL, Storage.parse(raw.partition("/")[2] or "fp"))
    if raw == "memory":
        return CacheSpec(None, memory=True)
    if raw.startswith(MEMORY):
        return CacheSpec(None, budget=_memory_size(raw[len(MEMORY) :]), memory=True)
    if raw == _LEGACY_MEMORY or raw.startswith(_LEGACY_MEMORY + "-"):
        name = raw[len(_LEGACY_MEMORY) + 1 :]
        inner = _parse(name) if name else CacheSpec(None, memory=True)
        return replace(inner, memory=True)
    head, at, budget = raw.partition("@")
    if at and not budget:
        raise ValueError("nothing after @")
    name, slash, storage = head.partition("/")
    question = False
    for part in ("name", "storage"):  # "+q" after the name, or (older) after the storage
        text = name if part == "name" else storage
        if text.endswith(QUESTION):
            question, text = True, text[: -len(QUESTION)]
            name, storage = (text, storage) if part == "name" else (name, text)
    if not name:
        raise ValueError("no policy named")
    if slash and not storage:
        raise ValueError("nothing after /")
    st = Storage.parse(storage) if slash else None
    if name == FULL:
        if budget:
            raise ValueError("the full cache keeps every token: no @BUDGET")
        return CacheSpec(FULL, st, question)
    _check_policy(name)
    if not budget:
        return CacheSpec(name, st, question)
    if budget == "memory":
        return CacheSpec(name, st, question, memory=True)
    if budget.startswith(MEMORY):
        return CacheSpec(name, st, question, _memory_size(budget[len(MEMORY) :]), memory=True)
    return CacheSpec(name, st, question, _token_budget(budget))


def _check_policy(name: str) -> None:
    if policy_class(name) is None:
        raise ValueError(
            f"unknown policy {name!r}; known policies: {', '.join(sorted(POLICIES))}, each also as ada-NAME "
            "(head-adaptive budgets) and merge-NAME (evicted tokens merged)"
        )


def _token_budget(text: str) -> int | float:
    try:
        value = float(text) if any(c in text for c in ".e") else int(text)
    except ValueError:
        raise ValueError(f"budget {text!r} is not a number of tokens or a share of the prompt") from None
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise ValueError(f"a share of the prompt is in (0, 1], got {text}")
    if isinstance(value, int) and value <= 0:
        raise ValueError(f"a budget of {value} tokens keeps nothing")
    return value


def _memory_size(text: str) -> float | int:
    """0.2 or 20% (a share of a 16-bit stock cache) or 64MiB (bytes): ``memory.parse_memory``."""
    return parse_memory(text)


def _size_text(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
