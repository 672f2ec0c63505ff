"""DGPO core (mmrl.core.dgpo): group weights, loss and clip mask by hand; the loss's gradient equals the
group-preference objective -sum_g log sigmoid(z_g) up to its constant factor."""

import math

import pytest
import torch

from mmrl.core.dgpo import dgpo_clip_mask, dgpo_group_weights, dgpo_loss

ADV = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
REF = torch.tensor([0.4, 0.4, 0.2, 0.5], dtype=torch.float64)
GROUPS = torch.tensor([0, 0, 7, 7])  # any labels


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_group_weights_and_loss_by_hand():
    dsm = torch.tensor([0.3, 0.5, 0.2, 0.4], dtype=torch.float64, requires_grad=True)
    # beta 10, G 2. group 0: (1 * 10 * (0.3 - 0.4) + (-1) * 10 * (0.5 - 0.4)) / 2 = -1 -> w = sigmoid(-1) = 0.268941
    # group 7: (0.5 * 10 * 0 + (-0.5) * 10 * (0.4 - 0.5)) / 2 = 0.25 -> w = sigmoid(0.25) = 0.562177
    w = dgpo_group_weights(ADV.double(), dsm.detach(), REF.double(), GROUPS, beta=10.0, group_size=2)
    assert w.tolist() == pytest.approx([sigmoid(-1)] * 2 + [sigmoid(0.25)] * 2, abs=1e-12)
    assert not w.requires_grad
    # loss = mean(w A ell) = (0.268941 (0.3 - 0.5) + 0.562177 (0.5 * 0.2 - 0.5 * 0.4)) / 4 = -0.0275015
    loss = dgpo_loss(ADV.double(), dsm, w)
    assert loss.item() == pytest.approx((sigmoid(-1) * -0.2 + sigmoid(0.25) * -0.1) / 4, abs=1e-12)
    assert loss.item() == pytest.approx(-0.0275015, abs=1e-6)
    loss.backward()
    assert dsm.grad.tolist() == pytest.approx((w * ADV.double() / 4).tolist(), abs=1e-12)


def test_gradient_is_the_group_preference_objective():
    """d/d ell of -sum_g log sigmoid(-(beta/G) sum_i A_i (ell_i - ell_ref,i)) = (beta / G) * B * d(loss)/d ell."""
    torch.manual_seed(0)
    beta, g, groups = 5.0, 4, torch.arange(3).repeat_interleave(4)
    adv, ref = torch.randn(12, dtype=torch.float64), torch.rand(12, dtype=torch.float64)
    ell = torch.rand(12, dtype=torch.float64, requires_grad=True)
    z = -(beta / g) * torch.zeros(3, dtype=torch.float64).index_add(0, groups, adv * (ell - ref))
    objective = -torch.nn.functional.logsigmoid(z).sum()
    (want,) = torch.autograd.grad(objective, ell)
    w = dgpo_group_weights(adv, ell.detach(), ref, groups, beta, g)
    (got,) = torch.autograd.grad(dgpo_loss(adv, ell, w), ell)
    torch.testing.assert_close(got * (beta / g) * 12, want, rtol=1e-12, atol=1e-12)


def test_clip_mask_by_hand_and_clipped_samples_carry_no_gradient():
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    dsm = torch.tensor([0.1, 0.1, 0.3, 0.3], requires_grad=True)
    old = torch.full((4,), 0.2)
    # r = exp(old - ell) = [1.105, 1.105, 0.905, 0.905]; c = 0.05: A > 0 clips above 1.05, A < 0 below 0.95
    mask = dgpo_clip_mask(adv, dsm, old, 0.05)
    assert mask.tolist() == [True, False, False, True]
    loss = dgpo_loss(adv, dsm, torch.ones(4), mask)
    loss.backward()
    assert dsm.grad.tolist() == pytest.approx([0.0, -0.25, 0.25, 0.0])


def test_shape_errors():
    with pytest.raises(ValueError, match="equal 1-d shapes"):
        dgpo_group_weights(ADV, torch.zeros(3), REF, GROUPS, 1.0, 2)
