import math

import pytest
import torch

from mmrl.core.advantages import get_advantage_estimator
from mmrl.core.cpgd import cpgd_advantages, cpgd_loss
from mmrl.core.losses import clipped_policy_loss

NAN, INF = float("nan"), float("inf")
L = math.log

# ratios 1.5, 0.5, 1.1, 0.7 with advantages +1, +1, -1, -1 (as tests/core/test_losses.py)
RATIO = torch.tensor([1.5, 0.5, 1.1, 0.7])
ADV = torch.tensor([1.0, 1.0, -1.0, -1.0])


def _run(ratio, adv, **kw):
    logp = torch.log(ratio).clone().requires_grad_(True)
    loss, metrics = cpgd_loss(logp, torch.zeros_like(logp), adv, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, metrics, grad


def test_clipped_log_ratio_hand_values():
    loss, m, grad = _run(RATIO, ADV)
    # per token max(-A lr, -A clip(lr, ln .8, ln 1.2)):
    #   lr=ln1.5 A=+1: -ln1.2 (clipped)     lr=ln0.5 A=+1: -ln0.5 (below the range: A>0 only clips above)
    #   lr=ln1.1 A=-1: ln1.1                lr=ln0.7 A=-1: ln0.8 (clipped)
    assert loss.item() == pytest.approx((-L(1.2) - L(0.5) + L(1.1) + L(0.8)) / 4)
    # gradient -A / 4 where not clipped: no ratio factor (the policy-gradient form)
    torch.testing.assert_close(grad, torch.tensor([0.0, -0.25, 0.25, 0.0]))
    assert m["clipfrac"] == pytest.approx(0.5) and m["pg_loss"] == pytest.approx(loss.item())
    assert m["ratio_max"] == pytest.approx(1.5) and m["ratio_mean"] == pytest.approx(0.95)
    assert m["approx_kl"] == pytest.approx(float((RATIO - 1 - torch.log(RATIO)).mean()), rel=1e-5)


def test_gradient_matches_lightrft_clamped_logp_form():
    # LightRFT: loss = -A * where(A > 0, clamp(logp, max=old + ln(1+e)), clamp(logp, min=old + ln(1-e))), token-mean
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(3, 5, generator=gen) - 2
    logp = (old + torch.randn(3, 5, generator=gen) * 0.3).requires_grad_(True)
    adv = torch.randn(3, 5, generator=gen)
    loss, _ = cpgd_loss(logp, old, adv, clip_low=0.2)
    (g,) = torch.autograd.grad(loss, logp)
    ref = -adv * torch.where(adv > 0, torch.clamp(logp, max=old + L(1.2)), torch.clamp(logp, min=old + L(0.8)))
    (g_ref,) = torch.autograd.grad(ref.mean(), logp)
    torch.testing.assert_close(g, g_ref)
    torch.testing.assert_close(loss, ref.mean() + (adv * old).mean())  # values differ by the constant A * old


def test_on_policy_gradient_equals_ppo():
    logp = torch.randn(2, 3).requires_grad_(True)
    adv = torch.tensor([1.5, -0.5])
    for agg in ("token-mean", "seq-mean-token-sum"):
        a, _ = cpgd_loss(logp, logp.detach(), adv, agg=agg, drift_coef=0.3)
        b, _ = clipped_policy_loss(logp, logp.detach(), adv, agg=agg)
        assert a.item() == pytest.approx(0.0, abs=1e-7)
        torch.testing.assert_close(torch.autograd.grad(a, logp)[0], torch.autograd.grad(b, logp)[0])


def test_policy_drift_value_and_clipped_gradient():
    ratio, adv = torch.tensor([2.0, 0.5]), torch.zeros(2)
    k3 = ratio - 1 - torch.log(ratio)
    loss, m, grad = _run(ratio, adv, drift_coef=0.1)
    assert loss.item() == pytest.approx(0.1 * float(k3.mean()))
    assert m["policy_drift"] == pytest.approx(float(k3.mean())) and m["pg_loss"] == 0.0
    torch.testing.assert_close(grad, 0.1 * (ratio - 1) / 2)  # d k3 / d logp = r - 1
    loss_c, _, grad_c = _run(ratio, adv, drift_coef=0.1, drift_clip=0.2)
    assert loss_c.item() == pytest.approx(loss.item())  # same value
    torch.testing.assert_close(grad_c, 0.1 * torch.tensor([0.2, -0.2]) / 2)  # weight clipped to +-0.2


def test_masked_positions_change_nothing_incl_grad():
    gen = torch.Generator().manual_seed(2)
    old = torch.randn(3, 4, generator=gen) - 1
    clean = (old + torch.randn(3, 4, generator=gen) * 0.5).requires_grad_(True)
    adv = torch.randn(3, generator=gen)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]).bool()
    dirty = clean.detach().clone()
    dirty[~mask] = NAN
    dirty.requires_grad_(True)
    dirty_old = old.clone()
    dirty_old[~mask] = -INF
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        a, ma = cpgd_loss(clean, old, adv, mask, agg=agg, drift_coef=0.5, drift_clip=0.1)
        b, mb = cpgd_loss(dirty, dirty_old, adv, mask, agg=agg, drift_coef=0.5, drift_clip=0.1)
        assert torch.equal(a, b) and ma == mb
        (ga,) = torch.autograd.grad(a, clean)
        (gb,) = torch.autograd.grad(b, dirty)
        assert torch.equal(ga, gb) and not gb[~mask].any()


