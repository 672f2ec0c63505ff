"""Tiny UnifiedReward judge: a tiny Qwen2.5-VL saved as UnifiedReward's checkpoints are (CodeGoat24/UnifiedReward-
qwen-7b is a plain Qwen2.5-VL directory: config.json, safetensors, processor and tokenizer files), with the
generation_config.json of Qwen2.5-VL-Instruct fine-tunes (sampling with top_k 1, repetition_penalty 1.05): the
settings the authors' `model.generate` call runs with, so the local judge's greedy decoding is checked against them.
"""

from __future__ import annotations

import json
from pathlib import Path

from mmrl.tiny.vlm_models import build_tiny_qwen25_vl

# source: Qwen2.5-VL-7B-Instruct generation_config.json (kept by its fine-tunes): do_sample with top_k 1 = argmax
INSTRUCT_GENERATION = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.1, "top_k": 1, "top_p": 0.001}


def build_tiny_unified_reward(path, seed: int = 0) -> Path:
    """`build_tiny_qwen25_vl(path, seed)` with Qwen2.5-VL-Instruct's generation settings in generation_config.json."""
    path = build_tiny_qwen25_vl(path, seed=seed)
    gen_file = Path(path) / "generation_config.json"
    gen = json.loads(gen_file.read_text())
    gen.pop("_from_model_config", None)  # a hand-written file, as the released ones
    gen.update(INSTRUCT_GENERATION)
    gen_file.write_text(json.dumps(gen, indent=2) + "\n")
    return Path(path)
