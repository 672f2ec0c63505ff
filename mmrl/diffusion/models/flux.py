"""FLUX.1 (`FluxPipeline`) as a FlowModel."""

from __future__ import annotations

import numpy as np
import torch

from mmrl.diffusion.models.base import FlowModel, PromptEmbeds, register_family


@register_family("FluxPipeline")
class FluxModel(FlowModel):
    """FLUX.1 (`FluxPipeline`). Latents stay [B, C, h, w] outside (like SD3, so samplers and log-probs
    see one layout); `_forward` packs them into [B, (h/2)(w/2), 4C] tokens with img_ids / txt_ids and
    unpacks the prediction. The guidance scale goes into the transformer's guidance embedding
    (FLUX-dev) instead of classifier-free guidance; timestep = sigma."""

    family = "flux"
    default_max_sequence_length = 512

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.has_guidance_embedding = bool(getattr(self.transformer.config, "guidance_embeds", False))

    def encode_prompts(self, prompts):
        with torch.no_grad():
            pe, pooled, _ = self.pipe.encode_prompt(prompt=list(prompts), prompt_2=None, device=self.device,
                                                    max_sequence_length=self.max_sequence_length)
        return PromptEmbeds(prompt_embeds=pe.to(self.dtype), pooled_prompt_embeds=pooled.to(self.dtype))

    def _forward(self, latents, sigma, embeds, guidance_scale):
        b, c, h, w = latents.shape
        packed = self.pipe._pack_latents(latents.to(self.dtype), b, c, h, w)
        img_ids = self.pipe._prepare_latent_image_ids(b, h // 2, w // 2, self.device, self.dtype)
        txt_ids = torch.zeros(embeds["prompt_embeds"].shape[1], 3, device=self.device, dtype=self.dtype)
        guidance = None
        if self.has_guidance_embedding:
            guidance = torch.full([b], float(guidance_scale), device=self.device, dtype=torch.float32)
        out = self.transformer(
            hidden_states=packed, timestep=sigma.to(self.dtype), guidance=guidance,
            pooled_projections=embeds["pooled_prompt_embeds"], encoder_hidden_states=embeds["prompt_embeds"],
            txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        # inverse of _pack_latents: [B, (h/2)(w/2), 4C] -> [B, C, h, w]
        return out.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)

    def initial_noise(self, n, height, width, generator=None):
        h, w = self._latent_hw(height, width, 2)
        c = self.transformer.config.in_channels // 4
        return torch.randn((n, c, h, w), generator=generator, device=self.device, dtype=torch.float32)

    def sigmas(self, num_steps, height, width):
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        h, w = self._latent_hw(height, width, 2)
        c = self.scheduler_config
        mu = calculate_shift((h // 2) * (w // 2), c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        sched = self._new_scheduler()
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), device="cpu", mu=mu)
        return sched.sigmas.float()

    def decode(self, latents, height, width):
        return self._vae_decode(latents)