def test_clip_higher_and_argument_errors():
    loss, m, _ = _run(RATIO, ADV, clip_low=0.2, clip_high=0.6)
    # range [ln .8, ln 1.6]: lr=ln1.5 with A=+1 is no longer clipped
    assert loss.item() == pytest.approx((-L(1.5) - L(0.5) + L(1.1) + L(0.8)) / 4)
    assert m["clipfrac"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="dual_clip"):
        _run(RATIO, ADV, dual_clip=3.0)
    with pytest.raises(ValueError, match="clip_low"):
        _run(RATIO, ADV, clip_low=1.0)
    with pytest.raises(ValueError, match="drift_coef"):
        _run(RATIO, ADV, drift_coef=-1.0)
    with pytest.raises(ValueError, match="advantages"):
        cpgd_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3))


def test_cpgd_advantages_weights_hand_values():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    gids = torch.tensor([7, 7, 7, 7, 3, 3])  # group 7 mean .5, population std .5; group 3 constant
    torch.testing.assert_close(cpgd_advantages(rewards, gids, "std", eps=0.0),
                               torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0, 0.0]))
    # 2 groups, 1 with unequal rewards -> weight 2
    torch.testing.assert_close(cpgd_advantages(rewards, gids, "clip_filter"),
                               torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0, 0.0]))
    torch.testing.assert_close(cpgd_advantages(rewards, gids, "none"), torch.tensor([0.5, -0.5, 0.5, -0.5, 0, 0]))
    # 4 groups, 1 live: weight min(4, 3) = 3
    r4 = torch.tensor([1.0, 0.0, 2.0, 2.0, 5.0, 5.0, 0.0, 0.0])
    g4 = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    torch.testing.assert_close(cpgd_advantages(r4, g4, "clip_filter"), torch.tensor([1.5, -1.5] + [0.0] * 6))
    assert torch.equal(get_advantage_estimator("cpgd")(r4, g4, weight="none"), cpgd_advantages(r4, g4, "none"))
    perm = torch.randperm(8)
    torch.testing.assert_close(cpgd_advantages(r4[perm], g4[perm]), cpgd_advantages(r4, g4)[perm])
    with pytest.raises(ValueError, match="cpgd weight"):
        cpgd_advantages(r4, g4, "grpo")
