"""HunyuanVideo 1.5 text-to-video (`HunyuanVideo15Pipeline`) as a FlowModel: latents [B, C, F, h, w], videos
[B, F, 3, H, W].

What diffusers 0.42's `HunyuanVideo15Pipeline` does per step, and what this family does the same way:
- text: the pipeline's `encode_prompt` (called as is): the prompt in its system template through Qwen2.5-VL, the
  third-to-last hidden state, padded to 1000 + 108 tokens and the first 108 (the system turn) dropped, with its mask;
  quoted glyph text ("...") through ByT5 (256 tokens; zeros and a zero mask when the prompt quotes nothing). The empty
  negative prompt ("", which the pipeline renders as " ") is the unconditional branch;
- transformer input: the noisy latents, zero condition latents and a zero mask on the channel dim (2C + 1 channels),
  zero `image_embeds` [B, 729, image_embed_dim] (the transformer then masks the image tokens out), timestep 1000 sigma;
  the output is the velocity (noise - x0) Euler steps on;
- guidance: the pipeline's `ClassifierFreeGuidance` guider holds the scale (it takes no guidance argument); here the
  rollout's `guidance_scale` is the scale, combined as the guider's default formulation v_u + w (v_c - v_u). A guider
  saved with another formulation (`use_original_formulation`, `guidance_rescale`, a `start` / `stop` window) is
  refused at load, naming the key;
- schedule: sigmas linspace(1, 0, N + 1)[:-1] through the scheduler (its static `shift`: 5 for the published 480p,
  9 for 720p), timestep = 1000 sigma, last sigma 0;
- decode: latents / scaling_factor, `AutoencoderKLHunyuanVideo15.decode`, [-1, 1] -> [0, 1].

`model.max_sequence_length` (default 1000, the pipeline's) sets the Qwen token budget after the template; padding is
masked out of every attention, so a shorter budget that still holds the prompt gives the same velocity. Frames: k m + 1
(the VAE's temporal factor k). Not covered: image-to-video (`HunyuanVideo15ImageToVideoPipeline`), the 1080p
super-resolution stage, step-distilled / MeanFlow checkpoints (`use_meanflow`), other guiders (APG, ...).
"""

from __future__ import annotations

import numpy as np
import torch

from mmrl.diffusion.models.base import ATTENTION_LORA_TARGETS, FlowModel, PromptEmbeds, TinyCase, register_family
from mmrl.perf import Architecture, FlopsEstimator, Pass, input_arg, register_architecture, register_flops
from mmrl.tiny import build_tiny_hunyuan_video15

Tensor = torch.Tensor

# guider keys the family reproduces only at these values (it combines CFG itself, with the rollout's scale)
_GUIDER_DEFAULTS = {"use_original_formulation": False, "guidance_rescale": 0.0, "start": 0.0, "stop": 1.0}


