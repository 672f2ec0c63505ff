"""GRPO-Guard ratio normalisation for the Gaussian SDE steps of Flow-GRPO (Wang et al. 2025, arXiv 2510.22319).

One SDE step x -> x' has mean mu (policy) / mu_old (the policy that sampled it) and step std s (the same for
both: it does not depend on the weights). With log-probs averaged over the D latent dimensions (as Flow-GRPO),

    log r = logp - logp_old = [2 mean_d(e * delta) - mean_d(delta^2)] / (2 s^2),   e = x' - mu_old, delta = mu - mu_old

The -mean_d(delta^2) / (2 s^2) term is always <= 0, so the ratio distribution is biased below 1 (more so at small
s, i.e. late steps), and the 1 / s scale makes the ratio's spread differ from step to step: one clip range fits no
step. GRPO-Guard removes the bias and the scale:

    log r_guard = (logp - logp_old) * s + mean_d((mu - mu_old)^2) / (2 s)
                = mean_d(delta * e) / s  =  mean_d(delta * eps)

where eps = e / s is the standard normal noise of the sampled step. Its gradient is mean_d(eps * dmu) at any
weights: the per-step gradients are re-weighted by s relative to the plain ratio's (as TempFlow-GRPO's
noise-level weighting). At the rollout's weights delta = 0, so r_guard = r = 1.

source: Flow-Factory (X-GenGroup/Flow-Factory at a0b2bc5, src/flow_factory/trainers/grpo.py `GRPOGuardTrainer.optimize`:
ratio = exp((log_prob - old_log_prob) * scale_factor + mse / (2 * scale_factor)), scale_factor =
sqrt(-dt) * std_dev_t, mse = mean over latent dims of (next_latents_mean - old next_latents_mean)^2); only for the
Flow-SDE dynamics there ("Flow-SDE" = our sde_type "sde").

Gradient reweighting (the paper's second part: "a gradient reweighting strategy equalizes policy gradients over noise
conditions"). For the Flow-GRPO step, d mu / d v = (1 + std_t^2 (1 - sigma) / (2 sigma)) dt = (1 + a^2 / 2) dt
(a = noise_level, std_t^2 = a^2 sigma / (1 - sigma)), so the guard ratio's gradient is (1 + a^2 / 2) dt mean_d(eps dv):
proportional to the step size. Dividing the step's policy loss by -dt = sigma_t - sigma_(t+1) makes it the same for
every step. source: verl-omni (verl-project/verl-omni at a1139ba, verl_omni/trainer/diffusion/diffusion_algos.py
`GRPOGuardLoss.compute_loss`: pg_loss = mean(per-element clipped loss) / sqrt_dt^2, sqrt_dt = sqrt(-dt); the KL is
added outside it). Flow-Factory's trainer does not reweight. The paper's own equation was not available to us; its
abstract, verl-omni's code and the derivation above agree on 1 / (-dt).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

__all__ = ["grpo_guard_log_ratio", "grpo_guard_step_weight"]


def grpo_guard_log_ratio(logp: Tensor, old_logp: Tensor, mean: Tensor, old_mean: Tensor, step_std: Tensor) -> Tensor:
    """log r_guard [B] (module docstring) of one SDE step per sample.

    logp [B] (current weights, with grad), old_logp [B] (the sampling policy's, no grad), mean / old_mean
    [B, ...] the step's Gaussian means (mean with grad), step_std: the step's standard deviation s, [B] or
    broadcastable [B, 1, ...] (> 0). Log-probs must be Gaussian log densities averaged over the latent dims.
    """
    if mean.shape != old_mean.shape:
        raise ValueError(f"mean/old_mean: shapes differ, {tuple(mean.shape)} vs {tuple(old_mean.shape)}")
    b = mean.shape[0]
    if logp.shape != (b,) or old_logp.shape != (b,):
        raise ValueError(f"logp/old_logp: expected shape [{b}], got {tuple(logp.shape)} and {tuple(old_logp.shape)}")
    dtype = torch.promote_types(logp.dtype, torch.float32)  # at least fp32 (bf16 loses the small differences)
    s = step_std.to(dtype).reshape(b, -1)[:, 0]
    if not bool((s > 0).all()):
        raise ValueError("step_std: the GRPO-Guard ratio needs a stochastic step (std > 0) for every sample")
    mse = (mean.to(dtype) - old_mean.detach().to(dtype)).flatten(1).pow(2).mean(1)
    return (logp.to(dtype) - old_logp.detach().to(dtype)) * s + mse / (2.0 * s)


def grpo_guard_step_weight(sigma: Tensor | float, sigma_next: Tensor | float) -> float:
    """GRPO-Guard's gradient reweighting of one step's policy loss: 1 / (sigma - sigma_next), i.e. 1 / (-dt)
    (module docstring). sigma > sigma_next: a step towards the data."""
    s, s_next = float(sigma), float(sigma_next)
    if not s > s_next:
        raise ValueError(f"grpo_guard_step_weight: expected sigma > sigma_next, got {s}, {s_next}")
    return 1.0 / (s - s_next)
