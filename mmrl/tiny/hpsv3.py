"""Tiny HPSv3 and EditReward checkpoints in their authors' formats, with a tiny Qwen-VL base directory in the
Hugging Face hub layout of the base models they name.

What a user downloads, and what these builders write at the same paths:

- HPSv3 (MizzenAI/HPSv3, `hpsv3` 1.0.0): one file `HPSv3.safetensors`, the full state dict of
  `Qwen2VLRewardModelBT` as transformers 4.45 names it (`visual.*`, `model.*`, `lm_head.weight`, `rm_head.*`),
  the embeddings resized to the tokenizer plus the added `<|Reward|>` token; plus the base `Qwen/Qwen2-VL-7B-Instruct`
  directory (config.json, preprocessor_config.json, tokenizer files, chat_template.json).
- EditReward (TIGER-AI-Lab/EditReward): a directory holding `model.safetensors`, the full state dict of
  `Qwen2_5_VLRewardModelBT_MultiHead` as transformers 4.57 names it (`model.visual.*`, `model.language_model.*`,
  `lm_head.weight`, `rm_heads.head_0.*`, `rm_heads.head_1.*`); plus the base `Qwen/Qwen2.5-VL-7B-Instruct` directory.

The base directory is written in the hub's (transformers 4.x) layout, flat config.json and all, so the authors'
own code (transformers 4.45 / 4.57) and mmrl (transformers 5) both read the same files; it carries base weights
too because the authors' code builds its model with `from_pretrained(base)` before loading the reward checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from mmrl.tiny.components import _prepare_dir, seed_weights, side_effect_free
from mmrl.tiny.vlm_models import _qwen_text_config, _qwen_token_ids
from mmrl.tiny.vocab import ASSETS_DIR, QWEN_CHAT_TEMPLATE, _load_tokenizer

REWARD_TOKEN = "<|Reward|>"  # source: hpsv3/train.py create_model_and_processor (also EditReward's)
# source: Qwen/Qwen2-VL-7B-Instruct and Qwen/Qwen2.5-VL-7B-Instruct preprocessor_config.json
HUB_MIN_PIXELS, HUB_MAX_PIXELS = 3136, 12845056
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _ranknet_head(hidden: int, out: int, prefix: str) -> dict[str, torch.Tensor]:
    """The authors' default head (rm_head_kwargs None): Linear(hidden, 1024), ReLU, Dropout(0.05), Linear(1024, 16),
    ReLU, Linear(16, out), keyed by Sequential index. source: hpsv3/model/qwen2vl_trainer.py Qwen2VLRewardModelBT"""
    head = torch.nn.Sequential(torch.nn.Linear(hidden, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.05),
                               torch.nn.Linear(1024, 16), torch.nn.ReLU(), torch.nn.Linear(16, out))
    return {f"{prefix}{k}": v.float().contiguous() for k, v in head.state_dict().items()}


def _write_tokenizer(path: Path) -> None:
    """tokenizer.json + a transformers-4.x tokenizer_config.json (added_tokens_decoder, additional_special_tokens,
    chat_template) as the Qwen hub repositories ship them."""
    shutil.copy(ASSETS_DIR / "qwen" / "tokenizer.json", path / "tokenizer.json")
    added = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    decoder = {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
               for t in added}
    specials = [t["content"] for t in added if t["special"] and t["content"] != "<|endoftext|>"]
    cfg = {"add_prefix_space": False, "added_tokens_decoder": decoder, "additional_special_tokens": specials,
           "bos_token": None, "chat_template": QWEN_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
           "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 32768, "pad_token": "<|endoftext|>",
           "padding_side": "left", "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
           "unk_token": None}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_CHAT_TEMPLATE}, indent=2))


def _hub_config(family: str, tok) -> dict:
    """Flat config.json of the hub's Qwen2-VL / Qwen2.5-VL-7B-Instruct with the tiny sizes of mmrl.tiny.vlm_models."""
    ids = _qwen_token_ids(tok)
    text = _qwen_text_config(tok, ids)
    rope = text.pop("rope_parameters")
    cfg = {k: v for k, v in text.items()}
    cfg.update(rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]},
               attention_dropout=0.0, initializer_range=0.02, max_window_layers=2, sliding_window=4096,
               use_sliding_window=False, tie_word_embeddings=False, torch_dtype="float32", use_cache=True,
               image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
               vision_start_token_id=ids["vision_start_token_id"], vision_end_token_id=ids["vision_end_token_id"],
               vision_token_id=tok.convert_tokens_to_ids("<|vision_pad|>"))
    if family == "qwen2_vl":
        cfg.update(architectures=["Qwen2VLForConditionalGeneration"], model_type="qwen2_vl",
                   vision_config=dict(depth=2, embed_dim=32, hidden_size=cfg["hidden_size"], num_heads=2, mlp_ratio=2,
                                      in_chans=3, in_channels=3, patch_size=14, spatial_merge_size=2,
                                      temporal_patch_size=2, hidden_act="quick_gelu"))
    else:
        cfg.update(architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl",
                   vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_chans=3,
                                      in_channels=3, out_hidden_size=cfg["hidden_size"], patch_size=14,
                                      spatial_merge_size=2, spatial_patch_size=14, temporal_patch_size=2,
                                      window_size=112, fullatt_block_indexes=[1], tokens_per_second=2,
                                      hidden_act="silu"))
    return cfg


