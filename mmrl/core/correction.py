"""Rollout correction: importance weights between the trainer's and the rollout engine's log-probs.

The rollout engine (vLLM, HF generate in bf16, a diffusion sampler, weights a step behind) samples with
pi_rollout; the trainer's forward gives pi_old for the same tokens. They differ (precision, kernels,
staleness), so every batch is slightly off-policy. Corrections, as verl's `rollout_correction`:

* TIS (truncated importance sampling): weight w = min(pi_old / pi_rollout, C) on the per-token policy loss
  (pass `weighted_advantages(adv, w)` as the advantages of any clipped policy loss).
* MIS (masked importance sampling, verl "rejection sampling"): positions / sequences whose ratio leaves
  [lower, upper] are dropped from the loss mask, hence also from the loss denominator.
* Veto: a sequence holding any token with ratio < veto_threshold is dropped whole.

Levels turn the per-position log-ratios d_t = old_t - rollout_t (valid positions only) into weights:
    token:     w_t = exp(d_t)
    sequence:  w   = exp(sum_t d_t)     product of token ratios (unbiased, high variance)
    geometric: w   = exp(mean_t d_t)    geometric mean, length-independent (verl: rejection only; here both)
Log-weights are clamped to [-20, 20] before exp (verl's safety bound); sequence / geometric weights are
broadcast to every valid position of the row. Weights are detached and 0 at masked positions.

Modes (what the trainer must do):
* decoupled: recompute old_logp with the trainer before the update (PPO ratio = pi / pi_old), then
  `rollout_correction(old_logp, rollout_logp, mask, is_level=..., rs_level=...)` once per batch; use
  `weighted_advantages(adv, out.weights)` and `out.mask` in the policy loss.
* bypass (the VLM recipe's `old_logprobs: rollout`): skip the old-log-prob forward, old_logp := rollout_logp.
  With a PPO-type loss the ratio pi / pi_rollout already is the importance weight: nothing to apply (the recipe
  refuses the combination). With the plain policy-gradient loss (`policy_loss: reinforce`; verl's bypass +
  use_policy_gradient, pg_is / pg_rs) the weights and masks come from the current policy in every micro-batch,
  `rollout_correction(logp.detach(), rollout_logp, mask, ...)`, and the loss is -sg(w) A logp on the kept tokens
  (`mmrl.vlm.update.PolicyGradientLoss.correction`). One forward fewer per step.
Diffusion: the same functions on per-denoising-step log-probs [B, T] (T = steps, mask = the SDE window):
"token" is per step, "sequence" the product over a trajectory's steps. [B] inputs are B rows of length 1.

source: verl trainer/ppo/rollout_corr_helper.py + docs/algo/rollout_corr.md; Liu, Li et al. 2025 "When Speed
Kills Stability" (richardli.xyz/rl-collapse); Yao et al. 2025 "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training" (fengyao.notion.site/off-policy-rl, TIS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

Tensor = torch.Tensor

LEVELS = ("token", "sequence", "geometric")
SAFETY_BOUND = 20.0  # exp(+-20): ~5e8 / ~2e-9, as verl


@dataclass
class RolloutCorrection:
    """`weights` [B, T] detached IS weights (None when IS is off), `mask` [B, T] bool: the input mask with
    rejected and vetoed positions removed, `metrics` floats keyed `rollout_corr/...`."""

    weights: Tensor | None
    mask: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def _prepare(trainer_logp: Tensor, rollout_logp: Tensor,
             mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (d = trainer - rollout, trainer, rollout, m bool), all [B, T] with 0 at masked positions; [B] -> [B, 1]."""
    if trainer_logp.shape != rollout_logp.shape:
        raise ValueError(f"trainer_logp/rollout_logp: shapes differ, {tuple(trainer_logp.shape)} vs "
                         f"{tuple(rollout_logp.shape)}")
    if trainer_logp.dim() not in (1, 2):
        raise ValueError(f"trainer_logp: expected shape [B] or [B, T], got {tuple(trainer_logp.shape)}")
    if mask is None:
        m = torch.ones_like(trainer_logp, dtype=torch.bool)
    elif mask.shape != trainer_logp.shape:
        raise ValueError(f"mask: expected shape {tuple(trainer_logp.shape)}, got {tuple(mask.shape)}")
    else:
        m = mask.to(trainer_logp.device).bool()
    dtype = torch.promote_types(trainer_logp.dtype, torch.float32)
    new, old = trainer_logp.detach().to(dtype), rollout_logp.detach().to(device=trainer_logp.device, dtype=dtype)
    if trainer_logp.dim() == 1:
        new, old, m = new[:, None], old[:, None], m[:, None]
    zero = torch.zeros((), dtype=dtype, device=new.device)
    new, old = torch.where(m, new, zero), torch.where(m, old, zero)  # nan/inf at masked positions: gone
    if bool(torch.isnan(new).any() | torch.isnan(old).any()):
        raise ValueError("trainer_logp/rollout_logp: nan at a valid (mask = 1) position")
    d = torch.where(m, new - old, zero)
    return torch.where(torch.isnan(d), zero, d), new, old, m  # -inf - -inf at a valid position: no evidence, 0


