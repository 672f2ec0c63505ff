"""Stateless sampler steps: hand-computed values, the diffusers scheduler as peer implementation."""

import math

import pytest
import torch

from mmrl.diffusion.sde import ode_step, sde_step_with_logprob

X = torch.tensor([[1.0, 2.0]])
V = torch.tensor([[0.5, -1.0]])
EPS = torch.tensor([[1.0, -2.0]])


def test_ode_step_equals_diffusers_scheduler_step_exactly():
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    sched.set_timesteps(10)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, generator=g)
    ours = x.clone()
    for i, t in enumerate(sched.timesteps):
        v = torch.randn(2, 4, 8, 8, generator=g)
        x = sched.step(v, t, x, return_dict=False)[0]
        ours = ode_step(ours, v, sched.sigmas[i], sched.sigmas[i + 1])
        assert torch.equal(ours, x), f"step {i}"


def test_sde_step_hand_computed():
    # sigma 0.5 -> 0.25, a = 0.5: std_t = sqrt(0.5 / 0.5) * 0.5 = 0.5, dt = -0.25
    # mean = x (1 + 0.25 / 1.0 * -0.25) + v (1 + 0.25 * 0.5 / 1.0) * -0.25 = 0.9375 x - 0.28125 v
    # step std = 0.5 * sqrt(0.25) = 0.25; x_next = mean + 0.25 eps
    out = sde_step_with_logprob(X, V, 0.5, 0.25, noise_level=0.5, noise=EPS)
    mean = torch.tensor([[0.9375 * 1 - 0.28125 * 0.5, 0.9375 * 2 + 0.28125]])  # [0.796875, 2.15625]
    assert torch.allclose(out.mean, mean, atol=1e-7)
    assert torch.allclose(out.prev_sample, mean + 0.25 * EPS, atol=1e-7)
    assert out.std.flatten().tolist() == [0.5]
    assert out.step_std.flatten().tolist() == [0.25]
    # log p = mean_d[-eps_d^2 / 2 - log 0.25 - log sqrt(2 pi)] = -(1 + 4) / 4 + log 4 - 0.5 log(2 pi)
    expected = -1.25 + math.log(4.0) - 0.5 * math.log(2 * math.pi)
    assert out.log_prob.shape == (1,)
    assert out.log_prob.item() == pytest.approx(expected, abs=1e-6)


def test_sde_log_prob_equals_torch_normal_and_recompute():
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(3, 4, 5, 5, generator=g), torch.randn(3, 4, 5, 5, generator=g)
    out = sde_step_with_logprob(x, v, 0.8, 0.6, noise_level=0.7, generator=g)
    peer = torch.distributions.Normal(out.mean, out.step_std).log_prob(out.prev_sample).mean(dim=(1, 2, 3))
    assert torch.allclose(out.log_prob, peer, atol=1e-5)
    again = sde_step_with_logprob(x, v, 0.8, 0.6, noise_level=0.7, prev_sample=out.prev_sample)
    assert torch.equal(again.log_prob, out.log_prob)
    assert torch.equal(again.prev_sample, out.prev_sample)


def test_noise_level_zero_is_the_ode_step():
    g = torch.Generator().manual_seed(2)
    x, v = torch.randn(2, 4, 6, 6, generator=g), torch.randn(2, 4, 6, 6, generator=g)
    out = sde_step_with_logprob(x, v, 0.7, 0.4, noise_level=0.0, generator=g)
    assert torch.equal(out.mean, ode_step(x, v, 0.7, 0.4))
    assert torch.equal(out.prev_sample, ode_step(x, v, 0.7, 0.4))
    assert torch.equal(out.log_prob, torch.zeros(2))
    cps = sde_step_with_logprob(x, v, 0.7, 0.4, noise_level=0.0, generator=g, sde_type="cps")
    assert torch.allclose(cps.prev_sample, ode_step(x, v, 0.7, 0.4), atol=1e-6)


def test_per_sample_sigmas_equal_separate_calls():
    g = torch.Generator().manual_seed(3)
    x, v, eps = (torch.randn(3, 2, 4, 4, generator=g) for _ in range(3))
    sig, sig_next = torch.tensor([1.0, 0.6, 0.2]), torch.tensor([0.9, 0.3, 0.0])
    for kind in ("sde", "cps"):
        out = sde_step_with_logprob(x, v, sig, sig_next, noise_level=0.7, noise=eps, sde_type=kind)
        for i in range(3):
            one = sde_step_with_logprob(x[i:i + 1], v[i:i + 1], sig[i].item(), sig_next[i].item(), noise_level=0.7,
                                        noise=eps[i:i + 1], sde_type=kind)
            assert torch.allclose(out.prev_sample[i:i + 1], one.prev_sample, atol=1e-6)
            assert torch.allclose(out.log_prob[i:i + 1], one.log_prob, atol=1e-5)
    with pytest.raises(ValueError, match="one per sample"):
        sde_step_with_logprob(x, v, torch.tensor([0.5, 0.4]), 0.1)


def test_sigma_one_guard_uses_sigma_next():
    # Flow-GRPO replaces sigma = 1 in (1 - sigma) by the schedule's second sigma (= sigma_next here)
    out = sde_step_with_logprob(X, V, 1.0, 0.8, noise_level=0.7, noise=EPS)
    assert out.std.item() == pytest.approx(math.sqrt(1.0 / (1 - 0.8)) * 0.7, rel=1e-6)
    assert torch.isfinite(out.log_prob).all() and torch.isfinite(out.prev_sample).all()


def test_cps_hand_computed():
    # sigma 0.5 -> 0.25, a = 0.5: std = 0.25 sin(pi/4); x0 = x - 0.5 v; x1 = x + 0.5 v
    # mean = 0.75 x0 + sqrt(0.0625 - std^2) x1; log p = -mean_d (x_next - mean)^2 = -std^2 mean_d eps^2
    out = sde_step_with_logprob(X, V, 0.5, 0.25, noise_level=0.5, noise=EPS, sde_type="cps")
    std = 0.25 * math.sin(math.pi / 4)
    x0, x1 = X - 0.5 * V, X + 0.5 * V
    mean = 0.75 * x0 + math.sqrt(0.0625 - std**2) * x1
    assert torch.allclose(out.mean, mean, atol=1e-6)
    assert torch.allclose(out.prev_sample, mean + std * EPS, atol=1e-6)
    assert out.log_prob.item() == pytest.approx(-(std**2) * 2.5, rel=1e-5)


def test_gradient_reaches_velocity_and_bad_inputs():
    v = V.clone().requires_grad_(True)
    out = sde_step_with_logprob(X, v, 0.5, 0.25, noise_level=0.7, prev_sample=torch.tensor([[0.8, 2.1]]))
    out.log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="sde_type"):
        sde_step_with_logprob(X, V, 0.5, 0.25, sde_type="ddim")
