import math

import pytest
import torch

from mmrl.core.correction import (
    offpolicy_metrics,
    rejection_mask,
    rollout_correction,
    truncated_is_weights,
    veto_mask,
    weighted_advantages,
)
from mmrl.core.losses import clipped_policy_loss

NAN, INF = float("nan"), float("inf")
L = math.log


def test_token_tis_hand_values():
    # ratios trainer/rollout = 1, 3, 0.25 ; C = 2 -> weights 1, 2, 0.25
    trainer = torch.tensor([[0.0, L(3.0), L(0.25)]]) - 1.0
    rollout = torch.full((1, 3), -1.0)
    w, m = truncated_is_weights(trainer, rollout, level="token", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 0.25]]))
    assert m["rollout_is_frac_high"] == pytest.approx(1 / 3)  # the 3 was truncated
    assert m["rollout_is_frac_low"] == pytest.approx(1 / 3)  # 0.25 < 1/2
    assert m["rollout_is_mean"] == pytest.approx((1 + 3 + 0.25) / 3)
    assert m["rollout_is_max"] == pytest.approx(3.0) and m["rollout_is_min"] == pytest.approx(0.25)
    assert m["rollout_is_applied_mean"] == pytest.approx(3.25 / 3)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(3.25**2 / (3 * (1 + 4 + 0.0625)))


def test_sequence_and_geometric_levels_hand_values():
    # row 0: valid ratios 2, 1.5 (third position masked, holds nan); row 1: one valid ratio 0.5
    trainer = torch.tensor([[L(2.0), L(1.5), NAN], [L(0.5), 0.0, 0.0]])
    rollout = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    w, m = truncated_is_weights(trainer, rollout, mask, level="sequence", threshold=2.0)
    # products 3 -> truncated to 2, and 0.5; broadcast to valid positions, 0 elsewhere
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0, 0.0], [0.5, 0.0, 0.0]]))
    assert m["rollout_is_frac_high"] == pytest.approx(0.5) and m["rollout_is_mean"] == pytest.approx(1.75)
    w, _ = truncated_is_weights(trainer, rollout, mask, level="geometric", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[math.sqrt(3.0)] * 2 + [0.0], [0.5, 0.0, 0.0]]))


def test_rejection_token_sequence_geometric():
    trainer = torch.log(torch.tensor([[1.0, 3.0, 0.25, 1.9], [1.2, 1.2, 1.2, 1.2]]))
    rollout = torch.zeros(2, 4)
    keep, m = rejection_mask(trainer, rollout, level="token", upper=2.0)  # lower = 1/2
    assert keep.tolist() == [[True, False, False, True], [True] * 4]
    assert m["rollout_rs_masked_fraction"] == pytest.approx(2 / 8)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    # sequence products: 1.425 (kept) and 1.2^4 = 2.07 (> 2: whole row dropped)
    keep, m = rejection_mask(trainer, rollout, level="sequence", upper=2.0)
    assert keep.tolist() == [[True] * 4, [False] * 4]
    assert m["rollout_rs_frac_high"] == pytest.approx(0.5) and m["rollout_rs_frac_low"] == 0.0
    # geometric means 1.425^(1/4) = 1.093 and 1.2: a tight band [1/1.1, 1.1] keeps row 0 only
    keep, _ = rejection_mask(trainer, rollout, level="geometric", upper=1.1)
    assert keep.tolist() == [[True] * 4, [False] * 4]
    keep, m = rejection_mask(-trainer, rollout, level="geometric", upper=1.1)  # 1/1.093 kept, 1/1.2 < 1/1.1
    assert keep.tolist() == [[True] * 4, [False] * 4] and m["rollout_rs_frac_low"] == pytest.approx(0.5)


