"""Policy losses for token policies (VLM) and diffusion policies, as pure tensor functions.

Every loss returns `(loss: scalar Tensor with grad, metrics: dict[str, float])`. Metrics are detached
Python floats, ready for `run.log`. Masks are bool or 0/1 tensors; masked positions never matter, even if
they hold nan/inf (inputs are replaced by `torch.where` before any arithmetic, so gradients stay finite).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from mmrl.core.kl import kl_estimate

Tensor = torch.Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _as_2d(x: Tensor) -> Tensor:
    return x[:, None] if x.dim() == 1 else x


def _as_mask(mask: Tensor | None, like: Tensor) -> Tensor:
    if mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    if mask.shape != like.shape:
        raise ValueError(f"mask: expected shape {tuple(like.shape)}, got {tuple(mask.shape)}")
    return mask.to(like.device).bool()


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor | None = None,
    mode: str = "token-mean",
    norm_const: float | None = None,
) -> Tensor:
    """Reduce loss_mat[B, T] (or [B]) over valid positions mask[B, T] to a scalar.

    token-mean:              sum_valid(l) / n_valid                               (DAPO token-level)
    seq-mean-token-mean:     mean_rows( sum_t(l) / n_t )                          (GRPO paper)
    seq-mean-token-sum:      mean_rows( sum_t(l) )
    seq-mean-token-sum-norm: mean_rows( sum_t(l) / norm_const ), norm_const defaults to T  (Dr.GRPO)
    "rows" are sequences with at least one valid token (fully masked rows are not counted). A [B]
    input is B sequences of length 1. No valid position at all -> 0 (still attached to the graph).
    Note: verl's seq-mean-token-sum-norm is sum_all / T (no division by the number of rows); ours
    matches TRL's dr_grpo and the Dr.GRPO paper: sum_all / (rows * T). Keep norm_const fixed (the max
    response length) across steps.
    """
    # source: verl core_algos.agg_loss; DAPO arXiv 2503.14476 (token-mean); Dr.GRPO arXiv 2503.20783 (constant norm)
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {list(AGG_MODES)}")
    if loss_mat.dim() not in (1, 2):
        raise ValueError(f"loss_mat: expected shape [B] or [B, T], got {tuple(loss_mat.shape)}")
    x2 = _as_2d(loss_mat)
    m = _as_2d(_as_mask(mask, loss_mat))
    x = torch.where(m, x2, torch.zeros((), dtype=x2.dtype, device=x2.device))
    if mode == "token-mean":
        return x.sum() / m.sum().clamp(min=1)
    n_t = m.sum(-1)
    rows = (n_t > 0).sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        return (x.sum(-1) / n_t.clamp(min=1)).sum() / rows
    if mode == "seq-mean-token-sum":
        return x.sum() / rows
    t = float(x.shape[-1]) if norm_const is None else float(norm_const)
    if t <= 0:
        raise ValueError(f"norm_const: expected > 0, got {norm_const}")
    return x.sum() / (rows * t)


def _masked_mean(x: Tensor, m: Tensor) -> float:
    return float(torch.where(m, x, torch.zeros_like(x)).sum() / m.sum().clamp(min=1))


def _prepare_pg_inputs(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if logp.shape != old_logp.shape:
        raise ValueError(f"logp/old_logp: shapes differ, {tuple(logp.shape)} vs {tuple(old_logp.shape)}")
    if logp.dim() not in (1, 2):
        raise ValueError(f"logp: expected shape [B] or [B, T], got {tuple(logp.shape)}")
    advantages = advantages.to(logp.device)
    if advantages.dim() == 1 and logp.dim() == 2:  # sequence advantage -> every token
        advantages = advantages[:, None].expand_as(logp)
    if advantages.shape != logp.shape:
        raise ValueError(f"advantages: expected shape [B] or {tuple(logp.shape)}, got {tuple(advantages.shape)}")
    m = _as_mask(mask, logp)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # sanitise masked positions first: nan there must not leak into values or gradients
    return (
        torch.where(m, logp, zero),
        torch.where(m, old_logp.detach().to(logp.dtype), zero),
        torch.where(m, advantages.detach().to(logp.dtype), zero),
        m,
    )


def _check_clip(clip_low: float, clip_high: float | None, dual_clip: float | None) -> float:
    clip_high = clip_low if clip_high is None else clip_high
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low: expected 0 <= clip_low < 1, got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high: expected >= 0, got {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip: expected a constant > 1 (e.g. 3.0), got {dual_clip}")
    return clip_high


def _clip_objective(
    ratio: Tensor, adv: Tensor, m: Tensor, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[Tensor, dict[str, float]]:
    """Per-position PPO-clip loss (+ dual clip) and the clip fractions."""
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    metrics = {"clipfrac": _masked_mean((loss_clipped > loss_unclipped).float(), m), "clipfrac_lower": 0.0}
    # flow_grpo's clipfrac (scripts/train_sd3.py at ac4c86e: mean(|ratio - 1| > clip_range), + _gt_one / _lt_one):
    # the ratio left the trust region, whatever the advantage's sign (ours above: the clip removed the gradient)
    with torch.no_grad():
        high, low = ratio.detach() - 1.0 > clip_high, 1.0 - ratio.detach() > clip_low
        metrics.update(clipfrac_ratio=_masked_mean((high | low).float(), m),
                       clipfrac_ratio_high=_masked_mean(high.float(), m),
                       clipfrac_ratio_low=_masked_mean(low.float(), m))
    if dual_clip is not None:
        # source: dual-clip PPO, Ye et al. 2020 arXiv 1912.09729: for A < 0 cap the loss at -c * A
        loss_cap = -adv * dual_clip
        neg = adv < 0
        metrics["clipfrac_lower"] = _masked_mean(((loss > loss_cap) & neg).float(), m)
        loss = torch.where(neg, torch.minimum(loss, loss_cap), loss)
    return loss, metrics


def clipped_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    norm_const: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip policy loss with clip-higher (DAPO) and dual clip.

    logp[B, T] (current policy, with grad), old_logp[B, T] (rollout policy), advantages[B, T] or [B]
    (broadcast to tokens), mask[B, T] or None. Diffusion: pass [B] tensors (one denoising step each).
        ratio = exp(logp - old_logp)       (log-ratio clamped to [-20, 20] for stability, as verl)
        l = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
        if dual_clip = c:  l = min(l, -c * A) where A < 0
        loss = agg_loss(l, mask, agg, norm_const)
    metrics: clipfrac (share of valid positions where the clipped branch is taken, i.e. no gradient),
    clipfrac_ratio (share with the ratio outside [1 - clip_low, 1 + clip_high], whatever the advantage: flow_grpo's
    `clipfrac`, |r - 1| > c when symmetric; clipfrac_ratio_high / _low: above / below, its `clipfrac_gt_one` /
    `clipfrac_lt_one`), clipfrac_lower (share where the dual clip caps the loss), approx_kl (k3 estimate of
    KL(old || new)), approx_kl_k1, ratio_mean, ratio_max, pg_loss.
    """
    # source: PPO arXiv 1707.06347; clip-higher DAPO arXiv 2503.14476; verl compute_policy_loss_vanilla
    clip_high = _check_clip(clip_low, clip_high, dual_clip)
    logp, old_logp, adv, m = _prepare_pg_inputs(logp, old_logp, advantages, mask)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss_mat, metrics = _clip_objective(ratio, adv, m, clip_low, clip_high, dual_clip)
    loss = agg_loss(loss_mat, m, agg, norm_const)
    with torch.no_grad():
        metrics.update(_ratio_metrics(ratio, old_logp, logp, m))
        metrics["pg_loss"] = float(loss)
    return loss, metrics


