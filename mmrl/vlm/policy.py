"""Load a Qwen-VL policy as `PolicyStates` from a `model:` section (path, build_tiny, lora, train_vision,
gradient_checkpointing): LoRA on the language model (+ the vision blocks with `train_vision`), or full
fine-tuning (`model.lora.rank: 0`; the reference is a frozen weight snapshot when `keep_ref`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from mmrl.training import LoRAConfig
from mmrl.vlm.common import load_policy

LM_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VISION_LORA_PATTERN = r".*visual\.blocks.*\.(qkv|proj|fc1|fc2|gate_proj|up_proj|down_proj)"


@dataclass
class VLMLoRAConfig(LoRAConfig):
    rank: int = 64
    """LoRA rank r on the language model; 0 = full fine-tuning (ref = a weight snapshot, +1x memory)."""
    alpha: int = 64
    """LoRA alpha (scale alpha / rank)."""
    target_modules: list[str] = field(default_factory=lambda: list(LM_TARGETS))
    """Language-model linear layers that get LoRA (matched by name under the language model only)."""



def build_policy(m: Any, device: torch.device, dtype: torch.dtype, keep_ref: bool):
    """(PolicyStates, processor) for the `model:` section `m`. `keep_ref`: full fine-tuning keeps a frozen
    reference copy (a KL term needs one); with LoRA the reference is the model with adapters off."""
    from mmrl.adapters import PolicyStates

    path = Path(m.path)
    if m.build_tiny and not (path / "config.json").is_file():
        from mmrl import tiny

        builders = {"qwen2_vl": tiny.build_tiny_qwen2_vl, "qwen25_vl": tiny.build_tiny_qwen25_vl}
        if m.build_tiny not in builders:
            raise ValueError(f"model.build_tiny: expected one of {sorted(builders)}, got {m.build_tiny!r}")
        builders[m.build_tiny](path, seed=0)
    model, processor = load_policy(path, device, dtype)
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if not m.lora.enabled:  # full fine-tuning
        if not m.train_vision:
            for n, p in model.named_parameters():
                if ".visual." in f".{n}":
                    p.requires_grad_(False)
        return PolicyStates(model, None, keep_ref_copy=keep_ref), processor
    from peft import LoraConfig

    pattern = rf".*language_model.*\.({'|'.join(m.lora.target_modules or LM_TARGETS)})"
    if m.train_vision:
        pattern += "|" + VISION_LORA_PATTERN
    init: Any = {"true": True, "false": False}.get(str(m.lora.init).lower(), m.lora.init)
    lora = LoraConfig(r=m.lora.rank, lora_alpha=m.lora.alpha, target_modules=pattern, lora_dropout=0.0,
                      init_lora_weights=init, base_model_name_or_path=str(path.resolve()))
    return PolicyStates(model, lora), processor


def rl_parameters(states: Any, freeze: Sequence[str]) -> list[torch.Tensor]:
    """The trainable parameters of `states` whose name contains none of `freeze` (what the RL optimizer updates);
    the other trainable ones stop requiring grad (DDP registers what requires grad when it wraps the model)."""
    params = [p for n, p in states.named_trainable_parameters() if not any(f in n for f in freeze)]
    keep = {id(p) for p in params}
    for p in states.trainable_parameters():
        p.requires_grad_(id(p) in keep)
    return params
