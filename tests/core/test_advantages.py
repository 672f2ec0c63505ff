import math

import pytest
import torch

from mmrl.core.advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_to_tokens,
    discounted_returns,
    gae,
    get_advantage_estimator,
    gigpo_advantages,
    group_advantages,
    hash_anchors,
    masked_whiten,
    reinforce_pp_advantages,
    rloo_advantages,
)

EPS = 1e-6
# Three groups with non-contiguous, unsorted ids, interleaved in the batch:
#   id 7    -> rewards 1, 2, 6   mean 3, deviations -2, -1, 3, unbiased var (4+1+9)/2 = 7
#   id -5   -> rewards 4, 4      (equal -> 0)
#   id 1000 -> reward 3          (single member -> 0)
REWARDS = torch.tensor([1.0, 4.0, 2.0, 3.0, 6.0, 4.0])
IDS = torch.tensor([7, -5, 7, 1000, 7, -5])


def test_grpo_hand_values():
    s = math.sqrt(7.0) + EPS
    expected = torch.tensor([-2 / s, 0.0, -1 / s, 0.0, 3 / s, 0.0])
    torch.testing.assert_close(group_advantages(REWARDS, IDS), expected)


def test_dr_grpo_is_mean_only():
    expected = torch.tensor([-2.0, 0.0, -1.0, 0.0, 3.0, 0.0])
    torch.testing.assert_close(group_advantages(REWARDS, IDS, scale_by_std=False), expected)
    torch.testing.assert_close(get_advantage_estimator("dr_grpo")(REWARDS, IDS), expected)


def test_grpo_global_std():
    # batch mean 20/6; sum of squared deviations 46/3; unbiased var (46/3)/5
    s = math.sqrt(46 / 3 / 5) + EPS
    expected = torch.tensor([-2 / s, 0.0, -1 / s, 0.0, 3 / s, 0.0])
    torch.testing.assert_close(group_advantages(REWARDS, IDS, std_mode="global"), expected)


def test_equal_rewards_exactly_zero():
    # 0.1 * 3 / 3 != 0.1 in float32; the constant-group rule must still give exact zeros
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7])
    g = torch.tensor([3, 3, 3, 9, 9])
    for kw in ({}, {"std_mode": "global"}, {"scale_by_std": False}):
        assert torch.equal(group_advantages(r, g, **kw), torch.zeros(5))
    assert torch.equal(rloo_advantages(r, g), torch.zeros(5))


def test_noncontiguous_ids_match_contiguous():
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(40, generator=gen)
    g = torch.randint(0, 6, (40,), generator=gen)
    for fn in (group_advantages, rloo_advantages):
        torch.testing.assert_close(fn(r, g * 1000 - 77), fn(r, g))


def test_batch_permutation_permutes_output():
    gen = torch.Generator().manual_seed(1)
    r = torch.randn(32, generator=gen)
    g = torch.randint(0, 5, (32,), generator=gen)
    perm = torch.randperm(32, generator=gen)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        fn = get_advantage_estimator(name)
        torch.testing.assert_close(fn(r[perm], g[perm]), fn(r, g)[perm], rtol=1e-5, atol=1e-6)


def test_rloo_hand_values():
    # id 7: 1 - (2+6)/2 = -3, 2 - (1+6)/2 = -1.5, 6 - (1+2)/2 = 4.5; others 0
    expected = torch.tensor([-3.0, 0.0, -1.5, 0.0, 4.5, 0.0])
    torch.testing.assert_close(rloo_advantages(REWARDS, IDS), expected)


def test_registry():
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"} <= set(ADVANTAGE_ESTIMATORS)
    with pytest.raises(ValueError, match="valid: .*grpo"):
        get_advantage_estimator("nope")
    torch.testing.assert_close(get_advantage_estimator("grpo")(REWARDS, IDS), group_advantages(REWARDS, IDS))


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="std_mode"):
        group_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), std_mode="batch")


def test_reinforce_pp_sequence_level():
    # [1, 2, 3, 6]: mean 3, deviations -2 -1 0 3, unbiased var 14/3
    s = math.sqrt(14 / 3) + EPS
    torch.testing.assert_close(
        reinforce_pp_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0])), torch.tensor([-2 / s, -1 / s, 0.0, 3 / s])
    )
    # masked entry (nan) ignored: [1, 2, 3] -> mean 2, var 1
    out = reinforce_pp_advantages(torch.tensor([1.0, 2.0, 3.0, float("nan")]), mask=torch.tensor([1, 1, 1, 0]))
    s = 1.0 + EPS
    torch.testing.assert_close(out, torch.tensor([-1 / s, 0.0, 1 / s, 0.0]))