def _ratio_metrics(ratio: Tensor, old_logp: Tensor, logp: Tensor, m: Tensor) -> dict[str, float]:
    ratio, logp = ratio.detach(), logp.detach()
    any_valid = bool(m.any())
    return {
        "approx_kl": _masked_mean(kl_estimate(old_logp, logp, "k3"), m),
        "approx_kl_k1": _masked_mean(kl_estimate(old_logp, logp, "k1"), m),
        "ratio_mean": _masked_mean(ratio, m),
        "ratio_max": float(ratio[m].max()) if any_valid else 1.0,
    }


def gspo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    clip_low: float = 3e-4,
    clip_high: float | None = 4e-4,
    dual_clip: float | None = None,
    agg: str = "seq-mean-token-mean",
    norm_const: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO: PPO-clip on the sequence-level ratio s_i = exp(mean_t(logp - old_logp)) over valid tokens.

    Shapes as `clipped_policy_loss` (logp[B, T], advantages[B] or [B, T]). Token form
    s_it = sg(s_i) * exp(logp_t - sg(logp_t)): value s_i, gradient s_i * grad logp_t, so with
    seq-mean-token-mean its gradient is the paper's sequence-level one. Log-ratio capped at 10 (verl).
    """
    # source: GSPO arXiv 2507.18071 (GSPO-token form); verl compute_policy_loss_gspo
    clip_high = _check_clip(clip_low, clip_high, dual_clip)
    if logp.dim() == 1:  # [B] -> B sequences of one token
        logp, old_logp, advantages = logp[:, None], old_logp[:, None], _as_2d(advantages)
        mask = None if mask is None else mask[:, None]
    logp, old_logp, adv, m = _prepare_pg_inputs(logp, old_logp, advantages, mask)
    n_t = m.sum(-1).clamp(min=1)
    seq_log_ratio = (logp - old_logp).sum(-1) / n_t  # masked entries are 0 after _prepare
    log_ratio = (logp - logp.detach() + seq_log_ratio.detach()[:, None]).clamp(max=10.0)
    ratio = torch.exp(log_ratio)
    loss_mat, metrics = _clip_objective(ratio, adv, m, clip_low, clip_high, dual_clip)
    loss = agg_loss(loss_mat, m, agg, norm_const)
    with torch.no_grad():
        metrics.update(_ratio_metrics(ratio, old_logp, logp, m))
        metrics["pg_loss"] = float(loss)
    return loss, metrics


def reinforce_policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor | None = None, *,
                          agg: str = "token-mean", norm_const: float | None = None,
                          **clip_args: float | None) -> tuple[Tensor, dict[str, float]]:
    """Plain policy gradient (REINFORCE), no ratio and no clipping: l = -A * logp, loss = agg_loss(l, mask).

    Shapes as `clipped_policy_loss`; the registry's clip arguments (clip_low, clip_high, dual_clip) are accepted
    and ignored.
    Its gradient -A * grad logp equals PPO-clip's at ratio 1. With importance weights w folded into the advantages
    (`correction.weighted_advantages`) it is -sg(w) * A * logp: verl's bypass + policy-gradient loss (pg_is / pg_rs)
    when w and the mask come from the current policy against the rollout's log-probs. metrics as PPO-clip's
    (clipfrac 0; approx_kl and ratio against old_logp, for monitoring)."""
    # source: Williams 1992 (REINFORCE); verl core_algos.compute_policy_loss_with_rollout_correction
    logp, old_logp, adv, m = _prepare_pg_inputs(logp, old_logp, advantages, mask)
    loss = agg_loss(-adv * logp, m, agg, norm_const)
    with torch.no_grad():
        metrics = {"clipfrac": 0.0, **_ratio_metrics(torch.exp((logp - old_logp).clamp(-20.0, 20.0)), old_logp,
                                                     logp, m)}
        metrics["pg_loss"] = float(loss)
    return loss, metrics


POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, float]]]] = {
    "ppo_clip": clipped_policy_loss,
    "gspo": gspo_policy_loss,
    "reinforce": reinforce_policy_loss,
}


def get_policy_loss(name: str) -> Callable[..., tuple[Tensor, dict[str, float]]]:
    """`fn(logp, old_logp, advantages, mask, clip_low=, clip_high=, dual_clip=, agg=, norm_const=)`."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; valid: {sorted(POLICY_LOSSES)}") from None


