"""The reward-hacking rule (`mmrl.core.hacking`) by hand."""

import math

import pytest
import torch

from mmrl.core.hacking import ScoreChange, hacking_verdict, score_change


def test_score_change_by_hand():
    base = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    cur = torch.tensor([1.5, 2.5, 3.0, 5.0], dtype=torch.float64)  # d = .5, .5, 0, 1: mean .5, unbiased std sqrt(1/6)
    ch = score_change(base, cur, z=2.0, min_effect=0.2)
    se = math.sqrt(1 / 6) / 2
    spread = math.sqrt(5 / 3)  # unbiased std of 1, 2, 3, 4
    assert ch.delta == pytest.approx(0.5) and ch.se == pytest.approx(se) and ch.spread == pytest.approx(spread)
    assert ch.noise == pytest.approx(max(2 * se, 0.2 * spread))
    assert ch.rose and not ch.fell
    # the effect floor: a consistent but tiny change (se = 0) does not count
    tiny = score_change(base, base - 1e-6)
    assert tiny.se < 1e-15 and tiny.delta == pytest.approx(-1e-6) and not tiny.fell
    # a constant, unchanged score: noise 0, neither
    assert score_change(base, cur).noise == pytest.approx(max(2 * se, 0.5 * spread))  # the default floor: 0.5
    flat = score_change(torch.ones(3), torch.ones(3))
    assert flat.noise == 0.0 and not flat.rose and not flat.fell


def test_verdict():
    up, down, still = ScoreChange(1.0, 0.1, 0.05, 1.0), ScoreChange(-1.0, 0.1, 0.05, 1.0), ScoreChange(0, 0.1, 0, 1)
    assert hacking_verdict(up, {"a": down, "b": still}) == (True, ["a"])
    assert hacking_verdict(still, {"a": down}) == (False, ["a"])  # the reward did not rise: not hacking
    assert hacking_verdict(up, {"a": still}) == (False, [])


def test_errors():
    with pytest.raises(ValueError, match="same non-zero number"):
        score_change(torch.ones(3), torch.ones(2))
    with pytest.raises(ValueError, match=">= 0"):
        score_change(torch.ones(3), torch.ones(3), z=-1)
