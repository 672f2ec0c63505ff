"""Stateless flow-matching sampler steps: ODE (Euler), SDE with log-prob (Flow-GRPO), CPS.

Every step is a pure function of ``(sample, velocity, sigma, sigma_next)``; nothing is kept between
calls, so the trainer can recompute the log-prob of any recorded transition at any step, in any order.
Conventions (the rectified-flow convention of SD3 / FLUX / diffusers' FlowMatchEulerDiscreteScheduler):

- ``x_sigma = (1 - sigma) * x_0 + sigma * noise``; sigma goes from ~1 (noise) down to 0 (data);
- the model predicts the velocity ``v = noise - x_0``, so the Euler step is ``x + (sigma_next - sigma) v``;
- ``sigma`` / ``sigma_next`` are Python floats, 0-d tensors or per-sample tensors ``[B]``;
- log-probs are Gaussian log densities **averaged** (not summed) over all non-batch dimensions, as
  Flow-GRPO does, so their scale does not depend on the latent size; shape ``[B]``.

How this differs from Flow-GRPO's ``sde_step_with_logprob`` (flow_grpo/diffusers_patch/
sd3_sde_with_logprob.py): no scheduler object or step-index lookup (sigmas are arguments); the
``sigma == 1`` guard uses ``sigma_next`` instead of "the schedule's second sigma" - the same number,
because sigma == 1 only occurs at the first step, whose ``sigma_next`` is the schedule's second sigma.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import torch

Tensor = torch.Tensor
Sigma = Union[float, Tensor]

SDE_TYPES = ("sde", "cps")


@dataclass
class StepOutput:
    """Result of one stochastic step.

    prev_sample: x at sigma_next [B, ...] (the given one when recomputing, else a fresh sample);
    log_prob: log density of prev_sample under the step's Gaussian, mean over non-batch dims [B]
      (for ``cps`` the constants are dropped, as in Flow-GRPO);
    mean: the Gaussian's mean [B, ...] (carries the gradient of the velocity);
    std: Flow-GRPO's ``std_dev_t`` broadcastable to ``mean`` ([B, 1, ...]): the per-unit-time noise
      scale for ``sde``, the step's std itself for ``cps``; the KL term divides by ``2 std^2``;
    step_std: the actual standard deviation of prev_sample given sample ([B, 1, ...]);
    velocity: the velocity the step used (set by `sampling.step_log_prob`, None from this module).
    """

    prev_sample: Tensor
    log_prob: Tensor
    mean: Tensor
    std: Tensor
    step_std: Tensor
    velocity: Tensor | None = None


def _as_batch(sigma: Sigma, like: Tensor) -> Tensor:
    """sigma (float, 0-d or [B]) -> fp32 tensor broadcastable to `like` ([B, 1, 1, ...])."""
    s = torch.as_tensor(sigma, dtype=torch.float32, device=like.device)
    if s.dim() == 0:
        return s.reshape([1] * like.dim())
    if s.dim() != 1 or s.shape[0] != like.shape[0]:
        raise ValueError(f"sigma: expected a scalar or shape [{like.shape[0]}] (one per sample), got {tuple(s.shape)}")
    return s.reshape(-1, *([1] * (like.dim() - 1)))


def _mean_over_non_batch(x: Tensor) -> Tensor:
    return x.mean(dim=tuple(range(1, x.dim()))) if x.dim() > 1 else x


def ode_step(sample: Tensor, velocity: Tensor, sigma: Sigma, sigma_next: Sigma) -> Tensor:
    """Euler step of the probability-flow ODE: ``x_next = x + (sigma_next - sigma) * v``.

    Same arithmetic as diffusers' ``FlowMatchEulerDiscreteScheduler.step`` (computed in fp32, returned
    in ``velocity``'s dtype), so a deterministic rollout matches the diffusers pipeline bit for bit.
    """
    # source: diffusers FlowMatchEulerDiscreteScheduler.step: prev_sample = sample + dt * model_output
    x = sample.to(torch.float32)
    dt = _as_batch(sigma_next, x) - _as_batch(sigma, x)
    return (x + dt * velocity).to(velocity.dtype)


def sde_step_with_logprob(
    sample: Tensor,
    velocity: Tensor,
    sigma: Sigma,
    sigma_next: Sigma,
    noise_level: float = 0.7,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
    sde_type: str = "sde",
) -> StepOutput:
    """One stochastic step x_sigma -> x_sigma_next and the log-prob of the result.

    sample, velocity [B, ...]; sigma, sigma_next scalars or [B] (sigma > sigma_next >= 0).
    Give ``prev_sample`` to score a recorded transition (recompute), otherwise one is sampled with
    ``noise`` (standard normal, same shape as sample) or fresh noise from ``generator``.

    sde_type="sde" (Flow-GRPO, arXiv 2505.05470, eq. 9 with the Euler-Maruyama discretisation):
        dt = sigma_next - sigma (< 0),  std_t = sqrt(sigma / (1 - sigma)) * noise_level
        mean = x (1 + std_t^2 / (2 sigma) dt) + v (1 + std_t^2 (1 - sigma) / (2 sigma)) dt
        x_next = mean + std_t sqrt(-dt) eps
        log p = mean_dims[ -(x_next - mean)^2 / (2 std_t^2 (-dt)) - log(std_t sqrt(-dt)) - log sqrt(2 pi) ]
      with sigma = 1 replaced by sigma_next inside (1 - sigma) (Flow-GRPO's guard).
    sde_type="cps" (coefficients-preserving sampling, Flow-CPS; flow_grpo sde_type="cps"):
        std = sigma_next sin(noise_level pi / 2),  x0 = x - sigma v,  x1 = x + (1 - sigma) v
        mean = (1 - sigma_next) x0 + sqrt(sigma_next^2 - std^2) x1,  x_next = mean + std eps
        log p = mean_dims[ -(x_next - mean)^2 ]   (constants dropped, as flow_grpo does)
    noise_level = 0 gives mean = the ODE (Euler) step for both types.
    Everything is computed in fp32 (bf16 overflows in the mean, as Flow-GRPO notes).
    """
    # source: flow_grpo/diffusers_patch/sd3_sde_with_logprob.py (sde_step_with_logprob, 'sde' and 'cps')
    if sde_type not in SDE_TYPES:
        raise ValueError(f"unknown sde_type {sde_type!r}; valid: {list(SDE_TYPES)}")
    if noise_level < 0:
        raise ValueError(f"noise_level must be >= 0, got {noise_level}")
    x = sample.to(torch.float32)
    v = velocity.to(torch.float32)
    s = _as_batch(sigma, x)
    s_next = _as_batch(sigma_next, x)
    dt = s_next - s
    if sde_type == "sde":
        denom = 1.0 - torch.where(s >= 1.0, s_next, s)  # guard sigma == 1 (first step)
        std = torch.sqrt(s / denom) * noise_level
        mean = x * (1.0 + std**2 / (2.0 * s) * dt) + v * (1.0 + std**2 * (1.0 - s) / (2.0 * s)) * dt
        step_std = std * torch.sqrt(-dt)
    else:
        std = s_next * math.sin(noise_level * math.pi / 2.0)
        x0 = x - s * v
        x1 = x + v * (1.0 - s)
        mean = x0 * (1.0 - s_next) + x1 * torch.sqrt((s_next**2 - std**2).clamp(min=0.0))
        step_std = std
    if prev_sample is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        prev_sample = mean + step_std * noise.to(torch.float32)
    target = prev_sample.detach().to(torch.float32)
    if sde_type == "sde":
        var = step_std**2
        log_prob = -((target - mean) ** 2) / (2.0 * var) - torch.log(step_std) - 0.5 * math.log(2.0 * math.pi)
        if noise_level == 0:  # a deterministic step has no density; report 0 instead of nan
            log_prob = torch.zeros_like(mean)
    else:
        log_prob = -((target - mean) ** 2)
    return StepOutput(prev_sample, _mean_over_non_batch(log_prob), mean, std.expand(x.shape[0], *std.shape[1:]),
                      step_std.expand(x.shape[0], *step_std.shape[1:]))