# ----------------------------------------------------------------------------------------------
# diffusion preference / negative-aware losses


def dpo_loss(
    pol_w: Tensor, pol_l: Tensor, ref_w: Tensor, ref_l: Tensor, beta: float
) -> tuple[Tensor, dict[str, float]]:
    """Diffusion-DPO loss from per-sample denoising MSEs (lower = better fit).

    pol_w[B], pol_l[B]: policy MSE on the preferred / rejected sample (same noise and t for policy
    and reference); ref_w[B], ref_l[B]: reference MSE (no grad).
        inside = -0.5 * beta * ((pol_w - pol_l) - (ref_w - ref_l))
        loss = mean(-logsigmoid(inside))
    `beta` is the official code's `beta_dpo`: the paper's beta * T * omega(lambda_t) folded into one constant,
    with the code's factor 0.5. 5000 for SD1.5 and for SDXL alike: the official launchers (SalesforceAIResearch/
    DiffusionDPO at dff8e10, launchers/sd15.sh and launchers/sdxl.sh) pass --beta_dpo 5000, train.py has no SDXL
    rescaling, and diffusers' examples/research_projects/diffusion_dpo/train_diffusion_dpo_sdxl.py (at 03ea18c)
    defaults to beta_dpo=5000 with scale_term = -0.5 * beta_dpo.
    metrics: implicit_acc = share with inside > 0 (policy improved the winner more than the loser,
    relative to the reference; ties count as wrong), reward_margin = mean(inside), kl_proxy =
    mean(pol - ref) over both samples (how far the policy's fit moved), model_mse, ref_mse.
    """
    # source: Diffusion-DPO, Wallace et al. arXiv 2311.12908; official train.py: scale_term = -0.5 * beta_dpo
    shapes = {tuple(x.shape) for x in (pol_w, pol_l, ref_w, ref_l)}
    if len(shapes) != 1 or pol_w.dim() != 1:
        raise ValueError(f"dpo_loss: expected four tensors of shape [B], got shapes {sorted(shapes)}")
    ref_w, ref_l = ref_w.detach(), ref_l.detach()
    inside = -0.5 * beta * ((pol_w - pol_l) - (ref_w - ref_l))
    loss = -F.logsigmoid(inside).mean()
    with torch.no_grad():
        metrics = {
            "dpo_loss": float(loss),
            "implicit_acc": float((inside > 0).float().mean()),
            "reward_margin": float(inside.mean()),
            "kl_proxy": float(0.5 * ((pol_w - ref_w).mean() + (pol_l - ref_l).mean())),
            "model_mse": float(0.5 * (pol_w.mean() + pol_l.mean())),
            "ref_mse": float(0.5 * (ref_w.mean() + ref_l.mean())),
        }
    return loss, metrics


