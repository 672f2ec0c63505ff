"""Z-Image / Z-Image-Turbo (`ZImagePipeline`) as a FlowModel: latents [B, C, h, w], Qwen3 text encoder.

What diffusers' `ZImagePipeline` does per step, and what this family does the same way:
- text: the prompt in the tokenizer's chat template (`enable_thinking=True`), the text encoder's second-to-last
  hidden state, only the prompt's real tokens (a variable-length list); here they are kept zero-padded to
  `max_sequence_length` with their mask (`prompt_embeds`, `prompt_mask`), so prompts batch and cache like every
  family's, and unpadded per sample for the transformer;
- timestep convention: the transformer gets `(1000 - t) / 1000 = 1 - sigma` (0 at pure noise), a list of
  [C, 1, h, w] latents and a list of caption embeddings; its output is the negated velocity (the pipeline
  negates it before the Euler step: `noise_pred = -noise_pred`), so `transformer_velocity` returns `-output`;
- guidance: `guidance_scale` is Z-Image's own `s` in `pos + s (pos - neg)` (= standard CFG with w = 1 + s), on
  when s > 0 (diffusers' rule; Flow-Factory's Z-Image configs use 4, Turbo 0). `cfg_normalization` and
  `cfg_truncation` (off by default in diffusers) are not implemented;
- schedule: sigmas linspace(1, 1/N, N) and `mu` from the image token count, as the pipeline passes them.
"""

from __future__ import annotations

import torch

from mmrl.diffusion.models.base import FlowModel, PromptEmbeds, register_family

# source: Flow-Factory src/flow_factory/models/z_image/z_image.py (default LoRA targets)
Z_IMAGE_LORA_TARGETS = [
    "attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
]


@register_family("ZImagePipeline")
class ZImageModel(FlowModel):
    """Z-Image (`ZImagePipeline`); see the module docstring."""

    family = "z_image"
    default_max_sequence_length = 512  # the pipeline's
    lora_target_modules = Z_IMAGE_LORA_TARGETS

    def encode_prompts(self, prompts, images=None):
        self.check_text_only(images)
        with torch.no_grad():
            texts = [self.pipe.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                             add_generation_prompt=True, enable_thinking=True)
                     for p in prompts]
            tok = self.pipe.tokenizer(texts, padding="max_length", max_length=self.max_sequence_length,
                                      truncation=True, return_tensors="pt")
            mask = tok.attention_mask.to(self.device).bool()
            hidden = self.pipe.text_encoder(input_ids=tok.input_ids.to(self.device), attention_mask=mask,
                                            output_hidden_states=True).hidden_states[-2]
        pe = hidden.to(self.dtype) * mask[..., None]  # padding rows are dropped again in transformer_velocity
        return PromptEmbeds(prompt_embeds=pe, prompt_mask=mask)

    def cfg_enabled(self, guidance_scale):
        return guidance_scale > 0.0

    def combine_cfg(self, v_uncond, v_cond, guidance_scale, sigma=None):
        # pos + s (pos - neg) on the negated outputs: bitwise the negation of the pipeline's combination
        return v_cond + guidance_scale * (v_cond - v_uncond)

    def transformer_velocity(self, latents, sigma, embeds, guidance_scale):
        t = (1000 - sigma * 1000) / 1000  # the pipeline's (1000 - timestep) / 1000 with timestep = 1000 sigma
        x = list(latents.to(self.dtype).unsqueeze(2).unbind(0))
        caps = [pe[m] for pe, m in zip(embeds["prompt_embeds"], embeds["prompt_mask"])]
        out = self.transformer(x, t.to(self.dtype), caps, return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)

    def initial_noise(self, n, height, width, generator=None):
        h, w = self.latent_hw(height, width, 2)
        c = self.pipe.transformer.in_channels
        return torch.randn((n, c, h, w), generator=generator, device=self.device, dtype=torch.float32)

    def sigmas(self, num_steps, height, width):
        from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas

        h, w = self.latent_hw(height, width, 2)
        c = self.scheduler_config
        mu = calculate_shift((h // 2) * (w // 2), c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        sched = self.new_scheduler()
        sched.set_timesteps(sigmas=get_default_z_image_sigmas(num_steps), device="cpu", mu=mu)
        return sched.sigmas.float()

    def decode(self, latents, height, width):
        return self.vae_decode(latents)
