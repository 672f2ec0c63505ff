"""DGPO, Direct Group Preference Optimization (Luo, Hu, Tang; ICLR 2026, arXiv 2510.08425): a DPO-style objective
on groups instead of pairs, trained on clean ODE samples with the flow-matching (denoising) loss.

A group of G samples of one prompt is split by advantage into a preferred part (A > 0) and a rejected part (A < 0).
With the implicit reward of Diffusion-DPO, -beta (ell_theta - ell_ref) per sample (ell = the denoising loss at a
noised point of the sample, ell_ref the reference's), the group-level preference is maximised:

    z_g = -(beta / G) sum_{i in g} A_i (ell_i - ell_ref,i)          L = -sum_g log sigmoid(z_g)

    dL/dtheta = sum_g sigmoid(-z_g) (beta / G) sum_{i in g} A_i d ell_i / dtheta

so the loss is implemented (as the published code does) through detached group weights w_g = sigmoid(-z_g):

    loss = mean_i( w_g(i) A_i ell_i )      (same gradient up to the constant factor G / (beta * batch))

Optional PPO-style clipping (`clip_dsm` in the published config): with r_i = exp(ell_old,i - ell_i) against an "old"
(EMA) policy, ell_i is detached where A_i > 0 and r_i > 1 + c, or A_i < 0 and r_i < 1 - c.

Source: Luo-Yihong/DGPO scripts/train_sd3_dgpo.py at commit 01ceb4b (2026-04-25), compute_group_dgpo_loss_allreduce
(group sums of A beta (ell - ell_ref) / group_size, weights sigmoid(sum), loss mean(w A ell)) and the clip block of the
training loop. Imports only torch.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

__all__ = ["dgpo_group_weights", "dgpo_loss", "dgpo_clip_mask"]


def dgpo_group_weights(adv: Tensor, dsm: Tensor, ref_dsm: Tensor, group_index: Tensor, beta: float,
                       group_size: int) -> Tensor:
    """w [B] = sigmoid(sum over the sample's group of A_j beta (ell_j - ell_ref,j) / group_size), no gradient.

    adv, dsm, ref_dsm [B]; group_index [B] long (samples with equal index form a group; any labels)."""
    if not (adv.shape == dsm.shape == ref_dsm.shape == group_index.shape) or adv.dim() != 1:
        raise ValueError(f"dgpo_group_weights: expected equal 1-d shapes, got adv {tuple(adv.shape)}, dsm "
                         f"{tuple(dsm.shape)}, ref_dsm {tuple(ref_dsm.shape)}, group_index {tuple(group_index.shape)}")
    with torch.no_grad():
        term = adv.double() * beta * (dsm.double() - ref_dsm.double()) / group_size
        labels, inverse = torch.unique(group_index, return_inverse=True)
        sums = torch.zeros(len(labels), dtype=torch.float64, device=term.device).index_add_(0, inverse.to(term.device),
                                                                                              term)
        return torch.sigmoid(sums)[inverse.to(term.device)].to(dsm.dtype)


def dgpo_clip_mask(adv: Tensor, dsm: Tensor, old_dsm: Tensor, clip_range: float) -> Tensor:
    """bool [B]: where the ratio r = exp(ell_old - ell) left the trust region in the direction the advantage pushes
    (A > 0: r > 1 + c; else r < 1 - c); the DGPO loss takes no gradient from those samples."""
    ratio = torch.exp(old_dsm.detach().double() - dsm.detach().double())
    return torch.where(adv > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)


def dgpo_loss(adv: Tensor, dsm: Tensor, weights: Tensor, clipped: Tensor | None = None) -> Tensor:
    """mean_i( w_i A_i ell_i ), ell_i detached where `clipped`; a 0-dim tensor carrying dsm's gradient."""
    if clipped is not None:
        dsm = torch.where(clipped, dsm.detach(), dsm)
    return (weights.detach() * adv.to(dsm.dtype) * dsm).mean()
