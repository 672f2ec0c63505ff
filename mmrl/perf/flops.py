"""FLOPs of a forward pass computed from the architecture: the matrix multiplications of every Linear (and
patch-embedding convolution) for the tokens that go through it, plus attention.

A family declares, once per module class, which *token stream* each layer sees (SD3/FLUX: image tokens, text tokens,
or one per sample for the AdaLN / timestep layers; Qwen-VL: patches, merged patches, text tokens) and how many
query x key pairs its attention layers compute for a given input. The layer sizes are read from the module itself,
so any depth or width of the architecture is counted without a table of numbers. A forward costs

    2 * sum_streams tokens(stream) * sum_{layers of the stream} in_features * out_features      (Linear / patch conv)
  + 4 * sum_{attention layers} query_tokens * key_tokens * (heads * head_dim)                    (Q K^T and P V)

which is what ``torch.utils.flop_counter.FlopCounterMode`` counts for the same forward (mm / addmm / bmm /
convolution / scaled-dot-product attention; elementwise work, norms and softmax are not counted by either):
tests/test_perf.py checks the two agree exactly on tiny models of every registered family, and one SD3.5-Medium
block against a count by hand. Conventions: attention is counted over the full query x key product (a causal
kernel skips about half of it in a prefill; flop_counter and PaLM's MFU formula count it whole); LoRA branches are
not counted (they add ~2r/width of the base layer's work); a backward costs 2x the forward for trainable weights
(input and weight gradients) and 1x for frozen ones (input gradients only), 2x for attention.

This module holds the formula, the registry and the estimators of the Qwen-VL policies (and of Janus's decoder,
generation head and image-token aligner); each diffusion family declares its transformer's estimator in its own file
(mmrl/diffusion/models/<family>.py): a function decorated with ``@register_flops("ClassName")`` that takes the
module and returns a :class:`FlopsEstimator` (its stream rules and a ``shapes(args, kwargs)`` reading the forward's
inputs with :func:`input_arg`). The registry holds a family's estimator once ``mmrl.diffusion.models`` is imported
(loading a model imports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

FLOP_FAMILIES: dict[str, Callable[[nn.Module], "FlopsEstimator"]] = {}


def register_flops(*class_names: str):
    """Decorator: `fn(module) -> FlopsEstimator` counts forwards of modules whose class name is in `class_names`."""

    def add(fn):
        for name in class_names:
            if name in FLOP_FAMILIES and FLOP_FAMILIES[name] is not fn:
                raise ValueError(f"register_flops: {name!r} is already registered to {FLOP_FAMILIES[name].__name__}")
            FLOP_FAMILIES[name] = fn
        return fn

    return add


def flops_estimator(module: nn.Module) -> "FlopsEstimator | None":
    """The estimator of `module`'s class (None when its family has none registered)."""
    fn = FLOP_FAMILIES.get(type(module).__name__)
    return fn(module) if fn is not None else None


@dataclass
class Pass:
    """Token counts and attention work of one forward: ``tokens[stream]`` rows through each stream's layers and
    ``attention`` = sum over attention layers of query_tokens * key_tokens * attention width."""

    tokens: dict[str, int]
    attention: int = 0


