"""FLUX.1 (`FluxPipeline`) as a FlowModel."""

from __future__ import annotations

import torch

from mmrl.diffusion.models.base import FlowModel, PromptEmbeds, register_family


@register_family("FluxPipeline")
class FluxModel(FlowModel):
    """FLUX.1 (`FluxPipeline`). Latents stay [B, C, h, w] outside (like SD3, so samplers and log-probs
    see one layout); `transformer_velocity` packs them into [B, (h/2)(w/2), 4C] tokens with img_ids / txt_ids and
    unpacks the prediction. The guidance scale goes into the transformer's guidance embedding
    (FLUX-dev) instead of classifier-free guidance; timestep = sigma."""

    family = "flux"
    default_max_sequence_length = 512

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.has_guidance_embedding = bool(getattr(self.transformer.config, "guidance_embeds", False))

    def encode_prompts(self, prompts, images=None):
        self.check_text_only(images)
        with torch.no_grad():
            pe, pooled, _ = self.pipe.encode_prompt(prompt=list(prompts), prompt_2=None, device=self.device,
                                                    max_sequence_length=self.max_sequence_length)
        return PromptEmbeds(prompt_embeds=pe.to(self.dtype), pooled_prompt_embeds=pooled.to(self.dtype))

    def transformer_velocity(self, latents, sigma, embeds, guidance_scale):
        b, c, h, w = latents.shape
        img_ids = self.pipe._prepare_latent_image_ids(b, h // 2, w // 2, self.device, self.dtype)
        out = self.run_transformer(self.pack_tokens(latents), img_ids, sigma, embeds, guidance_scale)
        return self.unpack_tokens(out, c, h, w)

    def run_transformer(self, packed, img_ids, sigma, embeds, guidance_scale):
        """The transformer on packed tokens [B, N, 4C] with their ids [N, 3]; the packed prediction."""
        txt_ids = torch.zeros(embeds["prompt_embeds"].shape[1], 3, device=self.device, dtype=self.dtype)
        guidance = None
        if self.has_guidance_embedding:
            guidance = torch.full([packed.shape[0]], float(guidance_scale), device=self.device, dtype=torch.float32)
        return self.transformer(
            hidden_states=packed, timestep=sigma.to(self.dtype), guidance=guidance,
            pooled_projections=embeds["pooled_prompt_embeds"], encoder_hidden_states=embeds["prompt_embeds"],
            txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]

    def initial_noise(self, n, height, width, generator=None):
        return self.packed_noise(n, height, width, generator)

    def sigmas(self, num_steps, height, width):
        return self.packed_sigmas(num_steps, height, width)

    def decode(self, latents, height, width):
        return self.vae_decode(latents)
