"""FLUX.2 [dev] (`Flux2Pipeline`, Mistral3 text encoder) and FLUX.2 [klein] (`Flux2KleinPipeline`, Qwen3 text
encoder) as FlowModels.

Both keep the pipelines' noise space outside: latents [B, 128, H/16, W/16], i.e. the VAE's 32-channel latent
2x2-patchified and normalised by the VAE's batch-norm statistics (the shape `Flux2Pipeline.prepare_latents` draws
noise in). `transformer_velocity` packs them into [B, (H/16)(W/16), 128] tokens with 4-axis (t, h, w, l) position
ids, text ids (0, 0, 0, l), timestep `t / 1000` (= sigma), and unpacks the prediction. The schedule is
linspace(1, 1/N, N) with `mu = compute_empirical_mu(tokens, N)`: the shift depends on the step count as well as the
image size.

- [dev]: the guidance scale goes into the transformer's guidance embedding (no CFG, no negative prompt); text =
  Mistral3 hidden layers (10, 20, 30) of the prompt in the PixtralProcessor's chat template with the pipeline's
  system message, padded to `max_sequence_length`.
- [klein]: `guidance=None` and true CFG with the empty prompt when guidance_scale > 1, except for step-distilled
  checkpoints (`is_distilled: true` in model_index.json), where diffusers ignores the scale and so does this
  family (a warning says so once); text = Qwen3 hidden layers (9, 18, 27), chat template without thinking.

Not covered: reference-image conditioning (FLUX.2 editing), caption upsampling, the KV-cache klein variant.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from mmrl.diffusion.models.base import FlowModel, PromptEmbeds, TinyCase, register_family
from mmrl.perf import (
    Architecture, FlopsEstimator, packed_joint_estimator, register_architecture, register_flops,
)
from mmrl.tiny import build_tiny_flux2, build_tiny_flux2_klein

# source: Flow-Factory src/flow_factory/models/flux/flux2.py and flux2_klein.py (default LoRA targets). The
# single-stream blocks' output projection (`single_transformer_blocks.N.attn.to_out`, a plain Linear) is not among
# them: `attn.to_out.0` reaches only the double-stream blocks.
FLUX2_LORA_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
    "attn.add_v_proj", "attn.to_add_out", "attn.to_qkv_mlp_proj",
    "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
]


@register_family("Flux2Pipeline")
class Flux2Model(FlowModel):
    """FLUX.2 [dev] (`Flux2Pipeline`); see the module docstring."""

    family = "flux2"
    tiny_cases = (TinyCase("flux2", build_tiny_flux2, {"height": 32, "width": 32, "guidance_scale": 3.5}),)
    default_max_sequence_length = 512  # the pipeline's
    lora_target_modules = FLUX2_LORA_TARGETS
    text_encoder_out_layers: tuple[int, ...] = (10, 20, 30)  # the pipeline's default

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.has_guidance_embedding = bool(getattr(self.transformer.config, "guidance_embeds", False))
        self._ids: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def encode_prompts(self, prompts, images=None):
        self.check_text_only(images)
        with torch.no_grad():
            pe, _ = self.pipe.encode_prompt(prompt=list(prompts), device=self.device,
                                            max_sequence_length=self.max_sequence_length,
                                            text_encoder_out_layers=self.text_encoder_out_layers)
        return PromptEmbeds(prompt_embeds=pe.to(self.dtype))

    def _position_ids(self, b: int, h: int, w: int, text_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(img_ids [b, h w, 4], txt_ids [b, L, 4]) as the pipeline builds them; kept per shape."""
        key = (b, h, w, text_len)
        if key not in self._ids:
            img = self.pipe._prepare_latent_ids(torch.empty(b, 1, h, w)).to(self.device)
            txt = self.pipe._prepare_text_ids(torch.empty(b, text_len, 1)).to(self.device)
            self._ids[key] = (img, txt)
        return self._ids[key]

    def transformer_velocity(self, latents, sigma, embeds, guidance_scale):
        b, c, h, w = latents.shape
        pe = embeds["prompt_embeds"]
        img_ids, txt_ids = self._position_ids(b, h, w, pe.shape[1])
        guidance = None
        if self.has_guidance_embedding:
            guidance = torch.full([b], float(guidance_scale), device=self.device, dtype=torch.float32)
        packed = self.pipe._pack_latents(latents.to(self.dtype))  # [B, C, h, w] -> [B, h w, C]
        out = self.transformer(hidden_states=packed, timestep=(sigma * 1000 / 1000).to(self.dtype),
                               guidance=guidance, encoder_hidden_states=pe, txt_ids=txt_ids, img_ids=img_ids,
                               return_dict=False)[0]
        return out[:, : h * w].permute(0, 2, 1).reshape(b, c, h, w)

    def initial_noise(self, n, height, width, generator=None):
        h, w = self.latent_hw(height, width, 2)
        c = self.pipe.transformer.config.in_channels
        return torch.randn((n, c, h // 2, w // 2), generator=generator, device=self.device, dtype=torch.float32)

    def sigmas(self, num_steps, height, width):
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        h, w = self.latent_hw(height, width, 2)
        sched = self.new_scheduler()
        mu = compute_empirical_mu(image_seq_len=(h // 2) * (w // 2), num_steps=num_steps)
        if self.scheduler_config.get("use_flow_sigmas", False):
            sched.set_timesteps(num_steps, device="cpu", mu=mu)
        else:
            sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), device="cpu", mu=mu)
        return sched.sigmas.float()

    def _bn_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(like.device, like.dtype)
        return mean, std

    def decode(self, latents, height, width):
        z = latents.to(self.vae.dtype)
        mean, std = self._bn_stats(z)
        image = self.vae.decode(self.pipe._unpatchify_latents(z * std + mean), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode_images(self, images):
        """Images [B, 3, H, W] in [0, 1] -> latents [B, 128, H/16, W/16] (posterior mode, patchified, normalised)."""
        x = (images.to(self.device, torch.float32) * 2 - 1).to(self.vae.dtype)
        z = self.pipe._patchify_latents(self.vae.encode(x).latent_dist.mode())
        mean, std = self._bn_stats(z)
        return ((z - mean) / std).float()


@register_family("Flux2KleinPipeline")
class Flux2KleinModel(Flux2Model):
    """FLUX.2 [klein] (`Flux2KleinPipeline`); see the module docstring."""

    family = "flux2_klein"
    tiny_cases = (TinyCase("flux2_klein", build_tiny_flux2_klein, {"height": 32, "width": 32, "guidance_scale": 3.0}),)
    text_encoder_out_layers = (9, 18, 27)  # the pipeline's default

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.is_distilled = bool(self.pipe.config.get("is_distilled", False))
        self._warned = False

    def cfg_enabled(self, guidance_scale):
        if self.is_distilled and guidance_scale > 1.0 and not self._warned:
            warnings.warn(f"guidance_scale {guidance_scale} is ignored: this FLUX.2 [klein] checkpoint is step-"
                          f"distilled (is_distilled: true), as diffusers' Flux2KleinPipeline does", stacklevel=2)
            self._warned = True
        return guidance_scale > 1.0 and not self.is_distilled


# ------------------------------------------------------------------ what mmrl.perf reads: FLOPs, real width


@register_flops("Flux2Transformer2DModel")
def _flops(module: torch.nn.Module) -> FlopsEstimator:
    """FLUX.2 (dev / klein): the modulations computed once at the top, the single-stream blocks' q/k/v and MLP input
    fused into one projection; reference-image tokens of an edit are part of the packed latents."""
    return packed_joint_estimator(module, [
        ("time_guidance_embed.", "sample"), ("modulation", "sample"), ("norm_out.linear", "sample"),
        ("context_embedder", "text"), ("attn.add_", "text"), ("attn.to_add_out", "text"), ("ff_context.", "text"),
        ("single_transformer_blocks.", "joint"), ("", "image")])


def _training_row(model: torch.nn.Module, row: dict, dtype: torch.dtype) -> dict:
    """One row of the training forward: 128-channel 2 x 2-patchified latents packed, (H/16)(W/16) tokens with 4-axis
    ids, text tokens, timestep sigma, the guidance embedding's scale where the model has one ([dev])."""
    g = torch.Generator().manual_seed(0)
    c = model.config
    n, m = (row["height"] // 16) * (row["width"] // 16), row["text_tokens"]
    return {"hidden_states": torch.randn(1, n, c.in_channels, generator=g).to(dtype),
            "encoder_hidden_states": torch.randn(1, m, c.joint_attention_dim, generator=g).to(dtype),
            "timestep": torch.tensor([0.5]).to(dtype), "img_ids": torch.zeros(1, n, 4), "txt_ids": torch.zeros(1, m, 4),
            "guidance": torch.tensor([3.5]) if c.guidance_embeds else None}


def _flux2_config(heads: int, double: int, single: int, context: int, guidance_embeds: bool) -> dict:
    """A Flux2Transformer2DModel config: what FLUX.2 [dev] and [klein] share (heads of 128, 128-channel packed
    latents, mlp_ratio 3, 4-axis RoPE with theta 2000) and the numbers that differ."""
    return dict(patch_size=1, in_channels=128, num_layers=double, num_single_layers=single, attention_head_dim=128,
                num_attention_heads=heads, joint_attention_dim=context, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
                rope_theta=2000, guidance_embeds=guidance_embeds)


_SMALL_AND_ROW = dict(inputs=_training_row, small_widths={"attention_head_dim": 16, "num_attention_heads": 2,
                                                          "joint_attention_dim": 32, "axes_dims_rope": (4, 4, 4, 4)},
                      small_row=dict(height=64, width=64, text_tokens=8))

register_architecture(Architecture(
    name="flux2_dev", kind="flux2", class_name="Flux2Transformer2DModel",
    config=_flux2_config(heads=48, double=8, single=48, context=15360, guidance_embeds=True),
    depth={"num_layers": 8, "num_single_layers": 48},
    source="black-forest-labs/flux2 src/flux2/model.py Flux2Params (hidden 6144 = 48 heads x 128, 8 double + 48 "
           "single blocks, context 15360 = 3 x Mistral-Small's 5120, mlp_ratio 3, guidance embedding; 32.2B)",
    lora_targets=tuple(FLUX2_LORA_TARGETS), recipe="configs/diffusion/flow_grpo_flux2_dev.yaml",
    # 512 px -> 128 x 32 x 32 patchified latents: 1024 packed tokens; prompts padded to 512 tokens; micro-batch 1
    # (guidance embedding: no CFG)
    step=dict(rows=1, height=512, width=512, text_tokens=512, lora_rank=64),
    # LoRA only: a full fine-tuning depth point holds 3.3B trainable parameters with their gradients and AdamW state
    # (26 GB), more than a 24 GB measuring machine has
    measure_modes=("lora",), **_SMALL_AND_ROW,
))

register_architecture(Architecture(
    name="flux2_klein_9b", kind="flux2", class_name="Flux2Transformer2DModel",
    config=_flux2_config(heads=32, double=8, single=24, context=12288, guidance_embeds=False),
    depth={"num_layers": 8, "num_single_layers": 24},
    source="black-forest-labs/flux2 src/flux2/model.py Klein9BParams (hidden 4096 = 32 heads x 128, 8 double + 24 "
           "single blocks, context 12288 = 3 x Qwen3-8B's 4096, mlp_ratio 3, no guidance embedding; 9.08B)",
    lora_targets=tuple(FLUX2_LORA_TARGETS), recipe="configs/diffusion/flow_grpo_flux2_klein_pickscore.yaml",
    # 384 px -> 128 x 24 x 24 patchified latents: 576 packed tokens; prompts padded to 512 tokens
    # (max_sequence_length); micro-batch 1, distilled: guidance 1, no CFG
    step=dict(rows=1, height=384, width=384, text_tokens=512, lora_rank=64), **_SMALL_AND_ROW,
))
