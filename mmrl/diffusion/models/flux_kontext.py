"""FLUX.1 Kontext (`FluxKontextPipeline`) as a FlowModel: FLUX.1 conditioned on a source image."""

from __future__ import annotations

import torch

from mmrl.diffusion.models.base import PromptEmbeds, TinyCase, register_family
from mmrl.diffusion.models.flux import FluxModel
from mmrl.tiny import build_tiny_flux_kontext

# source: X-GenGroup/Flow-Factory src/flow_factory/models/flux/flux1_kontext.py (default_target_modules): the
# joint-attention projections plus both feed-forwards of the double-stream blocks; all exist in diffusers 0.42's
# FluxTransformer2DModel (`ff.net.2` is a Linear; the single-stream blocks' attention is reached by `attn.to_q/k/v`)
KONTEXT_LORA_TARGETS = [
    "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj",
    "attn.to_add_out", "ff.net.0.proj", "ff_context.net.0.proj", "ff.net.2", "ff_context.net.2",
]


@register_family("FluxKontextPipeline")
class FluxKontextModel(FluxModel):
    """FLUX.1 Kontext: the source image's VAE latents `image_latents` [N, C, hc, wc] (scaled as the flow model's
    latents) ride in the prompt conditioning; `transformer_velocity` packs them after the noisy latents' tokens with
    image ids whose first axis is 1 (the pipeline's `image_ids[..., 0] = 1`) and keeps the target's tokens of the
    prediction.
    The text (CLIP pooled + T5) does not see the image, so the CFG negative is the empty prompt with the same
    source latents; Kontext-dev is guidance-distilled (guidance embedding, no CFG), as FLUX.1-dev.

    `encode_prompts(prompts, images)` takes the source images at the size to condition on (the pipeline snaps them
    to a preferred ~1024^2 resolution with `_auto_resize`; recipes use the rollout's height x width, Flow-Factory's
    `condition_image_size`)."""

    family = "flux_kontext"
    tiny_cases = (TinyCase("flux_kontext", build_tiny_flux_kontext,
                           {"height": 32, "width": 32, "guidance_scale": 2.5}),)
    needs_source_image = True
    lora_target_modules = KONTEXT_LORA_TARGETS

    def encode_prompts(self, prompts, images=None):
        if images is None:
            raise ValueError(f"{type(self).__name__} ({self.family}) edits a source image: encode_prompts needs "
                             f"images=[N, 3, H, W] in [0, 1], one per prompt (the data rows' 'source_image')")
        if images.shape[0] != len(prompts):
            raise ValueError(f"{self.family}: {len(prompts)} prompts but {images.shape[0]} source images")
        out = self._text(prompts)
        out["image_latents"] = self.encode_images(images)
        return out

    def _text(self, prompts):
        return FluxModel.encode_prompts(self, prompts)

    def encode_empty_prompt(self):
        return self._text([""])

    def negative_rows(self, embeds):
        neg = self.negative_embeds(len(embeds))
        neg["image_latents"] = embeds["image_latents"]
        return PromptEmbeds(neg)

    def transformer_velocity(self, latents, sigma, embeds, guidance_scale):
        b, c, h, w = latents.shape
        cond = embeds["image_latents"]
        image_ids = self.pipe._prepare_latent_image_ids(b, cond.shape[-2] // 2, cond.shape[-1] // 2, self.device,
                                                        self.dtype)
        image_ids[..., 0] = 1
        ids = torch.cat([self.pipe._prepare_latent_image_ids(b, h // 2, w // 2, self.device, self.dtype), image_ids])
        out = self.run_transformer(self.pack_tokens(latents, cond), ids, sigma, embeds, guidance_scale)
        return self.unpack_tokens(out, c, h, w)
