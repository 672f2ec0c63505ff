import math

import pytest
import torch

from mmrl.core.losses import (
    POLICY_LOSSES,
    agg_loss,
    clipped_policy_loss,
    dpo_loss,
    get_policy_loss,
    gspo_policy_loss,
    nft_loss,
    nft_optimality_prob,
)

NAN, INF = float("nan"), float("inf")


def _softplus(x: float) -> float:  # -logsigmoid(x) = log(1 + e^-x)
    return math.log1p(math.exp(-x))


# ---------------------------------------------------------------------------------------------- agg_loss


def test_agg_modes_ragged_hand_values():
    # row 0 valid 1 2 3 4 (sum 10, n 4); row 1 valid 5 6 (sum 11, n 2); row 2 fully masked
    loss_mat = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, NAN, INF], [7.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    expect = {
        "token-mean": 21 / 6,  # 3.5
        "seq-mean-token-mean": (10 / 4 + 11 / 2) / 2,  # 4.0
        "seq-mean-token-sum": (10 + 11) / 2,  # 10.5
        "seq-mean-token-sum-norm": (10 + 11) / (2 * 4),  # 2.625 (norm_const = T = 4)
    }
    for mode, value in expect.items():
        assert agg_loss(loss_mat, mask, mode).item() == pytest.approx(value)
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", norm_const=10).item() == pytest.approx(21 / 20)


def test_agg_masked_values_change_nothing_incl_grad():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    clean = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]], requires_grad=True)
    dirty = torch.tensor([[1.0, 2.0, NAN], [3.0, INF, -INF]], requires_grad=True)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        a, b = agg_loss(clean, mask, mode), agg_loss(dirty, mask, mode)
        assert torch.equal(a, b)
        ga, = torch.autograd.grad(a, clean)
        gb, = torch.autograd.grad(b, dirty)
        assert torch.equal(ga, gb) and torch.equal(gb[~mask], torch.zeros(3))


def test_agg_1d_and_empty():
    x = torch.tensor([1.0, NAN, 3.0])
    m = torch.tensor([1, 0, 1])
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        assert agg_loss(x, m, mode).item() == pytest.approx(2.0)  # [B] = B sequences of length 1
    assert agg_loss(torch.ones(2, 3), torch.zeros(2, 3)).item() == 0.0
    with pytest.raises(ValueError, match="valid"):
        agg_loss(x, m, "sum")


# ---------------------------------------------------------------------------------------------- PPO clip

# ratios 1.5, 0.5, 1.1, 0.7 with advantages +1, +1, -1, -1
RATIO = torch.tensor([1.5, 0.5, 1.1, 0.7])
ADV = torch.tensor([1.0, 1.0, -1.0, -1.0])


def _loss(ratio, adv, **kw):
    logp = torch.log(ratio).clone().requires_grad_(True)
    loss, metrics = clipped_policy_loss(logp, torch.zeros_like(logp), adv, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, metrics, grad


def test_ppo_clip_symmetric_hand_values():
    loss, metrics, grad = _loss(RATIO, ADV)
    # per token max(-A r, -A clip(r, .8, 1.2)):
    #   r=1.5 A=+1: max(-1.5, -1.2) = -1.2 (clipped)   r=0.5 A=+1: max(-0.5, -0.8) = -0.5
    #   r=1.1 A=-1: max(1.1, 1.1) = 1.1                r=0.7 A=-1: max(0.7, 0.8) = 0.8 (clipped)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.1 + 0.8) / 4)
    assert metrics["clipfrac"] == pytest.approx(0.5) and metrics["clipfrac_lower"] == 0.0
    # d/dlogp of -A r / 4 = -A r / 4 where not clipped, 0 where clipped
    torch.testing.assert_close(grad, torch.tensor([0.0, -0.5 / 4, 1.1 / 4, 0.0]))
    assert metrics["ratio_mean"] == pytest.approx(0.95) and metrics["ratio_max"] == pytest.approx(1.5)
    # old vs new: k1 = mean(-log r), k3 = mean(r - 1 - log r)
    assert metrics["approx_kl_k1"] == pytest.approx(float(-torch.log(RATIO).mean()), rel=1e-5)
    assert metrics["approx_kl"] == pytest.approx(float((RATIO - 1 - torch.log(RATIO)).mean()), rel=1e-5)


def test_clip_higher_asymmetric():
    loss, metrics, _ = _loss(RATIO, ADV, clip_low=0.2, clip_high=0.6)
    # clip range [0.8, 1.6]: r=1.5 A=+1 no longer clipped -> -1.5; r=0.7 A=-1 still -> 0.8
    assert loss.item() == pytest.approx((-1.5 - 0.5 + 1.1 + 0.8) / 4)
    assert metrics["clipfrac"] == pytest.approx(0.25)


def test_dual_clip_negative_advantage():
    ratio = torch.tensor([5.0, 2.0, 5.0])
    adv = torch.tensor([-1.0, -1.0, 1.0])
    loss, metrics, grad = _loss(ratio, adv, dual_clip=3.0)
    # r=5 A=-1: max(5, 1.2) = 5, capped at -A*c = 3 (no gradient)
    # r=2 A=-1: max(2, 1.2) = 2 < 3 -> 2 (gradient -A r = 2)
    # r=5 A=+1: max(-5, -1.2) = -1.2 (clipped; dual clip applies to A<0 only)
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3)
    assert metrics["clipfrac_lower"] == pytest.approx(1 / 3)
    torch.testing.assert_close(grad, torch.tensor([0.0, 2.0 / 3, 0.0]))
    # without dual clip the first token costs 5
    assert _loss(ratio, adv)[0].item() == pytest.approx((5.0 + 2.0 - 1.2) / 3)
    with pytest.raises(ValueError, match="dual_clip"):
        _loss(ratio, adv, dual_clip=1.0)


