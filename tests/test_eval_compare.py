import json

import pytest

from kvevict.eval.compare import main, paired
from kvevict.eval.records import load


def test_paired_difference_uses_only_shared_samples(tmp_path, capsys):
    rows = [
        ("h2o", "s1", 0.90),
        ("h2o", "s2", 0.80),
        ("h2o", "s3", 0.70),
        ("roco", "s1", 0.95),
        ("roco", "s2", 0.83),
        ("roco", "s4", 0.10),
        ("full", "s1", 1.0),
    ]
    with open(tmp_path / "records.jsonl", "w") as f:
        for pol, sample, top1 in rows:
            f.write(
                json.dumps(
                    {
                        "model": "m",
                        "task": "ppl",
                        "policy": pol,
                        "budget": None if pol == "full" else 0.2,
                        "sample": sample,
                        "scores": {"top1": top1},
                    }
                )
                + "\n"
            )
    ci = paired(load(tmp_path), "ppl", "roco", "h2o", 0.2, "top1")
    assert ci.n == 2 and abs(ci.mean - 0.04) < 1e-9  # (0.05 + 0.03) / 2; s3 and s4 are unpaired
    main([str(tmp_path), "--task", "ppl", "--budget", "0.2", "--metric", "top1", "roco:h2o"])
    assert "ppl top1 roco - h2o @ 0.2: +0.04 [" in capsys.readouterr().out
    main([str(tmp_path), "--task", "ppl", "--budget", "0.4", "--metric", "top1", "roco:h2o"])
    assert "roco - h2o @ 0.4: no shared samples" in capsys.readouterr().out
    main([str(tmp_path), "--task", "ppl", "--budget", "0.2", "--metric", "top1", "roco:full"])
    # the full cache's records (budget None) pair with any budget
    assert "roco - full @ 0.2: -0.05 n=1" in capsys.readouterr().out
    # a policy at its own budget: two cells at different budgets pair by sample
    with open(tmp_path / "records.jsonl", "a") as f:
        for sample, top1 in (("s1", 0.5), ("s2", 0.6)):
            f.write(
                json.dumps(
                    {
                        "model": "m",
                        "task": "ppl",
                        "policy": "h2o/int8",
                        "budget": 0.33,
                        "sample": sample,
                        "scores": {"top1": top1},
                    }
                )
                + "\n"
            )
    ci = paired(load(tmp_path), "ppl", "h2o/int8@0.33", "h2o", 0.2, "top1")
    assert ci.n == 2 and ci.mean == pytest.approx(-0.3)  # (0.5 - 0.9 + 0.6 - 0.8) / 2
    main([str(tmp_path), "--task", "ppl", "--budget", "0.2", "--metric", "top1", "h2o/int8@0.33:h2o"])
    assert "h2o/int8@0.33 - h2o @ 0.2: -0.3 [" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--task", "ppl", "--budget", "0.2", "--metric", "top1", "h2o/int8@lots:h2o"])
    assert "after @ comes the cell's budget as a number" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--task", "ppl", "--budget", "0.2", "--metric", "top1", "h2o:nobody"])
    err = capsys.readouterr().err
    assert "policy 'nobody'" in err and "it has: full, h2o, h2o/int8, roco" in err


def test_paired_keeps_two_models_apart(tmp_path, capsys):
    """The same sample ids under two models must not collide: each model pairs with itself."""
    with open(tmp_path / "records.jsonl", "w") as f:
        for model, h2o, roco in (("m1", 0.5, 0.6), ("m2", 0.9, 0.7)):
            for pol, v in (("h2o", h2o), ("roco", roco)):
                for sample, shift in (("s1", 0.0), ("s2", 0.1)):
                    f.write(
                        json.dumps(
                            {
                                "model": model,
                                "task": "ppl",
                                "policy": pol,
                                "budget": 0.2,
                                "sample": sample,
                                "scores": {"top1": v + shift},
                            }
                        )
                        + "\n"
                    )
    recs = load(tmp_path)
    assert paired(recs, "ppl", "roco", "h2o", 0.2, "top1", model="m1").mean == pytest.approx(0.1)
    assert paired(recs, "ppl", "roco", "h2o", 0.2, "top1", model="m2").mean == pytest.approx(-0.2)
    with pytest.raises(ValueError, match="several models \\(m1, m2\\); say which with --model"):
        paired(recs, "ppl", "roco", "h2o", 0.2, "top1")
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--task", "ppl", "--budget", "0.2", "--metric", "top1", "roco:h2o"])
    assert "--model" in capsys.readouterr().err
    main([str(tmp_path), "--task", "ppl", "--budget", "0.2", "--metric", "top1", "--model", "m2", "roco:h2o"])
    assert "roco - h2o @ 0.2: -0.2 [" in capsys.readouterr().out


def test_a_baseline_run_pairs_with_this_one_sample_by_sample(tmp_path, capsys):
    """Two runs of the same samples (two versions of a rule): --baseline names the other's policies base.NAME."""
    for run, shift in (("new", 0.0), ("old", 0.1)):
        (tmp_path / run).mkdir()
        with open(tmp_path / run / "records.jsonl", "w") as f:
            for sample, nll in (("s1", 3.0), ("s2", 2.0), ("s3", 4.0)):
                f.write(
                    json.dumps(
                        {
                            "model": "m",
                            "task": "ppl",
                            "policy": "full",
                            "budget": None,
                            "sample": sample,
                            "scores": {"nll": nll},
                        }
                    )
                    + "\n"
                )
                if sample != "s3" or run == "new":  # s3 only in the new run: unpaired
                    f.write(
                        json.dumps(
                            {
                                "model": "m",
                                "task": "ppl",
                                "policy": "mem",
                                "budget": 0.2,
                                "sample": sample,
                                "scores": {"nll": nll + 0.01 + shift},
                            }
                        )
                        + "\n"
                    )
    args = [
        str(tmp_path / "new"),
        "--baseline",
        str(tmp_path / "old"),
        "--task",
        "ppl",
        "--budget",
        "0.2",
        "--metric",
        "nll",
    ]
    main(args + ["mem:base.mem", "base.full:full", "base.mem:full"])
    out = capsys.readouterr().out
    assert "mem - base.mem @ 0.2: -0.1 [" in out and "n=2" in out
    assert "base.full - full @ 0.2: +0 [+0, +0] n=3" in out and "base.mem - full @ 0.2: +0.11 [" in out
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main(args[:1] + ["--baseline", str(tmp_path / "empty")] + args[3:] + ["mem:base.mem"])
    assert "no records in --baseline" in capsys.readouterr().err
