"""CLIPScore: cosine similarity of CLIP image and text embeddings (transformers `CLIPModel`).

`scale="100"`: 100 * max(cos, 0)  # source: torchmetrics.multimodal.CLIPScore (default openai/clip-vit-large-patch14)
`scale="2.5"`: 2.5 * max(cos, 0)  # source: Hessel et al. 2021, "CLIPScore" (w = 2.5, ViT-B/32)
`scale="raw"`: cos (in [-1, 1]); also accepted: "cosine", 1.
Weights: a local CLIP directory in Hugging Face format, e.g. `openai/clip-vit-large-patch14`.
"""

from __future__ import annotations

from typing import Any

from mmrl.rewards.base import RewardOutput, register
from mmrl.rewards.image._common import HFClip, TorchImageReward, check_prompts

SCALES = {"100": 100.0, "2.5": 2.5, "raw": None}


def _parse_scale(scale: Any) -> str:
    key = str(scale).strip().lower()
    if key in ("cosine", "1", "1.0", "none"):
        key = "raw"
    if key in ("100.0",):
        key = "100"
    if key not in SCALES:
        raise ValueError(f"clip_score: unknown scale {scale!r}; valid: '100' (torchmetrics), '2.5' (Hessel et al.), 'raw'")
    return key


@register("clip_score")
class ClipScore(TorchImageReward):
    name = "clip_score"
    needs_prompts = True

    def __init__(self, weights: Any = None, processor: Any = None, *, scale: Any = "100", batch_size: int = 32,
                 device: Any = None, dtype: Any = "float32", differentiable: bool = False):
        super().__init__(batch_size, device, dtype, differentiable)
        self.clip = HFClip.from_paths(weights, processor, "clip_score")
        self.scale = _parse_scale(scale)
        self._freeze()

    def modules(self):
        return [self.clip.model]

    def _score(self, x, prompts, metadata):
        prompts = check_prompts(prompts, self.name)
        cos = (self.clip.image_embeds(x) * self.clip.text_embeds(prompts, x.device)).sum(-1)
        w = SCALES[self.scale]
        scores = cos if w is None else w * cos.clamp(min=0.0)
        return RewardOutput(scores.float(), {"cosine": cos.detach().float()})
