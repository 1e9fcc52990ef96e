"""Server counters and gauges, rendered in the Prometheus text exposition format (version 0.0.4).

Written by hand rather than with prometheus_client: a dozen numbers do not need a dependency.
All updates come from the engine's worker thread or the event loop, under one lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque

# every way a request ends: each outcome's series is shown from the start (0 until one ends so), so
# that a scraper, a dashboard or a test tells a count of 0 from a series that is not there
OUTCOMES = ("completed", "cancelled", "timeout", "failed", "rejected", "overloaded", "draining", "unauthorized")
LABELS = {"kvevict_requests_total": [(("outcome", o),) for o in OUTCOMES]}

# name -> (type, help)
SPECS = {
    "kvevict_requests_total": ("counter", "Requests by outcome (" + ", ".join(OUTCOMES) + ")."),
    "kvevict_prompt_tokens_total": ("counter", "Prompt tokens of completed or cancelled requests."),
    "kvevict_generated_tokens_total": ("counter", "Tokens generated."),
    "kvevict_tokens_per_second": ("gauge", "Tokens generated per second over the last 10 seconds."),
    "kvevict_kv_memory_bytes": ("gauge", "K/V bytes the server may hold (--kv-memory); admission keeps to it."),
    "kvevict_kv_bytes_held": ("gauge", "Bytes of K/V storage held by the running batches now."),
    "kvevict_kv_bytes_reserved": ("gauge", "The most the running batches can grow to hold (what admission counts)."),
    "kvevict_kv_pool_bytes": (
        "gauge",
        "Bytes of the page pools the rows' keys, values and bookkeeping live in, free pages included.",
    ),
    "kvevict_kv_bytes_full": ("gauge", "Bytes a stock cache would hold for the running sequences now, in 16 bits."),
    "kvevict_kv_bytes_peak": ("gauge", "Most K/V storage held at once since start."),
    "kvevict_evicted_tokens_total": ("counter", "KV entries evicted (tokens x layers x KV heads), real tokens only."),
    "kvevict_running_sequences": ("gauge", "Sequences being decoded."),
    "kvevict_running_batches": ("gauge", "Decode batches (one cache each: one per policy and budget)."),
    "kvevict_queued_requests": ("gauge", "Requests waiting for memory or a batch slot."),
    "kvevict_time_to_first_token_seconds": ("summary", "From arrival to the first token, recent requests."),
    "kvevict_prefix_cache_memory_bytes": ("gauge", "Bytes the prompt-prefix store may hold (--prefix-cache-memory)."),
    "kvevict_prefix_cache_bytes": ("gauge", "Bytes of K/V the prompt-prefix store holds now (a part of kv_memory)."),
    "kvevict_prefix_cache_entries": ("gauge", "Prompt prefixes stored."),
    "kvevict_prefix_cache_hits_total": ("counter", "Requests that began with a stored prefix and reused it."),
    "kvevict_prefix_cache_misses_total": ("counter", "Requests that looked for a stored prefix and found none."),
    "kvevict_prefix_cache_tokens_saved_total": ("counter", "Prompt tokens not prefilled: stored prefixes reused."),
    "kvevict_prefix_cache_evictions_total": ("counter", "Stored prefixes evicted (least recently used first)."),
}
QUANTILES = (0.5, 0.95)
RECENT = 1000  # observations a summary keeps for its quantiles

WINDOW_S = 10.0


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self._values: dict[tuple[str, tuple], float] = {}
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) for tokens/s
        self._observed: dict[str, deque] = {}  # summary name -> recent values

    def add(self, name: str, value: float = 1, **labels) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._values[key] = self._values.get(key, 0) + value
            if name == "kvevict_generated_tokens_total":
                self._recent.append((time.monotonic(), value))
                self._prune()  # bounded without a scraper too

    def set(self, name: str, value: float, **labels) -> None:
        with self._lock:
            self._values[(name, tuple(sorted(labels.items())))] = value

    def peak(self, name: str, value: float) -> None:
        with self._lock:
            key = (name, ())
            self._values[key] = max(self._values.get(key, 0), value)

    def observe(self, name: str, value: float) -> None:
        """One observation of a summary: _sum and _count grow, quantiles cover the recent ones."""
        with self._lock:
            self._observed.setdefault(name, deque(maxlen=RECENT)).append(value)
            for suffix, v in (("_sum", value), ("_count", 1)):
                key = (name + suffix, ())
                self._values[key] = self._values.get(key, 0) + v

    def get(self, name: str, **labels) -> float:
        with self._lock:
            return self._values.get((name, tuple(sorted(labels.items()))), 0)

    def _prune(self) -> None:
        old = time.monotonic() - WINDOW_S
        while self._recent and self._recent[0][0] < old:
            self._recent.popleft()

    def _rate(self) -> float:
        self._prune()
        return sum(n for _, n in self._recent) / WINDOW_S

    def render(self) -> str:
        with self._lock:
            self._values[("kvevict_tokens_per_second", ())] = self._rate()
            lines = []
            for name, (kind, help_) in SPECS.items():
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
                if kind == "summary":
                    values = sorted(self._observed.get(name, ()))
                    lines += [f'{name}{{quantile="{q}"}} {_num(_quantile(values, q))}' for q in QUANTILES]
                    lines += [
                        f"{name}{sfx} {_num(self._values.get((name + sfx, ()), 0))}" for sfx in ("_sum", "_count")
                    ]
                    continue
                values = {labels: v for (n, labels), v in self._values.items() if n == name}
                values = {**dict.fromkeys(LABELS.get(name, ()), 0), **values}
                for labels, v in sorted(values.items()) or [((), 0)]:
                    lab = ",".join(f'{k}="{val}"' for k, val in labels)
                    lines.append(f"{name}{{{lab}}} {_num(v)}" if lab else f"{name} {_num(v)}")
            return "\n".join(lines) + "\n"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.6g}"


def _quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile of sorted values (0 when there are none)."""
    if not values:
        return 0.0
    return values[min(len(values) - 1, max(0, -(-int(q * 1000) * len(values) // 1000) - 1))]
