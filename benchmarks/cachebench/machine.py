"""What the numbers were measured on: cores, torch threads, load, versions, code revision, and
the machine's copy bandwidth (the denominator of the decode floor)."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from .memory_math import copy_bandwidth


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _git_revision() -> str | None:
    root = Path(__file__).resolve().parents[2]  # the repository: the library and its benchmarks
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "src", "benchmarks"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{rev}{'+uncommitted' if dirty else ''}" if rev else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    import torch
    import transformers

    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": load_average(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvevict_revision": _git_revision(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def measure_copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 7) -> dict:
    """Copy a buffer larger than any cache level ``repeats`` times with torch's threads; bytes/s
    read + written (STREAM "copy"). The best is the attainable peak; the median shows the spread."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        rates.append(copy_bandwidth(nbytes, time.perf_counter() - t0))
    rates.sort()
    return {"bytes": nbytes, "best": rates[-1], "median": statistics.median(rates), "worst": rates[0]}
