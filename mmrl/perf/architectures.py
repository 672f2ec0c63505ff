"""The real architectures at their published widths, buildable at any depth with random weights, and the shape of the
training micro-batch their shipped recipe runs: for memory measurements and throughput checks without downloading a
checkpoint (benchmarks/real_width.py, benchmarks/gpu_check.py, mmrl.tiny.random_real).

    import mmrl.diffusion.models                                            # the families register theirs
    arch = get_architecture("flux1_dev")
    model = arch.build(depth={"num_layers": 1, "num_single_layers": 1})   # real width, 2 blocks, random bf16 weights
    arch.parameters()                                                       # the full-depth count (meta device)
    arch.small()                                                            # the same class at tiny widths (CPU tests)

This module owns the registry; each diffusion family registers its architectures in its own file
(mmrl/diffusion/models/<family>.py: `register_architecture(Architecture(...))` with the published config, the keys
that set its depth, the micro-batch of its recipe, how to build one row of its training forward, and its tiny widths),
so they are here once `mmrl.diffusion.models` is imported. The VLM policies (Qwen2.5-VL-3B, GLM-4.1V-9B-Thinking,
InternVL3.5-1B and -8B: one per family of mmrl.vlm.families) are registered below.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import nn

# `step` keys that count rows or say what is trained, not the shape of a row
_COUNTS = ("rows", "lora_rank", "trained_experts", "train_vision")


@dataclass(frozen=True)
class Architecture:
    """One published model at real width."""

    name: str
    kind: str
    """The model family (`sd3`, `flux`, `flux2`, `wan`, `qwen_image`, `z_image`: diffusers transformers) or a VLM
    policy family of mmrl.vlm.families (`qwen_vl`, `glm4v`, `internvl`: a transformers VLM)."""
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
    """Shape of one training micro-batch of that recipe: `rows` through the model, `lora_rank` (and
    `trained_experts`), and the shape of one row (resolution, frames, tokens: `row()`). A VLM's `train_vision` is
    its recipe's `model.train_vision` (LoRA also on the vision blocks; full fine-tuning trains the vision tower, else
    it is frozen); without it, LoRA on the language model and full fine-tuning of every weight."""
    config_class: str | None = None
    experts: int = 1
    """Models of this config the pipeline holds (Wan 2.2 A14B: a high- and a low-noise expert; `step`'s
    "trained_experts" says how many the recipe trains); a row goes through one. `build` makes one; `parameters`
    counts them all."""
    fit: Callable[[dict], None] | None = field(default=None, compare=False)
    """Adjusts config keys that depend on the depth (e.g. which blocks have dual attention) in place."""
    inputs: Callable[[nn.Module, dict, torch.dtype], dict] | None = field(default=None, compare=False)
    """`inputs(model, row, dtype)`: the keyword arguments of one training forward of a built model for one row of
    shape `row` (random values, the layout the family's recipe passes)."""
    small_widths: dict[str, Any] = field(default_factory=dict)
    """Config keys (dotted) that make it tiny: `small()`, the same class and code path on a CPU."""
    small_row: dict[str, Any] = field(default_factory=dict)
    """The row a tiny-width measurement uses (`benchmarks/real_width.py --small`)."""
    measured_row: dict[str, Any] | None = None
    """The row benchmarks/real_width.py measures when the recipe's row (`row()`) does not fit a CPU measurement."""
    row_scale: dict[str, float] = field(default_factory=dict)
    """With `measured_row`: how what one measured row adds scales to the recipe's row, per depth key, `fixed` (all
    but the counted blocks) or `*` (every part); 1 where not given."""
    measure_config: dict[str, Any] = field(default_factory=dict)
    """Config keys replaced for a measurement only (a buffer too large to build that the weights count anyway)."""
    measure_modes: tuple[str, ...] = ("lora", "full")
    """Fine-tuning modes a measurement at real width can hold on a CPU machine."""
    lora_regex: str = ""
    """A regex of the module names LoRA goes on (peft's `target_modules` as a string), where the recipe's pattern
    is not a list of name suffixes (Janus: the decoder's projections and the generation head); "" = `lora_targets`."""
    full_trains: tuple[str, ...] = ()
    """Parameter-name prefixes full fine-tuning trains, where the recipe freezes the rest (Janus: the decoder and
    the generation head); () = every parameter (a VLM: see `step["train_vision"]`)."""
    loss: Callable[[nn.Module, dict], torch.Tensor] | None = field(default=None, compare=False)
    """`loss(model, inputs)`: the scalar a training step differentiates, where it is not a scalar of the forward's
    output nor a VLM's response log-probability (Janus: the guided image-token log-probabilities)."""

    def row(self) -> dict[str, Any]:
        """The shape of one row of the recipe's micro-batch (`step` without its counts)."""
        return {k: v for k, v in self.step.items() if k not in _COUNTS}

    def small(self) -> "Architecture":
        """The same architecture at `small_widths`, 2 blocks of each depth key."""
        cfg = json.loads(json.dumps(self.config, default=list))
        for key, value in self.small_widths.items():
            node = cfg
            *parents, leaf = key.split(".")
            for p in parents:
                node = node[p]
            node[leaf] = value
        return replace(self, config=cfg, depth={k: 2 for k in self.depth})

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


def get_architecture(name: str, small: bool = False) -> Architecture:
    """The registered architecture `name`, or with `small` its tiny-width version (`Architecture.small`)."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; valid: {sorted(ARCHITECTURES)} (the diffusion families "
                         f"register theirs when mmrl.diffusion.models is imported)")
    return ARCHITECTURES[name].small() if small else ARCHITECTURES[name]


# ------------------------------------------------------------------------------------------------- VLM policies

# the recipes' LoRA targets (mmrl.vlm.config.LM_TARGETS, under the language model; GLM's fused gate_up_proj joins them)
_LM_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _qwen25_full_attention_blocks(cfg: dict) -> None:
    v = cfg["vision_config"]
    v["fullatt_block_indexes"] = [i for i in (7, 15, 23, 31) if i < v["depth"]]


def _text_ids(cfg, n: int, g: torch.Generator) -> list[int]:
    """`n` random text token ids below the special tokens of the Qwen / GLM vocabularies."""
    return torch.randint(0, 150000 % cfg.text_config.vocab_size, (n,), generator=g).tolist()


def _mrope_vlm_row(model: nn.Module, row: dict, dtype: torch.dtype) -> dict:
    """One rollout row through a 3-D M-RoPE policy (Qwen2.5-VL, GLM-4.1V): the image's patches as the processor
    flattens them (channels x temporal patch x patch^2 each) with its grid, one placeholder per merged 2x2 group between
    the image's begin/end tokens, prompt and response tokens; `response_tokens` says how many of the last tokens are
    scored."""
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    v = cfg.vision_config
    gh, gw = row["image_patches"]
    # Qwen's <|vision_start|> / <|vision_end|>, GLM's <|begin_of_image|> / <|end_of_image|>
    start, end = ((cfg.vision_start_token_id, cfg.vision_end_token_id) if hasattr(cfg, "vision_start_token_id")
                  else (cfg.image_start_token_id, cfg.image_end_token_id))
    ids = ([start] + [cfg.image_token_id] * (gh * gw // v.spatial_merge_size ** 2) + [end]
           + _text_ids(cfg, row["prompt_tokens"] + row["response_tokens"], g))
    ids = torch.tensor([ids])
    patch = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": (ids == cfg.image_token_id).long(),
            "pixel_values": torch.randn(gh * gw, patch, generator=g).to(dtype),
            "image_grid_thw": torch.tensor([[1, gh, gw]]), "response_tokens": row["response_tokens"]}


def _internvl_row(model: nn.Module, row: dict, dtype: torch.dtype) -> dict:
    """One rollout row through InternVL: `tiles` tiles of 448 x 448 as `pixel_values` [tiles, 3, 448, 448], each
    (448 / 14)^2 x 0.5^2 = 256 <IMG_CONTEXT> tokens after the pixel shuffle, between two tokens where <img> / </img>
    stand (text ids here: the memory is the same), prompt and response tokens; 1-D positions (the model's own)."""
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    v = cfg.vision_config
    side, patch = v.image_size[0], v.patch_size[0]
    per_tile = int((side // patch) ** 2 * cfg.downsample_ratio ** 2)
    text = _text_ids(cfg, 2 + row["prompt_tokens"] + row["response_tokens"], g)
    ids = torch.tensor([text[:1] + [cfg.image_token_id] * (per_tile * row["tiles"]) + text[1:]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.randn(row["tiles"], v.num_channels, side, side, generator=g).to(dtype),
            "response_tokens": row["response_tokens"]}


_SMALL_TEXT = {"text_config.hidden_size": 64, "text_config.intermediate_size": 128,
               "text_config.num_attention_heads": 4, "text_config.num_key_value_heads": 2}

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
    lora_targets=_LM_TARGETS,
    recipe="configs/vlm/grpo_qwen25vl_3b_geo3k.yaml",
    # micro-batch 4 rows; an image at min_pixels 512^2 -> 532 x 532 (38 x 38 patches, 361 tokens after merging);
    # ~120 prompt tokens; responses up to max_new_tokens 2048 (the worst case is what has to fit). Measured before
    # `train_vision` existed here: LoRA on the language model, full fine-tuning of every weight (the recipe's).
    step=dict(rows=4, image_patches=(38, 38), prompt_tokens=120, response_tokens=2048, lora_rank=64),
    inputs=_mrope_vlm_row,
    # measured with the real image and prompt but 256 response tokens (737 in all): decoder layers scale to
    # 361 + 120 + 2048 = 2529 tokens, the rest (dominated by the response logits) to 2048 / 256
    measured_row=dict(image_patches=(38, 38), prompt_tokens=120, response_tokens=256),
    row_scale={"text_config.num_hidden_layers": 2529 / 737, "fixed": 2048 / 256},
    small_widths={**_SMALL_TEXT,
                  "text_config.rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                  "mrope_section": [2, 3, 3]},
                  "vision_config.hidden_size": 32, "vision_config.intermediate_size": 64, "vision_config.num_heads": 2,
                  "vision_config.out_hidden_size": 64},
    small_row=dict(image_patches=(8, 8), prompt_tokens=8, response_tokens=8),
))

register_architecture(Architecture(
    name="glm41v_9b_thinking", kind="glm4v", class_name="Glm4vForConditionalGeneration", config_class="Glm4vConfig",
    config=dict(
        text_config=dict(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
                         num_attention_heads=32, num_key_value_heads=2, rms_norm_eps=1e-5, hidden_act="silu",
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [8, 12, 12], "partial_rotary_factor": 0.5}),
        vision_config=dict(depth=24, hidden_size=1536, intermediate_size=13696, num_heads=12, out_hidden_size=4096,
                           image_size=336, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           hidden_act="silu", rms_norm_eps=1e-5, attention_bias=False),
        tie_word_embeddings=False, image_token_id=151343, video_token_id=151344, image_start_token_id=151339,
        image_end_token_id=151340, video_start_token_id=151341, video_end_token_id=151342),
    depth={"text_config.num_hidden_layers": 40, "vision_config.depth": 24},
    # the shape keys only (the context length, eos/pad ids change no weight and no step)
    source="zai-org/GLM-4.1V-9B-Thinking config.json as transformers 5.24 Glm4vConfig documents it (its defaults "
           "name this checkpoint; q/k/v biases are fixed in its code); 10.29B parameters, output layer untied "
           "(model card: 10.3B)",
    lora_targets=_LM_TARGETS,
    recipe="configs/vlm/grpo_glm41v_9b_geo3k.yaml",
    # micro-batch 4 rows; mmrl resizes the image to min_pixels 512^2 -> 532 x 532 before GLM's processor (38 x 38
    # patches, 361 tokens after merging, between <|begin_of_image|> / <|end_of_image|>); ~120 prompt tokens;
    # responses up to max_new_tokens 2048. The recipe trains every weight (vision tower included) under FSDP over 8
    # GPUs; the LoRA rows are its one-GPU alternative (model.lora.rank=64, the vision blocks get adapters too).
    step=dict(rows=4, image_patches=(38, 38), prompt_tokens=120, response_tokens=2048, lora_rank=64,
              train_vision=True),
    inputs=_mrope_vlm_row,
    # measured at 256 response tokens (363 + 120 + 256 = 739): decoder layers scale to 363 + 120 + 2048 = 2531
    # tokens, the rest (the response logits, the vision tower) to 2048 / 256
    measured_row=dict(image_patches=(38, 38), prompt_tokens=120, response_tokens=256),
    row_scale={"text_config.num_hidden_layers": 2531 / 739, "fixed": 2048 / 256},
    # a full fine-tuning depth point holds ~2B trainable parameters with gradients and AdamW state (~16 GB): more
    # than this machine's free memory
    measure_modes=("lora",),
    small_widths={**_SMALL_TEXT,
                  "text_config.rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [1, 1, 2], "partial_rotary_factor": 0.5},
                  "vision_config.hidden_size": 32, "vision_config.intermediate_size": 64, "vision_config.num_heads": 2,
                  "vision_config.out_hidden_size": 64},
    small_row=dict(image_patches=(8, 8), prompt_tokens=8, response_tokens=8),
))


def _internvl35(hidden: int, intermediate: int, layers: int, heads: int) -> dict:
    """An InternVL3.5 config (transformers format, the -HF checkpoints): InternViT-300M at 448 px + a Qwen3 decoder
    of these sizes (8 KV heads of 128, untied output layer)."""
    return dict(
        text_config=dict(model_type="qwen3", vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8, head_dim=128,
                         rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        vision_config=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                           attention_bias=True, image_size=[448, 448], patch_size=[14, 14], hidden_act="gelu",
                           norm_type="layer_norm", layer_norm_eps=1e-6, use_qk_norm=False,
                           use_absolute_position_embeddings=True, layer_scale_init_value=0.1),
        image_token_id=151671, downsample_ratio=0.5, projector_hidden_act="gelu", vision_feature_layer=-1,
        vision_feature_select_strategy="default", tie_word_embeddings=False)


# the recipe's micro-batch: 4 rows of one 448 x 448 tile (the published run resizes every image to one tile; the
# checkpoint's processor tiles a larger or oblong image into more, + a thumbnail: 256 tokens each), ~120 prompt
# tokens, responses up to max_new_tokens 32768; full fine-tuning with the vision tower frozen. LoRA rows at rank 64
# (no InternVL recipe ships LoRA). Measured at 256 response tokens (258 + 120 + 256 = 634): decoder layers scale to
# 258 + 120 + 32768 = 33146 tokens, the rest (the response logits, the vision tower) to 32768 / 256
_INTERNVL35 = dict(
    kind="internvl", class_name="InternVLForConditionalGeneration", config_class="InternVLConfig",
    lora_targets=_LM_TARGETS, recipe="configs/vlm/grpo_internvl35_1b_geo3k.yaml",
    step=dict(rows=4, tiles=1, prompt_tokens=120, response_tokens=32768, lora_rank=64, train_vision=False),
    inputs=_internvl_row, measured_row=dict(tiles=1, prompt_tokens=120, response_tokens=256),
    row_scale={"text_config.num_hidden_layers": 33146 / 634, "fixed": 32768 / 256},
    small_widths={**_SMALL_TEXT, "text_config.head_dim": 16, "vision_config.hidden_size": 32,
                  "vision_config.intermediate_size": 64, "vision_config.num_attention_heads": 2},
    small_row=dict(tiles=1, prompt_tokens=8, response_tokens=8))

register_architecture(Architecture(
    name="internvl35_1b", config=_internvl35(1024, 3072, 28, 16),
    depth={"text_config.num_hidden_layers": 28, "vision_config.num_hidden_layers": 24},
    source="OpenGVLab/InternVL3_5-1B-HF config.json (Qwen3-0.6B decoder, InternViT-300M): 1,060,897,792 "
           "parameters, as counted in its safetensors (304,012,288 vision, 5,253,120 projector, 751,632,384 language)",
    **_INTERNVL35))

register_architecture(Architecture(
    name="internvl35_8b", config=_internvl35(4096, 12288, 36, 32),
    depth={"text_config.num_hidden_layers": 36, "vision_config.num_hidden_layers": 24},
    source="OpenGVLab/InternVL3_5-8B-HF config.json (Qwen3-8B decoder, InternViT-300M; model card: 8.5B)",
    # the 1B recipe's row at 8B (no recipe here ships the 8B); LoRA only: a full fine-tuning depth point holds
    # ~1.9B trainable parameters with gradients and AdamW state, more than this machine's free memory
    measure_modes=("lora",), **_INTERNVL35))