def nft_optimality_prob(advantages: Tensor, adv_clip_max: float = 5.0) -> Tensor:
    """DiffusionNFT optimality probability r in [0, 1] from advantages[B]: clip to +-adv_clip_max,
    map linearly so A = -max -> 0, A = 0 -> 0.5, A = +max -> 1."""
    # source: DiffusionNFT arXiv 2509.16117; official train script: r = clamp(clamp(A, -m, m) / m / 2 + 0.5, 0, 1)
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max: expected > 0, got {adv_clip_max}")
    a = advantages.clamp(-adv_clip_max, adv_clip_max)
    return (a / adv_clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


def nft_loss(
    v_pred: Tensor,
    v_old: Tensor,
    x0: Tensor,
    xt: Tensor,
    t: Tensor | float,
    r: Tensor,
    beta: float,
    adaptive_weighting: bool = True,
    weight_min: float = 1e-5,
    loss_scale: float = 1.0,
) -> tuple[Tensor, dict[str, float]]:
    """DiffusionNFT negative-aware fine-tuning loss (flow matching x_t = (1 - t) x0 + t eps, v = eps - x0).

    v_pred[B, ...] trainable velocity, v_old[B, ...] velocity of the sampling ("old") policy (no grad),
    x0[B, ...] clean sample, xt[B, ...] its noised version at time t (scalar, [B] or broadcastable),
    r[B] optimality probability in [0, 1] (see `nft_optimality_prob`), beta > 0.
        v_pos = beta * v_pred + (1 - beta) * v_old         (implicit positive policy)
        v_neg = (1 + beta) * v_old - beta * v_pred         (implicit negative policy)
        x0_pos = xt - t * v_pos,  x0_neg = xt - t * v_neg
        L_pos = mean_dims((x0_pos - x0)^2 / w_pos),  w_pos = sg(mean_dims |x0_pos - x0|) clamped >= weight_min
        (same for L_neg; w = 1 when adaptive_weighting=False)
        loss = loss_scale * mean_B(r * L_pos + (1 - r) * L_neg) / beta
    The official script uses loss_scale = adv_clip_max. Weights are computed in float64 as there.
    metrics: pos_loss, neg_loss, old_deviate = mean (v_pred - v_old)^2, r_mean, nft_loss.
    """
    # source: DiffusionNFT arXiv 2509.16117 (implicit v+ / v-); NVlabs train script (x0 adaptive weights, / beta)
    if beta <= 0:
        raise ValueError(f"beta: expected > 0, got {beta}")
    for name, x in (("v_old", v_old), ("x0", x0), ("xt", xt)):
        if x.shape != v_pred.shape:
            raise ValueError(f"{name}: expected shape {tuple(v_pred.shape)} (as v_pred), got {tuple(x.shape)}")
    B = v_pred.shape[0]
    if r.shape != (B,):
        raise ValueError(f"r: expected shape [{B}], got {tuple(r.shape)}")
    dims = tuple(range(1, v_pred.dim()))
    t = torch.as_tensor(t, dtype=v_pred.dtype, device=v_pred.device)
    if t.dim() == 1 and v_pred.dim() > 1:
        t = t.view(-1, *([1] * (v_pred.dim() - 1)))
    v_old = v_old.detach()
    v_pos = beta * v_pred + (1.0 - beta) * v_old
    v_neg = (1.0 + beta) * v_old - beta * v_pred

    def weighted_x0_mse(v: Tensor) -> Tensor:
        err = xt - t * v - x0
        if adaptive_weighting:
            with torch.no_grad():
                w = err.double().abs().mean(dim=dims, keepdim=True).clamp(min=weight_min).to(err.dtype)
        else:
            w = torch.ones((), dtype=err.dtype, device=err.device)
        return (err**2 / w).mean(dim=dims)

    pos, neg = weighted_x0_mse(v_pos), weighted_x0_mse(v_neg)
    r = r.to(pos.dtype)
    loss = loss_scale * (r * pos + (1.0 - r) * neg).mean() / beta
    with torch.no_grad():
        metrics = {
            "nft_loss": float(loss),
            "pos_loss": float(pos.mean()),
            "neg_loss": float(neg.mean()),
            "old_deviate": float(((v_pred - v_old) ** 2).mean()),
            "r_mean": float(r.mean()),
        }
    return loss, metrics
