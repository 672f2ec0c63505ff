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

from mmrl.diffusion.models.base import FlowModel, PromptEmbeds, TinyCase, register_family
from mmrl.perf import Architecture, FlopsEstimator, Pass, input_arg, register_architecture, register_flops
from mmrl.tiny import build_tiny_z_image

# source: Flow-Factory src/flow_factory/models/z_image/z_image.py (default LoRA targets)
Z_IMAGE_LORA_TARGETS = [
    "attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
]


@register_family("ZImagePipeline")
class ZImageModel(FlowModel):
    """Z-Image (`ZImagePipeline`); see the module docstring."""

    family = "z_image"
    tiny_cases = (TinyCase("z_image", build_tiny_z_image, {"height": 32, "width": 32, "guidance_scale": 2.0}),)
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


# ------------------------------------------------------------------ what mmrl.perf reads: FLOPs, real width


def _pad32(n: int) -> int:  # Z-Image pads every caption and image sequence to a multiple of 32 tokens (SEQ_MULTI_OF)
    return n + (-n) % 32


@register_flops("ZImageTransformer2DModel")
def _flops(module: torch.nn.Module) -> FlopsEstimator:
    """Z-Image (single-stream DiT): per sample an image latent [C, F, H, W] and caption features [M, D] (lists), each
    padded to a multiple of 32 tokens; noise-refiner blocks on the image tokens and context-refiner blocks on the
    caption tokens (each padded to the longest in the batch), then the main blocks and the final layer on
    image + caption tokens; AdaLN modulations and the timestep MLP once per sample. Basic (text-to-image) mode, the
    one mmrl's Z-Image family calls; a forward in the omni mode (nested lists: SigLIP features, several images) is
    not counted."""
    width = module.config.dim
    n_noise, n_ctx, n_main = len(module.noise_refiner), len(module.context_refiner), len(module.layers)
    keys = list(module.all_x_embedder.keys())
    rules = [("t_embedder.", "sample"), ("adaLN_modulation", "sample"), ("cap_embedder.", "cap_embed"),
             ("noise_refiner.", "noisy"), ("context_refiner.", "cap"), ("siglip_", "siglip"), ("layers.", "unified")]
    rules += [(f"all_x_embedder.{k}", f"x_embed:{k}") for k in keys]
    rules += [(f"all_final_layer.{k}.", f"unified:{k}") for k in keys]

    def shapes(args, kwargs):
        x, caps = input_arg(args, kwargs, "x"), input_arg(args, kwargs, "cap_feats", 2)
        if isinstance(x[0], (list, tuple)):
            return None  # omni mode: not counted (the meter skips a forward whose shapes are None)
        p, fp = kwargs.get("patch_size", 2), kwargs.get("f_patch_size", 1)
        n = [_pad32((xi.shape[1] // fp) * (xi.shape[2] // p) * (xi.shape[3] // p)) for xi in x]
        m = [_pad32(c.shape[0]) for c in caps]
        b, ln, lm, lu = len(x), max(n), max(m), max(a + c for a, c in zip(n, m))
        tokens = {"sample": b, f"x_embed:{p}-{fp}": sum(n), "noisy": b * ln, "cap_embed": sum(m), "cap": b * lm,
                  "unified": b * lu, f"unified:{p}-{fp}": b * lu}
        return Pass(tokens, b * width * (n_noise * ln * ln + n_ctx * lm * lm + n_main * lu * lu))

    return FlopsEstimator(module, rules, shapes)


def _training_row(model: torch.nn.Module, row: dict, dtype: torch.dtype) -> dict:
    """One row of the training forward: lists of one [C, 1, H/8, W/8] latent and one [M, D] caption, t = 1 - sigma."""
    g = torch.Generator().manual_seed(0)
    c = model.config
    return {"x": [torch.randn(c.in_channels, 1, row["height"] // 8, row["width"] // 8, generator=g).to(dtype)],
            "t": torch.tensor([0.5]).to(dtype), "return_dict": False,
            "cap_feats": [torch.randn(row["text_tokens"], c.cap_feat_dim, generator=g).to(dtype)]}


register_architecture(Architecture(
    name="z_image_6b", kind="z_image", class_name="ZImageTransformer2DModel",
    config=dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
                n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0,
                t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512]),
    depth={"n_layers": 30},  # the 2 noise- and 2 context-refiner blocks are counted in the fixed part
    source="Tongyi-MAI/Z-Image transformer/config.json (dim 3840, 30 blocks + 2 + 2 refiner blocks, 30 heads; 6.15B)",
    lora_targets=tuple(Z_IMAGE_LORA_TARGETS), recipe="configs/diffusion/flow_grpo_z_image_pickscore.yaml",
    # 512 px -> 16 x 64 x 64 latents, 1024 tokens of 2 x 2 patches; prompts up to 512 tokens (max_sequence_length);
    # micro-batch 1 doubled by classifier-free guidance (4.0)
    step=dict(rows=2, height=512, width=512, text_tokens=512, lora_rank=64),
    inputs=_training_row,
    small_widths={"dim": 32, "n_heads": 2, "n_kv_heads": 2, "cap_feat_dim": 32, "axes_dims": [4, 6, 6],
                  "axes_lens": [512, 64, 64]},
    small_row=dict(height=64, width=64, text_tokens=8),
))
