"""Wan 2.1 / 2.2 text-to-video (`WanPipeline`) as a FlowModel: latents [B, C, F, h, w], videos [B, F, 3, H, W].

What diffusers' `WanPipeline` does per step, and what this family does the same way:
- text: UMT5 `last_hidden_state` of the prompt, cut to its real tokens and zero-padded to `max_sequence_length`
  (the pipeline's `_get_t5_prompt_embeds`); negative prompt "" for classifier-free guidance, on when scale > 1;
- timestep: the raw `t = 1000 sigma` (no /1000); Wan 2.2 TI2V-5B (`expand_timesteps: true` in model_index.json)
  gets it once per latent token ([B, F' (h/2) (w/2)]), which for text-to-video is the same value everywhere;
- Wan 2.2 A14B (`transformer_2` + `boundary_ratio`): samples with `t >= boundary_ratio * 1000` go through
  `transformer` (high noise) with `guidance_scale`, the others through `transformer_2` with `guidance_scale_2`
  (`model.family_options: {guidance_scale_2: ...}`; default = guidance_scale, as diffusers). Both experts can train:
  they are one module (`WanExperts`) that LoRA (or full fine-tuning) wraps as a whole (`idle_experts` names one that
  a window of sampling steps never reaches);
- decode: `latents / (1 / latents_std) + latents_mean`, `AutoencoderKLWan.decode`, [-1, 1] -> [0, 1].

The sampler is Euler / Flow-GRPO SDE on the pipeline scheduler's sigma schedule: with the published
`UniPCMultistepScheduler` (flow sigmas, `flow_shift`) the sigmas are UniPC's, but the solver is first-order (UniPC
is a multistep predictor-corrector, which a per-step log-probability cannot follow); with a
`FlowMatchEulerDiscreteScheduler` the ODE rollout equals diffusers' pipeline. The frame count must be 4k+1 (the
VAE's temporal factor 4; diffusers rounds other counts with a warning, this refuses them) and at most
4 (rope_max_seq_len - 1) + 1 (the transformer's rotary table; 4093 frames with the published models' 1024).
Not covered: image-to-video (Wan I2V, TI2V with a first frame), VACE, Wan-Animate.
"""

from __future__ import annotations

from typing import Any

import torch

from mmrl.diffusion.models.base import FlowModel, PromptEmbeds, register_family

Tensor = torch.Tensor

# source: Flow-Factory src/flow_factory/models/wan/wan2_t2v.py (default LoRA targets for Wan transformers)
WAN_LORA_TARGETS = [
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
    "ffn.net.0.proj", "ffn.net.2",
]


class WanExperts(torch.nn.Module):
    """Wan 2.2 A14B's two experts as one trainable module: `high` (the pipeline's `transformer`) denoises samples
    whose timestep is >= `boundary` (= boundary_ratio * 1000), `low` (`transformer_2`) the others. A batch that
    mixes both (DiffusionNFT draws a noise level per sample) is split, each part run through its expert, and
    joined back in order."""

    def __init__(self, high: torch.nn.Module, low: torch.nn.Module, boundary: float):
        super().__init__()
        self.high, self.low, self.boundary = high, low, float(boundary)
        self._no_split_modules = getattr(high, "_no_split_modules", None)  # FSDP shards each expert's blocks
        self.config = high.config

    @property
    def dtype(self) -> torch.dtype:
        return next(self.high.parameters()).dtype

    def forward(self, hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor,
                return_dict: bool = False, **kw: Any):
        t = timestep if timestep.dim() == 1 else timestep[:, 0]  # expanded timesteps: one value per sample
        high = t >= self.boundary
        if bool(high.all()) or not bool(high.any()):
            expert = self.high if bool(high.all()) else self.low
            return expert(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                          return_dict=False, **kw)
        out = torch.empty_like(hidden_states)
        for mask, expert in ((high, self.high), (~high, self.low)):
            out[mask] = expert(hidden_states=hidden_states[mask], timestep=timestep[mask],
                               encoder_hidden_states=encoder_hidden_states[mask], return_dict=False, **kw)[0]
        return (out,)