def test_policy_loss_masked_positions_change_nothing():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=gen) * 0.1 - 1
    old = logp + torch.randn(3, 5, generator=gen) * 0.3
    adv = torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    dirty = lambda x, v: torch.where(mask, x, torch.full_like(x, v))  # noqa: E731
    for fn in (clipped_policy_loss, gspo_policy_loss):
        for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
            a_in = logp.clone().requires_grad_(True)
            b_in = dirty(logp, NAN).requires_grad_(True)
            la, ma = fn(a_in, old, adv, mask, clip_low=0.2, agg=agg, dual_clip=3.0)
            lb, mb = fn(b_in, dirty(old, INF), dirty(adv, NAN), mask, clip_low=0.2, agg=agg, dual_clip=3.0)
            assert torch.equal(la, lb) and ma == mb
            (ga,) = torch.autograd.grad(la, a_in)
            (gb,) = torch.autograd.grad(lb, b_in)
            assert torch.equal(ga, gb) and torch.isfinite(gb).all() and torch.equal(gb[~mask], torch.zeros(6))


def test_sequence_advantage_broadcast_and_batch_permutation():
    gen = torch.Generator().manual_seed(2)
    logp = torch.randn(4, 6, generator=gen) * 0.2
    old = torch.randn(4, 6, generator=gen) * 0.2
    adv = torch.randn(4, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.3
    a, _ = clipped_policy_loss(logp, old, adv, mask)
    b, _ = clipped_policy_loss(logp, old, adv[:, None].expand(4, 6), mask)
    assert torch.equal(a, b)
    perm = torch.tensor([2, 0, 3, 1])
    for agg in ("token-mean", "seq-mean-token-mean"):
        x, _ = clipped_policy_loss(logp, old, adv, mask, agg=agg)
        y, _ = clipped_policy_loss(logp[perm], old[perm], adv[perm], mask[perm], agg=agg)
        torch.testing.assert_close(x, y)


def test_diffusion_1d_inputs():
    # one denoising step per sample: [B] log-probs, no mask; equals the [B, 1] token case
    loss, metrics, _ = _loss(RATIO, ADV)
    loss2, _ = clipped_policy_loss(torch.log(RATIO)[:, None], torch.zeros(4, 1), ADV[:, None], torch.ones(4, 1))
    torch.testing.assert_close(loss, loss2)


def test_gspo_sequence_ratio():
    # one sequence, token log-ratios 0.1 and 0.3 -> s = exp(0.2) = 1.22140
    logp = torch.tensor([[0.1, 0.3, NAN]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    adv = torch.tensor([1.0])
    s = math.exp(0.2)
    # default clip (3e-4, 4e-4): s clipped to 1.0004 -> loss -1.0004, no gradient
    loss, metrics = gspo_policy_loss(logp, torch.zeros(1, 3), adv, mask)
    assert loss.item() == pytest.approx(-1.0004) and metrics["clipfrac"] == 1.0
    # wide clip: loss -s; d/dlogp_t = -A * s / n_tokens = -s / 2 on each valid token
    loss, metrics = gspo_policy_loss(logp, torch.zeros(1, 3), adv, mask, clip_low=0.5, clip_high=0.5)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-s, rel=1e-6) and metrics["ratio_mean"] == pytest.approx(s, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-s / 2, -s / 2, 0.0]]))


