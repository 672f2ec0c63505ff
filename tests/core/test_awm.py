"""AWM core (mmrl.core.awm): weighted matching log-probs, the clipped advantage-weighted loss, stratified timesteps;
expected numbers computed by hand in the comments."""

import math

import pytest
import torch

from mmrl.core.awm import AWM_WEIGHTINGS, awm_policy_loss, matching_log_prob, stratified_timestep_indices


# ---------------------------------------------------------------------------------------- matching_log_prob


def test_matching_log_prob_weightings_by_hand():
    # v - target = [1, 2] -> ell = mean([1, 4]) = 2.5; t = 0.4
    v, target, t = torch.tensor([[1.0, 3.0]]), torch.tensor([[0.0, 1.0]]), torch.tensor([0.4])
    expect = {
        "uniform": -2.5,
        "t": -0.4 * 2.5,  # -1.0
        "t2": -0.16 * 2.5,  # -0.4
        "huber": -0.4 * (math.sqrt(2.5 + 1e-10) - 1e-5),  # -0.63245...
        "ghuber": -0.4 / 0.25 * ((2.5 + 1e-10) ** 0.25 - 1e-10 ** 0.25),  # -1.6 * (1.257433 - 0.003162) = -2.006834
    }
    assert sorted(expect) == sorted(AWM_WEIGHTINGS)
    for name, value in expect.items():
        lp = matching_log_prob(v, target, t, name, ghuber_power=0.25)
        assert lp.dtype == torch.float64 and lp.shape == (1,)
        assert lp.item() == pytest.approx(value, rel=1e-7), name  # t is float32 (0.4 + 6e-9)
    assert matching_log_prob(v, target, t, "ghuber", 0.25).item() == pytest.approx(-2.0068338, abs=1e-6)
    # ghuber with p = 1/2 is huber scaled by 1/p = 2
    assert matching_log_prob(v, target, t, "ghuber", 0.5).item() == pytest.approx(2 * expect["huber"], rel=1e-7)


def test_matching_log_prob_is_per_sample_over_all_latent_dims():
    g = torch.Generator().manual_seed(0)
    v, target = torch.randn(3, 4, 2, 2, generator=g), torch.randn(3, 4, 2, 2, generator=g)
    t = torch.tensor([0.2, 0.5, 0.9])
    lp = matching_log_prob(v, target, t, "t")
    ell = (v.double() - target.double()).pow(2).flatten(1).mean(1)
    assert torch.allclose(lp, -t.double() * ell)
    with pytest.raises(ValueError, match="valid"):
        matching_log_prob(v, target, t, "cosine")
    with pytest.raises(ValueError, match="ghuber_power"):
        matching_log_prob(v, target, t, "ghuber", 0.0)


# ---------------------------------------------------------------------------------------- awm_policy_loss


def test_awm_policy_loss_by_hand():
    # r = [1, 1.5, 0.5], A = [1, 1, -2], c = 0.2
    #   point 0: max(-1, -1) = -1
    #   point 1: max(-1.5, -1 * 1.2) = -1.2 (clipped)
    #   point 2: max(2 * 0.5, 2 * 0.8) = 1.6 (clipped)
    lp = torch.tensor([0.0, math.log(1.5), math.log(0.5)], requires_grad=True)
    old, adv = torch.zeros(3), torch.tensor([1.0, 1.0, -2.0])
    loss, m = awm_policy_loss(lp, old, adv, clip_range=0.2)
    assert loss.item() == pytest.approx((-1 - 1.2 + 1.6) / 3)
    assert m["policy/clipfrac"] == pytest.approx(2 / 3)
    assert m["policy/ratio_max"] == pytest.approx(1.5)
    assert m["policy/approx_kl"] == pytest.approx(0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 3)
    loss.backward()
    # d/d lp: point 0 -A r / 3 = -1/3; the clipped points have no gradient
    assert torch.allclose(lp.grad, torch.tensor([-1 / 3, 0.0, 0.0]))