@dataclass
class FlopsEstimator:
    """Multiply-adds per token of each stream's layers (read from `module`), split by whether the weight trains,
    and a `shapes(args, kwargs) -> Pass` that reads a forward's inputs."""

    module: nn.Module
    rules: list[tuple[str, str]]  # (substring of the layer name, stream); first match wins, "" matches every layer
    shapes: Callable[[tuple, dict], "Pass | None"]  # None: this forward is not counted
    macs: dict[str, dict[bool, int]] = field(default_factory=dict)  # stream -> {trainable: multiply-adds per token}
    forward_only: tuple[str, ...] = ()  # streams whose output never reaches the model's output: no backward

    def __post_init__(self):
        self.refresh()

    def refresh(self) -> None:
        """Re-read the layers (which weights train may change, e.g. when PolicyStates is built)."""
        self.macs = {}
        for name, mod in self.module.named_modules():
            w = getattr(mod, "weight", None)
            if ".lora_" in f".{name}" or w is None or not isinstance(mod, (nn.Linear, nn.Conv2d, nn.Conv3d)):
                continue
            stream = next((s for pattern, s in self.rules if pattern in name), None)
            if stream is None:
                continue
            if isinstance(mod, nn.Linear):
                per_token = mod.in_features * mod.out_features
            else:  # patch embedding: kernel == stride, one output position per token
                if tuple(mod.kernel_size) != tuple(mod.stride):
                    raise ValueError(f"FLOPs: {name} is a convolution with kernel != stride, not a patch embedding")
                per_token = mod.out_channels * (mod.in_channels // mod.groups) * math.prod(mod.kernel_size)
            slot = self.macs.setdefault(stream, {True: 0, False: 0})
            slot[bool(w.requires_grad)] += per_token

    def forward_flops(self, p: Pass) -> int:
        """FLOPs of one forward with token counts / attention work `p`."""
        linear = sum(2 * n * (m[True] + m[False]) for s, n in p.tokens.items() for m in [self.macs.get(s, {True: 0, False: 0})])
        return int(linear + 4 * p.attention)

    def backward_flops(self, p: Pass) -> int:
        """FLOPs of the backward of that forward: input gradients through every layer (1x), weight gradients of the
        trainable ones (1x more), attention 2x."""
        linear = sum(2 * n * (2 * m[True] + m[False]) for s, n in p.tokens.items() if s not in self.forward_only
                     for m in [self.macs.get(s, {True: 0, False: 0})])
        return int(linear + 8 * p.attention)


def input_arg(args: tuple, kwargs: dict, name: str, pos: int = 0):
    """The forward input `name`, given by keyword or at position `pos` (None when absent)."""
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else None


# ------------------------------------------------------------------------ shared by several diffusion families


def packed_joint_estimator(module: nn.Module, rules: list[tuple[str, str]]) -> FlopsEstimator:
    """FLUX-style transformers (FLUX.1, FLUX.2): double-stream blocks (as SD3's joint blocks) then single-stream
    blocks, all attending over image + text tokens; inputs are packed latents [B, N, C] and text [B, M, D]. `rules`
    (the family's) name the streams `image`, `text`, `sample` (one row per sample) and `joint` (image + text)."""
    width = module.config.num_attention_heads * module.config.attention_head_dim
    n_blocks = len(module.transformer_blocks) + len(module.single_transformer_blocks)

    def shapes(args, kwargs):
        x, ctx = input_arg(args, kwargs, "hidden_states"), input_arg(args, kwargs, "encoder_hidden_states", 1)
        b, n, m = x.shape[0], x.shape[1], ctx.shape[1]
        return Pass({"image": b * n, "text": b * m, "sample": b, "joint": b * (n + m)},
                    b * width * n_blocks * (n + m) ** 2)

    return FlopsEstimator(module, rules, shapes)


# ------------------------------------------------------------------------------------------------- Qwen-VL policies


def _cache_length(cache: Any) -> int:
    if cache is None:
        return 0
    get = getattr(cache, "get_seq_length", None)
    return int(get()) if get is not None else 0


@register_flops("Qwen2VLTextModel", "Qwen2_5_VLTextModel", "Qwen3VLTextModel", "Glm4vTextModel")
def _qwen_text(module: nn.Module) -> FlopsEstimator:
    """The Qwen-VL decoder (without the lm_head, counted as its own Linear). Rows are counted by their real
    (attention-mask) tokens: padding is not useful work. Attention: each row's new tokens against its cached +
    new real tokens, per layer. A packed row (4-D mask) counts its whole length against itself."""
    cfg = module.config
    width = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    layers = cfg.num_hidden_layers

    def shapes(args, kwargs):
        x = kwargs.get("inputs_embeds")
        x = x if x is not None else input_arg(args, kwargs, "input_ids")
        b, q = x.shape[0], x.shape[1]
        cache = kwargs.get("cache")  # (transformers >= 5.20; `past_key_values` before)
        past = _cache_length(cache if cache is not None else kwargs.get("past_key_values"))
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] == past + q:
            real = mask.to(torch.bool)
            q_rows = real[:, -q:].sum(-1).to(torch.int64)
            kv_rows = real.sum(-1).to(torch.int64)
            return Pass({"text": int(q_rows.sum())}, width * layers * int((q_rows * kv_rows).sum()))
        return Pass({"text": b * q}, width * layers * b * q * (past + q))

    return FlopsEstimator(module, [("", "text")], shapes)


def _window_lengths(h: int, w: int, merge: int, window: int) -> list[int]:
    """Patches per attention window of one frame of h x w patches (Qwen2.5-VL's get_window_index): the merged grid
    cut into window x window tiles, the last ones smaller."""
    hm, wm = h // merge, w // merge
    rows = [min(window, hm - i) for i in range(0, hm, window)]
    cols = [min(window, wm - j) for j in range(0, wm, window)]
    return [r * c * merge * merge for r in rows for c in cols]


