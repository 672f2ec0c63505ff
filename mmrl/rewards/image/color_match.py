"""`prompt_color`: how much of the image is in the colour the prompt names (synthetic-shapes captions).

A programmatic, checkable-by-eye reward for the tiny CPU demos: for "a red circle on a blue background"
with `target="background"` the score is the soft fraction of pixels close to blue. Soft membership
exp(-d^2 / (2 sigma^2)) of the RGB distance d keeps it differentiable; `hard=True` counts pixels within
`sigma` instead (mmrl.pipelines.shapes.color_fraction).
"""

from __future__ import annotations

import torch

from mmrl.pipelines.shapes import COLORS, color_fraction, parse_caption
from mmrl.rewards.base import RewardModel, RewardOutput, register


@register("prompt_color")
class PromptColorReward(RewardModel):
    name = "prompt_color"
    needs_prompts = True
    unit = "fraction of pixels in the prompt's colour"
    score_range = (0.0, 1.0)

    def __init__(self, target: str = "background", sigma: float = 0.25, hard: bool = False,
                 differentiable: bool = True, batch_size: int = 256, device=None):
        if target not in ("background", "shape"):
            raise ValueError(f"prompt_color: target must be 'background' or 'shape', got {target!r}")
        self.target, self.sigma, self.hard = target, float(sigma), bool(hard)
        self.differentiable = bool(differentiable) and not hard
        self.batch_size = batch_size

    def _color_of(self, prompt: str, metadata: dict | None) -> str:
        if metadata and metadata.get("color"):
            return str(metadata["color"])
        try:
            parsed = parse_caption(prompt)
        except ValueError as exc:
            raise ValueError(f"prompt_color: cannot read a colour from prompt {prompt!r} ({exc}); pass metadata "
                             "[{'color': ...}]") from None
        return parsed["background"] if self.target == "background" else parsed["objects"][0][1]

    def score_images(self, images, prompts, metadata):
        colors = [self._color_of(p, None if metadata is None else metadata[i]) for i, p in enumerate(prompts)]
        scores = []
        for img, color in zip(images, colors):
            if color not in COLORS:
                raise ValueError(f"prompt_color: unknown colour {color!r}; known: {sorted(COLORS)}")
            if self.hard:
                scores.append(color_fraction(img[None], color, tol=self.sigma)[0])
            else:
                ref = torch.tensor(COLORS[color], dtype=img.dtype, device=img.device).view(3, 1, 1) / 255.0
                d2 = (img - ref).pow(2).sum(0)
                scores.append(torch.exp(-d2 / (2 * self.sigma ** 2)).mean())
        return RewardOutput(torch.stack(scores).float(), {"color": colors})
