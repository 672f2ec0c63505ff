"""Wan 2.1 / 2.2 text-to-video (`WanPipeline`) as a FlowModel: latents [B, C, F, h, w], videos [B, F, 3, H, W].

What diffusers' `WanPipeline` does per step, and what this family does the same way:
- text: UMT5 `last_hidden_state` of the prompt, cut to its real tokens and zero-padded to `max_sequence_length`
  (the pipeline's `_get_t5_prompt_embeds`); negative prompt "" for classifier-free guidance, on when scale > 1;
- timestep: the raw `t = 1000 sigma` (no /1000); Wan 2.2 TI2V-5B (`expand_timesteps: true` in model_index.json)
  gets it once per latent token ([B, F' (h/2) (w/2)]), which for text-to-video is the same value everywhere;
- Wan 2.2 A14B (`transformer_2` + `boundary_ratio`): samples with `t >= boundary_ratio * 1000` go through
  `transformer` (high noise) with `guidance_scale`, the others through `transformer_2` with `guidance_scale_2`
  (`model.family_options: {guidance_scale_2: ...}`; default = guidance_scale, as diffusers). Both experts can train:
  they are one module (`WanExperts`) that LoRA (or full fine-tuning) wraps as a whole (`idle_experts` names one that
  a window of sampling steps never reaches);
- decode: `latents / (1 / latents_std) + latents_mean`, `AutoencoderKLWan.decode`, [-1, 1] -> [0, 1].

The sampler is Euler / Flow-GRPO SDE on the pipeline scheduler's sigma schedule: with the published
`UniPCMultistepScheduler` (flow sigmas, `flow_shift`) the sigmas are UniPC's, but the solver is first-order (UniPC
is a multistep predictor-corrector, which a per-step log-probability cannot follow); with a
`FlowMatchEulerDiscreteScheduler` the ODE rollout equals diffusers' pipeline. The frame count must be 4k+1 (the
VAE's temporal factor 4; diffusers rounds other counts with a warning, this refuses them) and at most
4 (rope_max_seq_len - 1) + 1 (the transformer's rotary table; 4093 frames with the published models' 1024).
Not covered: image-to-video (Wan I2V, TI2V with a first frame), VACE, Wan-Animate.
"""

from __future__ import annotations

from typing import Any

import torch

from mmrl.diffusion.models.base import FlowModel, PromptEmbeds, TinyCase, register_family
from mmrl.perf import Architecture, FlopsEstimator, Pass, input_arg, register_architecture, register_flops
from mmrl.tiny import build_tiny_wan

Tensor = torch.Tensor

_TINY_ROLLOUT = {"height": 32, "width": 32, "num_frames": 5, "guidance_scale": 3.0}  # Wan 2.1 and 2.2 A14B's tiny cases

# source: Flow-Factory src/flow_factory/models/wan/wan2_t2v.py (default LoRA targets for Wan transformers)
WAN_LORA_TARGETS = [
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
    "ffn.net.0.proj", "ffn.net.2",
]


class WanExperts(torch.nn.Module):
    """Wan 2.2 A14B's two experts as one trainable module: `high` (the pipeline's `transformer`) denoises samples
    whose timestep is >= `boundary` (= boundary_ratio * 1000), `low` (`transformer_2`) the others. A batch that
    mixes both (DiffusionNFT draws a noise level per sample) is split, each part run through its expert, and
    joined back in order."""

    def __init__(self, high: torch.nn.Module, low: torch.nn.Module, boundary: float):
        super().__init__()
        self.high, self.low, self.boundary = high, low, float(boundary)
        self._no_split_modules = getattr(high, "_no_split_modules", None)  # FSDP shards each expert's blocks
        self.config = high.config

    @property
    def dtype(self) -> torch.dtype:
        return next(self.high.parameters()).dtype

    def forward(self, hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor,
                return_dict: bool = False, **kw: Any):
        t = timestep if timestep.dim() == 1 else timestep[:, 0]  # expanded timesteps: one value per sample
        high = t >= self.boundary
        if bool(high.all()) or not bool(high.any()):
            expert = self.high if bool(high.all()) else self.low
            return expert(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                          return_dict=False, **kw)
        out = torch.empty_like(hidden_states)
        for mask, expert in ((high, self.high), (~high, self.low)):
            out[mask] = expert(hidden_states=hidden_states[mask], timestep=timestep[mask],
                               encoder_hidden_states=encoder_hidden_states[mask], return_dict=False, **kw)[0]
        return (out,)


