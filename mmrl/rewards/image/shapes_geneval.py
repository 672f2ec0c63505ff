"""`shapes_geneval`: the GenEval-style check of the synthetic shapes world (`mmrl.pipelines.shapes_check`) as a reward.

Per image, the offline detector reads the background and the shapes, and the prompt's checks (object, colour,
count, position, background; GenEval's task types) are answered True/False. Score:

    mode="fraction" (default): share of the checks the prompt asks that pass, in [0, 1] (a graded score: a judge
                               needs a spread to estimate its noise from);
    mode="correct":            1 if every asked check passes (GenEval's per-image score), else 0.

A flat shape on a flat background scores 1; a busy texture loses the background and colour checks. The
detector is exact on rendered scenes and needs no model (see mmrl/pipelines/shapes_check.py for its rules). A prompt
outside the shapes grammar raises ValueError naming it. Made as a judge for the tiny world (`log.judges`).
"""

from __future__ import annotations

from typing import Any

import torch

from mmrl.rewards.base import RewardModel, RewardOutput, register

_CHECKS = ("object", "color", "count", "position", "background")


@register("shapes_geneval")
class ShapesGenEval(RewardModel):
    name = "shapes_geneval"
    unit = "share of the prompt's checks passed"
    score_range = (0.0, 1.0)
    needs_prompts = True

    def __init__(self, mode: str = "fraction", tol: float = 0.3, min_area: float = 0.004, batch_size: int = 64,
                 device: Any = None):
        if mode not in ("fraction", "correct"):
            raise ValueError(f"shapes_geneval: mode must be 'fraction' or 'correct', got {mode!r}")
        self.mode, self.tol, self.min_area, self.batch_size = mode, float(tol), float(min_area), batch_size

    def score_images(self, images, prompts, metadata):
        from mmrl.pipelines.shapes_check import check_images

        results = check_images(list(images.unbind(0)), prompts, tol=self.tol, min_area=self.min_area)
        scores = []
        for prompt, res in zip(prompts, results):
            if res is None:
                raise ValueError(f"shapes_geneval: prompt {prompt!r} is not in the shapes grammar "
                                 "(e.g. 'a red circle on a blue background')")
            asked = [res["checks"][c] for c in _CHECKS if res["checks"][c] is not None]
            scores.append(float(res["checks"]["correct"]) if self.mode == "correct" else sum(asked) / len(asked))
        return RewardOutput(torch.tensor(scores, dtype=torch.float32),
                            {"correct": torch.tensor([float(r["checks"]["correct"]) for r in results])})
