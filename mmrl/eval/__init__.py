"""Evaluation: `run_eval` (the `mmrl eval` command: a diffusion policy on held-out prompts, every configured
reward, a JSON report and a grid) and the offline GenEval-style check of the synthetic shapes world."""

from mmrl.eval.harness import apply_checkpoint, prompt_seed, resolve_checkpoint, reward_stats, run_eval  # noqa: F401
from mmrl.pipelines.shapes_check import (  # noqa: F401
    CHECKS, RELATIONS, DetectedObject, Detection, ObjectSpec, ShapesPrompt, accuracy, check_images, check_prompt,
    detect_shapes, parse_shapes_prompt,
)
