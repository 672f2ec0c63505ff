"""PickScore (Kirstain et al. 2023): a CLIP-H/14 fine-tuned on Pick-a-Pic preferences.

score = logit_scale.exp() * cos(image_emb, text_emb)  (about 17-24 for real images; logit_scale.exp() = 100
for the released model). `scale_by_26=True` divides by 26 as Flow-GRPO does so scores sit near [0, 1].
# source: PickScore README inference snippet; flow_grpo/pickscore_scorer.py (scores / 26)

Weights: a local copy of `yuvalkirstain/PickScore_v1` (transformers `CLIPModel`). That repository has no
tokenizer/preprocessor files; they come from `laion/CLIP-ViT-H-14-laion2B-s32B-b79K`: pass its local
directory as `processor=` (defaults to the weights directory).
"""

from __future__ import annotations

from typing import Any

from mmrl.rewards.base import RewardOutput, register
from mmrl.rewards.image._common import HFClip, TorchImageReward, check_prompts, require_path


@register("pickscore")
class PickScore(TorchImageReward):
    name = "pickscore"
    needs_prompts = True

    def __init__(self, weights: Any = None, processor: Any = None, *, scale_by_26: bool = False,
                 batch_size: int = 16, device: Any = None, dtype: Any = "float32", differentiable: bool = False):
        super().__init__(batch_size, device, dtype, differentiable)
        model_dir = require_path(weights, "pickscore", "'yuvalkirstain/PickScore_v1'", kind="dir")
        proc_dir = model_dir if processor is None else require_path(
            processor, "pickscore processor", "'laion/CLIP-ViT-H-14-laion2B-s32B-b79K'", kind="dir")
        self.clip = HFClip(model_dir, proc_dir, "pickscore", "'laion/CLIP-ViT-H-14-laion2B-s32B-b79K'")
        self.scale_by_26 = bool(scale_by_26)
        self._freeze()

    def modules(self):
        return [self.clip.model]

    def _score(self, x, prompts, metadata):
        prompts = check_prompts(prompts, self.name)
        img = self.clip.image_embeds(x)
        txt = self.clip.text_embeds(prompts, x.device)
        cos = (img * txt).sum(-1)
        scores = self.clip.model.logit_scale.exp() * cos
        if self.scale_by_26:
            scores = scores / 26.0
        return RewardOutput(scores.float(), {"cosine": cos.detach().float()})
