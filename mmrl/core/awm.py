"""Advantage Weighted Matching (AWM; Xue et al. 2025, arXiv 2509.25050): policy gradient for flow-matching
models written with the pretraining loss itself.

A clean sample x0 of the rollout is scored at training points (t, eps), x_t = (1 - t) x0 + t eps, by the
flow-matching error of the velocity prediction, used as its log-likelihood surrogate:

    ell = mean_d (v_theta(x_t, t) - (eps - x0))^2          log p = -w(ell, t)

and trained with PPO's clipped surrogate on r = exp(log p - log p_old) (log p_old: the rollout policy at the
same point), weighted by the sample's advantage A:

    L = mean over points of max(-A r, -A clip(r, 1 - c, 1 + c))

At r = 1 (on-policy, before any update) the gradient is A * d w(ell, t) / d theta: the matching loss of
high-advantage samples goes down, that of low-advantage samples up (advantage-weighted flow matching).

Weightings w(ell, t), e = 1e-10 (source: scxue/advantage_weighted_matching scripts/train_sd3_awm.py,
`compute_log_prob_awm`; the same table in X-GenGroup/Flow-Factory guidance/algorithms.md "AWM Weighting"):
    uniform: ell     t: t ell     t2: t^2 ell     huber: t (sqrt(ell + e) - sqrt(e))
    ghuber:  t / p ((ell + e)^p - e^p)   (p = ghuber_power; the published SD3.5 setting: ghuber, p = 0.25)

Imports only torch.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

__all__ = ["AWM_WEIGHTINGS", "matching_log_prob", "awm_policy_loss", "stratified_timestep_indices"]

AWM_WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")
_EPS = 1e-10


def matching_log_prob(v: Tensor, target: Tensor, t: Tensor, weighting: str = "ghuber",
                      ghuber_power: float = 0.25) -> Tensor:
    """log p [B] (float64) = -w(ell, t) with ell = mean over all but dim 0 of (v - target)^2.

    v, target [B, ...] (target = eps - x0, the rectified-flow velocity); t [B] noise levels in (0, 1)."""
    if weighting not in AWM_WEIGHTINGS:
        raise ValueError(f"awm weighting: unknown {weighting!r}; valid: {list(AWM_WEIGHTINGS)}")
    if v.shape != target.shape:
        raise ValueError(f"matching_log_prob: v {tuple(v.shape)} and target {tuple(target.shape)} differ")
    err = (v.double() - target.double()).pow(2)
    ell = err.mean(dim=tuple(range(1, err.dim()))) if err.dim() > 1 else err
    t = t.to(ell.device, torch.float64).reshape(-1)
    if weighting == "uniform":
        w = ell
    elif weighting == "t":
        w = t * ell
    elif weighting == "t2":
        w = t * t * ell
    elif weighting == "huber":
        w = t * ((ell + _EPS).sqrt() - _EPS ** 0.5)
    else:
        if not ghuber_power > 0:
            raise ValueError(f"awm ghuber_power: expected > 0, got {ghuber_power}")
        w = t / ghuber_power * ((ell + _EPS).pow(ghuber_power) - _EPS ** ghuber_power)
    return -w


def awm_policy_loss(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, clip_range: float,
                    weights: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """Clipped advantage-weighted surrogate over N training points.

    log_prob [N] (with grad), old_log_prob [N] (rollout policy; detached here), advantages [N],
    weights [N] >= 0 (None = all 1; 0 = the point is masked out). Returns (sum(w * l) / sum(w), metrics) with
    l = max(-A r, -A clip(r, 1 - c, 1 + c)), r = exp(log_prob - old_log_prob); an all-zero weight vector gives
    a zero loss. Metrics (weighted over the points): policy/clipfrac (|r - 1| > c), policy/approx_kl
    (1/2 (log r)^2), policy/ratio_max."""
    if clip_range < 0:
        raise ValueError(f"awm clip_range: expected >= 0, got {clip_range}")
    if not (log_prob.shape == old_log_prob.shape == advantages.shape) or log_prob.dim() != 1:
        raise ValueError(f"awm_policy_loss: expected equal 1-d shapes, got log_prob {tuple(log_prob.shape)}, "
                         f"old_log_prob {tuple(old_log_prob.shape)}, advantages {tuple(advantages.shape)}")
    w = torch.ones_like(log_prob) if weights is None else weights.to(log_prob.device, log_prob.dtype)
    if w.shape != log_prob.shape:
        raise ValueError(f"awm_policy_loss: weights {tuple(w.shape)} vs log_prob {tuple(log_prob.shape)}")
    valid = w > 0  # masked points may hold nan/inf: replaced before any arithmetic (finite values and gradients)
    adv = torch.where(valid, advantages.to(log_prob.device, log_prob.dtype), 0.0)
    log_ratio = torch.where(valid, log_prob - old_log_prob.detach().to(log_prob.dtype), 0.0)
    ratio = log_ratio.exp()
    per_point = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range))
    total = w.sum()
    loss = (w * per_point).sum() / total.clamp_min(torch.finfo(w.dtype).tiny)  # all masked: 0 (not nan)
    with torch.no_grad():
        norm = float(total) if float(total) > 0 else 1.0
        lr = log_ratio.detach()
        metrics = {"policy/clipfrac": float((w * ((ratio - 1).abs() > clip_range)).sum()) / norm,
                   "policy/approx_kl": float((w * 0.5 * lr.pow(2)).sum()) / norm,
                   "policy/ratio_max": float(ratio[valid].max()) if bool(valid.any()) else 1.0}
    return loss, metrics


def stratified_timestep_indices(n: int, k: int, lo: int, hi: int, generator: torch.Generator | None = None) -> Tensor:
    """[n, k] long: for each of n samples, k schedule indices in [lo, hi), one drawn uniformly from each of k
    equal strata (boundaries linspace(lo, hi, k + 1) truncated to integers; an empty stratum gives its lower
    bound). Source of the stratification: scxue/advantage_weighted_matching train_sd3_awm.py `time_type`
    discrete / discrete_wo_init (which draws one index set per micro-batch; here each sample draws its own)."""
    if k < 1 or hi <= lo:
        raise ValueError(f"stratified_timestep_indices: need k >= 1 and hi > lo, got k={k}, [{lo}, {hi})")
    bounds = torch.linspace(lo, hi, k + 1).long()
    low, width = bounds[:-1], bounds[1:] - bounds[:-1]
    u = torch.rand((n, k), generator=generator)
    return low + (u * width).long().clamp_max((width - 1).clamp_min(0))
