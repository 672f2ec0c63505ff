"""Several rewards into one advantage (`mmrl.core.multi_reward`): sum-then-normalise vs GDPO, by hand."""

import math

import pytest
import torch

from mmrl.core import group_advantages
from mmrl.core.multi_reward import AGGREGATIONS, multi_reward_advantages, weighted_sum


def _grpo(groups):
    return lambda r: group_advantages(r, groups)


def test_weighted_sum_by_hand():
    c = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 3.0]])
    assert weighted_sum(c, [2.0, 0.5]).tolist() == [2.0, 0.5, 5.5]


def test_gdpo_separates_what_the_sum_collapses():
    # one group of 4, two binary rewards (GDPO's motivating example): (1,0), (0,1), (1,1), (0,0)
    c = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    g = torch.zeros(4, dtype=torch.long)
    summed = multi_reward_advantages(c, [1.0, 1.0], _grpo(g), "sum_then_normalise")
    # by hand: sums 1, 1, 2, 0; mean 1; unbiased std sqrt((0 + 0 + 1 + 1) / 3) = sqrt(2/3)
    s = math.sqrt(2 / 3) + 1e-6
    assert summed.tolist() == pytest.approx([0.0, 0.0, 1 / s, -1 / s], abs=1e-6)
    gdpo = multi_reward_advantages(c, [1.0, 1.0], _grpo(g), "normalise_then_sum")
    # each column: values 1, 0, 1, 0 -> mean 0.5, unbiased std sqrt(1/3); A_k = +-0.5 / (sqrt(1/3) + 1e-6)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    per = torch.tensor([[a, -a], [-a, a], [a, a], [-a, -a]])
    total = per.sum(1)  # 0, 0, 2a, -2a
    want = (total - total.mean()) / (total.std() + 1e-4)
    assert gdpo.tolist() == pytest.approx(want.tolist(), abs=1e-6)
    # rows (1,0) and (0,1) carry opposite per-reward advantages; their sum is 0 either way, and the exact zero of
    # the whitening keeps them at exactly 0 only if every per-reward advantage is 0 - here they are not
    assert gdpo[0].item() == pytest.approx(0.0, abs=1e-6) and gdpo[2].item() > 0 > gdpo[3].item()


def test_gdpo_weights_and_scale_free():
    # reward 2 has 1000x the spread of reward 1: the sum follows reward 2 only; GDPO weighs both equally
    c = torch.tensor([[1.0, 0.0], [0.0, 1000.0], [0.5, 500.0], [0.2, 100.0]])
    g = torch.zeros(4, dtype=torch.long)
    summed = multi_reward_advantages(c, [1.0, 1.0], _grpo(g), "sum_then_normalise")
    only2 = group_advantages(c[:, 1] + c[:, 0], g)
    assert torch.allclose(summed, only2)
    gdpo = multi_reward_advantages(c, [1.0, 1.0], _grpo(g), "normalise_then_sum")
    scaled = multi_reward_advantages(c * torch.tensor([3.0, 0.01]), [1.0, 1.0], _grpo(g), "normalise_then_sum")
    assert torch.allclose(gdpo, scaled, atol=1e-4)  # per-reward normalisation: each reward's scale drops out
    w = multi_reward_advantages(c, [2.0, 0.0], _grpo(g), "normalise_then_sum")
    alone = group_advantages(c[:, 0], g) * 2.0
    assert torch.allclose(w, (alone - alone.mean()) / (alone.std() + 1e-4), atol=1e-6)


def test_constant_groups_stay_exactly_zero_and_mask():
    c = torch.tensor([[1.0, 2.0], [1.0, 2.0], [0.0, 1.0], [3.0, 0.0], [9.0, 9.0]])
    g = torch.tensor([0, 0, 1, 1, 2])
    out = multi_reward_advantages(c, [1.0, 1.0], _grpo(g), "normalise_then_sum")
    assert out[0].item() == 0.0 and out[1].item() == 0.0 and out[4].item() == 0.0  # exact, not ~1e-9
    assert out[2].item() != 0.0
    m = torch.tensor([True, True, True, True, False])
    masked = multi_reward_advantages(c, [1.0, 1.0], _grpo(g), "normalise_then_sum", mask=m)
    assert masked[4].item() == 0.0
    # a masked row (a dropped sample: its values may be nan) changes nothing else
    c2 = c.clone()
    c2[4] = float("nan")
    g2 = g.clone()
    masked2 = multi_reward_advantages(c2, [1.0, 1.0], lambda r: torch.nan_to_num(group_advantages(
        torch.nan_to_num(r), g2)), "normalise_then_sum", mask=m)
    assert torch.equal(masked, masked2)


def test_single_column_and_errors():
    r = torch.tensor([1.0, 2.0, 4.0, 4.0])
    g = torch.tensor([0, 0, 1, 1])
    assert torch.equal(multi_reward_advantages(r, [1.0], _grpo(g), "sum_then_normalise"), group_advantages(r, g))
    assert AGGREGATIONS == ("sum_then_normalise", "normalise_then_sum")
    with pytest.raises(ValueError, match="expected one of"):
        multi_reward_advantages(r, [1.0], _grpo(g), "gdpo")
    with pytest.raises(ValueError, match="weights: expected 2"):
        multi_reward_advantages(torch.ones(4, 2), [1.0], _grpo(g))
    with pytest.raises(ValueError, match="mask"):
        multi_reward_advantages(r, [1.0], _grpo(g), mask=torch.ones(3, dtype=torch.bool))
