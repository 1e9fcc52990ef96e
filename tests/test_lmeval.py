"""kvevict as an lm-evaluation-harness model, end to end on a tiny random model with a tokenizer:
scores against the stock model's, stop strings, bad model_args, and the CLI on local tasks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

import kvevict  # noqa: E402
from conftest import DEADLINE  # noqa: E402
from kvevict.cli import main as kvevict_main  # noqa: E402
from kvevict.eval.streaming import continuation_logprob  # noqa: E402
from kvevict.lmeval import register  # noqa: E402
from tiny_chat_model import save_tiny_chat_model  # noqa: E402

KvevictLM = register()

PAIRS = [
    ("The cat sat on the", " mat"),
    ("Hello", " world, how are you"),
    ("Abc def ghi jkl mno", " p"),
    ("Q: 2+2=", " 4"),
    ("A much longer context that goes on and on for a while", " and then ends."),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def stock(folder):
    model, tok = kvevict.load_model(folder)
    model.set_attn_implementation("sdpa")  # plain transformers, no kvevict cache or attention
    return model, tok


def _ll(pairs):
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


@torch.no_grad()
def _stock_logprob(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    ids = torch.tensor([ctx + cont])
    lp = torch.log_softmax(model(ids).logits[0].float(), -1)[len(ctx) - 1 : -1]
    target = torch.tensor(cont)
    return lp.gather(1, target[:, None]).sum().item(), bool((lp.argmax(-1) == target).all())


def _encode(tok, ctx, cont):
    whole = tok.encode(ctx + cont, add_special_tokens=False)
    n = len(tok.encode(ctx, add_special_tokens=False))
    return whole[:n], whole[n:]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_loglikelihood_with_a_covering_budget_equals_the_stock_model(folder, stock, batch_size):
    lm = KvevictLM(pretrained=folder, policy="h2o", budget=256, batch_size=batch_size)
    got = lm.loglikelihood(_ll(PAIRS), disable_tqdm=True)
    model, tok = stock
    for (ctx, cont), (lp, greedy) in zip(PAIRS, got):
        want_lp, want_greedy = _stock_logprob(model, *_encode(tok, ctx, cont))
        assert lp == pytest.approx(want_lp, abs=1e-4)
        assert greedy == want_greedy
    b = lm.get_model_info()["kvevict"]["bytes"]["loglikelihood"]
    assert b["requests"] == len(PAIRS) and b["kv_bytes_max"] > 0 and b["full_kv_bytes_max"] > 0


def test_a_small_budget_evicts_the_context_as_continuation_scoring_does(folder, stock):
    lm = KvevictLM(pretrained=folder, policy="h2o", budget=6, batch_size=1)
    got = lm.loglikelihood(_ll(PAIRS), disable_tqdm=True)
    model, tok = stock
    differs = 0
    for (ctx, cont), (lp, _) in zip(PAIRS, got):
        c, x = _encode(tok, ctx, cont)
        want = continuation_logprob(lm.model, torch.tensor([c]), torch.tensor([x]), "h2o", 6)
        assert lp == pytest.approx(want, abs=1e-4)
        differs += abs(lp - _stock_logprob(model, c, x)[0]) > 1e-3
    assert differs >= 3  # contexts longer than 6 tokens lost some of them
    b = lm.get_model_info()["kvevict"]["bytes"]["loglikelihood"]
    assert b["kv_share"] < 1.0 and b["kv_bytes_max"] < b["full_kv_bytes_max"]


def test_a_memory_budget_holds_at_most_that_share_of_the_bytes(folder, stock):
    # contexts past the memory plan's short-prompt floor (128 tokens kept whole), so they are compressed
    pairs = [(c + ". " + "Words go on and on here. " * 12, x) for c, x in PAIRS]
    lm = KvevictLM(pretrained=folder, memory=0.2, batch_size=2)
    got = lm.loglikelihood(_ll(pairs), disable_tqdm=True)
    model, tok = stock
    assert any(abs(lp - _stock_logprob(model, *_encode(tok, c, x))[0]) > 1e-4 for (c, x), (lp, _) in zip(pairs, got))
    b = lm.get_model_info()["kvevict"]["bytes"]["loglikelihood"]
    # at most that share, or what the plan's short-prompt floor keeps of the shortest context (MIN_TOKENS
    # tokens: MAS's three tiers, floored, keep int8 alone; 8 dims, one statistic per slot), against
    # 16-bit K + V per token
    from kvevict.memory import MIN_TOKENS
    from kvevict.storage import Storage

    shortest = min(len(_encode(tok, c, x)[0]) for c, x in pairs)
    floor = MIN_TOKENS * Storage(kv_bits=8, group=8).slot_bytes(8, 8, 4, 2) / (shortest * 2 * 8 * 2)
    assert 0.05 < b["kv_share"] <= max(0.2, floor) < 0.5


def test_kvzip_is_recorded_on_each_context(folder):
    lm = KvevictLM(pretrained=folder, policy="kvzip-pool", budget=12, batch_size=4)  # one request per batch
    got = lm.loglikelihood(_ll(PAIRS[:3]), disable_tqdm=True)
    from kvevict.eval.caches import new_cache

    for (ctx, cont), (lp, _) in zip(PAIRS[:3], got):
        c, x = _encode(lm.tokenizer, ctx, cont)
        c, x = torch.tensor([c]), torch.tensor([x])
        cache = new_cache(lm.model, "kvzip-pool", 12, prompt=c, tokenizer=lm.tokenizer)
        with torch.no_grad():
            logits = lm.model(c, cache=cache).logits[0, -1]
            want = 0.0
            for i in range(x.shape[1]):
                want += torch.log_softmax(logits.float(), -1)[x[0, i]].item()
                logits = lm.model(x[:, i : i + 1], cache=cache).logits[0, -1]
        assert lp == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("max_length", [4096, 24])
def test_rolling_loglikelihood_with_a_covering_budget_equals_the_stock_model(folder, stock, max_length):
    text = "Some text to score, with a few words in it. " * 2
    lm = KvevictLM(pretrained=folder, budget=256, chunk=7, max_length=max_length, batch_size=2)
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)[0]
    model, tok = stock
    tokens = tok.encode(text, add_special_tokens=False)
    windows = list(map(make_disjoint_window, get_rolling_token_windows(tokens, tok.eos_token_id, max_length, 1)))
    assert (len(windows) > 1) == (max_length < len(tokens))
    want = sum(_stock_logprob(model, c, x)[0] for c, x in windows)
    assert got == pytest.approx(want, abs=1e-3)


def _gen(prompts, until, max_gen_toks):
    return [
        Instance("generate_until", {}, (p, {"until": until, "max_gen_toks": max_gen_toks, "do_sample": False}), i)
        for i, p in enumerate(prompts)
    ]


def test_generate_until_is_greedy_batched_and_stops_at_its_stop_strings(folder, stock):
    prompts = ["Hello there", "A longer prompt than the first one"]
    lm = KvevictLM(pretrained=folder, budget=256, batch_size=2)
    free = lm.generate_until(_gen(prompts, [], 12), disable_tqdm=True)
    model, tok = stock
    for p, text in zip(prompts, free):  # the stock model's own greedy answer, one prompt at a time
        ids = tok(p, return_tensors="pt")["input_ids"]
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id
        )
        assert text == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        assert 0 < len(tok.encode(text, add_special_tokens=False)) <= 12
    stops = []
    for text in free:  # a stop string that first occurs past the answer's start
        k = next(k for k in range(1, len(text) - 1) if text.find(text[k : k + 2]) == k)
        stops.append(text[k : k + 2])
    cut = lm.generate_until(_gen(prompts, stops, 12), disable_tqdm=True)
    for text, got in zip(free, cut):
        first = min(text.find(s) for s in stops if s in text)
        assert got == text[:first] and len(got) < len(text)
    assert lm.get_model_info()["kvevict"]["bytes"]["generate_until"]["requests"] == 4


def test_a_bad_model_arg_is_a_clear_error(folder):
    with pytest.raises(ValueError, match=r"unknown model_args budgett .*allowed: pretrained, policy, budget"):
        KvevictLM.create_from_arg_string(f"pretrained={folder},budgett=3")
    with pytest.raises(ValueError, match=r"parameters of policy 'streamingllm': recent, sinks"):
        KvevictLM.create_from_arg_string(f"pretrained={folder},policy=streamingllm,window=3")
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        KvevictLM.create_from_arg_string(f"pretrained={folder},policy=nope")
    with pytest.raises(ValueError, match="float budget"):
        KvevictLM.create_from_arg_string(f"pretrained={folder},budget=1.5")
    with pytest.raises(ValueError, match="batch_size auto"):
        KvevictLM(pretrained=folder, batch_size="auto")


def _tasks(root: Path) -> Path:
    """A multiple-choice task and a generate_until task over local jsonl files (offline)."""
    root.mkdir(parents=True, exist_ok=True)
    mc = [
        ("The sky is", [" blue", " green", " loud"], 0),
        ("Two plus two is", [" four", " five"], 0),
        ("Cats say", [" meow", " moo"], 0),
    ]
    gen = [("Say hi:", "hi"), ("Count: 1 2 3", "4"), ("Name a colour:", "red")]
    (root / "mc.jsonl").write_text(
        "".join(json.dumps({"question": q, "choices": c, "label": lab}) + "\n" for q, c, lab in mc)
    )
    (root / "gen.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in gen))
    (root / "tiny_mc.yaml").write_text(
        "task: kvevict_tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (root / "tiny_gen.yaml").write_text(
        "task: kvevict_tiny_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'gen.jsonl'}\ntest_split: test\noutput_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["a"]\n  max_gen_toks: 10\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return root


def test_the_cli_runs_local_tasks_and_prints_the_bytes(folder, tmp_path, capsys):
    tasks = _tasks(tmp_path / "tasks")
    out = tmp_path / "out"
    rc = kvevict_main(
        [
            "lm-eval",
            "--model",
            "kvevict",
            "--model_args",
            f"pretrained={folder},policy=h2o,budget=8",
            "--tasks",
            "kvevict_tiny_mc,kvevict_tiny_gen",
            "--include_path",
            str(tasks),
            "--output_path",
            str(out),
            "--log_samples",
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0
    assert "kvevict_tiny_mc" in printed and "kvevict_tiny_gen" in printed and "exact_match" in printed
    assert "kvevict KV cache: policy=h2o budget=8" in printed
    assert "loglikelihood: 7 requests" in printed and "generate_until: 3 requests" in printed
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    info = results["config"]["kvevict"]
    assert info["budget"] == 8 and info["bytes"]["loglikelihood"]["requests"] == 7
    assert 0 < info["bytes"]["generate_until"]["kv_share"] < 1  # 8 tokens kept of longer prompts
    answers = [json.loads(line)["resps"][0][0] for line in next(out.rglob("samples_kvevict_tiny_gen_*.jsonl")).open()]
    assert len(answers) == 3 and all("a" not in a for a in answers)  # cut at the task's stop string


def test_registering_keeps_lm_evals_own_models():
    from lm_eval.api.registry import get_model, model_registry

    assert get_model("kvevict") is KvevictLM
    assert "hf" in model_registry and "dummy" in model_registry  # lm-eval imports them only into an empty registry


def test_python_m_checks_model_args_before_lm_eval_starts(folder, tmp_path):
    tasks = _tasks(tmp_path)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(kvevict.__file__).parents[1]), os.environ.get("PYTHONPATH")])
        ),
    }
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvevict.lmeval",
            "--model",
            "kvevict",
            "--model_args",
            f"pretrained={folder},bogus=1",
            "--tasks",
            "kvevict_tiny_mc",
            "--include_path",
            str(tasks),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=DEADLINE,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert "kvevict lm-eval: error: unknown model_args bogus" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_memory_budget_picks_the_policy_per_request_type(folder):
    from kvevict.lmeval.args import parse_settings
    from kvevict.lmeval.cli import bytes_lines

    s = parse_settings({"pretrained": folder, "memory": 0.2})
    assert s.policy is None
    assert [s.policy_for(k) for k in ("generate_until", "loglikelihood", "loglikelihood_rolling")] == [
        "kvzip-pool",
        "kvzip-pool",
        "mas",
    ]  # the whole context known before decoding, or streamed
    assert parse_settings({"pretrained": folder, "memory": 0.2, "batch_size": 4}).policy_for("loglikelihood") == "mas"
    assert parse_settings({"pretrained": folder}).policy_for("generate_until") == "h2o"  # a token budget
    assert parse_settings({"pretrained": folder, "memory": 0.2, "policy": "tova"}).policy_for("loglikelihood") == "tova"
    lm = KvevictLM(pretrained=folder, memory=0.2)
    lm.loglikelihood(_ll(PAIRS[:1]), disable_tqdm=True)
    info = lm.get_model_info()
    # with the model known: no probe for it, so KVzip over a sample of each context (from 20%)
    assert info["kvevict"]["policies"] == {"loglikelihood": "kvzip-sample"}
    assert bytes_lines(info)[1].startswith("  loglikelihood [kvzip-sample]: 1 requests")
