"""Ray start-up shared by the grid's Ray executor and ``kvevict serve --replicas``."""

from __future__ import annotations

import os


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Join the Ray cluster at ``address`` ("auto", "ray://host:10001"), or start a local one with
    ``num_cpus`` (default: every core) when ``address`` is None, "" or "local". Returns whether this
    call started or joined Ray (then the caller shuts it down); False when Ray was already up."""
    try:
        import ray
    except ImportError:
        raise ValueError("Ray is not installed: pip install 'kvevict[ray]'.") from None
    if ray.is_initialized():
        return False
    quiet = dict(include_dashboard=False, log_to_driver=False)
    if address in (None, "", "local"):
        ray.init(num_cpus=num_cpus or os.cpu_count(), **quiet)
    else:
        ray.init(address=address, **quiet)
    return True
