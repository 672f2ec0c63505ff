"""FLUX.1 (`FluxPipeline`) as a FlowModel."""

from __future__ import annotations

import torch

from mmrl.diffusion.models.base import FlowModel, PromptEmbeds, TinyCase, register_family
from mmrl.perf import (
    Architecture, FlopsEstimator, packed_joint_estimator, register_architecture, register_flops,
)
from mmrl.tiny import build_tiny_flux


@register_family("FluxPipeline")
class FluxModel(FlowModel):
    """FLUX.1 (`FluxPipeline`). Latents stay [B, C, h, w] outside (like SD3, so samplers and log-probs
    see one layout); `transformer_velocity` packs them into [B, (h/2)(w/2), 4C] tokens with img_ids / txt_ids and
    unpacks the prediction. The guidance scale goes into the transformer's guidance embedding
    (FLUX-dev) instead of classifier-free guidance; timestep = sigma."""

    family = "flux"
    tiny_cases = (TinyCase("flux", build_tiny_flux, {"height": 64, "width": 64, "guidance_scale": 3.5}),)
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


# ------------------------------------------------------------------ what mmrl.perf reads: FLOPs, real width


@register_flops("FluxTransformer2DModel")
def _flops(module: torch.nn.Module) -> FlopsEstimator:
    """FLUX.1: AdaLN modulations inside each block (one row per sample)."""
    return packed_joint_estimator(module, [
        ("time_text_embed.", "sample"), ("norm1.linear", "sample"), ("norm1_context.linear", "sample"),
        ("norm.linear", "sample"), ("norm_out.linear", "sample"), ("context_embedder", "text"), ("attn.add_", "text"),
        ("attn.to_add_out", "text"), ("ff_context.", "text"), ("single_transformer_blocks.", "joint"), ("", "image")])


def _training_row(model: torch.nn.Module, row: dict, dtype: torch.dtype) -> dict:
    """One row of the training forward: (H/16)(W/16) packed latent tokens, text tokens, the pooled text, the guidance
    embedding's scale, timestep sigma."""
    g = torch.Generator().manual_seed(0)
    c = model.config
    h, w, m = row["height"] // 8, row["width"] // 8, row["text_tokens"]
    text = torch.randn(1, m, c.joint_attention_dim, generator=g).to(dtype)
    pooled = torch.randn(1, c.pooled_projection_dim, generator=g).to(dtype)
    n = (h // 2) * (w // 2)
    return {"hidden_states": torch.randn(1, n, c.in_channels, generator=g).to(dtype), "encoder_hidden_states": text,
            "pooled_projections": pooled, "timestep": torch.tensor([0.5]).to(dtype),
            "guidance": torch.tensor([3.5]), "img_ids": torch.zeros(n, 3), "txt_ids": torch.zeros(m, 3)}


register_architecture(Architecture(
    name="flux1_dev", kind="flux", class_name="FluxTransformer2DModel",
    config=dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56)),
    depth={"num_layers": 19, "num_single_layers": 38},
    source="black-forest-labs/FLUX.1-dev transformer/config.json (11.9B parameters)",
    lora_targets=tuple(FluxModel.lora_target_modules), recipe="configs/diffusion/flow_grpo_flux_pickscore.yaml",
    # 512 px -> 1024 packed latent tokens of 64 channels; 512 T5 tokens; micro-batch 3 (guidance embedding: no CFG)
    step=dict(rows=3, height=512, width=512, text_tokens=512, lora_rank=32),
    inputs=_training_row,
    # measured at 256 px (256 image tokens) + 128 text tokens = 384 tokens, scaled to 512 px + 512 = 1536
    measured_row=dict(height=256, width=256, text_tokens=128), row_scale={"*": 1536 / 384},
    small_widths={"attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
                  "pooled_projection_dim": 32, "axes_dims_rope": (4, 6, 6)},
    small_row=dict(height=64, width=64, text_tokens=8),
))
