"""Scale-out on a local Ray instance (loopback only, 2 CPUs): the grid executor's actors give the
same records as in-process, and ``serve --replicas 2`` answers through Ray Serve like one server."""

import json
import time
import urllib.request

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytest.importorskip("ray.serve")

from kvevict.distributed import RayExecutor, read_records, run_grid  # noqa: E402
from kvevict.serve.server import free_port  # noqa: E402
from serve_helpers import DEADLINE  # noqa: E402
from tiny_chat_model import save_tiny_chat_model  # noqa: E402

FN = "kvevict.distributed.passkey_task:run"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny_chat_model(tmp_path_factory.mktemp("tiny-ray")))


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    assert ray.util.get_node_ip_address() == "127.0.0.1"  # loopback only (conftest's RAY_ variables)
    yield
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def _start_replicas(*args, **kwargs):
    """``replicas.start``, again while Ray Serve's own 60 s wait for its proxy runs out (the proxy
    goes on starting); the test skips, saying so, if the proxy is not up within the deadline."""
    from kvevict.serve import replicas

    deadline = time.monotonic() + DEADLINE
    while True:
        try:
            return replicas.start(*args, **kwargs)
        except TimeoutError as err:  # Ray Serve's "proxies not available after 60s"
            if time.monotonic() > deadline:
                pytest.skip(f"Ray Serve could not start its HTTP proxy on this machine in {DEADLINE:g} s: {err}")


def test_ray_actors_run_the_grid_like_one_process(folder, tmp_path, local_ray):
    grid = [
        {
            "policy": p,
            "budget": None if p == "full" else 16,
            "tokens": 60,
            "depth": d,
            "haystack": "filler",
            "max_new_tokens": 4,
        }
        for p in ("full", "h2o", "recency")
        for d in (0.0, 1.0)
    ]
    run_grid(grid, FN, folder, tmp_path / "inline.jsonl", executor="inline", progress=False)
    ex = RayExecutor(folder, workers=2, threads=1)
    try:
        s = run_grid(grid[:4], FN, folder, tmp_path / "ray.jsonl", executor=ex, progress=False)
        assert s.done == 4 and not s.failed
        assert len(ex.actors) == 2  # one model-holding actor per worker
        s = run_grid(grid, FN, folder, tmp_path / "ray.jsonl", executor=ex, progress=False)  # resumes
        assert (s.done, s.skipped) == (2, 4)
    finally:
        ex.close()
    key = lambda r: (r["grid_key"], r["text"], r["kv_bytes"], r["full_kv_bytes"])  # noqa: E731
    assert sorted(map(key, read_records(tmp_path / "ray.jsonl"))) == sorted(
        map(key, read_records(tmp_path / "inline.jsonl"))
    )


def test_two_replicas_under_ray_serve_behind_one_openai_api(folder, local_ray):
    port = free_port()
    settings = dict(model_id="tiny", policy="h2o", budget=8, max_tokens=8)
    _start_replicas(folder, settings, 2, "127.0.0.1", port, threads=1, cpus_per_replica=0.5)
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=url + "/v1", api_key="t", max_retries=0, timeout=DEADLINE)
    messages = [{"role": "user", "content": "Hello from Ray."}]
    answers = {
        client.chat.completions.create(model="tiny", messages=messages).choices[0].message.content for _ in range(4)
    }
    assert len(answers) == 1  # the same weights and greedy decoding on every replica
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model="tiny", messages=messages, stream=True)
        if c.choices
    )
    assert {streamed} == answers
    with pytest.raises(openai.BadRequestError, match="kv_budget"):
        client.chat.completions.create(model="tiny", messages=messages, extra_body={"kv_budget": -1})
    pids = set()
    for _ in range(20):  # both replicas take requests
        with urllib.request.urlopen(url + "/health", timeout=DEADLINE) as r:
            pids.add(json.load(r)["pid"])
    assert len(pids) == 2