@register_family("HunyuanVideo15Pipeline")
class HunyuanVideo15Model(FlowModel):
    """HunyuanVideo 1.5 text-to-video (`HunyuanVideo15Pipeline`); see the module docstring."""

    family = "hunyuan_video15"
    tiny_cases = (TinyCase("hunyuan_video15", build_tiny_hunyuan_video15,
                           {"height": 16, "width": 16, "num_frames": 5, "guidance_scale": 3.0}),)
    is_video = True
    default_max_sequence_length = 1000  # the pipeline's tokenizer_max_length
    # the joint attention's projections (video and text streams) of every double-stream block, and the token
    # refiner's self-attention; Flow-GRPO's SD3 default, each name exists here (test_hunyuan_video15 checks it)
    lora_target_modules = ATTENTION_LORA_TARGETS

    def __init__(self, pipe, device, dtype, max_sequence_length):
        super().__init__(pipe, device, dtype, max_sequence_length)
        guider = dict(pipe.guider.config) if getattr(pipe, "guider", None) is not None else {}
        for key, default in _GUIDER_DEFAULTS.items():
            if key in guider and guider[key] != default:
                raise ValueError(f"HunyuanVideo15Pipeline: guider/guider_config.json {key}={guider[key]!r} is not "
                                 f"supported (expected {default!r}: guidance is v_u + w (v_c - v_u) with "
                                 f"rollout.guidance_scale)")
        pipe.tokenizer_max_length = self.max_sequence_length  # what encode_prompt pads / truncates the prompt to
        self.temporal_factor = int(self.vae.config.temporal_compression_ratio)
        self.vae_scale_factor = int(self.vae.config.spatial_compression_ratio)
        self.latent_channels = int(self.vae.config.latent_channels)
        self.patch = int(self.transformer.config.patch_size)

    def set_num_frames(self, num_frames: int) -> None:
        """Frames per video: k m + 1 (the VAE's temporal factor k encodes the first frame alone, then k at a time)."""
        k = self.temporal_factor
        if num_frames < 1 or (num_frames - 1) % k:
            raise ValueError(f"rollout.num_frames={num_frames}: the HunyuanVideo 1.5 VAE takes {k}k+1 frames; use "
                             f"{max(1, (num_frames - 1) // k * k + 1)} or {((num_frames - 1) // k + 1) * k + 1}")
        self.num_frames = int(num_frames)

    # ------------------------------------------------------------------ text
    def encode_prompts(self, prompts, images=None):
        self.check_text_only(images)
        with torch.no_grad():
            pe, mask, glyph, glyph_mask = self.pipe.encode_prompt(prompt=list(prompts), device=self.device,
                                                                  dtype=self.dtype, batch_size=len(prompts))
        return PromptEmbeds(prompt_embeds=pe, prompt_embeds_mask=mask, glyph_embeds=glyph,
                            glyph_embeds_mask=glyph_mask)

    # ------------------------------------------------------------------ denoising
    def transformer_velocity(self, latents, sigma, embeds, guidance_scale):
        b, _, f, h, w = latents.shape
        x = latents.to(self.dtype)
        cond = torch.zeros(b, self.latent_channels + 1, f, h, w, device=x.device, dtype=x.dtype)  # t2v: no frame
        cfg = self.transformer.config
        image = torch.zeros(b, self.pipe.vision_num_semantic_tokens, cfg.image_embed_dim, device=x.device,
                            dtype=x.dtype)
        t = (sigma * self.scheduler_config.get("num_train_timesteps", 1000)).to(self.dtype)
        return self.transformer(hidden_states=torch.cat([x, cond], dim=1), image_embeds=image, timestep=t,
                                encoder_hidden_states=embeds["prompt_embeds"],
                                encoder_attention_mask=embeds["prompt_embeds_mask"],
                                encoder_hidden_states_2=embeds["glyph_embeds"],
                                encoder_attention_mask_2=embeds["glyph_embeds_mask"], return_dict=False)[0]

    def initial_noise(self, n, height, width, generator=None):
        h, w = self.latent_hw(height, width, self.patch)
        f = (self.num_frames - 1) // self.temporal_factor + 1
        return torch.randn((n, self.latent_channels, f, h, w), generator=generator, device=self.device,
                           dtype=torch.float32)

    def sigmas(self, num_steps, height, width):
        """The pipeline's: linspace(1, 0, N + 1) without its last point, through the scheduler's shift, then 0."""
        sched = self.new_scheduler()
        sched.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1], device="cpu")
        return sched.sigmas.float()

    # ------------------------------------------------------------------ VAE
    def decode(self, latents, height, width):
        """[B, C, F', h, w] -> videos [B, F, 3, H, W] in [0, 1]; one frame -> images [B, 3, H, W]."""
        z = latents.to(self.vae.dtype) / self.vae.config.scaling_factor
        # one sample at a time: diffusers 0.42's VAE attention builds its causal mask [B, L, L] against queries
        # [B, 1, L, C], which broadcasts to [B, B, L, L] and fails for B > 1
        video = torch.cat([self.vae.decode(zi, return_dict=False)[0] for zi in z.split(1)])  # [-1, 1]
        video = (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
        return video[:, 0] if self.num_frames == 1 else video

    @torch.no_grad()
    def encode_images(self, images):
        """Images [B, 3, H, W] (one frame) or videos [B, F, 3, H, W] in [0, 1] -> latents [B, C, F', h, w]."""
        x = images.to(self.device, torch.float32)
        x = x.unsqueeze(1) if x.dim() == 4 else x
        x = (x * 2 - 1).permute(0, 2, 1, 3, 4).to(self.vae.dtype)
        z = torch.cat([self.vae.encode(xi).latent_dist.mean.float() for xi in x.split(1)])  # one at a time: decode
        return z * self.vae.config.scaling_factor


# ------------------------------------------------------------------ what mmrl.perf reads: FLOPs, real width


@register_flops("HunyuanVideo15Transformer3DModel")
def _flops(module: torch.nn.Module) -> FlopsEstimator:
    """HunyuanVideo 1.5: the Qwen tokens through the token refiner (self-attention over them alone), then video tokens
    and the joint context (Qwen + ByT5 + image tokens, padding included: masks do not shorten the matrices) through
    every double-stream block's joint attention; time / modulation layers once per sample."""
    cfg = module.config
    width = cfg.num_attention_heads * cfg.attention_head_dim
    pt, p = cfg.patch_size_t, cfg.patch_size
    n_blocks, n_refiner = len(module.transformer_blocks), len(module.context_embedder.token_refiner.refiner_blocks)
    rules = [("time_embed.", "sample"), ("time_text_embed.", "sample"), ("norm_out.linear", "sample"),
             ("norm1.linear", "sample"), ("norm1_context.linear", "sample"), ("context_embedder_2.", "glyph"),
             ("context_embedder.", "text"), ("image_embedder.", "image"), ("attn.add_", "context"),
             ("attn.to_add_out", "context"), ("ff_context.", "context"), ("", "video")]

    def shapes(args, kwargs):
        x = input_arg(args, kwargs, "hidden_states")
        b, _, f, h, w = x.shape
        n = (f // pt) * (h // p) * (w // p)
        m = input_arg(args, kwargs, "encoder_hidden_states", 2).shape[1]
        g = kwargs["encoder_hidden_states_2"].shape[1]
        i = kwargs["image_embeds"].shape[1]
        ctx = m + g + i
        return Pass({"video": b * n, "text": b * m, "glyph": b * g, "image": b * i, "context": b * ctx,
                     "sample": b}, b * width * (n_refiner * m * m + n_blocks * (n + ctx) ** 2))

    return FlopsEstimator(module, rules, shapes)


def _training_row(model: torch.nn.Module, row: dict, dtype: torch.dtype) -> dict:
    """One row of the training forward: the VAE's 4x time / 16x space (the published one), 2C + 1 input channels,
    `text_tokens` Qwen tokens, 256 ByT5 and 729 image tokens (zeros, masked) as the pipeline passes them."""
    g = torch.Generator().manual_seed(0)
    c = model.config
    down_t, down_s = row.get("temporal_factor", 4), row.get("spatial_factor", 16)
    f, h, w = (row["num_frames"] - 1) // down_t + 1, row["height"] // down_s, row["width"] // down_s
    m, glyph = row["text_tokens"], row.get("glyph_tokens", 256)
    mask = torch.zeros(1, m)
    mask[:, : row.get("prompt_tokens", 64)] = 1
    return {"hidden_states": torch.randn(1, c.in_channels, f, h, w, generator=g).to(dtype),
            "timestep": torch.tensor([500.0]).to(dtype),
            "encoder_hidden_states": torch.randn(1, m, c.text_embed_dim, generator=g).to(dtype),
            "encoder_attention_mask": mask.to(dtype),
            "encoder_hidden_states_2": torch.zeros(1, glyph, c.text_embed_2_dim).to(dtype),
            "encoder_attention_mask_2": torch.zeros(1, glyph).to(dtype),
            "image_embeds": torch.zeros(1, row.get("image_tokens", 729), c.image_embed_dim).to(dtype)}


register_architecture(Architecture(
    name="hunyuan_video15_480p_t2v", kind="hunyuan_video15", class_name="HunyuanVideo15Transformer3DModel",
    # source: diffusers scripts/convert_hunyuan_video1_5_to_diffusers.py (commit 38c42b4) TRANSFORMER_CONFIGS
    # ["480p_t2v"] (= the 0.42 class defaults); scheduler shift 5.0 and guider scale 6.0 from the same file
    config=dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128, num_layers=54,
                num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm",
                text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152, rope_theta=256.0,
                rope_axes_dim=(16, 56, 56), use_meanflow=False, target_size=640, task_type="t2v"),
    depth={"num_layers": 54},
    source="diffusers scripts/convert_hunyuan_video1_5_to_diffusers.py @38c42b4 TRANSFORMER_CONFIGS['480p_t2v'] "
           "(hidden 2048 = 16 x 128, 54 double-stream blocks, 2 refiner blocks, Qwen2.5-VL-7B 3584-wide text, "
           "Glyph-ByT5 1472, SigLIP 1152; 8.3B)",
    lora_targets=tuple(ATTENTION_LORA_TARGETS), recipe="configs/diffusion/flow_grpo_hunyuan15_t2v.yaml",
    # 33 frames at 480 x 480 (DanceGRPO's HunyuanVideo size; its 53 frames is not 4k+1) -> 32 x 9 x 30 x 30 latents,
    # 8100 tokens of (1, 1, 1) patches; 1000 Qwen + 256 ByT5 + 729 image context tokens; micro-batch 1 doubled by CFG
    step=dict(rows=2, num_frames=33, height=480, width=480, text_tokens=1000, lora_rank=64),
    # the recipe's 10085-token row does not fit a CPU measurement beside other jobs: measure 5 frames at 256 px (512
    # video tokens + the same 1985 context tokens) and scale what a row adds by the tokens the blocks see (10085 /
    # 2497, linear: flash attention on a GPU keeps no [L, L] matrix), the fixed part too (with gradient checkpointing
    # it holds the recomputed block): an upper bound, the token refiner sees the same text in both rows
    measured_row=dict(num_frames=5, height=256, width=256, text_tokens=1000),
    row_scale={"*": (8100 + 1985) / (512 + 1985)},
    inputs=_training_row,
    small_widths={"num_attention_heads": 2, "attention_head_dim": 16, "text_embed_dim": 16, "text_embed_2_dim": 32,
                  "image_embed_dim": 12, "rope_axes_dim": (4, 6, 6)},
    small_row=dict(num_frames=5, height=32, width=32, text_tokens=16, glyph_tokens=8, image_tokens=9,
                   prompt_tokens=4),
))
