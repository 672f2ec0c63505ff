"""Velocity-norm drift of a flow-matching policy against its reference, and a hinge penalty on it.

RL post-training of flow models (DiffusionNFT, AWM, Diffusion-DPO) is reported to inflate the per-step velocity
norm ||v_theta(x_t, t, c)|| by 5-15% over the reference model's ||v_ref(x_t, t, c)|| on the same inputs, with a
loss of image quality the reward does not see (NormGuard, Pan et al. 2026, arXiv 2606.27771). Per sample b:

    n_b = ||v_b||_2,   n_ref_b = ||v_ref_b||_2        (over every non-batch dimension, in float32)
    ratio_b = n_b / n_ref_b
    penalty = mean_b max(0, ratio_b - 1)^2          (v_ref has no gradient)

The penalty is a squared relative hinge: zero while the policy's velocity is not longer than the reference's,
scale free (the same coefficient means the same for any latent size), smooth at the hinge. NormGuard describes "a
hinge penalty that activates only when ||v_theta|| exceeds ||v_ref||"; its exact form (linear or squared,
absolute or relative) was not available to us, so this is our reading, not a reproduction.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

__all__ = ["velocity_norms", "velocity_norm_penalty"]


def velocity_norms(v: Tensor) -> Tensor:
    """L2 norm of every sample of v [B, ...] over its non-batch dimensions, float32 [B]."""
    if v.dim() < 2:
        raise ValueError(f"velocity: expected shape [B, ...] with at least one non-batch dim, got {tuple(v.shape)}")
    return v.float().flatten(1).norm(dim=1)


def velocity_norm_penalty(v: Tensor, ref_norm: Tensor, mask: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """(penalty: scalar with the gradient of v, metrics) for v [B, ...] against the reference's norms ref_norm [B]
    (`velocity_norms(v_ref)`, no gradient), as in the module docstring.

    mask [B] bool (None = all rows): the mean runs over its rows (0 when empty). metrics: velocity_norm_ratio
    (mean ratio), velocity_norm_ratio_max, velocity_norm / velocity_norm_ref (mean norms), norm_penalty.
    """
    n = velocity_norms(v)
    n_ref = ref_norm.detach().float().to(n.device).reshape(-1)
    if n_ref.shape != n.shape:
        raise ValueError(f"ref_norm: expected shape [{n.shape[0]}] (one norm per sample), got {tuple(ref_norm.shape)}")
    ratio = n / n_ref.clamp(min=1e-12)
    m = torch.ones_like(ratio, dtype=torch.bool) if mask is None else mask.to(ratio.device).bool()
    hinge = torch.where(m, torch.relu(ratio - 1.0) ** 2, torch.zeros_like(ratio))
    penalty = hinge.sum() / m.sum().clamp(min=1)
    with torch.no_grad():
        k = max(int(m.sum()), 1)
        metrics = {
            "velocity_norm_ratio": float(torch.where(m, ratio, torch.zeros_like(ratio)).sum()) / k,
            "velocity_norm_ratio_max": float(ratio[m].max()) if bool(m.any()) else 1.0,
            "velocity_norm": float(torch.where(m, n, torch.zeros_like(n)).sum()) / k,
            "velocity_norm_ref": float(torch.where(m, n_ref, torch.zeros_like(n_ref)).sum()) / k,
            "norm_penalty": float(penalty),
        }
    return penalty, metrics
