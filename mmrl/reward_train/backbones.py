"""The reward models `reward_bt` trains, each one a zoo reward whose weights are made trainable: training scores a
pair with the zoo's own `reward(images=..., prompts=...)`, so the exported model scores exactly as it trained.

- `clip` (PickScore / HPS style): the zoo's `pickscore`, score = logit_scale.exp() * cos(text, image) of a
  transformers CLIPModel directory (a CLIP, or PickScore_v1 to go on from it); LoRA on the attention projections of
  both towers, or every weight (PickScore fine-tunes the whole CLIP);
- `vlm_head`: the zoo's `hpsv3` (a Qwen2-VL with a `<|Reward|>` token and an MLP head on its last hidden state,
  `mmrl.rewards.vlm_head`); the score is the head's first output (mu); LoRA on the decoder's attention and on the
  head's Linear layers, or every weight.

`export(dir)` writes the trained model in the zoo's format with LoRA merged, and `mmrl_reward.json`, which the zoo
entry `learned_pref` (`mmrl.rewards.learned`) reads: `mmrl.rewards.load("learned_pref", weights=dir)`.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

from torch import nn

from mmrl.rewards.learned import SPEC_FILE

# LoRA targets when `model.lora.target_modules` is empty
CLIP_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
QWEN_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


class Backbone:
    """A zoo reward made trainable: `reward` (scores through its own __call__, with gradients to its weights: it is
    loaded `differentiable`), `module` (the nn.Module whose weights train: what `PolicyStates` wraps), `export`."""

    reward_name = ""
    reward: Any
    module: nn.Module

    def lora_targets(self) -> list[str]:
        raise NotImplementedError

    def export(self, out: Path) -> dict:
        """Write the merged model into `out`; returns the `mmrl_reward.json` record (reward name, weights, kwargs)."""
        raise NotImplementedError


def merged_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` with its LoRA layers (adapter "default") merged into plain layers: W + scale * B @ A
    (peft's merge); the live module is left as it is. Without LoRA layers: a plain copy."""
    from peft.tuners.lora import LoraLayer

    out = copy.deepcopy(module)
    for name, mod in list(out.named_modules()):
        if isinstance(mod, LoraLayer):
            mod.merge(adapter_names=["default"])
            parent_name, _, child = name.rpartition(".")
            setattr(out.get_submodule(parent_name) if parent_name else out, child, mod.get_base_layer())
    left = [n for n, _ in out.named_parameters() if "lora_" in n]
    if left:  # pragma: no cover - peft changed its layout
        raise RuntimeError(f"reward_bt export: LoRA weights left after merging: {left[:3]}")
    return out


class ClipBackbone(Backbone):
    reward_name = "pickscore"

    def __init__(self, path: str, processor: str, device: Any, batch_size: int, kwargs: dict):
        from mmrl.rewards.image.pickscore import PickScore

        self.path, self.processor, self.kwargs = Path(path), Path(processor or path), dict(kwargs)
        self.reward = PickScore(weights=path, processor=processor or None, device=device, dtype="float32",
                                batch_size=batch_size, differentiable=True, **self.kwargs)
        self.module = self.reward.clip.model

    def lora_targets(self) -> list[str]:
        return CLIP_LORA_TARGETS

    def export(self, out: Path) -> dict:
        merged_copy(self.module).save_pretrained(str(out), safe_serialization=True)
        self.reward.clip.tokenizer.save_pretrained(str(out))
        for name in ("preprocessor_config.json", "processor_config.json"):  # the image geometry HFClip reads
            if (self.processor / name).is_file():
                shutil.copy(self.processor / name, out / name)
        return {"reward": self.reward_name, "weights": ".", "kwargs": self.kwargs}


class VLMHeadBackbone(Backbone):
    reward_name = "hpsv3"
    checkpoint_name = "HPSv3.safetensors"

    def __init__(self, path: str, processor: str, device: Any, dtype: str, batch_size: int, kwargs: dict):
        from mmrl.rewards.image.hpsv3 import HPSv3

        self.base, self.dtype, self.kwargs = Path(processor).resolve(), dtype, dict(kwargs)
        self.reward = HPSv3(weights=path, processor=processor, device=device, dtype=dtype, batch_size=batch_size,
                            **self.kwargs)
        self.reward.differentiable = True  # gradients reach the weights made trainable below
        bb = self.reward.backbone
        self.module = nn.ModuleDict({"model": bb.model, "rm_head": bb.heads["rm_head."]})

    def lora_targets(self) -> list[str]:
        heads = [f"rm_head.{n}" for n, m in self.module["rm_head"].named_modules() if isinstance(m, nn.Linear)]
        return QWEN_LORA_TARGETS + heads

    def export(self, out: Path) -> dict:
        from safetensors.torch import save_file

        merged = merged_copy(self.module)
        state = {k: v.contiguous() for k, v in merged["model"].state_dict().items()}
        state.update({f"rm_head.{k}": v.float().contiguous() for k, v in merged["rm_head"].state_dict().items()})
        save_file(state, str(out / self.checkpoint_name), metadata={"format": "pt"})
        return {"reward": self.reward_name, "weights": self.checkpoint_name,
                "kwargs": {"processor": str(self.base), "dtype": self.dtype, **self.kwargs}}


def build_backbone(model_cfg: Any, device: Any, dtype: str, batch_size: int) -> Backbone:
    """The backbone `model.backbone` names, loaded from `model.path` (and `model.processor`)."""
    if model_cfg.backbone == "clip":
        return ClipBackbone(model_cfg.path, model_cfg.processor, device, batch_size, model_cfg.kwargs)
    return VLMHeadBackbone(model_cfg.path, model_cfg.processor, device, dtype, batch_size, model_cfg.kwargs)


def write_export(backbone: Backbone, out: Path, info: dict) -> Path:
    """`out/`: the merged model in the zoo's format + mmrl_reward.json (what `learned_pref` loads, and `info`:
    the run, its pairs, its held-out accuracy). Written into a temporary folder, then renamed: never half-written."""
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    record = backbone.export(tmp) | info
    (tmp / SPEC_FILE).write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