@register_flops("Qwen2VisionTransformerPretrainedModel", "Qwen2_5_VisionTransformerPretrainedModel",
                "Qwen3VLVisionModel", "Glm4vVisionModel")
def _qwen_vision(module: nn.Module) -> FlopsEstimator:
    """The Qwen-VL vision tower: blocks over patches, attention per frame of each image (Qwen2.5-VL: inside
    windows of `window_size` pixels, except the `fullatt_block_indexes` blocks), mergers over merged patches.
    GLM-4.1V's tower is the same with full attention and a `downsample` patch convolution over merged patches."""
    cfg = module.config
    blocks = list(module.blocks)
    width = blocks[0].attn.qkv.out_features // 3
    merge = cfg.spatial_merge_size
    full = set(getattr(cfg, "fullatt_block_indexes", None) or range(len(blocks)))
    window = getattr(cfg, "window_size", None)
    window = window // merge // cfg.patch_size if window else None

    def shapes(args, kwargs):
        x, grid = input_arg(args, kwargs, "hidden_states"), input_arg(args, kwargs, "grid_thw", 1)
        patches = x.shape[0]
        attn = 0
        for t, h, w in grid.tolist():
            frame = h * w
            windows = _window_lengths(h, w, merge, window) if window else [frame]
            per_full, per_window = t * frame * frame, t * sum(n * n for n in windows)
            attn += sum(per_full if i in full else per_window for i in range(len(blocks)))
        return Pass({"patch": patches, "merged": patches // (merge * merge)}, width * attn)

    return FlopsEstimator(module, [("merger", "merged"), ("downsample", "merged"), ("", "patch")], shapes)


# InternVL (3 / 3.5) policies: their decoder is a plain Qwen2 / Qwen3 model (no meter walks into one anywhere else)
register_flops("Qwen2Model", "Qwen3Model")(_qwen_text)


@register_flops("InternVLVisionModel")
def _internvl_vision(module: nn.Module) -> FlopsEstimator:
    """InternVL's vision tower: every tile ([tiles, 3, H, W]) is (H/p)(W/p) patches + a CLS token through every
    layer, attention within the tile; the patch convolution sees the patches only."""
    cfg = module.config
    ph, pw = cfg.patch_size if isinstance(cfg.patch_size, (list, tuple)) else (cfg.patch_size,) * 2
    layers = cfg.num_hidden_layers
    width = cfg.hidden_size

    def shapes(args, kwargs):
        x = input_arg(args, kwargs, "pixel_values")
        tiles, patches = x.shape[0], (x.shape[2] // ph) * (x.shape[3] // pw)
        return Pass({"patch": tiles * patches, "token": tiles * (patches + 1)},
                    width * layers * tiles * (patches + 1) ** 2)

    return FlopsEstimator(module, [("patch_embeddings", "patch"), ("", "token")], shapes)


@register_flops("InternVLMultiModalProjector")
def _internvl_projector(module: nn.Module) -> FlopsEstimator:
    """InternVL's projector: every image token after the pixel shuffle (4 patches -> 1) through its MLP."""

    def shapes(args, kwargs):
        x = input_arg(args, kwargs, "image_features")
        return Pass({"merged": x.numel() // x.shape[-1]})

    return FlopsEstimator(module, [("", "merged")], shapes)


# Janus / Janus-Pro (mmrl.ar_image): the Llama decoder counts as the Qwen-VL decoder (a guided row pair is two rows;
# the chain-of-thought's left-padded image prompts carry a mask, which the estimator counts like the VLMs'). The VQ decoder is not counted, as no recipe counts a VAE.
register_flops("LlamaModel")(_qwen_text)


@register_flops("JanusVQVAEHead", "JanusVQVAEAlignerMLP")
def _janus_rows(module: nn.Module) -> FlopsEstimator:
    """Janus's generation head (hidden state -> image-token logits) and image-token aligner (codebook embedding ->
    decoder width): every row of the input through their Linear layers."""

    def shapes(args, kwargs):
        x = input_arg(args, kwargs, "hidden_states")
        return Pass({"rows": x.numel() // x.shape[-1]})

    return FlopsEstimator(module, [("", "rows")], shapes)


@register_flops("Linear")
def _linear(module: nn.Module) -> FlopsEstimator:
    """A plain Linear (e.g. the lm_head): every row of the input."""

    def shapes(args, kwargs):
        x = input_arg(args, kwargs, "input")
        return Pass({"rows": x.numel() // x.shape[-1]})

    return FlopsEstimator(module, [("", "rows")], shapes)