def test_weights_mask_points_even_nan():
    lp = torch.tensor([0.0, float("nan"), math.log(0.5)], requires_grad=True)
    old, adv = torch.tensor([0.0, float("inf"), 0.0]), torch.tensor([1.0, float("nan"), -2.0])
    loss, m = awm_policy_loss(lp, old, adv, clip_range=0.2, weights=torch.tensor([1.0, 0.0, 3.0]))
    assert loss.item() == pytest.approx((1 * -1 + 3 * 1.6) / 4)  # weighted mean over the unmasked points
    assert m["policy/clipfrac"] == pytest.approx(3 / 4)
    loss.backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[1] == 0
    # every point masked: zero loss, zero gradient (not nan)
    lp2 = torch.tensor([0.3, 0.1], requires_grad=True)
    loss, m = awm_policy_loss(lp2, torch.zeros(2), torch.ones(2), 0.2, weights=torch.zeros(2))
    loss.backward()
    assert loss.item() == 0 and torch.equal(lp2.grad, torch.zeros(2)) and m["policy/ratio_max"] == 1.0


def test_zero_advantage_gives_zero_gradient():
    v = torch.tensor([[1.0, 3.0], [0.5, -1.0]], requires_grad=True)
    target, t = torch.tensor([[0.0, 1.0], [2.0, 2.0]]), torch.tensor([0.3, 0.8])
    lp = matching_log_prob(v, target, t, "ghuber")
    loss, _ = awm_policy_loss(lp, lp.detach(), torch.zeros(2), clip_range=1.0)
    loss.backward()
    assert loss.item() == 0 and torch.equal(v.grad, torch.zeros_like(v))


@pytest.mark.parametrize("weighting", AWM_WEIGHTINGS)
def test_sign_of_the_update(weighting):
    """A > 0 moves v towards the flow-matching target (its matching loss falls), A < 0 away from it."""
    target, t = torch.tensor([[0.0, 1.0, -1.0]]), torch.tensor([0.5])
    for sign in (1.0, -1.0):
        v = torch.tensor([[1.0, 3.0, 0.0]], requires_grad=True)
        lp = matching_log_prob(v, target, t, weighting)
        loss, _ = awm_policy_loss(lp, lp.detach(), torch.tensor([sign]), clip_range=1.0)
        loss.backward()
        with torch.no_grad():
            before = (v - target).pow(2).mean()
            after = (v - 0.01 * v.grad - target).pow(2).mean()
        assert (after < before) if sign > 0 else (after > before), (weighting, sign)


def test_on_policy_gradient_is_advantage_times_matching_gradient():
    # uniform weighting, one point, r = 1: d loss / dv = A * d ell / dv = A * 2 (v - target) / D
    v = torch.tensor([[1.0, 3.0]], requires_grad=True)
    target = torch.tensor([[0.0, 1.0]])
    lp = matching_log_prob(v, target, torch.tensor([0.7]), "uniform")
    loss, _ = awm_policy_loss(lp, lp.detach(), torch.tensor([0.5]), clip_range=0.1)
    loss.backward()
    assert torch.allclose(v.grad, 0.5 * 2 * torch.tensor([[1.0, 2.0]]) / 2)


def test_awm_policy_loss_input_errors():
    with pytest.raises(ValueError, match="clip_range"):
        awm_policy_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), -0.1)
    with pytest.raises(ValueError, match="equal 1-d shapes"):
        awm_policy_loss(torch.zeros(2), torch.zeros(3), torch.zeros(2), 0.1)
    with pytest.raises(ValueError, match="weights"):
        awm_policy_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), 0.1, weights=torch.ones(3))


# ---------------------------------------------------------------------------------------- timestep strata


def test_stratified_timestep_indices():
    g = torch.Generator().manual_seed(0)
    idx = stratified_timestep_indices(500, 3, 0, 6, generator=g)  # strata [0, 2), [2, 4), [4, 6)
    assert idx.shape == (500, 3) and idx.dtype == torch.long
    for j in range(3):
        assert set(idx[:, j].tolist()) == {2 * j, 2 * j + 1}
    # more points than steps: linspace(1, 4, 7) -> [1, 1, 2, 2, 3, 3, 4]; empty strata give their lower bound
    assert stratified_timestep_indices(4, 6, 1, 4, generator=g).tolist() == [[1, 1, 2, 2, 3, 3]] * 4
    with pytest.raises(ValueError, match="hi > lo"):
        stratified_timestep_indices(2, 2, 3, 3)
