"""``kvevict serve --replicas N``: N copies of the same server under Ray Serve, one model and one
engine per replica, behind one HTTP address (Ray Serve's proxy spreads requests over replicas).

The API is the same app as the single server (``create_app``), built inside each replica through
``serve.ingress()``'s late-bound ``__serve_build_asgi_app__``, so nothing about routes, validation
or streaming differs. /metrics and /health answer for whichever replica gets the request.
"""

from __future__ import annotations

import os
import sys
import time


def deployment(
    model_name: str, settings: dict, replicas: int, threads: int | None = None, cpus_per_replica: float | None = None
):
    """A bound Ray Serve application of ``replicas`` kvevict servers."""
    from ray import serve

    cpus = cpus_per_replica if cpus_per_replica is not None else max(0.1, (os.cpu_count() or 1) / replicas)

    @serve.deployment(
        name="kvevict", num_replicas=replicas, ray_actor_options={"num_cpus": cpus}, max_ongoing_requests=1000
    )
    @serve.ingress()
    class KvevictReplica:
        def __init__(self, model_name, settings, threads):
            from kvevict.serve.server import build

            # not self.app: Ray Serve's ingress wrapper owns that name
            self.kv_app, self.kv_engine = build(model_name, settings, threads)

        def __serve_build_asgi_app__(self):
            return self.kv_app

        def __del__(self):
            engine = getattr(self, "kv_engine", None)
            if engine is not None:
                engine.stop()

    per_replica = threads or max(1, int((os.cpu_count() or 1) // replicas))
    return KvevictReplica.bind(model_name, settings, per_replica)


def start(
    model_name: str,
    settings: dict,
    replicas: int,
    host: str,
    port: int,
    address: str | None = None,
    threads: int | None = None,
    num_cpus: int | None = None,
    cpus_per_replica: float | None = None,
):
    """Start Ray (or join ``address``), Ray Serve's HTTP proxy on host:port, and the replicas.
    Returns when every replica is up; stop with ``stop()``."""
    from ray import serve

    from ..distributed.ray_init import ensure_ray

    ensure_ray(address, num_cpus)
    serve.start(http_options={"host": host, "port": port})
    serve.run(deployment(model_name, settings, replicas, threads, cpus_per_replica), name="kvevict", route_prefix="/")


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def serve_replicas(model_name, settings, replicas, host, port, address=None, threads=None) -> int:
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ValueError("--replicas needs the ray extra: pip install 'kvevict[ray]'.") from None
    start(model_name, settings, replicas, host, port, address, threads)
    print(
        f"kvevict: {replicas} replicas of {settings['model_id']} on http://{host}:{port}/v1 (Ray Serve)",
        file=sys.stderr,
    )
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        stop()
    return 0