@register_family("WanPipeline")
class WanModel(FlowModel):
    """Wan 2.1 / 2.2 text-to-video (`WanPipeline`); see the module docstring."""

    family = "wan"
    is_video = True
    default_max_sequence_length = 512  # the pipeline's (Flow-Factory pads to it too)
    lora_target_modules = WAN_LORA_TARGETS
    option_names = ("guidance_scale_2",)

    def __init__(self, pipe, device, dtype, max_sequence_length):
        super().__init__(pipe, device, dtype, max_sequence_length)
        cfg = pipe.config
        self.expand_timesteps = bool(cfg.get("expand_timesteps", False))
        ratio = cfg.get("boundary_ratio", None)
        if pipe.transformer is None:
            raise ValueError("WanPipeline without `transformer` (a transformer_2-only checkpoint) is not supported")
        self.boundary = None
        if pipe.transformer_2 is not None:
            if ratio is None:
                raise ValueError("WanPipeline with transformer_2 needs boundary_ratio in model_index.json")
            self.boundary = float(ratio) * self.scheduler_config.get("num_train_timesteps", 1000)
            self.transformer = WanExperts(pipe.transformer, pipe.transformer_2, self.boundary)
        self.guidance_scale_2: float | None = None
        self.temporal_factor = int(self.vae.config.scale_factor_temporal)
        self.vae_scale_factor = int(self.vae.config.scale_factor_spatial)
        self.patch_size = tuple(pipe.transformer.config.patch_size)

    def idle_experts(self, num_steps, height, width, steps):
        """Wan 2.2 A14B: `transformer` runs the steps with t = 1000 sigma >= boundary, `transformer_2` the others;
        those of the two that no step in [steps[0], steps[1]) reaches."""
        if self.boundary is None:
            return []
        high = self._high_noise(self.sigmas(num_steps, height, width)[steps[0]:steps[1]])
        return [name for name, hit in (("transformer", high.any()), ("transformer_2", (~high).any())) if not hit]

    def configure(self, guidance_scale_2: float | None = None, **options: Any) -> None:
        """guidance_scale_2: CFG scale of Wan 2.2 A14B's low-noise expert (None = the rollout's guidance_scale)."""
        super().configure(**options)
        if guidance_scale_2 is not None and self.boundary is None:
            raise ValueError("model.family_options.guidance_scale_2 applies to Wan 2.2 A14B (transformer_2 and "
                             "boundary_ratio); this pipeline has one transformer")
        self.guidance_scale_2 = None if guidance_scale_2 is None else float(guidance_scale_2)

    def set_num_frames(self, num_frames: int) -> None:
        """Frames per video: k*m + 1 (the VAE's temporal factor k; it encodes the first frame alone, then k at a
        time), and at most as many latent frames (per temporal patch) as the transformer's rotary position table
        holds (`rope_max_seq_len`: diffusers slices the table to the frame count and reshapes, which fails beyond)."""
        k = self.temporal_factor
        if num_frames < 1 or (num_frames - 1) % k:
            raise ValueError(f"rollout.num_frames={num_frames}: the Wan VAE takes {k}k+1 frames (1, {k + 1}, "
                             f"{2 * k + 1}, {4 * k + 1}, ...); use {max(1, (num_frames - 1) // k * k + 1)} or "
                             f"{((num_frames - 1) // k + 1) * k + 1}")
        experts = [self.pipe.transformer] + ([self.pipe.transformer_2] if self.pipe.transformer_2 is not None else [])
        rope = min(int(t.config.rope_max_seq_len) for t in experts)
        latent, most_latent = (num_frames - 1) // k + 1, (rope + 1) * self.patch_size[0] - 1
        if latent > most_latent:
            raise ValueError(f"rollout.num_frames={num_frames}: {latent} latent frames (({num_frames} - 1) / {k} + 1), "
                             f"more than the Wan transformer's rotary positions take ({most_latent}: rope_max_seq_len "
                             f"{rope} in its config.json); use at most {(most_latent - 1) * k + 1} frames")
        self.num_frames = int(num_frames)

    # ------------------------------------------------------------------ text
    def encode_prompts(self, prompts, images=None):
        self.check_text_only(images)
        with torch.no_grad():
            pe, _ = self.pipe.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                            max_sequence_length=self.max_sequence_length, device=self.device)
        return PromptEmbeds(prompt_embeds=pe.to(self.dtype))

    # ------------------------------------------------------------------ denoising
    def _high_noise(self, sigma: torch.Tensor) -> torch.Tensor:
        """Which sigmas the high-noise expert (`transformer`) takes: t = sigma * num_train_timesteps >= boundary, the
        timestep `transformer_velocity` passes and `WanExperts` routes by."""
        return sigma * self.scheduler_config.get("num_train_timesteps", 1000) >= self.boundary

    def combine_cfg(self, v_uncond, v_cond, guidance_scale, sigma=None):
        if self.boundary is None or self.guidance_scale_2 is None:
            return v_uncond + guidance_scale * (v_cond - v_uncond)
        high = self._high_noise(sigma)
        w = torch.where(high, torch.tensor(float(guidance_scale)), torch.tensor(self.guidance_scale_2))
        return v_uncond + w.view(-1, *([1] * (v_cond.dim() - 1))).to(v_cond) * (v_cond - v_uncond)

    def transformer_velocity(self, latents, sigma, embeds, guidance_scale):
        b, _, f, h, w = latents.shape
        t = sigma * self.scheduler_config.get("num_train_timesteps", 1000)
        if self.expand_timesteps:  # Wan 2.2 TI2V: one timestep per latent token (all equal without a first frame)
            _, ph, pw = self.patch_size
            t = t[:, None].expand(b, f * (h // ph) * (w // pw))
        return self.transformer(hidden_states=latents.to(self.dtype), timestep=t,
                                encoder_hidden_states=embeds["prompt_embeds"], return_dict=False)[0]

    def initial_noise(self, n, height, width, generator=None):
        h, w = self.latent_hw(height, width, self.patch_size[1])
        f = (self.num_frames - 1) // self.temporal_factor + 1
        c = self.pipe.transformer.config.in_channels
        return torch.randn((n, c, f, h, w), generator=generator, device=self.device, dtype=torch.float32)

    def sigmas(self, num_steps, height, width):
        """The pipeline scheduler's sigmas for `num_steps` (FlowMatchEuler with its shift, or UniPC's flow sigmas
        with `flow_shift`), last one 0."""
        from diffusers import UniPCMultistepScheduler

        if self.pipe.scheduler.__class__.__name__ == "UniPCMultistepScheduler":
            sched = UniPCMultistepScheduler.from_config(self.scheduler_config)
            if not self.scheduler_config.get("use_flow_sigmas", False):
                raise ValueError("WanPipeline: a UniPCMultistepScheduler without use_flow_sigmas is not a "
                                 "flow-matching schedule")
        else:
            sched = self.new_scheduler()
        sched.set_timesteps(num_steps, device="cpu")
        return sched.sigmas.float()

    @property
    def sigma_shift(self) -> float:
        c = self.scheduler_config
        return float(c.get("flow_shift", c.get("shift", 1.0)))

    # ------------------------------------------------------------------ VAE
    def _latent_stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        c = self.vae.config
        mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(like.device, like.dtype)
        inv_std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(like.device, like.dtype)
        return mean, inv_std

    def decode(self, latents, height, width):
        """[B, C, F', h, w] -> videos [B, F, 3, H, W] in [0, 1]; one frame -> images [B, 3, H, W]."""
        z = latents.to(self.vae.dtype)
        mean, inv_std = self._latent_stats(z)
        video = self.vae.decode(z / inv_std + mean, return_dict=False)[0]  # [B, 3, F, H, W] in [-1, 1]
        video = (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
        return video[:, 0] if self.num_frames == 1 else video

    @torch.no_grad()
    def encode_images(self, images):
        """Images [B, 3, H, W] (one frame) or videos [B, F, 3, H, W] in [0, 1] -> latents [B, C, F', h, w]."""
        x = images.to(self.device, torch.float32)
        x = x.unsqueeze(1) if x.dim() == 4 else x
        z = self.vae.encode((x * 2 - 1).permute(0, 2, 1, 3, 4).to(self.vae.dtype)).latent_dist.mean.float()
        mean, inv_std = self._latent_stats(z)
        return (z - mean) * inv_std
