"""Drift diagnostics of the diffusion recipes, logged every step: how far the policy's velocity field and its
samples moved from the reference model's, and the optional penalty on the velocity norm (`algo.velocity_norm`).

Velocity norm (every point the recipe trains on, reference = adapters off / the frozen init):
    diag/velocity_norm_ratio      mean over the step's trained points of ||v_theta|| / ||v_ref|| (same x_t, t, c)
    diag/velocity_norm_ratio_max  its largest value;  diag/velocity_norm, diag/velocity_norm_ref  the mean norms
    policy/norm_penalty           mean max(0, ratio - 1)^2 (`mmrl.core.velocity_norm`), added to the loss times
                                  `algo.velocity_norm.coef` (0 = only measured)
measured whenever the recipe runs its reference forward (algo.kl.coef > 0, velocity_norm.coef > 0 or
velocity_norm.reference_pass; Diffusion-DPO always), at no extra cost; RL post-training of flow models is reported
to inflate the ratio by 5-15% (NormGuard, arXiv 2606.27771).

Sample statistics (`sample_statistics`) of the step's rollout images (`diag/sample/*`) and of the fixed-noise
evaluation images (`eval/sample/*`, comparable across evaluations): the RMS of the final latents and, in [0, 1]
pixel units, brightness (mean Rec. 601 luma), contrast (per-image std of luma, averaged), saturation (mean over
pixels of max(R, G, B) - min(R, G, B)) and detail (mean absolute difference between horizontally and vertically
adjacent pixels: what JPEG-incompressibility hacking drives up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmrl.core.velocity_norm import velocity_norm_penalty, velocity_norms

Tensor = torch.Tensor

__all__ = ["VelocityNormConfig", "sample_statistics", "velocity_norm_term", "velocity_reference_terms",
           "velocity_norms", "MAX_KEYS"]

# metrics a recipe reduces with max (not mean) over its micro-steps
MAX_KEYS = ("diag/velocity_norm_ratio_max",)


@dataclass
class VelocityNormConfig:
    """`algo.velocity_norm`: the velocity-norm diagnostic and its optional hinge penalty."""

    coef: float = 0.0
    """Weight of the penalty mean_b max(0, ||v_theta|| / ||v_ref|| - 1)^2 on every trained point (0 = off)."""
    reference_pass: bool = False
    """Run the no-grad reference forward even when no loss term needs it (algo.kl.coef = 0 and coef = 0), so that
    diag/velocity_norm_ratio is logged (one more forward per trained point)."""

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise ValueError(f"algo.velocity_norm.coef: expected >= 0, got {self.coef}")

    def needs_reference(self) -> bool:
        return self.coef > 0 or self.reference_pass


def velocity_norm_term(v: Tensor, ref_norm: Tensor, coef: float,
                       mask: Tensor | None = None) -> tuple[Tensor | float, dict[str, float]]:
    """(coef * penalty, or 0.0 when coef = 0; the diag/policy metrics of this micro-step) for v [b, ...] against
    the reference norms ref_norm [b]."""
    penalty, m = velocity_norm_penalty(v, ref_norm, mask)
    metrics = {"diag/velocity_norm_ratio": m["velocity_norm_ratio"],
               "diag/velocity_norm_ratio_max": m["velocity_norm_ratio_max"],
               "diag/velocity_norm": m["velocity_norm"], "diag/velocity_norm_ref": m["velocity_norm_ref"],
               "policy/norm_penalty": m["norm_penalty"]}
    return (coef * penalty if coef > 0 else 0.0), metrics


def velocity_reference_terms(v: Tensor, v_ref: Tensor, kl_coef: float,
                             norm_coef: float) -> tuple[Tensor | float, dict[str, float]]:
    """The loss terms against the reference velocity of DiffusionNFT / AWM at one batch of points: kl_coef *
    mean ||v - v_ref||^2 / D (their velocity-space KL, `kl/ref` when kl_coef > 0) plus the velocity-norm term
    (`velocity_norm_term`), and the metrics of both. v [b, ...] with gradient, v_ref [b, ...] without."""
    term, metrics = velocity_norm_term(v, velocity_norms(v_ref), norm_coef)
    if kl_coef > 0:
        kl = (v - v_ref).pow(2).mean(dim=tuple(range(1, v.dim()))).mean()
        metrics["kl/ref"] = kl.item()
        term = kl_coef * kl + term
    return term, metrics


@torch.no_grad()
def sample_statistics(images: Tensor | None, latents: Tensor | None = None,
                      prefix: str = "diag/sample/") -> dict[str, Any]:
    """Statistics of a batch of images [B, 3, H, W] in [0, 1] (videos [B, F, 3, H, W]: over all frames; and final
    latents [B, ...]); see the module docstring."""
    out: dict[str, Any] = {}
    if latents is not None:
        out[f"{prefix}latent_rms"] = float(latents.float().pow(2).mean().sqrt())
    if images is None or images.numel() == 0:
        return out
    x = images.detach().float().clamp(0, 1)
    x = x.flatten(0, 1) if x.dim() == 5 else x
    luma = 0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]  # Rec. 601
    detail = 0.5 * ((x[..., :, 1:] - x[..., :, :-1]).abs().mean() + (x[..., 1:, :] - x[..., :-1, :]).abs().mean())
    out.update({
        f"{prefix}brightness": float(luma.mean()),
        f"{prefix}contrast": float(luma.flatten(1).std(dim=1, unbiased=False).mean()),
        f"{prefix}saturation": float((x.amax(1) - x.amin(1)).mean()),
        f"{prefix}detail": float(detail),
    })
    return out
