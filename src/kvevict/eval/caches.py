"""One cache per grid cell: the stock full cache (the reference) or an evicting one."""

from __future__ import annotations

from transformers import DynamicCache

from ..cache import make_cache
from ..default_policy import pick_policy
from ..memory import MemoryPlan, storage_kind
from ..policies import policy_class
from ..spec import FULL, CacheSpec
from ..storage import Storage


def memory_spec(policy) -> bool:
    """Whether a grid cell's budget is a memory budget (``mem``, ``mem-NAME``, ``NAME@memory``)."""
    return isinstance(policy, str) and policy != FULL and CacheSpec.parse(policy).memory


def memory_policy(spec: str, prompt_known: bool, model=None, share=None) -> str:
    """The policy of a memory cell: the one it names, else what the plan picks
    (``kvevict.default_policy.pick_policy``: prompt-scoring when the prompt is known, streaming when not)."""
    return CacheSpec.parse(spec).policy or pick_policy(prompt_known=prompt_known, model=model, share=share)


def memory_cell(spec: str, prompt_known: bool, model=None, share=None) -> tuple[str, dict]:
    """A memory cell's policy and the bits it names: ``mem-kvzip-pool/int4`` -> ("kvzip-pool",
    {"kv_bits": 4, "evicted_bits": None}) (``make_cache(memory=..., **bits)`` spends the bytes at
    them; both None: the plan's storage)."""
    storage = CacheSpec.parse(spec).storage or Storage()
    return (
        memory_policy(spec, prompt_known, model, share),
        {"kv_bits": storage.kv_bits, "evicted_bits": storage.evicted_bits},
    )


def new_cache(model, policy: str, budget, sequence=None, covering: int | None = None, prompt=None, tokenizer=None):
    """The cache of one grid cell: ``policy`` a cache spec (``kvevict.spec``) without its budget,
    ``budget`` the grid's. ``full``: a DynamicCache (attention stays whatever it is: the kvevict
    attention is exact with it); ``full/STORAGE`` keeps every token at that storage (a budget of
    ``covering`` tokens, or the sequence's length); otherwise ``make_cache``.
    ``sequence`` (1, n): every token the cache will see, known in advance in teacher-forced scoring;
    the oracle is recorded on it (it cannot run without it). ``prompt`` (1, p) with ``tokenizer``:
    the prompt a policy that scores it in a pass of its own (``needs_prompt``: kvzip) is recorded
    on, as ``kvevict.generate`` does. A memory cell (``mem``, ``mem-NAME``): ``budget`` is a memory
    budget (``make_cache(memory=budget)``), the policy NAME or the one the plan picks: with
    ``prompt`` and ``tokenizer`` the prompt is known before decoding (``pick_policy(prompt_known=True)``,
    recorded on it), without them the text streams in (``prompt_known=False``); the caller fixes the
    prompt length (``set_prompt_length``) the share is taken of."""
    spec = CacheSpec.parse(policy).at(budget)
    if spec.question:
        raise ValueError(
            f"{policy!r} protects a prompt's question; this task streams text that has none "
            "(use it with passkey, needle, vartrack, narrativeqa)."
        )
    bits = {} if spec.storage is None else {"kv_bits": spec.storage.kv_bits, "evicted_bits": spec.storage.evicted_bits}
    if spec.slack is not None:
        bits["slack"] = spec.slack
    if spec.memory:
        # a prompt handed over before the cache exists is known, as in ``generate``: the plan's
        # prompt-scoring policy, recorded on it; a streamed text gets the streaming one
        name = memory_policy(
            policy, prompt_known=prompt is not None and tokenizer is not None, model=model, share=budget
        )
        return make_cache(model, _recorded(name, model, tokenizer, prompt) or name, memory=budget, **bits)
    two_tiers = isinstance(budget, MemoryPlan) and budget.pair is not None  # a memory plan's int8 and int4
    if spec.storage is not None and spec.storage.evicted_bits is not None and two_tiers:
        bits["evicted_budget"] = budget.partner()
    if spec.policy == FULL:
        if spec.is_stock:
            return DynamicCache(config=model.config)
        size = covering if covering is not None else (sequence.shape[1] if sequence is not None else None)
        if size is None:
            raise ValueError(f"{policy!r} keeps every token: give the sequence or the number of tokens to cover.")
        return make_cache(model, "h2o", size, **bits)
    if spec.policy == "oracle" and sequence is not None:
        from ..policies.oracle import Oracle

        return make_cache(model, Oracle.record(model, sequence), budget, **bits)
    return make_cache(model, _recorded(spec.policy, model, tokenizer, prompt) or spec.policy, budget, **bits)


def _recorded(name: str, model, tokenizer, prompt):
    """A policy that scores the prompt in a pass of its own (``needs_prompt``: kvzip), recorded on
    ``prompt``; None for any other policy or without a prompt."""
    found = policy_class(name) if prompt is not None else None
    if found is None or not found[0].needs_prompt:
        return None
    return found[0].record(model, tokenizer, prompt, **found[1])


def policy_names(requested: str | list[str], known: dict, full_alone: bool = False) -> list[str]:
    """Policy names from ``"h2o,roco"`` or ``"all"`` (every registered policy, aliases once).
    Unknown names are a ValueError listing the known ones; 'full' is always run, never listed.
    A name may carry a storage (``h2o/int4``, ``full/int2``: quantized, nothing evicted), the
    ``ada-`` prefix (head-adaptive budgets) and the ``+q`` suffix (question protected and observed).
    ``full_alone``: ``"full"`` alone is an empty list (a grid of the full cache and a peer's
    presses), not an error."""
    items = requested.split(",") if isinstance(requested, str) else list(requested)
    items = [p.strip().lower() for p in items if p.strip()]
    if items == ["all"]:
        seen, out = set(), []
        for name in sorted(known):
            cls = known[name]
            if cls in seen:
                continue
            seen.add(cls)
            out.append(getattr(cls, "name", name) if getattr(cls, "name", name) in known else name)
        return out
    bad = []
    for p in items:  # each a cache spec (``kvevict.spec``); a memory cell at bits no plan spends: refused now
        if p == FULL:
            continue
        try:
            spec = CacheSpec.parse(p)
        except ValueError as err:
            bad.append((p, err))
            continue
        if spec.memory and spec.storage is not None:
            try:
                storage_kind(spec.storage.kv_bits, spec.storage.evicted_bits)
            except ValueError as err:
                raise ValueError(
                    f"{p!r}: a memory cell is spent at int8, int4 or int8+int4 (or fp16), or named without bits ({err})"
                ) from None
    if bad:
        names = ", ".join(repr(p) for p, _ in bad)
        raise ValueError(
            f"unknown policy {names}; known policies: {', '.join(sorted(known))} "
            f"(or 'all'; the full cache is always included). {bad[0][1]}"
        )
    out = []
    for p in items:
        if p != FULL and p not in out:
            out.append(p)
    if not out and not (full_alone and FULL in items):
        raise ValueError(
            f"give at least one policy besides full (the full cache always runs; with --peer, "
            f"--policies full runs the peer alone); known policies: {', '.join(sorted(known))}."
        )
    return out
