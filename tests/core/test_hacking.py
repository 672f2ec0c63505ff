"""The reward-hacking rule (`mmrl.core.hacking`) by hand, and its minimum of finite prompts."""

import math

import pytest
import torch

from mmrl.core.hacking import MIN_PROMPTS, ScoreChange, hacking_verdict, score_change


def test_score_change_by_hand():
    base = torch.arange(1.0, 9.0, dtype=torch.float64)  # 8 prompts: 1 .. 8
    cur = base + torch.tensor([0.5, 0.5, 0.0, 1.0] * 2, dtype=torch.float64)  # d: mean .5, unbiased std sqrt(1/7)
    ch = score_change(base, cur, z=2.0, min_effect=0.1)
    se = math.sqrt(1 / 7) / math.sqrt(8)
    spread = math.sqrt(6.0)  # unbiased std of 1 .. 8
    assert ch.delta == pytest.approx(0.5) and ch.se == pytest.approx(se) and ch.spread == pytest.approx(spread)
    assert ch.noise == pytest.approx(max(2 * se, 0.1 * spread)) and ch.prompts == 8
    assert ch.verdict and ch.rose and not ch.fell
    # the effect floor: a consistent but tiny change (se = 0) does not count
    tiny = score_change(base, base - 1e-6)
    assert tiny.se < 1e-15 and tiny.delta == pytest.approx(-1e-6) and not tiny.fell
    # a constant, unchanged score: noise 0, neither
    assert score_change(base, cur).noise == pytest.approx(max(2 * se, 0.5 * spread))  # the default floor: 0.5
    flat = score_change(torch.ones(8), torch.ones(8))
    assert flat.noise == 0.0 and not flat.rose and not flat.fell


def test_verdict():
    up, down, still = (ScoreChange(1.0, 0.1, 0.05, 1.0, 8), ScoreChange(-1.0, 0.1, 0.05, 1.0, 8),
                       ScoreChange(0, 0.1, 0, 1, 8))
    assert hacking_verdict(up, {"a": down, "b": still}) == (True, ["a"])
    assert hacking_verdict(still, {"a": down}) == (False, ["a"])  # the reward did not rise: not hacking
    assert hacking_verdict(up, {"a": still}) == (False, [])


def test_no_verdict_below_the_minimum_of_finite_prompts():
    """One prompt: se and spread are 0, so the old rule counted any movement (a 1e-6 rise of the reward with a 1e-6
    fall of a judge fired the alarm). Below MIN_PROMPTS a score neither rises nor falls; at MIN_PROMPTS it does."""
    assert MIN_PROMPTS == 8
    one = score_change(torch.tensor([0.3]), torch.tensor([0.3 + 1e-6]), z=2.0, min_effect=0.0)
    assert one.noise == 0.0 and one.delta > 0 and one.prompts == 1 and not one.verdict and not one.rose
    fell = score_change(torch.tensor([0.3]), torch.tensor([0.3 - 1e-6]))
    assert not fell.fell
    assert hacking_verdict(one, {"judge": fell}) == (None, [])  # no verdict (the old rule: (True, ["judge"]))
    # a consistent rise on MIN_PROMPTS - 1 prompts: no verdict; the same on MIN_PROMPTS: it rose
    g = torch.Generator().manual_seed(0)
    base = torch.rand(MIN_PROMPTS, generator=g, dtype=torch.float64)
    cur = base + 0.1 + 0.01 * torch.rand(MIN_PROMPTS, generator=g, dtype=torch.float64)
    short, full = score_change(base[:-1], cur[:-1], min_effect=0.0), score_change(base, cur, min_effect=0.0)
    assert short.prompts == 7 and not short.rose and full.prompts == 8 and full.rose
    # the reward has a verdict, every judge has not: no verdict; one judge with enough prompts decides
    judge_down = score_change(base, base - 1.0)
    assert judge_down.fell
    assert hacking_verdict(full, {"short": fell}) == (None, [])
    assert hacking_verdict(full, {"short": fell, "full": judge_down}) == (True, ["full"])


def test_false_positive_rate_under_the_null():
    """Per-prompt changes i.i.d. N(0, 1) (nothing changed): "rose" at MIN_PROMPTS comes out at P(t_7 > 2) = 4.28%,
    within twice the nominal one-sided 2.28% of z = 2 (bound: 3.5% .. 4.55%; 20,000 trials, binomial se 0.14%).
    With 2 prompts the old rule's rate was P(t_1 > 2) = 14.8%; now it gives no verdict."""
    g = torch.Generator().manual_seed(0)
    trials = 20_000
    base = torch.randn(trials, MIN_PROMPTS, generator=g, dtype=torch.float64)
    cur = base + torch.randn(trials, MIN_PROMPTS, generator=g, dtype=torch.float64)
    rate = sum(score_change(b, c, min_effect=0.0).rose for b, c in zip(base, cur)) / trials
    assert 0.035 < rate < 2 * 0.02275, rate
    d = (cur - base)[:, :2]  # 2 prompts: what the rule would say without its minimum, and what it says now
    old_rate = float((d.mean(1) > 2 * d.std(1) / math.sqrt(2)).double().mean())
    assert 0.13 < old_rate < 0.165, old_rate
    assert not any(score_change(b[:2], c[:2], min_effect=0.0).rose for b, c in zip(base[:2000], cur[:2000]))


def test_errors():
    with pytest.raises(ValueError, match="same non-zero number"):
        score_change(torch.ones(3), torch.ones(2))
    with pytest.raises(ValueError, match=">= 0"):
        score_change(torch.ones(3), torch.ones(3), z=-1)
