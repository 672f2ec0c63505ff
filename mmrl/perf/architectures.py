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
from mmrl.diffusion.models.qwen_image import QWEN_IMAGE_LORA_TARGETS
from mmrl.diffusion.models.wan import WAN_LORA_TARGETS
from mmrl.diffusion.models.z_image import Z_IMAGE_LORA_TARGETS


@dataclass(frozen=True)
class Architecture:
    """One published model at real width."""

    name: str
    kind: str
    """Input layout: `sd3`, `flux`, `wan`, `qwen_image`, `z_image` (diffusers transformers) or `qwen_vl` (a
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
    """The shipped recipe config whose micro-batch `step` describes."""
    step: dict[str, Any]
    """Shape of one training micro-batch of that recipe (rows through the model, resolution, tokens)."""
    config_class: str | None = None
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
        return sum(p.numel() for p in model.parameters()) + _persistent_buffer_numel(model)


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
    config=dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
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