@register_family("WanPipeline")
class WanModel(FlowModel):
    """Wan 2.1 / 2.2 text-to-video (`WanPipeline`); see the module docstring."""

    family = "wan"
    tiny_cases = (TinyCase("wan21", build_tiny_wan, _TINY_ROLLOUT),
                  TinyCase("wan22_a14b", build_tiny_wan, _TINY_ROLLOUT, {"variant": "2.2_a14b"}))
    is_video = True
    default_max_sequence_length = 512  # the pipeline's (Flow-Factory pads to it too)
    lora_target_modules = WAN_LORA_TARGETS
    option_names = ("guidance_scale_2",)

    def __init__(self, pipe, device, dtype, max_sequence_length):
        super().__init__(pipe, device, dtype, max_sequence_length)
        cfg = pipe.config
        self.expand_timesteps = bool(cfg.get("expand_timesteps", False))
        ratio = cfg.get("boundary_ratio", None)
        if pipe.transformer is None:
            raise ValueError("WanPipeline without `transformer` (a transformer_2-only checkpoint) is not supported")
        self.boundary = None
        if pipe.transformer_2 is not None:
            if ratio is None:
                raise ValueError("WanPipeline with transformer_2 needs boundary_ratio in model_index.json")
            self.boundary = float(ratio) * self.scheduler_config.get("num_train_timesteps", 1000)
            self.transformer = WanExperts(pipe.transformer, pipe.transformer_2, self.boundary)
        self.guidance_scale_2: float | None = None
        self.temporal_factor = int(self.vae.config.scale_factor_temporal)
        self.vae_scale_factor = int(self.vae.config.scale_factor_spatial)
        self.patch_size = tuple(pipe.transformer.config.patch_size)

    def idle_experts(self, num_steps, height, width, steps):
        """Wan 2.2 A14B: `transformer` runs the steps with t = 1000 sigma >= boundary, `transformer_2` the others;
        those of the two that no step in [steps[0], steps[1]) reaches."""
        if self.boundary is None:
            return []
        high = self._high_noise(self.sigmas(num_steps, height, width)[steps[0]:steps[1]])
        return [name for name, hit in (("transformer", high.any()), ("transformer_2", (~high).any())) if not hit]

    def configure(self, guidance_scale_2: float | None = None, **options: Any) -> None:
        """guidance_scale_2: CFG scale of Wan 2.2 A14B's low-noise expert (None = the rollout's guidance_scale)."""
        super().configure(**options)
        if guidance_scale_2 is not None and self.boundary is None:
            raise ValueError("model.family_options.guidance_scale_2 applies to Wan 2.2 A14B (transformer_2 and "
                             "boundary_ratio); this pipeline has one transformer")
        self.guidance_scale_2 = None if guidance_scale_2 is None else float(guidance_scale_2)

    def set_num_frames(self, num_frames: int) -> None:
        """Frames per video: k*m + 1 (the VAE's temporal factor k; it encodes the first frame alone, then k at a
        time), and at most as many latent frames (per temporal patch) as the transformer's rotary position table
        holds (`rope_max_seq_len`: diffusers slices the table to the frame count and reshapes, which fails beyond)."""
        k = self.temporal_factor
        if num_frames < 1 or (num_frames - 1) % k:
            raise ValueError(f"rollout.num_frames={num_frames}: the Wan VAE takes {k}k+1 frames (1, {k + 1}, "
                             f"{2 * k + 1}, {4 * k + 1}, ...); use {max(1, (num_frames - 1) // k * k + 1)} or "
                             f"{((num_frames - 1) // k + 1) * k + 1}")
        experts = [self.pipe.transformer] + ([self.pipe.transformer_2] if self.pipe.transformer_2 is not None else [])
        rope = min(int(t.config.rope_max_seq_len) for t in experts)
        latent, most_latent = (num_frames - 1) // k + 1, (rope + 1) * self.patch_size[0] - 1
        if latent > most_latent:
            raise ValueError(f"rollout.num_frames={num_frames}: {latent} latent frames (({num_frames} - 1) / {k} + 1), "
                             f"more than the Wan transformer's rotary positions take ({most_latent}: rope_max_seq_len "
                             f"{rope} in its config.json); use at most {(most_latent - 1) * k + 1} frames")
        self.num_frames = int(num_frames)

    # ------------------------------------------------------------------ text
    def encode_prompts(self, prompts, images=None):
        self.check_text_only(images)
        with torch.no_grad():
            pe, _ = self.pipe.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                            max_sequence_length=self.max_sequence_length, device=self.device)
        return PromptEmbeds(prompt_embeds=pe.to(self.dtype))

    # ------------------------------------------------------------------ denoising
    def _high_noise(self, sigma: torch.Tensor) -> torch.Tensor:
        """Which sigmas the high-noise expert (`transformer`) takes: t = sigma * num_train_timesteps >= boundary, the
        timestep `transformer_velocity` passes and `WanExperts` routes by."""
        return sigma * self.scheduler_config.get("num_train_timesteps", 1000) >= self.boundary

    def combine_cfg(self, v_uncond, v_cond, guidance_scale, sigma=None):
        if self.boundary is None or self.guidance_scale_2 is None:
            return v_uncond + guidance_scale * (v_cond - v_uncond)
        high = self._high_noise(sigma)
        w = torch.where(high, torch.tensor(float(guidance_scale)), torch.tensor(self.guidance_scale_2))
        return v_uncond + w.view(-1, *([1] * (v_cond.dim() - 1))).to(v_cond) * (v_cond - v_uncond)

    def transformer_velocity(self, latents, sigma, embeds, guidance_scale):
        b, _, f, h, w = latents.shape
        t = sigma * self.scheduler_config.get("num_train_timesteps", 1000)
        if self.expand_timesteps:  # Wan 2.2 TI2V: one timestep per latent token (all equal without a first frame)
            _, ph, pw = self.patch_size
            t = t[:, None].expand(b, f * (h // ph) * (w // pw))
        return self.transformer(hidden_states=latents.to(self.dtype), timestep=t,
                                encoder_hidden_states=embeds["prompt_embeds"], return_dict=False)[0]

    def initial_noise(self, n, height, width, generator=None):
        h, w = self.latent_hw(height, width, self.patch_size[1])
        f = (self.num_frames - 1) // self.temporal_factor + 1
        c = self.pipe.transformer.config.in_channels
        return torch.randn((n, c, f, h, w), generator=generator, device=self.device, dtype=torch.float32)

    def sigmas(self, num_steps, height, width):
        """The pipeline scheduler's sigmas for `num_steps` (FlowMatchEuler with its shift, or UniPC's flow sigmas
        with `flow_shift`), last one 0."""
        from diffusers import UniPCMultistepScheduler

        if self.pipe.scheduler.__class__.__name__ == "UniPCMultistepScheduler":
            sched = UniPCMultistepScheduler.from_config(self.scheduler_config)
            if not self.scheduler_config.get("use_flow_sigmas", False):
                raise ValueError("WanPipeline: a UniPCMultistepScheduler without use_flow_sigmas is not a "
                                 "flow-matching schedule")
        else:
            sched = self.new_scheduler()
        sched.set_timesteps(num_steps, device="cpu")
        return sched.sigmas.float()

    @property
    def sigma_shift(self) -> float:
        c = self.scheduler_config
        return float(c.get("flow_shift", c.get("shift", 1.0)))

    # ------------------------------------------------------------------ VAE
    def _latent_stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        c = self.vae.config
        mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(like.device, like.dtype)
        inv_std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(like.device, like.dtype)
        return mean, inv_std

    def decode(self, latents, height, width):
        """[B, C, F', h, w] -> videos [B, F, 3, H, W] in [0, 1]; one frame -> images [B, 3, H, W]."""
        z = latents.to(self.vae.dtype)
        mean, inv_std = self._latent_stats(z)
        video = self.vae.decode(z / inv_std + mean, return_dict=False)[0]  # [B, 3, F, H, W] in [-1, 1]
        video = (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
        return video[:, 0] if self.num_frames == 1 else video

    @torch.no_grad()
    def encode_images(self, images):
        """Images [B, 3, H, W] (one frame) or videos [B, F, 3, H, W] in [0, 1] -> latents [B, C, F', h, w]."""
        x = images.to(self.device, torch.float32)
        x = x.unsqueeze(1) if x.dim() == 4 else x
        z = self.vae.encode((x * 2 - 1).permute(0, 2, 1, 3, 4).to(self.vae.dtype)).latent_dist.mean.float()
        mean, inv_std = self._latent_stats(z)
        return (z - mean) * inv_std


# ------------------------------------------------------------------ what mmrl.perf reads: FLOPs, real width


@register_flops("WanTransformer3DModel")
def _flops(module: torch.nn.Module) -> FlopsEstimator:
    """Wan 2.1 / 2.2: video tokens (3-D patches) through self-attention, cross-attention to the text tokens (and to
    image tokens for image-to-video), FFN; timestep layers once per timestep value (per token for Wan 2.2 TI2V)."""
    cfg = module.config
    width = cfg.num_attention_heads * cfg.attention_head_dim
    pt, ph, pw = cfg.patch_size
    n_blocks = len(module.blocks)
    rules = [("condition_embedder.time", "sample"), ("condition_embedder.text_embedder", "text"),
             ("condition_embedder.image_embedder", "image_context"), ("attn2.add_", "image_context"),
             ("attn2.to_k", "text"), ("attn2.to_v", "text"), ("", "video")]

    def shapes(args, kwargs):
        x = input_arg(args, kwargs, "hidden_states")
        ctx = input_arg(args, kwargs, "encoder_hidden_states", 2)
        t = input_arg(args, kwargs, "timestep", 1)
        img = kwargs.get("encoder_hidden_states_image")
        b, _, f, h, w = x.shape
        n, m = (f // pt) * (h // ph) * (w // pw), ctx.shape[1]
        k = img.shape[1] if img is not None else 0
        return Pass({"video": b * n, "text": b * m, "image_context": b * k,
                     "sample": t.numel() if isinstance(t, torch.Tensor) else b},
                    b * width * n_blocks * (n * n + n * m + n * k))

    return FlopsEstimator(module, rules, shapes)


def _training_row(model: torch.nn.Module, row: dict, dtype: torch.dtype) -> dict:
    """One row of the training forward. The Wan VAE: 4x in time ((F - 1) / 4 + 1 latent frames), 8x in space; Wan2.2's
    48-channel VAE (TI2V-5B): 16x in space, and the pipeline passes one timestep per token."""
    g = torch.Generator().manual_seed(0)
    c = model.config
    f = (row["num_frames"] - 1) // 4 + 1
    down = 16 if c.in_channels == 48 else 8
    h, w = row["height"] // down, row["width"] // down
    pt, ph, pw = c.patch_size
    t = torch.full((1, (f // pt) * (h // ph) * (w // pw)), 500.0) if c.in_channels == 48 else torch.tensor([500.0])
    return {"hidden_states": torch.randn(1, c.in_channels, f, h, w, generator=g).to(dtype), "timestep": t,
            "encoder_hidden_states": torch.randn(1, row["text_tokens"], c.text_dim, generator=g).to(dtype)}


def _wan_config(heads: int, ffn_dim: int, layers: int, channels: int = 16) -> dict:
    """A WanTransformer3DModel config: what every published Wan 2.1 / 2.2 transformer shares (heads of 128, (1, 2, 2)
    patches, UMT5's 4096-wide text) and the numbers that differ."""
    return dict(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=128, in_channels=channels,
                out_channels=channels, text_dim=4096, freq_dim=256, ffn_dim=ffn_dim, num_layers=layers,
                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


_SMALL_AND_ROW = dict(inputs=_training_row, small_widths={"num_attention_heads": 2, "attention_head_dim": 16,
                                                          "text_dim": 32, "ffn_dim": 64, "rope_max_seq_len": 64},
                      small_row=dict(num_frames=5, height=32, width=32, text_tokens=8))

register_architecture(Architecture(
    name="wan21_t2v_1_3b", kind="wan", class_name="WanTransformer3DModel",
    config=_wan_config(heads=12, ffn_dim=8960, layers=30),
    depth={"num_layers": 30},
    source="Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json (dim 1536, 30 layers, 12 heads, FFN 8960; 1.4B)",
    lora_targets=tuple(WAN_LORA_TARGETS), recipe="configs/diffusion/flow_grpo_wan21_t2v.yaml",
    # 5 frames at 256 px -> 16 x 2 x 32 x 32 latents, 2 x 16 x 16 = 512 tokens of (1, 2, 2) patches; 512 UMT5 tokens;
    # micro-batch 1 doubled by classifier-free guidance (5.0)
    step=dict(rows=2, num_frames=5, height=256, width=256, text_tokens=512, lora_rank=64), **_SMALL_AND_ROW,
))

register_architecture(Architecture(
    name="wan22_t2v_a14b", kind="wan", class_name="WanTransformer3DModel", experts=2,
    config=_wan_config(heads=40, ffn_dim=13824, layers=40),
    depth={"num_layers": 40},
    source="Wan-Video/Wan2.2 wan/configs/wan_t2v_A14B.py (per expert: dim 5120, 40 heads, 40 layers, FFN 13824, the "
           "Wan2.1 VAE (4, 8, 8); two experts, boundary 0.875; 2 x 14.29B)",
    lora_targets=tuple(WAN_LORA_TARGETS), recipe="configs/diffusion/flow_grpo_wan22_t2v_a14b.yaml",
    # 5 frames at 480 px -> 16 x 2 x 60 x 60 latents, 2 x 30 x 30 = 1800 tokens of (1, 2, 2) patches; 512 UMT5
    # tokens; micro-batch 1 doubled by classifier-free guidance (4.0 high-noise expert, 3.0 low-noise). One expert
    # trains: the recipe's SDE steps (1-3 of 10) are at t = 964 / 923 / 875 with flow_shift 3 (higher with 12), all
    # at or above the boundary 875, so only the high-noise expert's LoRA gets gradients (and AdamW state)
    step=dict(rows=2, num_frames=5, height=480, width=480, text_tokens=512, lora_rank=64, trained_experts=1),
    **_SMALL_AND_ROW,
))

register_architecture(Architecture(
    name="wan22_ti2v_5b", kind="wan", class_name="WanTransformer3DModel",
    config=_wan_config(heads=24, ffn_dim=14336, layers=30, channels=48),
    depth={"num_layers": 30},
    source="Wan-Video/Wan2.2 wan/configs/wan_ti2v_5B.py (dim 3072, 24 heads, 30 layers, FFN 14336, the Wan2.2 VAE: "
           "48 channels, (4, 16, 16); timesteps per token; 5.0B)",
    lora_targets=tuple(WAN_LORA_TARGETS),
    # no recipe here ships it (its published RL run uses DanceGRPO's SDE and HPSv3, neither in mmrl): the row is
    # that run's, verl-omni examples/dancegrpo_trainer/wan22/run_wan22_5b_t2v_hpsv3_auto.sh
    recipe="verl-omni examples/dancegrpo_trainer/wan22/run_wan22_5b_t2v_hpsv3_auto.sh",
    # num_frames 8, rounded to 9 by the pipeline, at 704 x 1280 -> 48 x 3 x 44 x 80 latents, 3 x 22 x 40 = 2640
    # tokens of (1, 2, 2) patches; max_sequence_length 1024 UMT5 tokens; micro-batch 4 per GPU doubled by true CFG
    # (5.0); LoRA rows at Flow-Factory's rank 64
    step=dict(rows=8, num_frames=9, height=704, width=1280, text_tokens=1024, lora_rank=64), **_SMALL_AND_ROW,
))
