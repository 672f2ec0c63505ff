"""Tiny VideoAlign / VideoReward checkpoint in the authors' layout (KwaiVGI/VideoAlign, checkpoint KlingTeam/VideoReward).

    <path>/model_config.json            data_config, training_args, model_config, peft_lora_config, inference_config
    <path>/checkpoint-<step>/model.pth  the PEFT model's full state dict (`torch.save(model.state_dict())`)
    <path>/checkpoint-<step>/tokenizer/ the tokenizer with the three reward tokens added
    <path>/base/                        the base model as on the Hub (Qwen/Qwen2-VL-2B-Instruct's files: flat
                                        config.json, model.safetensors, preprocessor_config.json, tokenizer)

The real checkpoint has no base/: its model_config.json names `Qwen/Qwen2-VL-2B-Instruct` (downloaded separately);
here `model_name_or_path` is the absolute path of base/ so the authors' own code loads this directory unchanged.
Key names and config.json are those of transformers 4.45.2 (the authors' pin): the vision tower at `visual.*`, the
decoder at `model.*`, LoRA as `<linear>.base_layer` + `lora_A.default` / `lora_B.default`.
# source: KwaiVGI/VideoAlign@219ab9db train_reward.py (create_model_and_processor, find_target_linear_names),
#         trainer.py (Qwen2VLRewardModelBT, VideoVLMRewardTrainer._save), utils.py (load_model_from_checkpoint)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mmrl.tiny.components import _prepare_dir, seed_weights, side_effect_free
from mmrl.tiny.vlm_models import _qwen_text_config, _qwen_token_ids
from mmrl.tiny.vocab import _load_tokenizer

REWARD_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the released checkpoint's output normalisation (KlingTeam/VideoReward model_config.json inference_config, as
# WorldFoundry's VideoAlign spec pins it); the tiny one keeps them so normalisation is exercised with real numbers
REAL_INFERENCE_CONFIG = {"VQ_mean": 3.6757, "VQ_std": 2.2476, "MQ_mean": 1.1646, "MQ_std": 1.3811,
                         "TA_mean": 2.8105, "TA_std": 2.5121}
# source: Qwen/Qwen2-VL-2B-Instruct preprocessor_config.json
BASE_PREPROCESSOR = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "max_pixels": 12845056, "merge_size": 2, "min_pixels": 3136,
    "patch_size": 14, "processor_class": "Qwen2VLProcessor", "resample": 3, "rescale_factor": 0.00392156862745098,
    "temporal_patch_size": 2,
}


def _legacy_name(key: str) -> str:
    """transformers 5 name -> 4.45 name (the layout of the authors' checkpoints)."""
    if key.startswith("model.visual."):
        return key[len("model."):]
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    return key


def _base_config(tok, ids: dict[str, int], text: dict) -> dict:
    """Qwen2-VL config.json in the flat layout of Qwen/Qwen2-VL-2B-Instruct (what transformers 4.45 reads)."""
    rope = text["rope_parameters"]
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
        "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": text["hidden_size"],
        "initializer_range": 0.02, "intermediate_size": text["intermediate_size"],
        "max_position_embeddings": text["max_position_embeddings"], "max_window_layers": 28,
        "num_attention_heads": text["num_attention_heads"], "num_hidden_layers": text["num_hidden_layers"],
        "num_key_value_heads": text["num_key_value_heads"], "rms_norm_eps": text["rms_norm_eps"],
        "rope_theta": rope["rope_theta"], "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
        "sliding_window": 32768, "use_sliding_window": False, "use_cache": True, "tie_word_embeddings": True,
        "torch_dtype": "float32", "vocab_size": len(tok),
        "bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"], "pad_token_id": ids["pad_token_id"],
        "image_token_id": ids["image_token_id"], "video_token_id": ids["video_token_id"],
        "vision_start_token_id": ids["vision_start_token_id"], "vision_end_token_id": ids["vision_end_token_id"],
        "vision_config": {"depth": 2, "embed_dim": 32, "hidden_size": text["hidden_size"], "hidden_act": "quick_gelu",
                          "mlp_ratio": 2, "num_heads": 2, "in_channels": 3, "patch_size": 14,
                          "spatial_merge_size": 2, "temporal_patch_size": 2},
    }


