"""Executors: where grid items run. Each has ``map(fn_path, keyed_items) -> iterator of
(key, records, error)`` in completion order, and ``close()``.

- InlineExecutor: this process, one item after another (no pool; can use a model already loaded).
- LocalExecutor: N worker processes (spawned), each loading the model once.
- RayExecutor: N Ray actors on a cluster (``address``: "auto", "ray://host:10001", or None for a
  local Ray), each holding the model; items are handed to whichever actor is free.
"""

from __future__ import annotations

import os

from .worker import ModelHolder, init_process, run_in_process

WORKER_DIED = (
    "{where} died (most often while loading the model: out of memory, or a folder that is not "
    "a model); run with --inline to see the error in this process."
)


class InlineExecutor:
    def __init__(self, model_name: str | None, threads: int | None = None, preloaded=None):
        self.holder = ModelHolder(model_name, threads, preloaded)

    def map(self, fn_path, keyed_items):
        for key, item in keyed_items:
            yield self.holder.run(fn_path, key, item)

    def close(self) -> None:
        pass


class LocalExecutor:
    def __init__(self, model_name: str | None, workers: int = 1, threads: int | None = None):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}.")
        threads = threads or max(1, (os.cpu_count() or 1) // workers)  # workers share the cores
        self.pool = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=init_process,
            initargs=(model_name, threads),
        )

    def map(self, fn_path, keyed_items):
        from concurrent.futures import as_completed
        from concurrent.futures.process import BrokenProcessPool

        futures = [self.pool.submit(run_in_process, fn_path, key, item) for key, item in keyed_items]
        try:
            for f in as_completed(futures):
                yield f.result()
        except BrokenProcessPool:
            raise ValueError(WORKER_DIED.format(where="a worker process")) from None

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)


class RayExecutor:
    def __init__(
        self,
        model_name: str | None,
        workers: int | None = None,
        threads: int | None = None,
        address: str | None = None,
        num_cpus: int | None = None,
    ):
        from .ray_init import ensure_ray

        self.started = ensure_ray(address, num_cpus)
        import ray

        self.ray = ray
        cpus = int(ray.cluster_resources().get("CPU", 1))
        workers = workers or max(1, cpus // (threads or 1))
        per_actor = max(1, cpus // workers)
        actor = ray.remote(num_cpus=per_actor)(ModelHolder)
        self.actors = [actor.remote(model_name, threads or per_actor) for _ in range(workers)]

    def map(self, fn_path, keyed_items):
        ray = self.ray
        todo = list(keyed_items)
        running = {}  # object ref -> actor
        idle = list(self.actors)
        while todo or running:
            while idle and todo:
                actor = idle.pop()
                key, item = todo.pop(0)
                running[actor.run.remote(fn_path, key, item)] = actor
            done, _ = ray.wait(list(running), num_returns=1)
            for ref in done:
                idle.append(running.pop(ref))
                try:
                    out = ray.get(ref)
                except ray.exceptions.RayActorError:
                    raise ValueError(WORKER_DIED.format(where="a Ray actor")) from None
                yield out

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []
        if self.started:
            self.ray.shutdown()


def make_executor(
    spec: str | None, model_name: str | None, workers: int | None = None, threads: int | None = None, preloaded=None
):
    """spec: "inline", "local" (default) or "ray[:ADDRESS]" ("ray:auto", "ray:ray://head:10001")."""
    spec = spec or "local"
    if model_name is not None and spec != "inline":
        from ..models import check_model

        check_model(model_name)  # here, not as a dead worker: BrokenProcessPool / RayActorError say nothing
    if spec == "inline":
        return InlineExecutor(model_name, threads, preloaded)
    if spec == "local":
        return LocalExecutor(model_name, workers or 1, threads)
    if spec == "ray" or spec.startswith("ray:"):
        return RayExecutor(model_name, workers, threads, address=spec[4:] or None)
    raise ValueError(f"unknown executor {spec!r}: use inline, local or ray[:ADDRESS].")
