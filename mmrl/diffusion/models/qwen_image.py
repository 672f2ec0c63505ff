"""Qwen-Image (`QwenImagePipeline`) as a FlowModel: Qwen2.5-VL text encoder, true CFG with a norm rescale."""

from __future__ import annotations

import torch

from mmrl.diffusion.models.base import FlowModel, PromptEmbeds, TinyCase, register_family
from mmrl.perf import Architecture, FlopsEstimator, Pass, input_arg, register_architecture, register_flops
from mmrl.tiny import build_tiny_qwen_image

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
    tiny_cases = (TinyCase("qwen_image", build_tiny_qwen_image, {"height": 32, "width": 32, "guidance_scale": 4.0}),)
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


# ------------------------------------------------------------------ what mmrl.perf reads: FLOPs, real width


@register_flops("QwenImageTransformer2DModel")
def _flops(module: torch.nn.Module) -> FlopsEstimator:
    """Qwen-Image (and its edit models): double-stream blocks only (image and text streams, joint attention over
    both), packed latents [B, N, C] (an edit's reference-image tokens are part of N). Modulations once per sample;
    with `zero_cond_t` (Qwen-Image-Edit-2511) the timestep embedding and the image modulations run on 2 rows per
    sample (the noisy and the clean timestep). The last block's text output is never used, so its text
    feed-forward and text attention output projection get no backward (autograd skips them)."""
    width = module.config.num_attention_heads * module.config.attention_head_dim
    n_blocks = len(module.transformer_blocks)
    doubled = 2 if getattr(module, "zero_cond_t", False) else 1
    last = f"transformer_blocks.{n_blocks - 1}."  # its text output is not used: that part gets no backward
    rules = [("time_text_embed.", "time"), ("img_mod.", "time"), ("txt_mod.", "sample"), ("norm_out.linear", "sample"),
             (last + "attn.to_add_out", "text_unused"), (last + "txt_mlp.", "text_unused"),
             ("txt_in", "text"), ("attn.add_", "text"), ("attn.to_add_out", "text"), ("txt_mlp.", "text"),
             ("", "image")]

    def shapes(args, kwargs):
        x, ctx = input_arg(args, kwargs, "hidden_states"), input_arg(args, kwargs, "encoder_hidden_states", 1)
        b, n, m = x.shape[0], x.shape[1], ctx.shape[1]
        return Pass({"image": b * n, "text": b * m, "text_unused": b * m, "sample": b, "time": doubled * b},
                    b * width * n_blocks * (n + m) ** 2)

    return FlopsEstimator(module, rules, shapes, forward_only=("text_unused",))


def _training_row(model: torch.nn.Module, row: dict, dtype: torch.dtype) -> dict:
    """One row of the training forward: 2 x 2-packed latents, (H/16)(W/16) tokens, text tokens with their mask (true
    CFG pads the text to the batch's longest), timestep sigma."""
    g = torch.Generator().manual_seed(0)
    c, h, w, m = model.config, row["height"] // 16, row["width"] // 16, row["text_tokens"]
    return {"hidden_states": torch.randn(1, h * w, c.in_channels, generator=g).to(dtype),
            "encoder_hidden_states": torch.randn(1, m, c.joint_attention_dim, generator=g).to(dtype),
            "encoder_hidden_states_mask": torch.ones(1, m), "timestep": torch.tensor([0.5]).to(dtype),
            "img_shapes": [[(1, h, w)]]}


register_architecture(Architecture(
    name="qwen_image_20b", kind="qwen_image", class_name="QwenImageTransformer2DModel",
    config=dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56)),
    depth={"num_layers": 60},
    source="Qwen/Qwen-Image transformer/config.json (60 double-stream blocks, width 3072, 24 heads; 20.4B parameters)",
    lora_targets=tuple(QWEN_IMAGE_LORA_TARGETS), recipe="configs/diffusion/flow_grpo_qwen_image_ocr.yaml",
    # 512 px -> 16 x 64 x 64 latents packed 2 x 2: 1024 tokens of 64 channels; prompts cut to 256 tokens
    # (max_sequence_length); micro-batch 4 doubled by true CFG (4.0) in the training forward
    step=dict(rows=8, height=512, width=512, text_tokens=256, lora_rank=64),
    inputs=_training_row,
    small_widths={"attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
                  "axes_dims_rope": (4, 6, 6)},
    small_row=dict(height=64, width=64, text_tokens=8),
))
