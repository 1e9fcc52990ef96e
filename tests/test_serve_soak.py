"""The soak's verdict on an answer that differs from the same prompt answered alone
(``benchmarks/serve_soak.py``): a near-tie flip only when the batch's own measured noise explains
the split, else wrong."""

import math

import pytest
from benchmarks.serve_load import gauge_values
from benchmarks.serve_soak import classify, shared_noise, split_at, swing


def tok(t, lp, **top):
    return (t, lp, {t: lp, **top})


ALONE = [tok("Red", -0.1, Blue=-3.0), tok(",", -0.01, **{".": -5.0}), tok(" green", -0.70, **{" blue": -0.71})]


def test_split_and_noise_are_read_on_the_shared_tokens_only():
    got = [tok("Red", -0.1 + 3e-3, Blue=-3.0), tok(",", -0.01), tok(" blue", -0.69, **{" green": -0.71})]
    assert split_at(ALONE, ALONE) is None
    assert split_at(ALONE, got) == 2
    assert split_at(ALONE, ALONE[:2]) == 2  # one answer ending first is a split too
    # the split token's own logprob (-0.69 against -0.70) does not count as noise
    assert math.isclose(shared_noise(ALONE, got), 3e-3)


def test_a_split_the_noise_explains_is_a_near_tie_and_one_it_does_not_is_wrong():
    # alone: " green" over " blue" by 0.01; batched: " blue" over " green" by 0.02 -> swing 0.03
    flip = [tok("Red", -0.1 + 0.02, Blue=-3.0), tok(",", -0.01), tok(" blue", -0.69, **{" green": -0.71})]
    assert math.isclose(swing(ALONE, flip, 2), 0.03)
    a = "Red, green"
    judged = classify([(a, ALONE, a, ALONE), (a, ALONE, "Red, blue", flip)])
    assert judged["verdicts"] == ["same", "near-tie"]  # noise 0.02: a swing up to 0.04 is explained
    assert math.isclose(judged["noise"], 0.02)
    quiet = [tok("Red", -0.1 + 1e-3, Blue=-3.0), tok(",", -0.01), tok(" blue", -0.69, **{" green": -0.71})]
    assert classify([(a, ALONE, "Red, blue", quiet)])["verdicts"] == ["wrong"]  # noise 1e-3: 0.03 is not


def test_a_split_to_a_token_outside_the_top_or_the_same_tokens_in_another_text_is_wrong():
    far = [tok("Red", -0.1, Blue=-3.0), tok(".", -0.02, **{",": -4.0})]  # both listed, far apart
    assert swing(ALONE, far, 1) > 3.0
    unlisted = [tok("Red", -0.1, Blue=-3.0), tok("!", -0.5, **{"?": -0.6})]
    assert swing(ALONE, unlisted, 1) == math.inf
    judged = classify([("Red, green", ALONE, "Red!", unlisted), ("Red, green", ALONE, "Red,  green", ALONE)])
    assert judged["verdicts"] == ["wrong", "wrong"]
    assert judged["swings"][1] == math.inf


def test_gauges_are_read_by_name_and_summed_over_vllm_label_sets():
    page = (
        "# HELP x\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="a b"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="a b"} 0.5\n'
        "kvevict_kv_bytes_held 1024\n"
    )
    assert gauge_values(page, {"kv": ("vllm:kv_cache_usage_perc",)}) == {"kv": 0.75}
    assert gauge_values(page, {"kv": ("kvevict_kv_bytes_held",)}) == {"kv": 1024.0}
    assert gauge_values(page)["kv_bytes_held"] == 1024.0


def test_the_vllm_server_gets_the_same_model_folder_key_and_threads(tmp_path, monkeypatch):
    from benchmarks.serve_soak import KEY, args_parser, server_command

    import kvevict.fetch

    (tmp_path / "smollm2-135m").mkdir()
    (tmp_path / "smollm2-135m" / "config.json").write_text("{}")
    monkeypatch.setattr(kvevict.fetch, "cache_dir", lambda: tmp_path)
    a = args_parser().parse_args(["--server", "vllm", "--vllm-python", "/venv/bin/python", "--threads", "3"])
    cmd, env = server_command(a)
    assert cmd[:4] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert cmd[4] == str(tmp_path / "smollm2-135m")
    for flag, value in (("--served-model-name", "smollm2-135m"), ("--api-key", KEY), ("--port", "8765")):
        assert cmd[cmd.index(flag) + 1] == value
    assert env["OMP_NUM_THREADS"] == "3"
    cmd, _ = server_command(args_parser().parse_args(["--serve-args=--max-queue 4"]))
    assert cmd[-2:] == ["--max-queue", "4"] and "kvevict.cli" in cmd


def test_an_unknown_server_is_refused_with_the_choices(capsys):
    from benchmarks.serve_soak import args_parser

    with pytest.raises(SystemExit):
        args_parser().parse_args(["--server", "sglang"])
    err = capsys.readouterr().err
    assert "--server" in err and "'kvevict'" in err and "'vllm'" in err


def test_tree_rss_sums_a_process_and_its_children_and_is_zero_once_gone():
    import subprocess
    import sys

    import psutil
    from benchmarks.serve_load import tree_rss

    # both stay until the test kills them, however long the measuring takes
    stay = "import time; time.sleep(3600)"
    code = f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', {stay!r}]); print(c.pid, flush=True); {stay}"
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        own = psutil.Process(parent.pid).memory_info().rss
        assert tree_rss(parent.pid) >= own + psutil.Process(child).memory_info().rss * 0.5
        assert tree_rss(child) < tree_rss(parent.pid)
    finally:
        psutil.Process(child).kill()
        parent.kill()
        parent.wait()
    assert tree_rss(parent.pid) == 0


def test_a_chat_turn_carries_the_story_once_and_the_earlier_answers_in_order():
    from benchmarks.serve_soak import chat_turn, label

    first = chat_turn("A story.", [], "Who?")
    assert first == (("user", "A story.\n\nWho?"),)
    third = chat_turn("A story.", [("Who?", "The crow."), ("Where?", "A tree.")], "What?")
    assert [r for r, _ in third] == ["user", "assistant", "user", "assistant", "user"]
    assert third[0][1] == "A story.\n\nWho?" and third[2:] == (
        ("user", "Where?"),
        ("assistant", "A tree."),
        ("user", "What?"),
    )
    assert third[0] == first[0]  # a later turn begins as the earlier one did: its stored prefix
    assert label(third) == "[chat turn 3] What?" and label("plain prompt") == "plain prompt"
