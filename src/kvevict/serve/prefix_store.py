"""The server's store of prompt prefixes: each one's cache as it stood after the prefix alone was
prefilled, so that a request whose token ids begin with it prefills only the rest (vLLM's and
SGLang's automatic prefix caching, Kwon et al. 2023; Zheng et al. 2024, over compressed caches).

An entry is keyed by its owner (the API key's ``auth.key_id``, or None where keys share prefixes
or there are none), its cache spec (policy, budget in tokens, recent window, bits: a cache made
otherwise would hold other tokens) and its token ids. The server is one model, so every entry is
that model's. ``lookup`` gives the longest stored prefix of a prompt that leaves at least one token
to prefill. The store is bounded in bytes (each entry's ``kv_bytes``, what its storage holds);
``put`` and ``shrink`` evict the least recently used entries first.

Entries are never read in place: a request decodes a copy (``copy.deepcopy``; paged storage gives
the copy pages of its own), so an entry stays as it was stored. Only the engine's worker thread
uses the store.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from .metrics import Metrics


def prefix_spec(req, kv_bits: int | None) -> tuple:
    """What a stored prefix must have been made with to serve ``req``: its policy, budget in tokens,
    recent window and storage bits (the server's ``kv_bits``; a full cache: the model's dtype)."""
    return req.policy, req.budget_tokens, req.recent, None if req.policy == "full" else kv_bits


@dataclass
class Snapshot:
    """One stored prefix: the cache after its ``length`` tokens, and what that cache holds."""

    cache: object  # an EvictingCache (pages of the engine's pools) or a DynamicCache (policy "full")
    length: int
    nbytes: int


class PrefixStore:
    def __init__(self, limit: int, metrics: Metrics | None = None):
        if limit < 1:
            raise ValueError(f"a prefix store holds at least one byte, got a limit of {limit}.")
        self.limit, self.metrics = limit, metrics or Metrics()
        self.nbytes = 0
        self._entries: OrderedDict[tuple, Snapshot] = OrderedDict()  # least recently used first
        self._lengths: dict[tuple, Counter] = {}  # (owner, spec) -> how many entries of each length
        self._gauges()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, owner, spec: tuple, ids: list[int], count: bool = True) -> Snapshot | None:
        """The longest stored prefix of ``ids`` shorter than ``ids`` (its entry becomes the most
        recently used), or None; ``count``: as a hit or a miss, and a hit's length as tokens saved
        (admission looks without counting, the prefill counts)."""
        got = self._longest(owner, spec, ids, len(ids) - 1)
        snap = None if got is None else self._entries[got]
        if got is not None:
            self._entries.move_to_end(got)
        if count:
            self.metrics.add(f"kvevict_prefix_cache_{'misses' if snap is None else 'hits'}_total")
            self.metrics.add("kvevict_prefix_cache_tokens_saved_total", 0 if snap is None else snap.length)
        return snap

    def put(self, owner, spec: tuple, ids: list[int], cache, nbytes: int) -> bool:
        """Store ``cache`` (the store's own: nobody else may change it) as the prefix ``ids``,
        evicting the least recently used entries until it fits; False (nothing stored) when it is
        larger than the whole store or already there."""
        key = (owner, spec, tuple(ids))
        if nbytes > self.limit or key in self._entries:
            return False
        self.shrink(self.limit - nbytes)
        self._entries[key] = Snapshot(cache, len(ids), nbytes)
        self._lengths.setdefault((owner, spec), Counter())[len(ids)] += 1
        self.nbytes += nbytes
        self._gauges()
        return True

    def shrink(self, nbytes: int) -> bool:
        """Evict the least recently used entries until the store holds at most ``nbytes``;
        whether any was evicted (their storage is freed once no copy in flight holds it)."""
        evicted = False
        while self._entries and self.nbytes > max(0, nbytes):
            (owner, spec, ids), snap = self._entries.popitem(last=False)
            lengths = self._lengths[(owner, spec)]
            lengths[len(ids)] -= 1
            if not lengths[len(ids)]:
                del lengths[len(ids)]
            if not lengths:
                del self._lengths[(owner, spec)]
            self.nbytes -= snap.nbytes
            self.metrics.add("kvevict_prefix_cache_evictions_total")
            evicted = True
        self._gauges()
        return evicted

    def _longest(self, owner, spec: tuple, ids: list[int], most: int) -> tuple | None:
        """The key of the longest stored prefix of ``ids`` with at most ``most`` tokens: one dict
        probe per stored length of this owner and spec."""
        for n in sorted(self._lengths.get((owner, spec), ()), reverse=True):
            key = (owner, spec, tuple(ids[:n]))
            if n <= most and key in self._entries:
                return key
        return None

    def _gauges(self) -> None:
        self.metrics.set("kvevict_prefix_cache_bytes", self.nbytes)
        self.metrics.set("kvevict_prefix_cache_entries", len(self._entries))
