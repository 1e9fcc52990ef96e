"""Server counters and gauges, rendered in the Prometheus text exposition format (version 0.0.4).

Written by hand rather than with prometheus_client: a dozen numbers do not need a dependency.
All updates come from the engine's worker thread or the event loop, under one lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque

# name -> (type, help)
SPECS = {
    "kvevict_requests_total": ("counter", "Requests by outcome (completed, cancelled, failed, rejected)."),
    "kvevict_prompt_tokens_total": ("counter", "Prompt tokens of completed or cancelled requests."),
    "kvevict_generated_tokens_total": ("counter", "Tokens generated."),
    "kvevict_tokens_per_second": ("gauge", "Tokens generated per second over the last 10 seconds."),
    "kvevict_kv_bytes_held": ("gauge", "Bytes of K/V storage held by the running batch now."),
    "kvevict_kv_bytes_full": ("gauge", "Bytes a full cache would hold for the running batch now."),
    "kvevict_kv_bytes_peak": ("gauge", "Largest K/V storage any batch has held since start."),
    "kvevict_evicted_tokens_total": ("counter", "KV entries evicted (tokens x layers x KV heads), real tokens only."),
    "kvevict_running_sequences": ("gauge", "Sequences in the running batch."),
    "kvevict_queued_requests": ("gauge", "Requests waiting for a batch."),
    "kvevict_batches_total": ("counter", "Decode batches run."),
    "kvevict_batched_sequences_total": ("counter", "Sequences run in those batches (mean batch = this / batches)."),
}

WINDOW_S = 10.0


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self._values: dict[tuple[str, tuple], float] = {}
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) for tokens/s

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
                samples = [(labels, v) for (n, labels), v in sorted(self._values.items()) if n == name]
                for labels, v in samples or [((), 0)]:
                    lab = ",".join(f'{k}="{val}"' for k, val in labels)
                    lines.append(f"{name}{{{lab}}} {_num(v)}" if lab else f"{name} {_num(v)}")
            return "\n".join(lines) + "\n"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.6g}"
