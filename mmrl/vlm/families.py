"""VLM policy families: what differs between the transformers VLMs the recipes train, as data (a family is a row
here plus its tiny builder, not a fork of the recipe code).

Every family listed shares the recipes' contract: ``AutoModelForImageTextToText`` loads it, the processor expands
one image placeholder per image into the tokens the vision features replace and returns ``pixel_values`` (+
``image_grid_thw`` for the M-RoPE families), the decoder is under ``language_model`` and takes explicit position ids.
What differs:

* ``chat_image``: how the chat template writes one image (``<image>`` in a prompt becomes this);
* ``image_pad``: the placeholder token the processor expands (also the processor's ``image_token``);
* ``vision_tokens``: special tokens the policy must never sample;
* ``turn_end``: the token that ends an assistant turn (what the format warm start teaches to emit);
* ``rope``: the ``mmrl.pipelines.qwen_rope.get_rope_index`` model type whose placement rule the family uses, or
  ``"1d"``: plain positions (InternVL); ``RolloutBatch`` keeps them as 3 equal rows and hands the model one;
* ``vision_attr`` / ``vision_lora``: the vision tower's attribute name and the LoRA pattern of its blocks
  (``model.train_vision``); ``vision_cache``: ``VisionCache`` can hand its features to the model;
* ``pad_wrap``: tokens the processor writes around an expanded placeholder that the chat template does not
  (InternVL's ``<img>`` ... ``</img>``); vLLM adds them itself, so token-in prompts to vLLM drop them with the run;
* ``fused_lm_targets``: fused linear layers of the decoder that stand for LoRA target names (GLM's ``gate_up_proj``
  is ``gate_proj`` + ``up_proj`` in one matrix).

GLM-4.1V (``glm4v``): transformers 5.24 ``Glm4vModel.get_rope_index`` places images exactly as Qwen3-VL does
(text +1 per token; an item with merged grid (t, h, w) at p gets (p + t_i, p + h_i, p + w_i), the position then
advances by max(h, w); videos split into one item per frame) - tested equal to it. InternVL (``internvl``): 1-D
positions, 448px tiles (+ a thumbnail) as ``pixel_values`` [tiles, 3, H, W], no ``.visual`` merge to hand cached
features to (``VisionCache`` passes its batches through). Videos are not supported here
(GLM writes a video's frames with the *image* token and tells them apart by the surrounding begin/end-of-video
tokens, which ``mm_token_type_ids`` built from ids does not see).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class VLMFamily:
    """One family of VLM policies (see the module docstring for each field's meaning)."""

    name: str
    model_types: tuple[str, ...]
    chat_image: str
    image_pad: str
    vision_tokens: tuple[str, ...]
    turn_end: str
    rope: str
    videos: bool = True
    pad_wrap: tuple[str, ...] = ()
    fused_lm_targets: dict[str, tuple[str, ...]] = field(default_factory=dict)
    vision_attr: str = "visual"
    vision_lora: str = r".*visual\.blocks.*\.(qkv|proj|fc1|fc2|gate_proj|up_proj|down_proj)"
    vision_cache: bool = True


QWEN_VL = VLMFamily(
    name="qwen_vl", model_types=("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"),
    chat_image="<|vision_start|><|image_pad|><|vision_end|>", image_pad="<|image_pad|>",
    vision_tokens=("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"),
    turn_end="<|im_end|>", rope="per-model")
# source: THUDM/GLM-4.1V-9B-Thinking chat_template.jinja / tokenizer_config.json (token strings; a turn ends where the
# model emits the next role token <|user|>, one of generation_config.json's eos ids);
# transformers 5.24.0 models/glm4v (processor image_token "<|image|>", Glm4vConfig *_token_id fields)
GLM4V = VLMFamily(
    name="glm4v", model_types=("glm4v",),
    chat_image="<|begin_of_image|><|image|><|end_of_image|>", image_pad="<|image|>",
    vision_tokens=("<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|image|>",
                   "<|video|>"),
    turn_end="<|user|>", rope="qwen3_vl", videos=False, fused_lm_targets={"gate_up_proj": ("gate_proj", "up_proj")})

# source: transformers 5.24.0 models/internvl (InternVLProcessor expands one <IMG_CONTEXT> into <img> +
# image_seq_length * tiles x <IMG_CONTEXT> + </img>; the language model is a plain Qwen2/Qwen3 decoder with 1-D
# positions; the vision tower is `vision_tower`, InternVLVisionLayer attention q/k/v_proj + projection_layer,
# mlp fc1/fc2)
INTERNVL = VLMFamily(
    name="internvl", model_types=("internvl",), chat_image="<IMG_CONTEXT>", image_pad="<IMG_CONTEXT>",
    vision_tokens=("<img>", "</img>", "<IMG_CONTEXT>"), turn_end="<|im_end|>", rope="1d", videos=False,
    pad_wrap=("<img>", "</img>"), vision_attr="vision_tower",
    vision_lora=r".*vision_tower\.encoder\.layer.*\.(q_proj|k_proj|v_proj|projection_layer|fc1|fc2)",
    vision_cache=False)

VLM_FAMILIES: dict[str, VLMFamily] = {f.name: f for f in (QWEN_VL, GLM4V, INTERNVL)}
VISION_ATTRS = tuple(dict.fromkeys(f.vision_attr for f in VLM_FAMILIES.values()))
ALL_VISION_TOKENS = tuple(dict.fromkeys(t for f in VLM_FAMILIES.values() for t in f.vision_tokens))


def family_of_config(config: Any, strict: bool = False) -> VLMFamily:
    """The family of a transformers config (by ``model_type``); Qwen-VL for another one, or with `strict` a
    ValueError naming the supported ones."""
    mt = getattr(config, "model_type", None)
    for fam in VLM_FAMILIES.values():
        if mt in fam.model_types:
            return fam
    if not strict:
        return QWEN_VL
    known = sorted(t for f in VLM_FAMILIES.values() for t in f.model_types)
    raise ValueError(f"model.path: a {mt!r} checkpoint is not a supported VLM policy; supported model_type: {known}")


def family_of_processor(processor: Any) -> VLMFamily:
    """The family whose placeholder is the processor's ``image_token`` (Qwen-VL when it has none: a bare
    tokenizer, as before families existed)."""
    token = getattr(processor, "image_token", None)
    for fam in VLM_FAMILIES.values():
        if token == fam.image_pad:
            return fam
    return QWEN_VL


def lm_lora_targets(config: Any, targets: list[str]) -> list[str]:
    """`targets` plus the family's fused layers that contain one of them (GLM: gate_proj -> gate_up_proj too)."""
    fam = family_of_config(config)
    extra = [fused for fused, parts in fam.fused_lm_targets.items() if set(parts) & set(targets)]
    return list(targets) + [t for t in extra if t not in targets]


def lora_target_pattern(config: Any, targets: list[str], train_vision: bool) -> str:
    """The LoRA `target_modules` regex of a policy: `targets` (+ the family's fused layers) under the language model,
    and with `train_vision` the family's vision blocks."""
    pattern = rf".*language_model.*\.({'|'.join(lm_lora_targets(config, list(targets)))})"
    return pattern + "|" + family_of_config(config).vision_lora if train_vision else pattern


def freeze_vision_tower(model: Any) -> None:
    """Full fine-tuning without `train_vision`: the family's vision tower stops requiring grad."""
    vision = f".{family_of_config(model.config).vision_attr}."
    for name, param in model.named_parameters():
        if vision in f".{name}":
            param.requires_grad_(False)
