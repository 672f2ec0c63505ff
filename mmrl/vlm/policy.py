"""Load a Qwen-VL policy as `PolicyStates` from a `model:` section (`mmrl.vlm.config.ModelConfig`: path, build_tiny,
lora, train_vision, gradient_checkpointing): LoRA on the language model (+ the vision blocks with `train_vision`), or
full fine-tuning (`model.lora.rank: 0`; the reference is a frozen weight snapshot when `keep_ref`). Every VLM recipe
builds its policy here (vlm_multiturn through `MultiTurnModelConfig.policy()`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from mmrl.vlm.common import load_policy
from mmrl.vlm.config import LM_TARGETS
from mmrl.vlm.families import QWEN_VL, freeze_vision_tower, lora_target_pattern

VISION_LORA_PATTERN = QWEN_VL.vision_lora  # the Qwen-VL vision blocks (each family names its own)


def build_policy(section: Any, device: torch.device, dtype: torch.dtype, keep_ref: bool, *, tiny_seed: int = 0):
    """(PolicyStates, processor) for the `model:` section `section`. `keep_ref`: full fine-tuning keeps a frozen
    reference copy (a KL term needs one); with LoRA the reference is the model with adapters off. `tiny_seed`: the
    seed of a tiny model built at `path` (`build_tiny`)."""
    from mmrl.adapters import PolicyStates

    path = Path(section.path)
    if section.build_tiny and not (path / "config.json").is_file():
        from mmrl import tiny

        builders = {"qwen2_vl": tiny.build_tiny_qwen2_vl, "qwen25_vl": tiny.build_tiny_qwen25_vl,
                    "glm4v": tiny.build_tiny_glm4v, "internvl": tiny.build_tiny_internvl}
        if section.build_tiny not in builders:
            raise ValueError(f"model.build_tiny: expected one of {sorted(builders)}, got {section.build_tiny!r}")
        builders[section.build_tiny](path, seed=tiny_seed)
    model, processor = load_policy(path, device, dtype)
    if section.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    lora = section.lora
    if not lora.enabled:  # full fine-tuning
        if not section.train_vision:
            freeze_vision_tower(model)
        return PolicyStates(model, None, keep_ref_copy=keep_ref), processor
    from peft import LoraConfig

    pattern = lora_target_pattern(model.config, list(lora.target_modules or LM_TARGETS), section.train_vision)
    init: Any = {"true": True, "false": False}.get(str(lora.init).lower(), lora.init)
    peft_config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=pattern, lora_dropout=0.0,
                             init_lora_weights=init, base_model_name_or_path=str(path.resolve()))
    return PolicyStates(model, peft_config), processor


def rl_parameters(states: Any, freeze: Sequence[str], *, freeze_now: bool = True) -> list[torch.Tensor]:
    """The trainable parameters of `states` whose name contains none of `freeze` (what the RL optimizer updates;
    ValueError when none is left). `freeze_now`: the other trainable ones stop requiring grad (DDP registers what
    requires grad when it wraps the model); False for a recipe whose format warm start still trains them (it calls
    again after the warm start)."""
    params = [p for n, p in states.named_trainable_parameters() if not any(f in n for f in freeze)]
    if not params:
        raise ValueError(f"model.freeze={list(freeze)!r} excludes every trainable parameter")
    if freeze_now:
        keep = {id(p) for p in params}
        for p in states.trainable_parameters():
            p.requires_grad_(id(p) in keep)
    return params
