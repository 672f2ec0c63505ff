"""Checks every model family's tests run (tests/diffusion/test_<family>.py; usable for a family of your own).

- `assert_sde_log_probs_follow_flow_grpo`: a family's SDE rollout records, for every stochastic step, the log
  density of the Flow-GRPO transition (arXiv 2505.05470 eq. 9, Euler-Maruyama), written out here by hand with
  `torch.distributions.Normal` on the family's own velocity; and the trainer's recomputation (`step_log_prob`,
  the path every recipe trains through) gives the same numbers. Latents of any rank (images, videos).
- `assert_lora_targets_exist`: every default LoRA target module of the family names at least one module of its
  transformer (peft's suffix match), so no target silently matches nothing.
- `packed(model, latents)`: [B, C, h, w] latents in the 2x2-packed token layout the FLUX.1 / Kontext / Qwen-Image
  pipelines take and return, for comparing rollouts with the pipeline's `output_type="latent"`.
"""

from __future__ import annotations

import math

import torch

from mmrl.diffusion.sampling import sample_groups, step_log_prob


def flow_grpo_log_prob(x, x_next, v, sigma, sigma_next, noise_level):
    """Flow-GRPO's SDE step density of x_next given x, averaged over non-batch dims, by hand (float64)."""
    dt = sigma_next - sigma
    std_t = math.sqrt(sigma / (1 - (sigma_next if sigma >= 1 else sigma))) * noise_level  # sigma = 1 guard
    mean = x * (1 + std_t ** 2 / (2 * sigma) * dt) + v * (1 + std_t ** 2 * (1 - sigma) / (2 * sigma)) * dt
    normal = torch.distributions.Normal(mean.double(), std_t * math.sqrt(-dt))
    return normal.log_prob(x_next.double()).flatten(1).mean(1)


def assert_sde_log_probs_follow_flow_grpo(model, embeds, *, guidance_scale, height=64, width=64, num_steps=4,
                                          noise_level=0.7):
    """Roll out 2 samples per prompt with the SDE on every step; check every recorded log-prob by hand and by
    recomputation; returns the trajectory."""
    traj = sample_groups(model, embeds, 2, num_steps=num_steps, height=height, width=width,
                         guidance_scale=guidance_scale, noise_level=noise_level,
                         generator=torch.Generator().manual_seed(3))
    assert bool(traj.sde_mask.all()) and torch.isfinite(traj.log_probs).all()
    emb = embeds.select(traj.prompt_index)
    b = len(traj)
    with torch.no_grad():
        for j in range(num_steps):
            s, s_next = traj.sigmas[j].item(), traj.sigmas[j + 1].item()
            x, x_next = traj.latents[:, j], traj.latents[:, j + 1]
            v = model.velocity(x, s, emb, guidance_scale=guidance_scale)
            hand = flow_grpo_log_prob(x, x_next, v, s, s_next, noise_level)
            assert torch.allclose(traj.log_probs[:, j].double(), hand, atol=1e-4, rtol=1e-5), \
                (j, (traj.log_probs[:, j].double() - hand).abs().max())
            again = step_log_prob(model, x, x_next, traj.sigmas[j].expand(b), traj.sigmas[j + 1].expand(b), emb,
                                  guidance_scale=guidance_scale, noise_level=noise_level)
            assert torch.allclose(again.log_prob, traj.log_probs[:, j], atol=1e-6, rtol=0), j
    return traj


def assert_lora_targets_exist(model):
    """Every default LoRA target of the family matches a module of its transformer (suffix match, as peft)."""
    names = [n for n, _ in model.transformer.named_modules()]
    for target in model.lora_target_modules:
        assert any(n == target or n.endswith("." + target) for n in names), f"LoRA target {target!r} matches nothing"


def packed(model, latents):
    """[B, C, h, w] -> the pipeline's packed tokens [B, (h/2)(w/2), 4C] (a copy)."""
    b, c, h, w = latents.shape
    return model.pipe._pack_latents(latents.clone(), b, c, h, w)
