"""Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline`) as a FlowModel."""

from __future__ import annotations

import torch

from mmrl.diffusion.models.base import FlowModel, PromptEmbeds, TinyCase, register_family
from mmrl.perf import Architecture, FlopsEstimator, Pass, input_arg, register_architecture, register_flops
from mmrl.tiny import build_tiny_sd3


@register_family("StableDiffusion3Pipeline")
class SD3Model(FlowModel):
    """Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline`): latents [B, C, h, w], timestep = 1000 sigma."""

    family = "sd3"
    tiny_cases = (TinyCase("sd3", build_tiny_sd3, {"height": 64, "width": 64, "guidance_scale": 1.0}),)
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


# ------------------------------------------------------------------ what mmrl.perf reads: FLOPs, real width


@register_flops("SD3Transformer2DModel")
def _flops(module: torch.nn.Module) -> FlopsEstimator:
    """SD3 / SD3.5 MMDiT: image tokens (patches), text tokens (context), one row per sample (AdaLN, time/text
    embeddings). Every joint block attends over image + text tokens; SD3.5's dual-attention blocks add an
    image-only attention (`attn2`)."""
    p = module.config.patch_size
    width = module.config.num_attention_heads * module.config.attention_head_dim
    blocks = list(module.transformer_blocks)
    dual = sum(1 for b in blocks if getattr(b, "attn2", None) is not None)
    rules = [("time_text_embed.", "sample"), ("norm1.linear", "sample"), ("norm1_context.linear", "sample"),
             ("norm_out.linear", "sample"), ("context_embedder", "text"), ("attn.add_", "text"),
             ("attn.to_add_out", "text"), ("ff_context.", "text"), ("", "image")]

    def shapes(args, kwargs):
        x, ctx = input_arg(args, kwargs, "hidden_states"), input_arg(args, kwargs, "encoder_hidden_states", 1)
        b, n = x.shape[0], (x.shape[-2] // p) * (x.shape[-1] // p)
        m = ctx.shape[1]
        return Pass({"image": b * n, "text": b * m, "sample": b},
                    b * width * (len(blocks) * (n + m) ** 2 + dual * n * n))

    return FlopsEstimator(module, rules, shapes)


def _training_row(model: torch.nn.Module, row: dict, dtype: torch.dtype) -> dict:
    """One row of the training forward: [1, C, H/8, W/8] latents, text tokens, the pooled text, timestep 1000 sigma."""
    g = torch.Generator().manual_seed(0)
    c = model.config
    h, w, m = row["height"] // 8, row["width"] // 8, row["text_tokens"]
    text = torch.randn(1, m, c.joint_attention_dim, generator=g).to(dtype)
    pooled = torch.randn(1, c.pooled_projection_dim, generator=g).to(dtype)
    return {"hidden_states": torch.randn(1, c.in_channels, h, w, generator=g).to(dtype),
            "encoder_hidden_states": text, "pooled_projections": pooled, "timestep": torch.tensor([500.0])}


def _sd35_dual_blocks(cfg: dict) -> None:
    # SD3.5-Medium: dual attention in blocks 0-12 of 24, never in the last (context_pre_only) block
    cfg["dual_attention_layers"] = tuple(i for i in range(13) if i < cfg["num_layers"] - 1)


register_architecture(Architecture(
    name="sd35_medium", kind="sd3", class_name="SD3Transformer2DModel",
    config=dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
    depth={"num_layers": 24}, fit=_sd35_dual_blocks,
    source="stabilityai/stable-diffusion-3.5-medium transformer/config.json (2.24B parameters + a 0.23B "
           "position table)",
    lora_targets=tuple(SD3Model.lora_target_modules), recipe="configs/diffusion/flow_grpo_sd35_pickscore.yaml",
    # 512 px -> 16 x 64 x 64 latents (1024 tokens of 2x2 patches); 77 CLIP + 128 T5 tokens; micro-batch 9 doubled by
    # classifier-free guidance (guidance 4.5) in the training forward
    step=dict(rows=18, height=512, width=512, text_tokens=205, lora_rank=32),
    inputs=_training_row,
    # the position table is a 0.23B-entry buffer computed in float64 at build time: measured with a 64 x 64 table,
    # which covers 512 px (the weights count the real one)
    measure_config={"pos_embed_max_size": 64},
    small_widths={"attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
                  "caption_projection_dim": 32, "pooled_projection_dim": 32, "pos_embed_max_size": 32,
                  "sample_size": 16},
    small_row=dict(height=64, width=64, text_tokens=8),
))