def test_veto_drops_whole_row():
    trainer = torch.log(torch.tensor([[1.0, 1e-5, 1.0], [0.9, 1.1, 1e-5]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # row 1's catastrophic token is padding
    keep, m = veto_mask(trainer, torch.zeros(2, 3), mask, threshold=1e-4)
    assert keep.tolist() == [[False] * 3, [True, True, False]]
    assert m["rollout_is_veto_fraction"] == pytest.approx(0.5)
    assert m["rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 5)


def _full(trainer, rollout, mask):
    return rollout_correction(trainer, rollout, mask, is_level="token", rs_level="sequence", rs_threshold=3.0,
                              veto_threshold=1e-3)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_masked_positions_change_nothing(level):
    gen = torch.Generator().manual_seed(0)
    trainer = torch.randn(4, 6, generator=gen) * 0.3 - 2
    rollout = trainer + torch.randn(4, 6, generator=gen) * 0.3
    mask = torch.rand(4, 6, generator=gen) > 0.3
    mask[3] = False  # a fully padded row
    dirty_t, dirty_r = trainer.clone(), rollout.clone()
    dirty_t[~mask], dirty_r[~mask] = NAN, -INF
    dirty_r[0][~mask[0]] = INF
    a = rollout_correction(trainer, rollout, mask, is_level=level, rs_level=level, rs_threshold=1.5,
                           veto_threshold=1e-3)
    b = rollout_correction(dirty_t, dirty_r, mask, is_level=level, rs_level=level, rs_threshold=1.5,
                           veto_threshold=1e-3)
    assert torch.equal(a.weights, b.weights) and torch.equal(a.mask, b.mask)
    assert a.metrics == b.metrics and all(math.isfinite(v) for v in a.metrics.values())
    assert not a.weights[~mask].any() and not a.mask[~mask].any()


def test_equal_logprobs_weight_one_nothing_dropped():
    logp = torch.randn(3, 5) - 1
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]).bool()
    for level in ("token", "sequence", "geometric"):
        out = rollout_correction(logp, logp.clone(), mask, is_level=level, is_threshold=1.0, rs_level=level,
                                 rs_threshold=1.0001, veto_threshold=0.5)
        assert torch.equal(out.weights, mask.float()) and torch.equal(out.mask, mask)
        met = out.metrics
        for key in ("rollout_is_frac_high", "rollout_is_frac_low", "rollout_rs_masked_fraction",
                    "rollout_is_veto_fraction", "kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff"):
            assert met[f"rollout_corr/{key}"] == pytest.approx(0.0, abs=1e-6), key
        assert met["rollout_corr/ppl_ratio"] == pytest.approx(1.0)
        assert met["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.0)


def test_offpolicy_metrics_hand_values():
    trainer = torch.tensor([[-1.0, -2.0], [-0.5, 9.0]])
    rollout = torch.tensor([[-1.5, -1.5], [-1.0, 9.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    m = offpolicy_metrics(trainer, rollout, mask)
    d = torch.tensor([0.5, -0.5, 0.5])  # trainer - rollout at the 3 valid tokens
    assert m["kl"] == pytest.approx(float(-d.mean()))
    assert m["k3_kl"] == pytest.approx(float((d.exp() - d - 1).mean()))
    assert m["chi2_token"] == pytest.approx(float((2 * d).exp().mean() - 1))
    assert m["chi2_seq"] == pytest.approx((math.exp(0.0) + math.exp(1.0)) / 2 - 1)  # row sums 0, 0.5
    assert m["training_log_ppl"] == pytest.approx((1.5 + 0.5) / 2)
    assert m["rollout_log_ppl"] == pytest.approx((1.5 + 1.0) / 2)
    assert m["log_ppl_diff"] == pytest.approx((0.0 - 0.5) / 2)
    assert m["ppl_ratio"] == pytest.approx((1 + math.exp(-0.5)) / 2)


def test_weighted_advantages_equal_per_token_loss_weights():
    # PPO-clip loss is homogeneous in A: clipped_policy_loss(adv * w) == mean(w * l(adv)) over kept tokens
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(3, 4, generator=gen) - 1
    logp = (old + torch.randn(3, 4, generator=gen) * 0.3).requires_grad_(True)
    rollout = old + torch.randn(3, 4, generator=gen) * 0.4
    adv = torch.tensor([1.0, -2.0, 0.5])
    mask = torch.ones(3, 4, dtype=torch.bool)
    out = rollout_correction(old, rollout, mask, is_level="token", is_threshold=1.5, rs_level="token",
                             rs_threshold=1.8)
    loss, _ = clipped_policy_loss(logp, old, weighted_advantages(adv, out.weights), out.mask)
    _, ref_met = clipped_policy_loss(logp, old, adv, out.mask)
    ratio = torch.exp(logp - old)
    a = adv[:, None].expand(3, 4)
    per_tok = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    expect = (out.weights * per_tok)[out.mask].sum() / out.mask.sum()
    torch.testing.assert_close(loss, expect)
    assert out.mask.sum() < 12  # rejection really removed tokens from the denominator
    assert weighted_advantages(adv, None) is adv


def test_1d_inputs_diffusion_single_step_and_errors():
    trainer = torch.log(torch.tensor([3.0, 1.0, 0.5]))
    w, _ = truncated_is_weights(trainer, torch.zeros(3), level="sequence", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([2.0, 1.0, 0.5]))
    assert rejection_mask(trainer, torch.zeros(3), upper=2.0)[0].tolist() == [False, True, True]
    with pytest.raises(ValueError, match="valid"):
        truncated_is_weights(trainer, torch.zeros(3), level="seq")
    with pytest.raises(ValueError, match="is_threshold"):
        truncated_is_weights(trainer, torch.zeros(3), threshold=0.5)
    with pytest.raises(ValueError, match="rs thresholds"):
        rejection_mask(trainer, torch.zeros(3), upper=2.0, lower=1.5)
    with pytest.raises(ValueError, match="shapes differ"):
        rollout_correction(trainer, torch.zeros(4))
    with pytest.raises(ValueError, match="nan at a valid"):
        rollout_correction(torch.tensor([NAN, 0.0]), torch.zeros(2), is_level="token")


def test_batch_normalize_and_metrics_only():
    trainer = torch.log(torch.tensor([[1.0, 3.0], [0.5, 1.0]]))
    w, m = truncated_is_weights(trainer, torch.zeros(2, 2), threshold=2.0, batch_normalize=True)
    assert float(w.mean()) == pytest.approx(1.0)  # applied 1, 2, .5, 1 (mean 1.125) / 1.125
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(1.125)
    out = rollout_correction(trainer, torch.zeros(2, 2))
    assert out.weights is None and out.mask.all() and "rollout_corr/kl" in out.metrics
    with pytest.raises(ValueError, match="advantages"):
        weighted_advantages(torch.ones(3), torch.ones(2, 2))


def test_diffusion_per_step_logprobs_in_the_sde_window():
    # [B=2, T=4 denoising steps]; only steps 1, 2 are SDE (stochastic) steps with log-probs, the rest ODE
    trainer = torch.tensor([[NAN, L(1.2), L(1.5), NAN], [NAN, L(0.9), L(1.0), NAN]]) - 300.0  # large Gaussian logps
    rollout = torch.full((2, 4), -300.0)
    window = torch.tensor([[0, 1, 1, 0]] * 2).bool()
    out = rollout_correction(trainer, rollout, window, is_level="sequence", is_threshold=2.0, rs_level="token",
                             rs_threshold=1.4)
    # trajectory weights: 1.2 * 1.5 = 1.8 and 0.9; step 2 of row 0 (1.5 > 1.4) rejected alone
    torch.testing.assert_close(out.weights, torch.tensor([[0, 1.8, 1.8, 0], [0, 0.9, 0.9, 0]]), atol=1e-4, rtol=0)
    assert out.mask.tolist() == [[False, True, False, False], [False, True, True, False]]
    step = truncated_is_weights(trainer[:, 1], rollout[:, 1], level="token")[0]  # one step at a time: [B]
    torch.testing.assert_close(step, torch.tensor([1.2, 0.9]), atol=1e-4, rtol=0)


def test_bounds_against_verl_k1_convention():
    # verl's newer rejection sampling (trainer/ppo/rollout_corr_helper.py at b178a3c, compute_rollout_rejection_mask)
    # bounds k1 = -log r (r = pi_old / pi_rollout): rollout_rs="token_k1", threshold "L_U" keeps a token iff
    # log L <= -log r <= log U, i.e. 1/U <= r <= 1/L. Ours bound r itself: rs_threshold_lower = 1/U, rs_threshold
    # = 1/L give the same mask (also per sequence: seq_sum_k1 <-> "sequence", seq_mean_k1 <-> "geometric").
    ratios = torch.tensor([[0.3, 0.6, 0.9, 1.0, 1.4, 1.9, 2.6, 5.0]])
    old, rollout = torch.log(ratios), torch.zeros_like(ratios)
    lo, up = 0.5, 1.5  # verl "0.5_1.5": asymmetric
    k1 = -(old - rollout)
    verl_keep = (k1 >= math.log(lo)) & (k1 <= math.log(up))
    ours, _ = rejection_mask(old, rollout, level="token", upper=1 / lo, lower=1 / up)
    assert torch.equal(ours, verl_keep)
    assert ours.tolist() == [[False, False, True, True, True, True, False, False]]  # r in [2/3, 2]
    # the same numbers read as bounds on r (our convention) keep another set: [0.5, 1.5]
    direct, _ = rejection_mask(old, rollout, level="token", upper=up, lower=lo)
    assert direct.tolist() == [[False, True, True, True, True, False, False, False]]
    # sequence level: seq_sum_k1 = -sum_t log r_t bounded by [log L, log U] <-> our "sequence" with 1/U, 1/L
    seq = torch.log(torch.tensor([[1.2, 1.3], [0.9, 0.95], [0.5, 0.5]]))
    k1_sum = -seq.sum(-1)
    verl_rows = (k1_sum >= math.log(lo)) & (k1_sum <= math.log(up))
    ours_seq, _ = rejection_mask(seq, torch.zeros_like(seq), level="sequence", upper=1 / lo, lower=1 / up)
    assert ours_seq.all(-1).tolist() == verl_rows.tolist() == [True, True, False]