def test_reinforce_pp_token_level_and_baseline():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # gamma=1 returns: [[1, 1, 1], [2, 2, -]]; valid mean 7/5 = 1.4; deviations -.4 x3, .6 x2;
    # unbiased var (3*.16 + 2*.36)/4 = 0.3
    s = math.sqrt(0.3) + EPS
    expected = torch.tensor([[-0.4 / s] * 3, [0.6 / s, 0.6 / s, 0.0]])
    torch.testing.assert_close(reinforce_pp_advantages(rewards, mask), expected)
    # baseline: row scores 1 and 2, group mean 1.5 -> -0.5 / +0.5 on every valid token;
    # valid mean -0.1 -> the same deviations -.4 x3, .6 x2 as above
    out = reinforce_pp_advantages(rewards, mask, group_ids=torch.tensor([4, 4]))
    torch.testing.assert_close(out, expected)


def test_broadcast_to_tokens():
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    assert torch.equal(out, torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))


def test_masked_whiten_ignores_masked():
    x = torch.tensor([1.0, 3.0, float("inf")])
    out = masked_whiten(x, torch.tensor([True, True, False]))
    s = math.sqrt(2.0) + EPS  # mean 2, unbiased var 2
    torch.testing.assert_close(out, torch.tensor([-1 / s, 1 / s, 0.0]))


def test_gae_hand_recursion_with_mask():
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[1.0, float("nan"), 2.0], [0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, float("inf"), 1.0], [0.1, 0.2, 0.3]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma, lam)
    # row 0 (position 1 skipped):
    #   t=2: delta = 2 + 0.9*0 - 1.0 = 1.0               A2 = 1.0
    #   t=0: delta = 1 + 0.9*1.0 - 0.5 = 1.4             A0 = 1.4 + 0.72*1.0 = 2.12
    # row 1:
    #   t=2: delta = 1 - 0.3 = 0.7                       A2 = 0.7
    #   t=1: delta = 0.9*0.3 - 0.2 = 0.07                A1 = 0.07 + 0.72*0.7 = 0.574
    #   t=0: delta = 0.9*0.2 - 0.1 = 0.08                A0 = 0.08 + 0.72*0.574 = 0.49328
    torch.testing.assert_close(adv, torch.tensor([[2.12, 0.0, 1.0], [0.49328, 0.574, 0.7]]))
    torch.testing.assert_close(ret, torch.tensor([[2.62, 0.0, 2.0], [0.59328, 0.774, 1.0]]))
    # skipping a masked position == deleting it
    adv2, ret2 = gae(torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 1.0]]), torch.ones(1, 2), gamma, lam)
    torch.testing.assert_close(adv2[0], adv[0, [0, 2]])
    # whiten over valid positions only
    adv_w, _ = gae(rewards, values, mask, gamma, lam, whiten=True)
    valid = mask.bool()
    assert abs(float(adv_w[valid].mean())) < 1e-6 and float(adv_w[~valid].abs().sum()) == 0.0


def test_discounted_returns_skip_masked():
    rewards = torch.tensor([[1.0, 5.0, 2.0, 3.0]])
    mask = torch.tensor([[1, 0, 1, 1]])
    # G3 = 3; G2 = 2 + 0.5*3 = 3.5; position 1 skipped; G0 = 1 + 0.5*3.5 = 2.75
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.5), torch.tensor([[2.75, 0.0, 3.5, 3.0]]))


def test_hash_anchors():
    ids = hash_anchors(["A", "B", "A", "C", "A"])
    assert ids.dtype == torch.long and ids.tolist() == [0, 1, 0, 2, 0]
    assert hash_anchors([[1, [2]], (1, 2), [1, [2]], {"a": [1]}, {"a": [1]}]).tolist() == [0, 1, 0, 2, 2]
    with pytest.raises(ValueError, match="observation 0"):
        hash_anchors([bytearray(b"x")])


def _gigpo_example():
    # episode group 0: ep0 reward 1 (anchors A, B), ep1 reward 0 (anchors A, C);
    # episode group 5: ep2 reward 3 (anchor A) -- same anchor id but another task: a separate step group.
    ep_rewards = torch.tensor([1.0, 0.0, 3.0])
    ep_groups = torch.tensor([0, 0, 5])
    step_returns = torch.tensor([0.9, 1.0, 0.0, 0.0, 3.0])
    step_ep = torch.tensor([0, 0, 1, 1, 2])
    anchors = hash_anchors(["A", "B", "A", "C", "A"])
    return ep_rewards, ep_groups, step_returns, step_ep, anchors


def test_gigpo_hand_example():
    args = _gigpo_example()
    # episode level, group 0: mean .5, unbiased std sqrt(.5) -> +-.5/sqrt(.5) = +-0.70711; group 5 single -> 0
    e = 0.5 / (math.sqrt(0.5) + EPS)
    # step group (0, A): returns .9 and 0 -> mean .45, std .45*sqrt(2) -> +-0.70711; (0,B), (0,C), (5,A) single -> 0
    s = 0.45 / (0.45 * math.sqrt(2.0) + EPS)
    expected = torch.tensor([e + s, e, -e - s, -e, 0.0])
    torch.testing.assert_close(gigpo_advantages(*args), expected)
    # Dr.GRPO style, omega = 0.5: episode +-.5, step +-.45
    expected = torch.tensor([0.5 + 0.225, 0.5, -0.5 - 0.225, -0.5, 0.0])
    torch.testing.assert_close(gigpo_advantages(*args, omega=0.5, scale_by_std=False), expected)