def _write_base(path: Path, family: str, seed: int) -> tuple[dict[str, torch.Tensor], int]:
    """The hub-layout base directory at `path`; returns (its weights keyed as transformers 5 names them, the
    tokenizer's length)."""
    from transformers import (
        AutoConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
    )

    path.mkdir(parents=True, exist_ok=True)
    tok = _load_tokenizer("qwen")
    (path / "config.json").write_text(json.dumps(_hub_config(family, tok), indent=2))
    _write_tokenizer(path)
    processor = "Qwen2VLProcessor" if family == "qwen2_vl" else "Qwen2_5_VLProcessor"
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": HUB_MIN_PIXELS, "max_pixels": HUB_MAX_PIXELS, "patch_size": 14, "temporal_patch_size": 2,
         "merge_size": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
         "image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor}, indent=2))
    cls = Qwen2VLForConditionalGeneration if family == "qwen2_vl" else Qwen2_5_VLForConditionalGeneration
    seed_weights(seed)
    model = cls(AutoConfig.from_pretrained(str(path))).eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    return state, len(tok)


def _legacy_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 / 4.57 names -> transformers 4.45 names (`model.visual.` -> `visual.`,
    `model.language_model.` -> `model.`)."""
    out = {}
    for k, v in state.items():
        if k.startswith("model.visual."):
            k = k[len("model."):]
        elif k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model."):]
        out[k] = v
    return out


def _add_reward_token_rows(state: dict[str, torch.Tensor], n_tokens: int) -> dict[str, torch.Tensor]:
    """Embedding and lm_head grown to the tokenizer plus `<|Reward|>` (the authors' resize_token_embeddings)."""
    state = dict(state)
    for key in ("model.language_model.embed_tokens.weight", "lm_head.weight"):
        w = state[key]
        assert w.shape[0] == n_tokens, (key, w.shape, n_tokens)
        state[key] = torch.cat([w, torch.randn(1, w.shape[1]) * 0.02]).contiguous()
    return state


@side_effect_free
def build_tiny_hpsv3(path, seed: int = 0) -> Path:
    """Tiny HPSv3 at ``path``: ``HPSv3.safetensors`` (authors' layout, head output [mu, log sigma]) and ``base/``
    (a tiny Qwen2-VL in the hub layout of Qwen/Qwen2-VL-7B-Instruct). Load it with
    ``load("hpsv3", weights=path / "HPSv3.safetensors", processor=path / "base")``."""
    from safetensors.torch import save_file

    path = _prepare_dir(path)
    state, n_tokens = _write_base(path / "base", "qwen2_vl", seed)
    save_file(_legacy_keys(state), str(path / "base" / "model.safetensors"), metadata={"format": "pt"})
    reward = _legacy_keys(_add_reward_token_rows(state, n_tokens))
    reward.update(_ranknet_head(state["lm_head.weight"].shape[1], 2, "rm_head."))
    save_file(reward, str(path / "HPSv3.safetensors"), metadata={"format": "pt"})
    return path


@side_effect_free
def build_tiny_edit_reward(path, seed: int = 0) -> Path:
    """Tiny EditReward (Qwen2.5-VL variant) at ``path``: ``checkpoint/model.safetensors`` (authors' layout, two heads:
    instruction following, visual quality; each [mu, log sigma]) and ``base/`` (a tiny Qwen2.5-VL in the hub layout
    of Qwen/Qwen2.5-VL-7B-Instruct). Load it with
    ``load("edit_reward", weights=path / "checkpoint", processor=path / "base")``."""
    from safetensors.torch import save_file

    path = _prepare_dir(path)
    state, n_tokens = _write_base(path / "base", "qwen2_5_vl", seed)
    save_file(state, str(path / "base" / "model.safetensors"), metadata={"format": "pt"})
    reward = _add_reward_token_rows(state, n_tokens)
    hidden = state["lm_head.weight"].shape[1]
    for i in range(2):
        reward.update(_ranknet_head(hidden, 2, f"rm_heads.head_{i}."))
    (path / "checkpoint").mkdir(exist_ok=True)
    save_file(reward, str(path / "checkpoint" / "model.safetensors"), metadata={"format": "pt"})
    return path
