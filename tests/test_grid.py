"""The grid executor: records merged into one JSONL, resume by skipping done items, failures
retried on the next run, and the same records from worker processes as in-process."""

import json

import pytest

from kvevict.distributed import item_key, read_records, run_grid
from tiny_chat_model import save_tiny_chat_model

FN = "kvevict.distributed.passkey_task:run"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny_chat_model(tmp_path_factory.mktemp("tiny-grid")))


def items(policies=("full", "h2o", "recency"), depths=(0.0, 1.0)):
    return [
        {
            "policy": p,
            "budget": None if p == "full" else 16,
            "tokens": 60,
            "depth": d,
            "haystack": "filler",
            "max_new_tokens": 4,
        }
        for p in policies
        for d in depths
    ]


def comparable(records):
    return sorted((r["grid_key"], r["text"], r["kv_bytes"], r["full_kv_bytes"], r["prompt_tokens"]) for r in records)


def test_inline_grid_writes_one_record_per_item_and_resumes(folder, tmp_path):
    out = tmp_path / "grid.jsonl"
    grid = items()
    s = run_grid(grid, FN, folder, out, executor="inline", progress=False)
    assert (s.done, s.skipped, s.records, s.failed) == (6, 0, 6, {})
    recs = read_records(out)
    assert sorted(r["grid_key"] for r in recs) == sorted(item_key(i) for i in grid)
    by_policy = {r["policy"]: r for r in recs}
    # the fp32 stock cache holds twice the 16-bit one every ratio is stated against
    assert by_policy["h2o"]["kv_bytes"] < by_policy["full"]["kv_bytes"] == 2 * by_policy["full"]["full_kv_bytes"]
    assert all(r["answer"].isdigit() and isinstance(r["found"], bool) for r in recs)
    # a second run does nothing; losing two lines (and a torn last line) reruns exactly those two
    s = run_grid(grid + grid[:2], FN, folder, out, executor="inline", progress=False)
    assert (s.done, s.skipped) == (0, 6)
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[2:]) + "\n" + lines[0][:20])
    s = run_grid(grid, FN, folder, out, executor="inline", progress=False)
    assert (s.done, s.skipped) == (2, 4)
    assert comparable(read_records(out)) == comparable(recs)


def test_a_failing_item_is_reported_not_written_and_retried(folder, tmp_path):
    out = tmp_path / "grid.jsonl"
    grid = items(("h2o",), (0.5,)) + [
        {"policy": "no-such-policy", "budget": 16, "tokens": 60, "depth": 0.5, "haystack": "filler"}
    ]
    s = run_grid(grid, FN, folder, out, executor="inline", progress=False)
    assert s.done == 2 and s.records == 1 and list(s.failed) == [item_key(grid[1])]
    assert "unknown policy 'no-such-policy'" in s.failed[item_key(grid[1])]
    assert run_grid(grid, FN, folder, out, executor="inline", progress=False).done == 1  # retried


def test_local_worker_processes_give_the_same_records(folder, tmp_path):
    grid = items(("full", "h2o"), (0.0, 1.0))
    run_grid(grid, FN, folder, tmp_path / "inline.jsonl", executor="inline", progress=False)
    s = run_grid(grid, FN, folder, tmp_path / "local.jsonl", executor="local", workers=2, threads=1, progress=False)
    assert s.done == 4 and not s.failed
    assert comparable(read_records(tmp_path / "local.jsonl")) == comparable(read_records(tmp_path / "inline.jsonl"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(fn="no_colon_path"), "'package.module:function'"),
        (dict(fn="kvevict.nothing_here:run"), "cannot import"),
        (dict(executor="slurm"), "unknown executor 'slurm'"),
    ],
)
def test_bad_grid_arguments_fail_clearly(folder, tmp_path, kwargs, message):
    args = dict(
        items=items(("h2o",), (0.0,)), fn=FN, model=folder, out=tmp_path / "g.jsonl", executor="inline", progress=False
    )
    args.update(kwargs)
    if args["fn"] != FN:  # a bad path is the item's error (a worker imports it), reported per item
        s = run_grid(**args)
        assert message in next(iter(s.failed.values()))
    else:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            run_grid(**args)


def test_records_are_json_lines_with_the_item_fields(folder, tmp_path):
    out = tmp_path / "g.jsonl"
    run_grid(items(("recency",), (0.5,)), FN, folder, out, executor="inline", progress=False)
    rec = json.loads(out.read_text().splitlines()[0])
    assert {"policy", "budget", "tokens", "depth", "grid_key", "text", "kv_bytes"} <= set(rec)


def test_kvevict_sweep_runs_prints_a_table_and_resumes(folder, tmp_path, capsys):
    from kvevict.cli import main

    argv = [
        "sweep",
        "--model",
        folder,
        "--inline",
        "--haystack",
        "filler",
        "--tokens",
        "40",
        "--depths",
        "0.5",
        "--policies",
        "full,h2o",
        "--budgets",
        "16",
        "--out",
        str(tmp_path / "s.jsonl"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 items: 2 run now (inline), 0 already" in out
    assert [line.split()[:3] for line in out.splitlines()[2:]] == [["full", "-", "1"], ["h2o", "16", "1"]]
    assert main(argv) == 0 and "0 run now (inline), 2 already" in capsys.readouterr().out
    assert main([*argv[:-6], "--depths", "1.5", "--out", str(tmp_path / "s.jsonl")]) == 2
    assert "--depths must be in [0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--budgets", "1.5", "(0, 1]"),
        ("--budgets", "0", "budget"),
        ("--tokens", "5k", "--tokens takes comma-separated integers"),
    ],
)
def test_kvevict_sweep_bad_numbers_fail_before_any_worker(tmp_path, capsys, flag, value, message):
    from kvevict.cli import main

    argv = [
        "sweep",
        "--model",
        str(tmp_path / "no-model-here"),
        "--inline",
        "--out",
        str(tmp_path / "s.jsonl"),
        flag,
        value,
    ]
    assert main(argv) == 2  # the model folder does not exist: failing here means nothing was loaded
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_a_bad_model_under_worker_processes_is_one_clear_line(tmp_path, capsys):
    """Checked in the parent, before any worker: not BrokenProcessPool."""
    from kvevict.cli import main

    argv = [
        "sweep",
        "--model",
        str(tmp_path / "no-model-here"),
        "--workers",
        "2",
        "--out",
        str(tmp_path / "s.jsonl"),
        "--policies",
        "h2o",
        "--budgets",
        "0.5",
        "--tokens",
        "64",
        "--depths",
        "0.5",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown model" in err and "no-model-here" in err


def test_a_worker_that_dies_loading_the_model_is_a_clear_error(tmp_path):
    """A folder that passes the cheap check but is not a model: the worker dies in its initializer."""
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="a worker process died .*--inline to see the error"):
        run_grid(
            items(("recency",), (0.5,)),
            FN,
            str(bad),
            tmp_path / "out.jsonl",
            executor="local",
            workers=1,
            threads=1,
            progress=False,
        )
