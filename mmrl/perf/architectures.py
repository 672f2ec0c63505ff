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
so they are here once `mmrl.diffusion.models` is imported. The Qwen2.5-VL policy is registered below.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import nn

# `step` keys that count rows or set the adapter, not the shape of a row
_COUNTS = ("rows", "lora_rank", "trained_experts")


@dataclass(frozen=True)
class Architecture:
    """One published model at real width."""

    name: str
    kind: str
    """The model family (`sd3`, `flux`, `flux2`, `wan`, `qwen_image`, `z_image`: diffusers transformers) or `qwen_vl`
    (a transformers VLM)."""
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
    `trained_experts`), and the shape of one row (resolution, frames, tokens: `row()`)."""
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


# ------------------------------------------------------------------------------------------------- Qwen-VL policies


def _qwen25_full_attention_blocks(cfg: dict) -> None:
    v = cfg["vision_config"]
    v["fullatt_block_indexes"] = [i for i in (7, 15, 23, 31) if i < v["depth"]]


def _qwen_vl_row(model: nn.Module, row: dict, dtype: torch.dtype) -> dict:
    """One rollout row through the policy: the image's patches and placeholder tokens, prompt and response tokens;
    `response_tokens` says how many of the last tokens are scored."""
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    gh, gw = row["image_patches"]
    merged = gh * gw // 4
    vocab = cfg.text_config.vocab_size
    ids = ([cfg.vision_start_token_id] + [cfg.image_token_id] * merged + [cfg.vision_end_token_id]
           + torch.randint(0, 150000 % vocab, (row["prompt_tokens"] + row["response_tokens"],), generator=g).tolist())
    ids = torch.tensor([ids])
    patch = cfg.vision_config.in_channels * cfg.vision_config.temporal_patch_size * cfg.vision_config.patch_size ** 2
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": (ids == cfg.image_token_id).long(),
            "pixel_values": torch.randn(gh * gw, patch, generator=g).to(dtype),
            "image_grid_thw": torch.tensor([[1, gh, gw]]), "response_tokens": row["response_tokens"]}


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
    inputs=_qwen_vl_row,
    # measured with the real image and prompt but 256 response tokens (737 in all): decoder layers scale to
    # 361 + 120 + 2048 = 2529 tokens, the rest (dominated by the response logits) to 2048 / 256
    measured_row=dict(image_patches=(38, 38), prompt_tokens=120, response_tokens=256),
    row_scale={"text_config.num_hidden_layers": 2529 / 737, "fixed": 2048 / 256},
    small_widths={"text_config.hidden_size": 64, "text_config.intermediate_size": 128,
                  "text_config.num_attention_heads": 4, "text_config.num_key_value_heads": 2,
                  "text_config.rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                  "mrope_section": [2, 3, 3]},
                  "vision_config.hidden_size": 32, "vision_config.intermediate_size": 64, "vision_config.num_heads": 2,
                  "vision_config.out_hidden_size": 64},
    small_row=dict(image_patches=(8, 8), prompt_tokens=8, response_tokens=8),
))
