"""Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline`) as a FlowModel."""

from __future__ import annotations

import torch

from mmrl.diffusion.models.base import FlowModel, PromptEmbeds, register_family


@register_family("StableDiffusion3Pipeline")
class SD3Model(FlowModel):
    """Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline`): latents [B, C, h, w], timestep = 1000 sigma."""

    family = "sd3"
    default_max_sequence_length = 128  # T5 tokens (the pipeline's own default is 256)

    def encode_prompts(self, prompts: list[str], images=None) -> PromptEmbeds:
        self.check_text_only(images)
        with torch.no_grad():
            pe, _, pooled, _ = self.pipe.encode_prompt(
                prompt=list(prompts), prompt_2=None, prompt_3=None, device=self.device,
                do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length)
        return PromptEmbeds(prompt_embeds=pe.to(self.dtype), pooled_prompt_embeds=pooled.to(self.dtype))

    def transformer_velocity(self, latents, sigma, embeds, guidance_scale):
        return self.transformer(
            hidden_states=latents.to(self.dtype), timestep=sigma * self.scheduler_config["num_train_timesteps"],
            encoder_hidden_states=embeds["prompt_embeds"], pooled_projections=embeds["pooled_prompt_embeds"],
            return_dict=False)[0]

    def initial_noise(self, n, height, width, generator=None):
        h, w = self.latent_hw(height, width, self.transformer.config.patch_size)
        c = self.transformer.config.in_channels
        return torch.randn((n, c, h, w), generator=generator, device=self.device, dtype=torch.float32)

    def sigmas(self, num_steps, height, width):
        sched = self.new_scheduler()
        kw = {}
        if self.scheduler_config.get("use_dynamic_shifting"):
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

            h, w = self.latent_hw(height, width)
            p = self.transformer.config.patch_size
            c = self.scheduler_config
            kw["mu"] = calculate_shift((h // p) * (w // p), c.get("base_image_seq_len", 256),
                                       c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
                                       c.get("max_shift", 1.16))
        sched.set_timesteps(num_steps, device="cpu", **kw)
        return sched.sigmas.float()

    def decode(self, latents, height, width):
        return self.vae_decode(latents)
