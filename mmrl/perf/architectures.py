"""The real architectures at their published widths, buildable at any depth with random weights, and the shape of the
training micro-batch their shipped recipe runs: for memory measurements and throughput checks without downloading a
checkpoint (benchmarks/real_width.py, benchmarks/gpu_check.py).

    arch = ARCHITECTURES["flux1_dev"]
    model = arch.build(depth={"num_layers": 1, "num_single_layers": 1})   # real width, 2 blocks, random bf16 weights
    arch.parameters()                                                       # the full-depth count (meta device)

Adding a family (Qwen-Image, Wan, FLUX.2, Z-Image, ...): one `register_architecture(Architecture(...))` with its
published config, the keys that set its depth, the micro-batch of its recipe and, in mmrl.perf.flops, an estimator
for its class; benchmarks/real_width.py then needs its input builder (one function keyed by `kind`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from mmrl.diffusion.models.base import ATTENTION_LORA_TARGETS
from mmrl.diffusion.models.flux2 import FLUX2_LORA_TARGETS
from mmrl.diffusion.models.qwen_image import QWEN_IMAGE_LORA_TARGETS
from mmrl.diffusion.models.wan import WAN_LORA_TARGETS
from mmrl.diffusion.models.z_image import Z_IMAGE_LORA_TARGETS


@dataclass(frozen=True)
class Architecture:
    """One published model at real width."""

    name: str
    kind: str
    """Input layout: `sd3`, `flux`, `flux2`, `wan`, `qwen_image`, `z_image` (diffusers transformers) or `qwen_vl` (a
    transformers VLM)."""
    class_name: str
    """diffusers / transformers class (transformers: the *ForConditionalGeneration class)."""
    config: dict
    """The published config (the kwargs of the class, or of its config class for transformers)."""
    depth: dict[str, int]
    """Keys (dotted into nested configs) that set the depth, at their full values."""
    source: str
    """Where the config comes from."""
    lora_targets: tuple[str, ...]
    """Module-name suffixes its recipe puts LoRA on."""
    recipe: str
    """The shipped recipe config whose micro-batch `step` describes (or the published run it follows, when no
    recipe here ships it)."""
    step: dict[str, Any]
    """Shape of one training micro-batch of that recipe (rows through the model, resolution, tokens)."""
    config_class: str | None = None
    experts: int = 1
    """Models of this config the pipeline holds (Wan 2.2 A14B: a high- and a low-noise expert; `step`'s
    "trained_experts" says how many the recipe trains); a row goes through one. `build` makes one; `parameters`
    counts them all."""
    fit: Callable[[dict], None] | None = field(default=None, compare=False)
    """Adjusts config keys that depend on the depth (e.g. which blocks have dual attention) in place."""

    def model_config(self, depth: dict[str, int] | None = None) -> dict:
        """The config at full depth, or with the `depth` keys replaced."""
        unknown = sorted(set(depth or {}) - set(self.depth))
        if unknown:
            raise ValueError(f"{self.name}: unknown depth key(s) {unknown}; valid: {sorted(self.depth)}")
        cfg = copy.deepcopy(self.config)
        for key, value in {**self.depth, **(depth or {})}.items():
            node = cfg
            *parents, leaf = key.split(".")
            for p in parents:
                node = node[p]
            node[leaf] = int(value)
        if self.fit is not None:
            self.fit(cfg)
        return cfg

    def build(self, depth: dict[str, int] | None = None, dtype: torch.dtype = torch.bfloat16,
              device: str | torch.device = "cpu") -> nn.Module:
        """The model with random weights (the class's own initialisation), created directly in `dtype` on `device`
        (`meta`: shapes only, no memory)."""
        cfg = self.model_config(depth)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                if self.config_class is None:
                    import diffusers

                    return getattr(diffusers, self.class_name)(**cfg)
                import transformers

                config = getattr(transformers, self.config_class)(**cfg)
                return getattr(transformers, self.class_name)(config)
        finally:
            torch.set_default_dtype(previous)

    def parameters(self, depth: dict[str, int] | None = None) -> int:
        """Parameters (+ persistent buffers such as SD3's position table) at this depth, counted on the meta device."""
        model = self.build(depth, device="meta")
        return self.experts * (sum(p.numel() for p in model.parameters()) + _persistent_buffer_numel(model))


def _persistent_buffer_numel(model: nn.Module) -> int:
    names = set(model.state_dict().keys())
    return sum(b.numel() for n, b in model.named_buffers() if n in names)


ARCHITECTURES: dict[str, Architecture] = {}


def register_architecture(arch: Architecture) -> Architecture:
    if arch.name in ARCHITECTURES:
        raise ValueError(f"register_architecture: {arch.name!r} is already registered")
    ARCHITECTURES[arch.name] = arch
    return arch


def get_architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; valid: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def _wan_config(heads: int, ffn_dim: int, layers: int, channels: int = 16) -> dict:
    """A WanTransformer3DModel config: what every published Wan 2.1 / 2.2 transformer shares (heads of 128, (1, 2, 2)
    patches, UMT5's 4096-wide text) and the numbers that differ."""
    return dict(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=128, in_channels=channels,
                out_channels=channels, text_dim=4096, freq_dim=256, ffn_dim=ffn_dim, num_layers=layers,
                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


def _flux2_config(heads: int, double: int, single: int, context: int, guidance_embeds: bool) -> dict:
    """A Flux2Transformer2DModel config: what FLUX.2 [dev] and [klein] share (heads of 128, 128-channel packed
    latents, mlp_ratio 3, 4-axis RoPE with theta 2000) and the numbers that differ."""
    return dict(patch_size=1, in_channels=128, num_layers=double, num_single_layers=single, attention_head_dim=128,
                num_attention_heads=heads, joint_attention_dim=context, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
                rope_theta=2000, guidance_embeds=guidance_embeds)


def _sd35_dual_blocks(cfg: dict) -> None:
    # SD3.5-Medium: dual attention in blocks 0-12 of 24, never in the last (context_pre_only) block
    cfg["dual_attention_layers"] = tuple(i for i in range(13) if i < cfg["num_layers"] - 1)


def _qwen25_full_attention_blocks(cfg: dict) -> None:
    v = cfg["vision_config"]
    v["fullatt_block_indexes"] = [i for i in (7, 15, 23, 31) if i < v["depth"]]


register_architecture(Architecture(
    name="sd35_medium", kind="sd3", class_name="SD3Transformer2DModel",
    config=dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
    depth={"num_layers": 24}, fit=_sd35_dual_blocks,
    source="stabilityai/stable-diffusion-3.5-medium transformer/config.json (2.24B parameters + a 0.23B "
           "position table)",
    lora_targets=tuple(ATTENTION_LORA_TARGETS), recipe="configs/diffusion/flow_grpo_sd35_pickscore.yaml",
    # 512 px -> 16 x 64 x 64 latents (1024 tokens of 2x2 patches); 77 CLIP + 128 T5 tokens; micro-batch 9 doubled by
    # classifier-free guidance (guidance 4.5) in the training forward
    step=dict(rows=18, height=512, width=512, text_tokens=205, lora_rank=32),
))

register_architecture(Architecture(
    name="flux1_dev", kind="flux", class_name="FluxTransformer2DModel",
    config=dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56)),
    depth={"num_layers": 19, "num_single_layers": 38},
    source="black-forest-labs/FLUX.1-dev transformer/config.json (11.9B parameters)",
    lora_targets=tuple(ATTENTION_LORA_TARGETS), recipe="configs/diffusion/flow_grpo_flux_pickscore.yaml",
    # 512 px -> 1024 packed latent tokens of 64 channels; 512 T5 tokens; micro-batch 3 (guidance embedding: no CFG)
    step=dict(rows=3, height=512, width=512, text_tokens=512, lora_rank=32),
))

register_architecture(Architecture(
    name="qwen25_vl_3b", kind="qwen_vl", class_name="Qwen2_5_VLForConditionalGeneration",
    config_class="Qwen2_5_VLConfig",
    config=dict(
        text_config=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=128000, rms_norm_eps=1e-6,
                         hidden_act="silu", tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", in_channels=3,
                           tokens_per_second=2),
        tie_word_embeddings=True, image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        vision_end_token_id=151653),
    depth={"text_config.num_hidden_layers": 36, "vision_config.depth": 32}, fit=_qwen25_full_attention_blocks,
    source="Qwen/Qwen2.5-VL-3B-Instruct config.json (3.75B parameters, embeddings tied)",
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    recipe="configs/vlm/grpo_qwen25vl_3b_geo3k.yaml",
    # micro-batch 4 rows; an image at min_pixels 512^2 -> 532 x 532 (38 x 38 patches, 361 tokens after merging);
    # ~120 prompt tokens; responses up to max_new_tokens 2048 (the worst case is what has to fit)
    step=dict(rows=4, image_patches=(38, 38), prompt_tokens=120, response_tokens=2048, lora_rank=64),
))

register_architecture(Architecture(
    name="wan21_t2v_1_3b", kind="wan", class_name="WanTransformer3DModel",
    config=_wan_config(heads=12, ffn_dim=8960, layers=30),
    depth={"num_layers": 30},
    source="Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json (dim 1536, 30 layers, 12 heads, FFN 8960; 1.4B)",
    lora_targets=tuple(WAN_LORA_TARGETS), recipe="configs/diffusion/flow_grpo_wan21_t2v.yaml",
    # 5 frames at 256 px -> 16 x 2 x 32 x 32 latents, 2 x 16 x 16 = 512 tokens of (1, 2, 2) patches; 512 UMT5 tokens;
    # micro-batch 1 doubled by classifier-free guidance (5.0)
    step=dict(rows=2, num_frames=5, height=256, width=256, text_tokens=512, lora_rank=64),
))

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
))

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
))

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
    step=dict(rows=1, height=384, width=384, text_tokens=512, lora_rank=64),
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
    step=dict(rows=8, num_frames=9, height=704, width=1280, text_tokens=1024, lora_rank=64),
))