def test_gigpo_bad_index():
    ep_rewards, ep_groups, step_returns, _, anchors = _gigpo_example()
    with pytest.raises(ValueError, match="step_episode_index"):
        gigpo_advantages(ep_rewards, ep_groups, step_returns, torch.tensor([0, 0, 1, 1, 3]), anchors)


def test_all_equal_group_zero_only_for_the_group_estimators():
    # what the module docstring claims, estimator by estimator: group 0 all-equal (1, 1, 1), group 1 varies,
    # group 2 all-equal at another value (5, 5, 5)
    r = torch.tensor([1.0, 1.0, 1.0, 0.3, 0.7, 0.2, 5.0, 5.0, 5.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    flat = torch.tensor([0, 1, 2, 6, 7, 8])
    for name in ("grpo", "dr_grpo", "rloo", "cpgd"):  # exactly 0, by the constant-group rule
        assert torch.equal(ADVANTAGE_ESTIMATORS[name](r, g)[flat], torch.zeros(6)), name
    # REINFORCE++ whitens over the batch without groups: an all-equal group gets its batch z-score
    a = ADVANTAGE_ESTIMATORS["reinforce_pp"](r, g)
    z = (r - r.mean()) / (r.std() + EPS)
    torch.testing.assert_close(a, z)
    assert a[flat].abs().min() > 0.5
    # REINFORCE++-baseline at sequence level: r - group mean is 0 there, then minus the batch mean of the centred
    # scores (0 only up to rounding): small but not exactly 0
    b = ADVANTAGE_ESTIMATORS["reinforce_pp_baseline"](r, g)
    assert b[flat].abs().max() < 1e-6
    # over tokens with unequal response lengths the batch mean is token-weighted, so it is not 0 at all:
    # rows 0, 1 (group 0) centred 0; rows 2, 3 (group 1) centred -0.3, +0.3 with 2 and 1 valid tokens
    rt = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.3, 0.0, 0.0], [0.9, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]]).bool()
    bt = reinforce_pp_advantages(rt, m, group_ids=torch.tensor([0, 0, 1, 1]))
    vals = torch.tensor([0.0] * 4 + [-0.3, -0.3, 0.3])  # the 7 valid tokens' centred scores
    mean, std = vals.mean(), vals.std()
    torch.testing.assert_close(bt[0, 0], (0.0 - mean) / (std + EPS))
    assert bt[0, 0].item() == pytest.approx(0.2070, abs=1e-3) and bt[0, 0].item() != 0.0


def test_gigpo_episode_statistics_per_step_row():
    # verl-agent's default (compute_mean_std_cross_steps=True): every step row carries its episode reward and the
    # group statistics run over the rows. Example: group 0 = ep0 (R 1, 2 steps) and ep1 (R 0, 2 steps) -> rows
    # 1, 1, 0, 0: the same mean as per episode but unbiased std over 4 rows sqrt(1/3); group 5: one episode -> 0.
    args = _gigpo_example()
    e_row = 0.5 / (math.sqrt(1 / 3) + EPS)
    s = 0.45 / (0.45 * math.sqrt(2.0) + EPS)
    expected = torch.tensor([e_row + s, e_row, -e_row - s, -e_row, 0.0])
    torch.testing.assert_close(gigpo_advantages(*args, episode_stats="step"), expected)
    # with episodes of unequal length the row mean is weighted: ep0 (R 1) has 3 steps, ep1 (R 0) 1 step
    ep_rewards, ep_groups = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    step_ep = torch.tensor([0, 0, 0, 1])
    anchors = hash_anchors(["A", "B", "C", "D"])  # no shared anchor: the step part is 0
    mean_norm = gigpo_advantages(ep_rewards, ep_groups, torch.zeros(4), step_ep, anchors, scale_by_std=False,
                                 episode_stats="step")
    torch.testing.assert_close(mean_norm, torch.tensor([0.25, 0.25, 0.25, -0.75]))  # row mean 3/4 (mean_norm)
    paper = gigpo_advantages(ep_rewards, ep_groups, torch.zeros(4), step_ep, anchors, scale_by_std=False)
    torch.testing.assert_close(paper, torch.tensor([0.5, 0.5, 0.5, -0.5]))  # episode mean 1/2
    # the same numbers as verl-agent's episode_norm_reward written as its loop (mean_norm: scores - group mean)
    rows = ep_rewards[step_ep].tolist()
    ref = [x - sum(rows) / len(rows) for x in rows]
    assert mean_norm.tolist() == pytest.approx(ref)
    with pytest.raises(ValueError, match="episode_stats"):
        gigpo_advantages(*args, episode_stats="turn")