def test_policy_loss_registry():
    assert get_policy_loss("ppo_clip") is clipped_policy_loss and "gspo" in POLICY_LOSSES
    with pytest.raises(ValueError, match="valid: .*ppo_clip"):
        get_policy_loss("a2c")


# ---------------------------------------------------------------------------------------------- DPO


def test_dpo_hand_values():
    pol_w = torch.tensor([0.1, 0.3], requires_grad=True)
    pol_l = torch.tensor([0.2, 0.1])
    ref_w = torch.tensor([0.2, 0.2])
    ref_l = torch.tensor([0.1, 0.05])
    loss, m = dpo_loss(pol_w, pol_l, ref_w, ref_l, beta=10.0)
    # model diff [-0.1, 0.2], ref diff [0.1, 0.15] -> difference [-0.2, 0.05]
    # inside = -0.5 * 10 * [-0.2, 0.05] = [1.0, -0.25]
    assert loss.item() == pytest.approx((_softplus(1.0) + _softplus(-0.25)) / 2, rel=1e-6)
    assert m["implicit_acc"] == 0.5
    assert m["reward_margin"] == pytest.approx(0.375)
    # kl proxy: 0.5 * (mean(pol_w - ref_w) + mean(pol_l - ref_l)) = 0.5 * (0 + 0.075)
    assert m["kl_proxy"] == pytest.approx(0.0375)
    # a worse fit on the preferred sample must raise the loss
    (g,) = torch.autograd.grad(loss, pol_w)
    assert (g > 0).all()


def test_dpo_policy_equals_reference_is_log2():
    x = torch.tensor([0.3, 0.1, 0.7])
    y = torch.tensor([0.2, 0.4, 0.7])
    loss, m = dpo_loss(x, y, x, y, beta=5000.0)
    assert loss.item() == pytest.approx(math.log(2.0)) and m["implicit_acc"] == 0.0


# ---------------------------------------------------------------------------------------------- NFT


def _nft_batch():
    # sample 0: x0 = [1, -1], eps = [0, 2], t = 0.5 -> xt = 0.5*x0 + 0.5*eps = [0.5, 0.5]
    # sample 1: x0 = [0, 2], eps = [1, 1], t = 0.25 -> xt = [0.25, 1.75]; v_pred = v_old = eps - x0 (exact)
    x0 = torch.tensor([[1.0, -1.0], [0.0, 2.0]])
    xt = torch.tensor([[0.5, 0.5], [0.25, 1.75]])
    t = torch.tensor([0.5, 0.25])
    v_pred = torch.tensor([[-1.0, 2.0], [1.0, -1.0]], requires_grad=True)
    v_old = torch.tensor([[0.0, 3.0], [1.0, -1.0]])
    return v_pred, v_old, x0, xt, t


def test_nft_hand_values():
    v_pred, v_old, x0, xt, t = _nft_batch()
    r = torch.tensor([0.8, 0.3])
    loss, m = nft_loss(v_pred, v_old, x0, xt, t, r, beta=0.5)
    # sample 0, beta 0.5:
    #   v_pos = .5*[-1, 2] + .5*[0, 3] = [-0.5, 2.5];  x0_pos = xt - .5*v_pos = [0.75, -0.75]; err [-.25, .25]
    #   w_pos = mean|err| = 0.25 -> L_pos = mean(.0625/.25) = 0.25
    #   v_neg = 1.5*[0, 3] - .5*[-1, 2] = [0.5, 3.5]; x0_neg = [0.25, -1.25]; err [-.75, -.25]
    #   w_neg = 0.5 -> L_neg = mean([.5625, .0625] / .5) = 0.625
    #   r*L_pos + (1-r)*L_neg = .8*.25 + .2*.625 = 0.325
    # sample 1: exact predictions -> 0 (weights clamp to 1e-5, errors are 0)
    # loss = mean([0.325, 0]) / beta = 0.325
    assert loss.item() == pytest.approx(0.325)
    assert m["pos_loss"] == pytest.approx(0.125) and m["neg_loss"] == pytest.approx(0.3125)
    assert m["old_deviate"] == pytest.approx((1 + 1) / 4)
    # no adaptive weighting: L_pos = .0625, L_neg = mean(.5625, .0625) = .3125
    #   (.8*.0625 + .2*.3125) / 2 / .5 = 0.1125
    loss, _ = nft_loss(v_pred, v_old, x0, xt, t, r, beta=0.5, adaptive_weighting=False)
    assert loss.item() == pytest.approx(0.1125)
    loss, _ = nft_loss(v_pred, v_old, x0, xt, t, r, beta=0.5, loss_scale=5.0)
    assert loss.item() == pytest.approx(5 * 0.325)


