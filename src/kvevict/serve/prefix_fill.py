"""A request's prefill through the prefix store (``prefix_store``): from a copy of the longest
stored prefix of its prompt, and in two parts when its own earlier turns are to be stored.

For a chat request the prefix to store is the prompt up to where its newest message begins
(``GenRequest.prefix_len``): prefilled alone, its cache is query-agnostic (the newest turn, the
question, was not yet seen), and a copy of it goes into the store. Then the rest is fed into the
request's own cache, positions going on after the prefix; an evicting cache takes it as any prompt
chunk, keeping its budget by its policy (the recent window protects the newest tokens). So a
request is prefilled the same way whether its prefix was stored just now or long ago: a hit gives
the answer the miss gave. Prefilled in parts, an evicting cache can keep other tokens than one
forward over the whole prompt would (the server's ``--prefix-cache-memory`` documents it).
"""

from __future__ import annotations

from collections import deque

from .batch import DecodeBatch, cache_bytes
from .handle import Handle, scores_prompt
from .prefix_store import PrefixStore, Snapshot, prefix_spec
from .settings import Settings


class PrefixFill:
    def __init__(self, model, settings: Settings, pages, store: PrefixStore, log: deque):
        self.model, self.settings, self.pages, self.store, self.log = model, settings, pages, store, log

    def spec(self, req) -> tuple:
        return prefix_spec(req, self.settings.kv_bits)

    def plan(self, h: Handle) -> tuple[Snapshot | None, int | None] | None:
        """(the stored prefix ``h`` starts from, where the prefix it stores ends), or None: neither,
        and it is prefilled with the others admitted beside it. A request that opted out, or wants
        its prompt's own logprobs (every position's logits), never looks."""
        req = h.req
        if not req.prefix_cache or scores_prompt(req):
            return None
        hit = self.store.lookup(req.owner, self.spec(req), req.prompt_ids)
        start = 0 if hit is None else hit.length
        split = req.prefix_len if h.stores and req.prefix_len is not None and req.prefix_len > start else None
        return None if hit is None and split is None else (hit, split)

    def prefill(self, h: Handle, hit: Snapshot | None, split: int | None):
        """Prefill ``h`` from ``hit`` (or from nothing), storing a copy of its cache at ``split``;
        returns (its one-row batch, its last logits (1, vocab))."""
        req, ids = h.req, h.req.prompt_ids
        start = 0 if hit is None else hit.length
        batch = None if hit is None else DecodeBatch.resume(self.model, hit.cache, start)
        parts = [(start, len(ids))] if split is None else [(start, split), (split, len(ids))]
        stored = False
        for a, b in parts:
            if batch is None:
                args = (req.policy, req.budget_tokens, req.recent, self.settings.kv_bits, self.pages)
                batch, logits = DecodeBatch.prefill(self.model, ids[a:b], *args)
            else:
                logits = batch.extend(ids[a:b])
            # admission reserved h.stores bytes for the copy: one that would take more is not made
            if b == split and batch.kv_bytes() <= h.stores:
                cache = batch.copy_cache()
                stored = self.store.put(req.owner, self.spec(req), ids[:split], cache, cache_bytes(cache))
        self.log.append(
            {"event": "prefix", "id": req.id, "reused": start, "prefilled": len(ids) - start, "stored": stored}
        )
        return batch, logits
