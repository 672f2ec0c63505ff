"""CPGD: Clipped Policy Gradient Optimization with Policy Drift (Liu et al. 2025, arXiv 2505.12504).

Objective (maximised) for y ~ pi_old, r_t = pi_theta(y_t | ...) / pi_old(y_t | ...):
    sum_t min( ln r_t * A,  clip(ln r_t, ln(1 - eps_low), ln(1 + eps_high)) * A )  -  alpha * KL(pi_old || pi_theta)
versus PPO: the surrogate is the log-ratio, so its gradient is A * grad ln pi (policy-gradient form, no ratio
factor that can blow up), clipped like PPO (for A > 0 only the upper bound binds, for A < 0 the lower one: no
gradient once the policy moved eps in the advantage's direction), plus an explicit policy-drift penalty.
Drift per token with the k3 estimator r - 1 - ln r (unbiased for KL(pi_old || pi_theta) at y ~ pi_old, >= 0),
whose gradient is (r - 1) grad ln pi. MM-EUREKA (the authors' code) exposes a drift coefficient
(`policy_drift_coef`, 0.01) and a drift clip range (`policy_drift_clip_eps`, 0.2); here `drift_clip = delta`
bounds the drift gradient's weight to clip(r, 1 - delta, 1 + delta) - 1 and keeps the value k3 (our reading of
that clip; `drift_clip=None` is the plain k3 gradient).

Advantages (LightRFT `CPGDCalculator`): sequence score R, group baseline, then a weight:
    A_i = w * (R_i - mean_g R)      w = 1 / (std_g + eps)     ("std": population std, LightRFT STD_weight)
                                    w = min(G / G_live, max_w) ("clip_filter": G groups in the batch, G_live with
                                                               unequal rewards; rescales for the zero-advantage
                                                               groups, capped at 3 as the paper's clip-filter-like
                                                               weight)
                                    w = 1                      ("none": mean-centred only)
source: CPGD arXiv 2505.12504 / github.com/ModalMinds/MM-EUREKA; LightRFT lightrft/models/loss.py (use_cpg_loss),
lightrft/trainer/advantage_calculator.py (CPGDCalculator).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mmrl.core.advantages import register_advantage
from mmrl.core.losses import POLICY_LOSSES, agg_loss

Tensor = torch.Tensor

CPGD_WEIGHTS = ("std", "clip_filter", "none")


def cpgd_advantages(rewards: Tensor, group_ids: Tensor, weight: str = "std", eps: float = 1e-6,
                    max_weight: float = 3.0) -> Tensor:
    """rewards[B] float, group_ids[B] (any ids) -> adv[B] = w * (r - group mean), w per `weight` (module doc).

    Groups whose rewards are all equal (incl. size 1) get exactly 0. Vectorised (index_add / scatter_reduce).
    """
    # source: LightRFT CPGDCalculator._get_cpgd_advantages_returns (STD_weight: population std + 1e-6)
    if weight not in CPGD_WEIGHTS:
        raise ValueError(f"cpgd weight: expected one of {list(CPGD_WEIGHTS)}, got {weight!r}")
    if max_weight < 1.0:
        raise ValueError(f"max_weight: expected >= 1, got {max_weight}")
    r = rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())
    if r.dim() != 1 or group_ids.shape != r.shape:
        raise ValueError(f"rewards/group_ids: expected two [B] tensors, got {tuple(r.shape)} and "
                         f"{tuple(group_ids.shape)}")
    _, inv = torch.unique(group_ids.to(r.device), return_inverse=True)
    g = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.bincount(inv, minlength=g).to(r.dtype)
    mean = (torch.zeros(g, dtype=r.dtype, device=r.device).index_add_(0, inv, r) / count)[inv]
    centred = r - mean
    hi = torch.full((g,), -math.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, inv, r, "amax")
    lo = torch.full((g,), math.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, inv, r, "amin")
    live = hi > lo
    if weight == "std":
        var = torch.zeros(g, dtype=r.dtype, device=r.device).index_add_(0, inv, centred**2) / count
        adv = centred / (var.sqrt()[inv] + eps)
    elif weight == "clip_filter":
        adv = centred * min(g / max(int(live.sum()), 1), max_weight)
    else:
        adv = centred
    return torch.where(live[inv], adv, torch.zeros_like(adv))


@register_advantage("cpgd")
def _cpgd(rewards: Tensor, group_ids: Tensor, **kw: Any) -> Tensor:
    return cpgd_advantages(rewards, group_ids, **kw)


def cpgd_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    norm_const: float | None = None,
    drift_coef: float = 0.0,
    drift_clip: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """CPGD policy loss; arguments and shapes as `clipped_policy_loss` (logp[B, T] or [B] with grad, old_logp
    same shape, advantages [B] or [B, T], mask or None), plus drift_coef (alpha >= 0) and drift_clip (delta > 0).
        lr = clamp(logp - old_logp, -20, 20),  r = exp(lr)
        l_pg = max(-A * lr, -A * clip(lr, ln(1 - clip_low), ln(1 + clip_high)))
        l_drift = r - 1 - lr                       (gradient weight clip(r, 1 - delta, 1 + delta) - 1 with drift_clip)
        loss = agg_loss(l_pg + drift_coef * l_drift, mask, agg, norm_const)
    `dual_clip` is accepted for signature compatibility and must be None (the log-ratio loss is bounded).
    Masked positions change nothing, even holding nan/inf. metrics: pg_loss, policy_drift (agg of l_drift),
    clipfrac (share of valid positions on the clipped branch, i.e. no pg gradient), clipfrac_lower (0),
    approx_kl (mean k3 = mean l_drift), approx_kl_k1, ratio_mean, ratio_max.
    """
    # source: CPGD arXiv 2505.12504 (clipped log-ratio + policy drift); LightRFT PolicyLoss use_cpg_loss (same gradient)
    clip_high = clip_low if clip_high is None else clip_high
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"clip_low/clip_high: expected 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, "
                         f"{clip_high}")
    if dual_clip is not None:
        raise ValueError(f"dual_clip: not used by cpgd (its log-ratio loss is bounded), expected None, got {dual_clip}")
    if drift_coef < 0.0 or (drift_clip is not None and drift_clip <= 0.0):
        raise ValueError(f"drift_coef/drift_clip: expected >= 0 and None or > 0, got {drift_coef}, {drift_clip}")
    logp, old, adv, m = _prepare(logp, old_logp, advantages, mask)
    lr = (logp - old).clamp(-20.0, 20.0)
    pg_unclipped = -adv * lr
    pg_clipped = -adv * lr.clamp(math.log(1.0 - clip_low), math.log(1.0 + clip_high))
    pg = torch.maximum(pg_unclipped, pg_clipped)
    ratio = torch.exp(lr)
    k3 = ratio - 1.0 - lr
    if drift_clip is not None:  # value k3, gradient (clip(r) - 1) * grad logp
        coef = (ratio.clamp(1.0 - drift_clip, 1.0 + drift_clip) - 1.0).detach()
        drift = k3.detach() + coef * (logp - logp.detach())
    else:
        drift = k3
    loss = agg_loss(pg + drift_coef * drift, m, agg, norm_const)
    with torch.no_grad():
        mean = lambda x: float(torch.where(m, x, torch.zeros_like(x)).sum() / m.sum().clamp(min=1))  # noqa: E731
        metrics = {
            "pg_loss": float(agg_loss(pg, m, agg, norm_const)),
            "policy_drift": float(agg_loss(k3, m, agg, norm_const)),
            "clipfrac": mean((pg_clipped > pg_unclipped).to(lr.dtype)),
            "clipfrac_lower": 0.0,
            "approx_kl": mean(k3),
            "approx_kl_k1": mean(-lr),
            "ratio_mean": mean(ratio),
            "ratio_max": float(ratio[m].max()) if bool(m.any()) else 1.0,
        }
    return loss, metrics


def _prepare(logp: Tensor, old_logp: Tensor, advantages: Tensor,
             mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Shape checks; values at masked positions replaced by 0 before any arithmetic (nan-safe gradients)."""
    if logp.shape != old_logp.shape:
        raise ValueError(f"logp/old_logp: shapes differ, {tuple(logp.shape)} vs {tuple(old_logp.shape)}")
    if logp.dim() not in (1, 2):
        raise ValueError(f"logp: expected shape [B] or [B, T], got {tuple(logp.shape)}")
    adv = advantages.to(logp.device)
    if adv.dim() == 1 and logp.dim() == 2 and adv.shape[0] == logp.shape[0]:
        adv = adv[:, None].expand_as(logp)
    if adv.shape != logp.shape:
        raise ValueError(f"advantages: expected shape [B] or {tuple(logp.shape)}, got {tuple(advantages.shape)}")
    if mask is None:
        m = torch.ones_like(logp, dtype=torch.bool)
    elif mask.shape != logp.shape:
        raise ValueError(f"mask: expected shape {tuple(logp.shape)}, got {tuple(mask.shape)}")
    else:
        m = mask.to(logp.device).bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    return (torch.where(m, logp, zero), torch.where(m, old_logp.detach().to(logp.dtype), zero),
            torch.where(m, adv.detach().to(logp.dtype), zero), m)


# `algo.policy_loss: cpgd` in the VLM recipes: the registry's call signature, with MM-EUREKA's drift settings
# (policy_drift_coef 0.01, policy_drift_clip_eps 0.2)
CPGD_DRIFT_COEF, CPGD_DRIFT_CLIP = 0.01, 0.2


def registered_cpgd_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor | None = None,
                         **kw: Any) -> tuple[Tensor, dict[str, float]]:
    """`cpgd_loss` with drift_coef=0.01, drift_clip=0.2 (the `cpgd` entry of `mmrl.core.losses.POLICY_LOSSES`)."""
    return cpgd_loss(logp, old_logp, advantages, mask, drift_coef=CPGD_DRIFT_COEF, drift_clip=CPGD_DRIFT_CLIP, **kw)


POLICY_LOSSES["cpgd"] = registered_cpgd_loss