def _model_config(base: Path, lora_r: int, lora_alpha: int) -> dict:
    """model_config.json as train_reward.save_configs_to_json writes it (the fields inference reads, with the
    released checkpoint's values except the base path, dtype float32 and the LoRA rank)."""
    return {
        "data_config": {"meta_data": "/path/to/dataset/meta_data.csv", "data_dir": "/path/to/dataset",
                        "meta_data_test": None, "max_frame_pixels": 200704, "num_frames": None, "fps": 2.0,
                        "p_shuffle_frames": 0.0, "p_color_jitter": 0.0, "eval_dim": ["VQ", "MQ", "TA"],
                        "prompt_template_type": "detailed_special", "add_noise": False, "sample_type": "uniform",
                        "use_tied_data": True},
        "training_args": {"output_dir": "rm_output", "bf16": False, "lora_enable": True},
        "model_config": {"model_name_or_path": str(base), "model_revision": "main", "output_dim": 1,
                         "use_special_tokens": True, "freeze_vision_tower": False, "freeze_llm": False,
                         "tune_merger": True, "torch_dtype": "float32", "trust_remote_code": False,
                         "attn_implementation": None, "load_in_8bit": False, "load_in_4bit": False,
                         "bnb_4bit_quant_type": "nf4", "use_bnb_nested_quant": False, "reward_token": "special",
                         "loss_type": "btt"},
        "peft_lora_config": {"lora_enable": True, "vision_lora": False, "lora_r": lora_r, "lora_alpha": lora_alpha,
                             "lora_dropout": 0.05, "lora_target_modules": None,
                             "lora_namespan_exclude": ["lm_head", "rm_head", "embed_tokens", "visual"],
                             "lora_modules_to_save": None, "lora_task_type": "CAUSAL_LM", "use_rslora": False,
                             "num_lora_modules": -1},
        "inference_config": dict(REAL_INFERENCE_CONFIG),
    }


@side_effect_free
def build_tiny_videoalign(path, seed: int = 0, step: int = 8, lora_r: int = 4, lora_alpha: int = 8) -> Path:
    """A tiny VideoReward checkpoint at ``path`` (layout in the module docstring); returns ``path``.

    Base: the tiny Qwen2-VL of ``build_tiny_qwen2_vl`` (text hidden 64, 2 layers; vision depth 2), embeddings tied
    as in Qwen2-VL-2B, the real 2B preprocessor settings. Reward model: embeddings resized by the three reward
    tokens, LoRA (rank ``lora_r``) on every decoder linear, ``rm_head`` Linear(64, 1, bias=False); LoRA B is random
    (not PEFT's zeros) so loading that ignored LoRA would change the scores."""
    from safetensors.torch import save_file
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    path = _prepare_dir(path)
    base = path / "base"
    base.mkdir(exist_ok=True)
    tok = _load_tokenizer("qwen")
    ids = _qwen_token_ids(tok)
    text = _qwen_text_config(tok, ids)
    config = _base_config(tok, ids, text)
    seed_weights(seed)
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(**json.loads(json.dumps(config)))).eval()  # a copy: the
    # config class rewrites rope_scaling in place, and config.json must stay in the 4.45 layout
    state = {_legacy_name(k): v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    state.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight (Qwen2-VL-2B ships it that way)
    save_file(state, str(base / "model.safetensors"), metadata={"format": "pt"})
    (base / "config.json").write_text(json.dumps(config, indent=2))
    (base / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["bos_token_id"], "eos_token_id": [ids["eos_token_id"], ids["pad_token_id"]],
         "pad_token_id": ids["pad_token_id"]}, indent=2))
    (base / "preprocessor_config.json").write_text(json.dumps(BASE_PREPROCESSOR, indent=2))
    (base / "chat_template.json").write_text(json.dumps({"chat_template": tok.chat_template}, indent=2))
    tok.save_pretrained(base)

    # the reward model: what create_model_and_processor + get_peft_model build, then torch.save(state_dict())
    g = torch.Generator().manual_seed(seed + 1)
    tok.add_special_tokens({"additional_special_tokens": list(REWARD_TOKENS)})
    embed = state["model.embed_tokens.weight"]
    embed = torch.cat([embed, 0.02 * torch.randn(len(tok) - embed.shape[0], embed.shape[1], generator=g)])
    state["model.embed_tokens.weight"] = state["lm_head.weight"] = embed
    state["rm_head.weight"] = torch.randn(1, text["hidden_size"], generator=g) / text["hidden_size"] ** 0.5
    peft: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        if key.startswith("model.layers.") and module.rpartition(".")[2] in LORA_TARGETS:
            peft[f"base_model.model.{module}.base_layer.{leaf}"] = value
            if leaf == "weight":
                out_dim, in_dim = value.shape
                peft[f"base_model.model.{module}.lora_A.default.weight"] = torch.randn(lora_r, in_dim, generator=g) / in_dim ** 0.5
                peft[f"base_model.model.{module}.lora_B.default.weight"] = 0.05 * torch.randn(out_dim, lora_r, generator=g)
        else:
            peft[f"base_model.model.{key}"] = value
    ckpt = path / f"checkpoint-{int(step)}"
    ckpt.mkdir(exist_ok=True)
    torch.save(peft, ckpt / "model.pth")
    tok.save_pretrained(ckpt / "tokenizer")
    (path / "model_config.json").write_text(json.dumps(_model_config(base.resolve(), lora_r, lora_alpha), indent=4))
    return path
