"""GRPO-Guard's ratio (`mmrl.core.grpo_guard`) against a hand computation and against the Gaussian step it
normalises (`mmrl.diffusion.sde.sde_step_with_logprob`)."""

import math

import pytest
import torch

from mmrl.core.grpo_guard import grpo_guard_log_ratio, grpo_guard_step_weight
from mmrl.diffusion.sde import sde_step_with_logprob


def _gauss_logp(x, mu, s):  # Flow-GRPO's log-prob: averaged over the latent dims
    return (-(x - mu) ** 2 / (2 * s**2) - math.log(s) - 0.5 * math.log(2 * math.pi)).flatten(1).mean(1)


def test_hand_values():
    # one sample, D = 2: mu_old = (0, 0), mu = (0.1, -0.2), x' = (0.3, 0.1), s = 0.5
    f64 = torch.float64
    mu_old, mu = torch.zeros(1, 2, dtype=f64), torch.tensor([[0.1, -0.2]], dtype=f64)
    x, s = torch.tensor([[0.3, 0.1]], dtype=f64), 0.5
    lp, lp_old = _gauss_logp(x, mu, s), _gauss_logp(x, mu_old, s)
    out = grpo_guard_log_ratio(lp, lp_old, mu, mu_old, torch.tensor([s], dtype=f64))
    assert out.dtype == f64
    # Flow-Factory's formula: (lp - lp_old) * s + mean((mu - mu_old)^2) / (2 s)
    lr = ((-(0.2**2 + 0.3**2) + (0.3**2 + 0.1**2)) / (2 * 0.25)) / 2  # mean over the 2 dims
    want = lr * s + ((0.01 + 0.04) / 2) / (2 * s)
    assert out.item() == pytest.approx(want, rel=1e-12)
    # = mean_d((mu - mu_old) * (x' - mu_old)) / s = mean(delta * eps)
    assert out.item() == pytest.approx(((0.1 * 0.3) + (-0.2 * 0.1)) / 2 / s, rel=1e-12)


def test_identity_and_gradient_on_real_sde_steps():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 2, 2)
    v_old, v = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    noise = torch.randn(3, 4, 2, 2)
    old = sde_step_with_logprob(x, v_old, 0.8, 0.6, noise_level=0.7, noise=noise)
    v = v.requires_grad_(True)
    new = sde_step_with_logprob(x, v, 0.8, 0.6, noise_level=0.7, prev_sample=old.prev_sample)
    out = grpo_guard_log_ratio(new.log_prob, old.log_prob, new.mean, old.mean, new.step_std)
    want = ((new.mean - old.mean) * noise).flatten(1).mean(1)  # mean_d(delta * eps)
    assert torch.allclose(out, want.detach(), atol=1e-5)
    # the gradient is mean_d(eps * d mu) at any weights: d out_b / d v = eps * (d mu / d v) / D
    out.sum().backward()
    coef = (1.0 + new.std**2 * (1 - 0.8) / (2 * 0.8)) * (0.6 - 0.8)  # d mean / d v of the sde step
    assert torch.allclose(v.grad, noise * coef / 16, atol=1e-6)
    # at the sampling weights the ratio is exactly 1 (log 0): no bias, unlike the plain ratio's -mse / 2s^2 term
    same = grpo_guard_log_ratio(old.log_prob, old.log_prob, old.mean, old.mean, old.step_std)
    assert torch.equal(same, torch.zeros(3))


def test_gradient_reweighting_by_hand():
    """GRPO-Guard's gradient reweighting (algo.grpo_guard_reweight): the step's loss times 1 / (sigma - sigma_next).
    The guard ratio's gradient is eps * (1 + a^2 / 2) dt / D (a = noise_level 0.7, D = 16 latent dims): 0.2 and 0.1
    times -1.245 eps / 16 at the steps 0.8 -> 0.6 and 0.4 -> 0.3; reweighted, both are -1.245 eps / 16."""
    assert grpo_guard_step_weight(0.8, 0.6) == pytest.approx(5.0)
    assert grpo_guard_step_weight(0.4, 0.3) == pytest.approx(10.0)
    torch.manual_seed(1)
    x, v_old, noise = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    for sigma, sigma_next in ((0.8, 0.6), (0.4, 0.3)):
        old = sde_step_with_logprob(x, v_old, sigma, sigma_next, noise_level=0.7, noise=noise)
        v = (v_old + 0.01 * torch.randn(3, 4, 2, 2)).requires_grad_(True)
        new = sde_step_with_logprob(x, v, sigma, sigma_next, noise_level=0.7, prev_sample=old.prev_sample)
        out = grpo_guard_log_ratio(new.log_prob, old.log_prob, new.mean, old.mean, new.step_std)
        (out.sum() * grpo_guard_step_weight(sigma, sigma_next)).backward()
        assert torch.allclose(v.grad, -(1 + 0.49 / 2) * noise / 16, atol=1e-6), (sigma, sigma_next)
    with pytest.raises(ValueError, match="expected sigma > sigma_next, got 0.3, 0.3"):
        grpo_guard_step_weight(0.3, 0.3)


def test_errors():
    with pytest.raises(ValueError, match="std > 0"):
        grpo_guard_log_ratio(torch.zeros(1), torch.zeros(1), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1))
    with pytest.raises(ValueError, match="shapes differ"):
        grpo_guard_log_ratio(torch.zeros(1), torch.zeros(1), torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1))