def test_nft_gradient_only_through_v_pred():
    v_pred, v_old, x0, xt, t = _nft_batch()
    v_old.requires_grad_(True)
    loss, _ = nft_loss(v_pred, v_old, x0, xt, t, torch.tensor([1.0, 1.0]), beta=1.0, adaptive_weighting=False)
    loss.backward()
    assert v_old.grad is None
    # beta = 1, r = 1: loss = mean_B mean_d (xt - t v - x0)^2 -> dL/dv = -2 t err / (B * D)
    # sample 0 err = xt - .5*v - x0 = [0.5+0.5-1, 0.5-1+1] = [0, 0.5] -> grad [0, -2*.5*.5/4] = [0, -0.125]
    torch.testing.assert_close(v_pred.grad, torch.tensor([[0.0, -0.125], [0.0, 0.0]]))


def test_nft_optimality_prob():
    a = torch.tensor([-10.0, -2.5, 0.0, 2.5, 10.0])
    torch.testing.assert_close(nft_optimality_prob(a, 5.0), torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]))


def test_nft_bad_inputs():
    v_pred, v_old, x0, xt, t = _nft_batch()
    with pytest.raises(ValueError, match="r: expected shape"):
        nft_loss(v_pred, v_old, x0, xt, t, torch.ones(3), beta=1.0)
    with pytest.raises(ValueError, match="beta"):
        nft_loss(v_pred, v_old, x0, xt, t, torch.ones(2), beta=0.0)


def test_reinforce_loss_by_hand():
    """-A * logp averaged over valid tokens; its gradient is -A / n per valid token (PPO-clip's at ratio 1)."""
    from mmrl.core.losses import get_policy_loss, reinforce_policy_loss

    assert get_policy_loss("reinforce") is reinforce_policy_loss
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0, -1.0], [-0.3, -0.7, -9.0]])
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    loss, m = reinforce_policy_loss(logp, old, adv, mask, clip_low=0.2)
    want = -(2.0 * (-1.0 - 2.0 - 0.5) + -1.0 * (-0.3 - 0.7)) / 5
    assert float(loss.detach()) == pytest.approx(want) and m["pg_loss"] == pytest.approx(want) and m["clipfrac"] == 0.0
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.4, -0.4, -0.4], [0.2, 0.2, 0.0]]))
    assert m["ratio_max"] == pytest.approx(math.exp(0.5))  # exp(-0.5 - -1.0) at token 3 of row 0
    # same gradient as PPO-clip at ratio 1 (old = logp)
    from mmrl.core.losses import clipped_policy_loss

    p2 = logp.detach().clone().requires_grad_(True)
    clipped_policy_loss(p2, p2.detach(), adv, mask)[0].backward()
    assert torch.allclose(p2.grad, logp.grad)


def test_clipfrac_as_flow_grpo_defines_it():
    # flow_grpo (scripts/train_sd3.py at ac4c86e): clipfrac = mean(|r - 1| > c), _gt_one (r - 1 > c), _lt_one
    # (1 - r > c): whatever the advantage's sign; ours (`clipfrac`) counts where the clip removed the gradient
    loss, metrics, _ = _loss(RATIO, ADV)  # r = 1.5, 0.5, 1.1, 0.7 with A = +1, +1, -1, -1; c = 0.2
    r = RATIO
    assert metrics["clipfrac_ratio"] == pytest.approx(float(((r - 1).abs() > 0.2).float().mean()))  # 3/4
    assert metrics["clipfrac_ratio"] == pytest.approx(0.75)
    assert metrics["clipfrac_ratio_high"] == pytest.approx(0.25) and metrics["clipfrac_ratio_low"] == pytest.approx(0.5)
    assert metrics["clipfrac"] == pytest.approx(0.5)  # r=0.5 with A > 0 is outside the range but not clipped
    _, asym, _ = _loss(RATIO, ADV, clip_low=0.2, clip_high=0.6)  # [0.8, 1.6]: only 0.5 and 0.7 are outside
    assert asym["clipfrac_ratio"] == pytest.approx(0.5) and asym["clipfrac_ratio_high"] == 0.0
