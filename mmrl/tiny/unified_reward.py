"""Tiny UnifiedReward judges: a tiny Qwen2.5-VL (or Qwen3-VL) saved as UnifiedReward's checkpoints are
(CodeGoat24/UnifiedReward-qwen-7b, UnifiedReward-2.0-qwen3vl-8b are plain Hugging Face directories: config.json,
safetensors, processor and tokenizer files), with the generation_config.json of the base Instruct model the
fine-tunes keep (Qwen2.5-VL: sampling with top_k 1, repetition_penalty 1.05, the settings the authors'
`model.generate` call runs with, so the local judge's greedy decoding is checked against them; Qwen3-VL: temperature
0.7, top_p 0.8, top_k 20, what their vLLM server samples with).
"""

from __future__ import annotations

import json
from pathlib import Path

from mmrl.tiny.vlm_models import build_tiny_qwen3_vl, build_tiny_qwen25_vl

# source: Qwen2.5-VL-7B-Instruct generation_config.json (kept by its fine-tunes): do_sample with top_k 1 = argmax
INSTRUCT_GENERATION = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.1, "top_k": 1, "top_p": 0.001}
# source: Qwen3-VL-4B-Instruct generation_config.json (as copied into fine-tunes on the hub)
QWEN3_INSTRUCT_GENERATION = {"do_sample": True, "repetition_penalty": 1.0, "temperature": 0.7, "top_k": 20,
                             "top_p": 0.8}


def _instruct_generation(path, settings: dict) -> Path:
    gen_file = Path(path) / "generation_config.json"
    gen = json.loads(gen_file.read_text())
    gen.pop("_from_model_config", None)  # a hand-written file, as the released ones
    gen.update(settings)
    gen_file.write_text(json.dumps(gen, indent=2) + "\n")
    return Path(path)


def build_tiny_unified_reward(path, seed: int = 0) -> Path:
    """`build_tiny_qwen25_vl(path, seed)` with Qwen2.5-VL-Instruct's generation settings in generation_config.json."""
    return _instruct_generation(build_tiny_qwen25_vl(path, seed=seed), INSTRUCT_GENERATION)


def build_tiny_unified_reward_qwen3vl(path, seed: int = 0, head_dim: int = 16) -> Path:
    """`build_tiny_qwen3_vl(path, seed, head_dim)` with Qwen3-VL-Instruct's generation settings (head_dim 32 or more
    for vLLM's CPU backend)."""
    return _instruct_generation(build_tiny_qwen3_vl(path, seed=seed, head_dim=head_dim), QWEN3_INSTRUCT_GENERATION)
