"""Qwen-Image (`QwenImagePipeline`) as a FlowModel: Qwen2.5-VL text encoder, true CFG with a norm rescale."""

from __future__ import annotations

import torch

from mmrl.diffusion.models.base import FlowModel, PromptEmbeds, register_family

# source: verl-project/verl-omni examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr_lora.sh (target_modules);
# every name exists in diffusers 0.42's QwenImageTransformerBlock (`img_mlp.net.2` is the plain Linear of the MLP:
# Flow-Factory's `img_mlp.net.2.proj` matches nothing)
QWEN_IMAGE_LORA_TARGETS = [
    "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
]


@register_family("QwenImagePipeline")
class QwenImageModel(FlowModel):
    """Qwen-Image. Latents stay [B, C, h, w] outside (16 channels, h = H/8); `transformer_velocity` packs them 2x2 into
    [B, (h/2)(w/2), 4C] tokens with `img_shapes` for the 3-D RoPE, timestep = sigma (the pipeline's t/1000).

    Text: the pipeline's `encode_prompt` (chat template, last hidden layer, template tokens dropped), rows of
    different lengths kept with `prompt_embeds_mask` (PromptEmbeds pads them when batches are stacked; the
    transformer masks the padding). CFG is the pipeline's "true CFG" with the empty prompt as the negative, then
    rescaled per token to the conditional prediction's norm (`combine_cfg`), as diffusers' QwenImagePipeline (and
    Flow-Factory's and verl-omni's adapters) do. The VAE (AutoencoderKLQwenImage) is a video VAE: images are
    single frames, latents normalised with its per-channel `latents_mean` / `latents_std`."""

    family = "qwen_image"
    default_max_sequence_length = 512  # the pipeline's default (its tokenizer limit is 1024)
    lora_target_modules = QWEN_IMAGE_LORA_TARGETS
    # the last block's text-stream output (txt_mlp, to_add_out, ...) feeds nothing: only the image tokens are predicted
    has_unused_parameters = True

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.has_guidance_embedding = bool(getattr(self.transformer.config, "guidance_embeds", False))

    # ------------------------------------------------------------------ text
    def encode_prompts(self, prompts, images=None):
        self.check_text_only(images)
        pe, mask = self.encode_text(list(prompts))
        return PromptEmbeds(prompt_embeds=pe, prompt_embeds_mask=mask)

    @torch.no_grad()
    def encode_text(self, prompts, image=None):
        """(prompt_embeds [N, L, D] in the model dtype, mask [N, L] long) from the pipeline's own encoder."""
        kw = {} if image is None else {"image": image}
        pe, mask = self.pipe.encode_prompt(prompt=prompts, device=self.device,
                                           max_sequence_length=self.max_sequence_length, **kw)
        pe = pe[:, : self.max_sequence_length]  # the edit pipelines' encode_prompt does not cut (the T2I one does)
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(pe.shape[:2], dtype=torch.long, device=pe.device)
        return pe.to(self.dtype), mask[:, : pe.shape[1]].long()

    # ------------------------------------------------------------------ denoising
    def _text_inputs(self, embeds, prefix=""):
        """(text embeddings, mask or None) cut to the longest row: padding every row shares carries no information,
        and the pipeline passes no mask when no row is padded."""
        pe, mask = embeds[prefix + "prompt_embeds"], embeds[prefix + "prompt_embeds_mask"]
        n = int(mask.sum(1).max())
        pe, mask = pe[:, :n], mask[:, :n]
        return pe, (None if bool(mask.all()) else mask)

    def run_transformer(self, packed, img_shapes, sigma, embeds, guidance_scale):
        pe, mask = self._text_inputs(embeds)
        guidance = None
        if self.has_guidance_embedding:
            guidance = torch.full([packed.shape[0]], float(guidance_scale), device=self.device, dtype=torch.float32)
        return self.transformer(hidden_states=packed, timestep=sigma.to(self.dtype), guidance=guidance,
                                encoder_hidden_states_mask=mask, encoder_hidden_states=pe, img_shapes=img_shapes,
                                return_dict=False)[0]

    def transformer_velocity(self, latents, sigma, embeds, guidance_scale):
        b, c, h, w = latents.shape
        shapes = [[(1, h // 2, w // 2)]] * b
        out = self.run_transformer(self.pack_tokens(latents), shapes, sigma, embeds, guidance_scale)
        return self.unpack_tokens(out, c, h, w)

    def combine_cfg(self, v_uncond, v_cond, guidance_scale, sigma=None):
        """True CFG, then each token (2x2 latent patch, all channels) rescaled to the conditional branch's norm:
        comb * ||v_c|| / ||comb||."""
        # source: diffusers 0.42 pipelines/qwenimage/pipeline_qwenimage.py __call__ (comb_pred, cond_norm, noise_norm)
        comb = v_uncond + guidance_scale * (v_cond - v_uncond)
        b, c, h, w = comb.shape

        def token_norm(x):  # ||.|| over each packed token = over (channel, 2, 2) of a patch
            return x.reshape(b, c, h // 2, 2, w // 2, 2).pow(2).sum(dim=(1, 3, 5), keepdim=True).sqrt()

        scale = token_norm(v_cond) / token_norm(comb)
        return (comb.reshape(b, c, h // 2, 2, w // 2, 2) * scale).reshape(b, c, h, w)

    def initial_noise(self, n, height, width, generator=None):
        return self.packed_noise(n, height, width, generator)

    def sigmas(self, num_steps, height, width):
        return self.packed_sigmas(num_steps, height, width)

    # ------------------------------------------------------------------ VAE
    def _latent_stats(self, like):
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean, dtype=torch.float32, device=like.device).view(1, -1, 1, 1)
        std = torch.tensor(cfg.latents_std, dtype=torch.float32, device=like.device).view(1, -1, 1, 1)
        return mean, std

    def decode(self, latents, height, width):
        mean, std = self._latent_stats(latents)
        z = (latents.float() * std + mean).unsqueeze(2)  # one frame: [B, C, 1, h, w]
        image = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode_images(self, images):
        """Images [B, 3, H, W] in [0, 1] -> normalised latents [B, C, h, w] (posterior mode = mean, then
        (z - latents_mean) / latents_std, as the edit pipelines' `_encode_vae_image`)."""
        x = (images.to(self.device, torch.float32) * 2 - 1).unsqueeze(2).to(self.vae.dtype)
        z = self.vae.encode(x).latent_dist.mode()[:, :, 0].float()
        mean, std = self._latent_stats(z)
        return (z - mean) / std
