"""`kvevict eval` / `kvevict inspect` bad input: one clear line naming what to change, exit 2,
before any model loads."""

import pytest

import kvevict
from kvevict.cli import main
from kvevict.eval.caches import policy_names


@pytest.mark.parametrize(
    "argv, words",
    [
        (["eval", "--policies", "h2o,nope"], ["unknown policy 'nope'", "known policies:", "h2o"]),
        (["eval", "--tasks", "ppl,bogus"], ["unknown task 'bogus'", "known tasks:", "passkey", "xsum"]),
        (["eval", "--budgets", "1.5"], ["(0, 1]"]),
        (["eval", "--budgets", "abc"], ["budget must be"]),
        (["eval", "--samples", "0"], ["--samples"]),
        (["eval", "--samples", "5", "--first-sample", "5"], ["--first-sample", "[0, 5)"]),
        (["eval", "--first-sample", "-1"], ["--first-sample"]),
        (["eval", "--depths", "0.5,2"], ["--depths"]),
        (["eval", "--lengths", "1k"], ["--lengths"]),
        (["eval", "--lengths", ","], ["--lengths", "at least 128"]),
        (["eval", "--lengths", "1024,20"], ["--lengths", "at least 128"]),
        (["eval", "--depths", ""], ["--depths"]),
        (["inspect", "--text", "/nonexistent/file.txt"], ["does not exist"]),
        (["inspect", "--text", __file__, "--policy", "nope"], ["unknown policy 'nope'", "known policies:"]),
    ],
)
def test_bad_input_is_one_clear_line(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    for w in words:
        assert w in err


def test_policy_names_all_takes_every_registered_policy_once():
    names = policy_names("all", kvevict.POLICIES)
    assert len(names) == len(set(kvevict.POLICIES[n] for n in names))
    assert {kvevict.POLICIES[n] for n in names} == set(kvevict.POLICIES.values())
    assert "h2o" in names
    assert policy_names("H2O, full,h2o", kvevict.POLICIES) == ["h2o"]
    with pytest.raises(ValueError, match="at least one policy besides full.*--policies full runs the peer alone"):
        policy_names("full", kvevict.POLICIES)
    assert policy_names("full", kvevict.POLICIES, full_alone=True) == []  # a peer's presses beside the full cache
    assert policy_names("h2o,full", kvevict.POLICIES, full_alone=True) == ["h2o"]
    with pytest.raises(ValueError, match="at least one policy"):
        policy_names(" , ", kvevict.POLICIES, full_alone=True)  # nothing named is still an error


def test_eval_policies_full_alone_is_refused_without_a_peer_and_parsed_with_one():
    from kvevict.cli import build_parser
    from kvevict.commands.eval import parse_args

    base = ["eval", "--policies", "full", "--budgets", "0.5", "--tasks", "passkey"]
    with pytest.raises(ValueError, match="besides full"):
        parse_args(build_parser().parse_args(base))
    policies, budgets, *_ = parse_args(build_parser().parse_args(base + ["--peer", "kvpress"]))
    assert policies == [] and budgets == [0.5]


def test_summary_only_reads_existing_records(tmp_path, capsys):
    import json

    rec = {"model": "m", "task": "passkey", "policy": "full", "budget": None, "sample": "s1", "scores": {"em": 1.0}}
    (tmp_path / "records.jsonl").write_text(json.dumps(rec) + "\n")
    assert main(["eval", "--model", "m", "--summary-only", "--out", str(tmp_path)]) == 0
    assert "## passkey" in capsys.readouterr().out
    assert (tmp_path / "passkey.png").exists()
