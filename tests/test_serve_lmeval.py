"""lm-eval's ``local-completions`` model pointed at ``kvevict serve`` (echo + logprobs,
the API key from OPENAI_API_KEY) scores a local multiple-choice task with the log-likelihoods
``kvevict lm-eval`` computes directly on the same full cache, request by request."""

import json

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("openai")
pytest.importorskip("tenacity")  # lm-eval[api]: its API models need it

from kvevict.serve.server import ServerThread, build  # noqa: E402
from serve_helpers import DEFAULTS, folder  # noqa: E402,F401
from test_lmeval import _tasks  # noqa: E402


def _logliks(out) -> dict:
    """(doc id, choice) -> (log-likelihood, is_greedy) from lm-eval's logged samples."""
    return {(s["doc_id"], i): tuple(r[0]) for s in out["samples"]["kvevict_tiny_mc"] for i, r in enumerate(s["resps"])}


def test_lm_eval_local_completions_through_the_server_matches_kvevict_lm_eval(folder, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate

    from kvevict.lmeval import register

    register()
    tasks = _tasks(tmp_path / "tasks")
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks))
    direct = simple_evaluate(
        model="kvevict",
        model_args=f"pretrained={folder},policy=full",
        tasks=["kvevict_tiny_mc"],
        task_manager=manager,
        log_samples=True,
    )
    monkeypatch.setenv("OPENAI_API_KEY", "lm-eval-key")  # local-completions sends it as the Bearer token
    app, engine = build(folder, {**DEFAULTS, "policy": "full", "api_key": "lm-eval-key"})
    with ServerThread(app) as srv:
        served = simple_evaluate(
            model="local-completions",
            tasks=["kvevict_tiny_mc"],
            task_manager=manager,
            log_samples=True,
            model_args=f"model={DEFAULTS['model_id']},base_url={srv.url}/v1/completions,tokenizer={folder},"
            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=2,max_retries=1",
        )
    want, got = _logliks(direct), _logliks(served)
    assert len(got) == len(want) == 7 and got.keys() == want.keys()
    for key in want:
        assert abs(got[key][0] - want[key][0]) < 1e-4, (key, got[key], want[key])
        assert got[key][1] == want[key][1]  # is_greedy, from top_logprobs
    acc = [r["results"]["kvevict_tiny_mc"]["acc,none"] for r in (direct, served)]
    assert acc[0] == acc[1]
    assert engine.metrics.get("kvevict_requests_total", outcome="completed") == 7
    json.dumps(served["results"])  # a plain result, as lm-eval writes it
