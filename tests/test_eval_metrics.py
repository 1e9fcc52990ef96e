"""Each metric and interval against values computed by hand."""

import math

import pytest
import torch

from kvevict.eval import intervals, metrics


def test_perplexity_is_exp_of_mean_nll():
    assert metrics.perplexity(2 * math.log(4.0), 2) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        metrics.perplexity(1.0, 0)


def test_token_nll_of_uniform_and_peaked_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, 0.0, 0.0]])
    nll = metrics.token_nll(logits, torch.tensor([2, 0]))
    # uniform over 4: -log(1/4); peaked: p(0) = 3 / (3 + 1 + 1 + 1) = 1/2
    assert nll.tolist() == pytest.approx([math.log(4.0), math.log(2.0)])


def test_top1_agreement_counts_matching_argmax():
    ref = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 5.0]])
    got = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    assert metrics.top1_agreement(got, ref).tolist() == [1.0, 0.0, 1.0]


def test_kl_divergence_by_hand():
    # ref = (1/2, 1/2), p = (3/4, 1/4): KL = 1/2 log(2/3) + 1/2 log(2)
    ref = torch.tensor([[0.0, 0.0]])
    p = torch.tensor([[math.log(3.0), 0.0]])
    want = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert metrics.kl_divergence(p, ref).item() == pytest.approx(want, abs=1e-6)
    assert metrics.kl_divergence(ref, ref).item() == pytest.approx(0.0, abs=1e-7)


def test_exact_match_is_containment_of_the_answer():
    assert metrics.exact_match("The pass key is 48213.", "48213") == 1.0
    assert metrics.exact_match("48231", "48213") == 0.0


def test_token_f1_by_hand_and_max_over_references():
    # pred "the cat sat" -> [cat, sat]; ref "a cat sat down" -> [cat, sat, down]: P = 1, R = 2/3
    assert metrics.token_f1("the cat sat", "a cat sat down") == pytest.approx(2 * 1 * (2 / 3) / (1 + 2 / 3))
    assert metrics.token_f1("Tom.", ["the keeper", "tom"]) == 1.0
    assert metrics.token_f1("nothing", ["the keeper"]) == 0.0
    assert metrics.normalize_answer("The  Cat, sat!") == "cat sat"


def test_rouge_by_hand():
    # unigrams: pred {the, cat, sat}, ref {the, cat, ran}: P = R = 2/3; bigrams: (the cat) shared of 2 each
    s = metrics.rouge("the cat sat", "the cat ran")
    assert s["rouge1"] == pytest.approx(2 / 3)
    assert s["rouge2"] == pytest.approx(1 / 2)
    assert s["rougeL"] == pytest.approx(2 / 3)
    assert metrics._rouge_scorer() is metrics._rouge_scorer()  # built once, not per call
    assert metrics.rouge("same words here", "same words here")["rougeL"] == pytest.approx(1.0)


def test_bleu_identical_is_100_and_partial_by_hand():
    assert metrics.bleu("the quick brown fox jumps", "the quick brown fox jumps") == pytest.approx(100.0)
    # 4 of 5 words, same length: p1 = 4/5, p2 = 3/4, p3 = 2/3, p4 = 1/2 (no brevity penalty)
    want = 100 * math.exp((math.log(4 / 5) + math.log(3 / 4) + math.log(2 / 3) + math.log(1 / 2)) / 4)
    assert metrics.bleu("the quick brown fox sleeps", "the quick brown fox jumps") == pytest.approx(want, rel=1e-4)


def test_mean_ci_by_hand():
    ci = intervals.mean_ci([1.0, 2.0, 3.0])
    # mean 2, s = 1, t_{0.975, 2} = 4.303: half-width 4.303 / sqrt(3)
    assert ci.mean == 2.0 and ci.n == 3
    assert ci.hi - ci.mean == pytest.approx(4.303 / math.sqrt(3))
    assert intervals.mean_ci([5.0]).n == 1 and math.isnan(intervals.mean_ci([5.0]).lo)


def test_wilson_interval_by_hand():
    ci = intervals.wilson_ci(8, 10)
    z = 1.96
    centre = (0.8 + z * z / 20) / (1 + z * z / 10)
    half = z * math.sqrt(0.8 * 0.2 / 10 + z * z / 400) / (1 + z * z / 10)
    assert (ci.lo, ci.hi) == pytest.approx((centre - half, centre + half))
    assert intervals.wilson_ci(0, 5).lo == pytest.approx(0.0, abs=1e-12) and intervals.wilson_ci(0, 5).hi > 0
    for n in range(1, 40):  # never a hair outside [0, 1] (n = 10 gave -2.8e-17)
        assert intervals.wilson_ci(0, n).lo >= 0.0 and intervals.wilson_ci(n, n).hi <= 1.0


def test_aggregate_exp_turns_mean_nll_into_perplexity():
    ci = intervals.aggregate([math.log(2.0), math.log(8.0)], "exp")
    assert ci.mean == pytest.approx(4.0)  # exp(mean log) = geometric mean
    assert ci.lo < 4.0 < ci.hi
    assert intervals.aggregate([1, 0, 1, 1], "proportion").mean == 0.75