def _level_log_weights(d: Tensor, m: Tensor, level: str) -> tuple[Tensor, Tensor]:
    """-> (log-weight per position [B, T], log-weight per unit [N]); units = valid tokens or non-empty rows."""
    if level not in LEVELS:
        raise ValueError(f"unknown correction level {level!r}; valid: {list(LEVELS)}")
    if level == "token":
        return d, d[m]
    n = m.sum(-1)
    seq = d.sum(-1) if level == "sequence" else d.sum(-1) / n.clamp(min=1)
    return seq[:, None].expand_as(d), seq[n > 0]


def _unit_stats(prefix: str, log_units: Tensor, upper: float, lower: float) -> dict[str, float]:
    if log_units.numel() == 0:
        return {f"{prefix}_frac_high": 0.0, f"{prefix}_frac_low": 0.0}
    return {  # in log space: exact even beyond the safety bound
        f"{prefix}_frac_high": float((log_units > math.log(upper)).float().mean()),
        f"{prefix}_frac_low": float((log_units < math.log(lower)).float().mean()),
    }


def truncated_is_weights(trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor | None = None,
                         level: str = "token", threshold: float = 2.0,
                         batch_normalize: bool = False) -> tuple[Tensor, dict[str, float]]:
    """TIS weights w = min(exp(clamp(log_w, -20, 20)), threshold), log_w per `level` (module docstring).

    trainer_logp, rollout_logp, mask: [B, T] or [B] -> weights of the same shape (detached, 0 where masked).
    batch_normalize: divide by the mean applied weight over units (tokens or rows), so the batch mean is 1.
    metrics (units = valid tokens for "token", non-empty rows otherwise): rollout_is_mean/std/min/max of the
    untruncated weights, rollout_is_frac_high = share truncated (w > threshold), rollout_is_frac_low (w <
    1/threshold, informative), rollout_is_applied_mean, rollout_is_eff_sample_size = (sum w)^2 / (N sum w^2)
    of the applied weights (1 = uniform), rollout_is_batch_norm_factor when batch_normalize.
    """
    # source: verl rollout_corr_helper.compute_rollout_correction_weights (TIS, safety bound, batch normalize)
    if not threshold >= 1.0:
        raise ValueError(f"is_threshold: expected >= 1 (equal log-probs must keep weight 1), got {threshold}")
    d, _, _, m = _prepare(trainer_logp, rollout_logp, mask)
    logw, log_units = _level_log_weights(d, m, level)
    zero = torch.zeros((), dtype=d.dtype, device=d.device)
    raw = torch.exp(logw.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    w = torch.where(m, raw.clamp(max=threshold), zero)
    units = torch.exp(log_units.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    applied = units.clamp(max=threshold)
    metrics = _unit_stats("rollout_is", log_units, threshold, 1.0 / threshold)
    if units.numel():
        metrics.update({
            "rollout_is_mean": float(units.mean()), "rollout_is_std": float(units.std(unbiased=False)),
            "rollout_is_min": float(units.min()), "rollout_is_max": float(units.max()),
            "rollout_is_applied_mean": float(applied.mean()),
            "rollout_is_eff_sample_size": float(applied.sum() ** 2 / (applied.numel() * (applied**2).sum())),
        })
    else:
        metrics.update({k: 1.0 for k in ("rollout_is_mean", "rollout_is_min", "rollout_is_max",
                                          "rollout_is_applied_mean", "rollout_is_eff_sample_size")})
        metrics["rollout_is_std"] = 0.0
    if batch_normalize:
        factor = float(applied.mean()) if applied.numel() else 1.0
        w = w / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return w.reshape(trainer_logp.shape), metrics


def rejection_mask(trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor | None = None, level: str = "token",
                   upper: float = 2.0, lower: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """MIS: keep = mask & (lower <= w <= upper), w per `level`; lower defaults to 1 / upper (verl).

    Shapes as `truncated_is_weights`; returns a bool mask. "token" drops single positions, "sequence" and
    "geometric" whole rows. metrics: rollout_rs_masked_fraction (valid tokens dropped), rollout_rs_seq_masked_
    fraction (non-empty rows that lost any token), rollout_rs_frac_high / _frac_low (units above / below).
    """
    # source: verl rollout_corr_helper.compute_rollout_rejection_mask
    lower = 1.0 / upper if lower is None and upper > 0 else lower
    if not (lower is not None and 0.0 < lower <= 1.0 <= upper):
        raise ValueError(f"rs thresholds: expected 0 < lower <= 1 <= upper, got lower={lower}, upper={upper}")
    d, _, _, m = _prepare(trainer_logp, rollout_logp, mask)
    logw, log_units = _level_log_weights(d, m, level)
    keep = m & (logw >= math.log(lower)) & (logw <= math.log(upper))
    metrics = _unit_stats("rollout_rs", log_units, upper, lower)
    metrics.update(_drop_fractions("rollout_rs", m, keep))
    return keep.reshape(trainer_logp.shape), metrics


def _drop_fractions(prefix: str, m: Tensor, keep: Tensor) -> dict[str, float]:
    dropped, rows = m & ~keep, m.any(-1)
    return {f"{prefix}_masked_fraction": float(dropped.sum() / m.sum().clamp(min=1)),
            f"{prefix}_seq_masked_fraction": float((dropped.any(-1) & rows).sum() / rows.sum().clamp(min=1))}


def veto_mask(trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor | None = None,
              threshold: float = 1e-4) -> tuple[Tensor, dict[str, float]]:
    """Drop every row holding a valid token with (unclamped) ratio trainer / rollout < threshold.

    metrics: rollout_is_veto_fraction (non-empty rows dropped), rollout_is_catastrophic_token_fraction.
    """
    # source: verl rollout_corr_helper (rollout_token_veto_threshold)
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"veto_threshold: expected 0 < threshold < 1 (e.g. 1e-4), got {threshold}")
    d, _, _, m = _prepare(trainer_logp, rollout_logp, mask)
    bad = m & (d < math.log(threshold))
    keep = m & ~bad.any(-1, keepdim=True)
    rows = m.any(-1)
    metrics = {"rollout_is_veto_fraction": float((bad.any(-1) & rows).sum() / rows.sum().clamp(min=1)),
               "rollout_is_catastrophic_token_fraction": float(bad.sum() / m.sum().clamp(min=1))}
    return keep.reshape(trainer_logp.shape), metrics


def offpolicy_metrics(trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor | None = None) -> dict[str, float]:
    """Gap between the two log-prob sets over valid positions (rows = non-empty rows):
    kl = mean_tok(rollout - trainer) (k1 of KL(rollout || trainer), can be < 0); k3_kl = mean_tok(e^d - d - 1);
    training_log_ppl / rollout_log_ppl = mean_rows(-mean_t logp); training_ppl / rollout_ppl = mean_rows
    exp(-mean_t logp); log_ppl_diff = mean_rows(mean_t rollout - mean_t trainer), log_ppl_abs_diff, ppl_ratio
    = mean_rows exp(row diff); chi2_token = mean_tok(e^{2d}) - 1; chi2_seq = mean_rows(e^{2 sum_t d}) - 1.
    (For diffusion steps "ppl" is exp of a Gaussian log-density: compare runs, not to 1.)"""
    # source: verl rollout_corr_helper.compute_offpolicy_metrics
    d, new, old, m = _prepare(trainer_logp, rollout_logp, mask)
    n = m.sum(-1)
    rows = n > 0
    if not bool(rows.any()):
        return {}
    tok = lambda x: float(torch.where(m, x, torch.zeros_like(x)).sum() / m.sum())  # noqa: E731
    dc = d.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    mean_new, mean_old = (new.sum(-1) / n.clamp(min=1))[rows], (old.sum(-1) / n.clamp(min=1))[rows]
    diff = mean_old - mean_new
    return {
        "kl": tok(-d), "k3_kl": tok(torch.expm1(dc) - dc),  # expm1: exact for tiny d (exp(d) - 1 rounds to 0)
        "training_log_ppl": float(-mean_new.mean()), "rollout_log_ppl": float(-mean_old.mean()),
        "training_ppl": float(torch.exp(-mean_new).mean()), "rollout_ppl": float(torch.exp(-mean_old).mean()),
        "log_ppl_diff": float(diff.mean()), "log_ppl_abs_diff": float(diff.abs().mean()),
        "ppl_ratio": float(torch.exp(diff).mean()), "chi2_token": tok(torch.exp(2.0 * dc)) - 1.0,
        "chi2_seq": float(torch.exp(2.0 * d.sum(-1)[rows].clamp(-SAFETY_BOUND, SAFETY_BOUND)).mean()) - 1.0,
    }


def rollout_correction(trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor | None = None, *,
                       is_level: str | None = None, is_threshold: float = 2.0, is_batch_normalize: bool = False,
                       rs_level: str | None = None, rs_threshold: float = 2.0, rs_threshold_lower: float | None = None,
                       veto_threshold: float | None = None) -> RolloutCorrection:
    """All corrections at once (module docstring for the modes). trainer_logp, rollout_logp, mask: [B, T] or [B].

    is_level None -> no weights (metrics only); rs_level None -> no rejection; veto_threshold None -> no veto.
    With all three off this still returns the off-policy metrics. Metrics are prefixed `rollout_corr/`.
    """
    # source: verl rollout_corr_helper.compute_rollout_correction_and_rejection_mask
    keep = torch.ones_like(trainer_logp, dtype=torch.bool) if mask is None else mask.to(trainer_logp.device).bool()
    if keep.shape != trainer_logp.shape:
        raise ValueError(f"mask: expected shape {tuple(trainer_logp.shape)}, got {tuple(keep.shape)}")
    metrics: dict[str, float] = {}
    weights = None
    if is_level is not None:
        weights, mt = truncated_is_weights(trainer_logp, rollout_logp, keep, is_level, is_threshold,
                                           is_batch_normalize)
        metrics.update(mt)
    out = keep
    if rs_level is not None:
        out, mt = rejection_mask(trainer_logp, rollout_logp, keep, rs_level, rs_threshold, rs_threshold_lower)
        metrics.update(mt)
    if veto_threshold is not None:
        vkeep, mt = veto_mask(trainer_logp, rollout_logp, keep, veto_threshold)
        out = out & vkeep
        metrics.update(mt)
    metrics.update(offpolicy_metrics(trainer_logp, rollout_logp, keep))
    return RolloutCorrection(weights, out, {f"rollout_corr/{k}": v for k, v in metrics.items()})


def weighted_advantages(advantages: Tensor, weights: Tensor | None) -> Tensor:
    """advantages[B] or [B, T] times IS weights[B, T] (None -> advantages unchanged, [B] kept as is).

    A PPO-clip / GSPO / CPGD per-position loss is positively homogeneous in the advantage (l(w A) = w l(A)
    for w >= 0, the clip and dual clip included), so w * A is exactly "multiply the per-token loss by w"
    (verl: pg_losses * rollout_is_weights) and works with `clipped_policy_loss` unchanged."""
    if weights is None:
        return advantages
    adv = advantages.to(device=weights.device, dtype=weights.dtype)
    if adv.dim() == 1 and weights.dim() == 2 and adv.shape[0] == weights.shape[0]:
        adv = adv[:, None].expand_as(weights)
    if adv.shape != weights.shape:
        raise ValueError(f"advantages: expected shape [B] or {tuple(weights.shape)}, got {tuple(advantages.shape)}")
    return adv * weights.detach()
