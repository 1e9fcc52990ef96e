"""One cache per grid cell: the stock full cache (the reference) or an evicting one."""

from __future__ import annotations

from transformers import DynamicCache

from ..cache import make_cache
from ..storage import Storage, split_spec

FULL = "full"


MEMORY = "mem"  # a cell spec: "mem" (policy picked by the memory plan), "mem-NAME" or "mem-NAME/BITS"
# (the bytes spent at those bits: kvevict.memory.storage_kind), budget = memory share


def memory_spec(policy) -> bool:
    return isinstance(policy, str) and (policy == MEMORY or policy.startswith(MEMORY + "-"))


def memory_policy(spec: str, prompt_known: bool, model=None, share=None) -> str:
    """The policy of a memory cell: NAME for ``mem-NAME``, else what the plan picks
    (``kvevict.memory.pick_policy``: prompt-scoring when the prompt is known, streaming when not)."""
    from ..memory import pick_policy

    return spec[len(MEMORY) + 1:] or pick_policy(prompt_known=prompt_known, model=model, share=share)


def memory_cell(spec: str, prompt_known: bool, model=None, share=None) -> tuple[str, dict]:
    """A memory cell's policy and the bits it names: ``mem-kvzip-pool/int4`` -> ("kvzip-pool",
    {"kv_bits": 4, "evicted_bits": None}) (``make_cache(memory=..., **bits)`` spends the bytes at
    them; both None: the plan's storage)."""
    name, storage = split_spec(memory_policy(spec, prompt_known, model, share))
    return name, {"kv_bits": storage.kv_bits, "evicted_bits": storage.evicted_bits}


def new_cache(model, policy: str, budget, sequence=None, covering: int | None = None, prompt=None, tokenizer=None):
    """``policy == "full"``: a DynamicCache (attention stays whatever it is: the kvevict attention
    is exact with it); otherwise ``make_cache(model, policy, budget)``. A policy may name its
    storage after a slash (``h2o/int4``, ``h2o/int4+int2``; see ``Storage.parse``); ``full/int4``
    is that storage with nothing evicted (a budget of ``covering`` tokens, or the sequence's length).
    ``sequence`` (1, n): every token the cache will see, known in advance in teacher-forced scoring;
    the oracle is recorded on it (it cannot run without it). ``prompt`` (1, p) with ``tokenizer``:
    the prompt a policy that scores it in a pass of its own (``needs_prompt``: kvzip) is recorded
    on, as ``kvevict.generate`` does. ``mem`` / ``mem-NAME``: ``budget`` is a memory budget
    (``make_cache(memory=budget)``), the policy NAME or the one the plan picks: with ``prompt`` and
    ``tokenizer`` the prompt is known before decoding (``pick_policy(prompt_known=True)``, recorded
    on it), without them the text streams in (``prompt_known=False``); the caller fixes the prompt
    length (``set_prompt_length``) the share is taken of."""
    from ..generate import split_question

    if split_question(policy)[1]:
        raise ValueError(f"{policy!r} protects a prompt's question; this task streams text that has none "
                         "(use it with passkey, needle, vartrack, narrativeqa).")
    if memory_spec(policy):
        # a prompt handed over before the cache exists is known, as in ``generate``: the plan's
        # prompt-scoring policy, recorded on it; a streamed text gets the streaming one
        name, bits = memory_cell(policy, prompt_known=prompt is not None and tokenizer is not None, model=model,
                                 share=budget)
        return make_cache(model, _recorded(name, model, tokenizer, prompt) or name, memory=budget, **bits)
    name, storage = split_spec(policy)
    kw = {"kv_bits": storage.kv_bits, "evicted_bits": storage.evicted_bits}
    if storage.evicted_bits is not None and getattr(budget, "pair", None):  # a memory plan's two tiers
        kw["evicted_budget"] = budget.partner()
    if name == FULL:
        if storage == Storage():
            return DynamicCache(config=model.config)
        size = covering if covering is not None else (sequence.shape[1] if sequence is not None else None)
        if size is None:
            raise ValueError(f"{policy!r} keeps every token: give the sequence or the number of tokens to cover.")
        return make_cache(model, "h2o", size, **kw)
    if name == "oracle" and sequence is not None:
        from ..policies.oracle import Oracle

        return make_cache(model, Oracle.record(model, sequence), budget, **kw)
    return make_cache(model, _recorded(name, model, tokenizer, prompt) or name, budget, **kw)


def _recorded(name: str, model, tokenizer, prompt):
    """A policy that scores the prompt in a pass of its own (``needs_prompt``: kvzip), recorded on
    ``prompt``; None for any other policy or without a prompt."""
    from ..policies import policy_class

    found = policy_class(name) if prompt is not None else None
    if found is None or not getattr(found[0], "needs_prompt", False):
        return None
    return found[0].record(model, tokenizer, prompt, **found[1])


def policy_names(requested: str | list[str], known: dict) -> list[str]:
    """Policy names from ``"h2o,roco"`` or ``"all"`` (every registered policy, aliases once).
    Unknown names are a ValueError listing the known ones; 'full' is always run, never listed.
    A name may carry a storage (``h2o/int4``, ``full/int2``: quantized, nothing evicted), the
    ``ada-`` prefix (head-adaptive budgets) and the ``+q`` suffix (question protected and observed)."""
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
    from ..generate import split_question
    from ..policies.registry import ADAPTIVE, MERGE

    def base(p):  # "ada-h2o/int4+q" -> "ada-h2o"; a bad storage is a clear error now, not mid-grid
        spec = split_question(p)[0]
        return split_spec(spec)[0] if "/" in spec else spec

    def known_name(b):
        if b == "mem":  # a memory budget, the policy picked by the plan (generation tasks)
            return True
        if b.startswith("mem-"):  # a memory budget for a named policy
            b = b[len("mem-"):]
        for prefix in (MERGE, ADAPTIVE):  # "merge-ada-h2o": h2o, merged and head-adaptive
            if b.startswith(prefix) and b[len(prefix):] != FULL:
                b = b[len(prefix):]
        return b == FULL or b in known

    bad = [p for p in items if not known_name(base(p))]
    if bad:
        raise ValueError(f"unknown policy {', '.join(map(repr, bad))}; known policies: {', '.join(sorted(known))} "
                         "(or 'all'; the full cache is always included).")
    for p in items:  # bits a memory budget cannot be spent at: refused now, not at the grid's first cell
        spec = split_question(p)[0]
        if memory_spec(spec) and "/" in spec:
            from ..memory import storage_kind

            try:
                storage_kind(**memory_cell(spec, prompt_known=True)[1])
            except ValueError as err:
                raise ValueError(f"{p!r}: a memory cell is spent at int8, int4 or int8+int4 (or fp16), or "
                                 f"named without bits ({err})") from None
    out = []
    for p in items:
        if p != FULL and p not in out:
            out.append(p)
    if not out:
        raise ValueError(f"give at least one policy; known policies: {', '.join(sorted(known))}.")
    return out
