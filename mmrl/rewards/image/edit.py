"""Rewards for image editing: the edited image is scored against its source (and instruction).

Every edit reward reads the source image from each sample's metadata, as the edit data rows carry it
(`mmrl.pipelines.edits`): `metadata[i]["source_image"]` (a path, bytes, PIL image, array or float CHW tensor in
[0, 1]) and optionally `metadata[i]["mask"]` (white = the region the edit may change). Standalone use:

    from mmrl.rewards import load
    keep = load("edit_preservation")                      # pixels outside the mask unchanged
    keep(edited, metadata=[{"source_image": "src.png", "mask": "mask.png"}])
    follow = load("clip_direction", weights="/models/clip-vit-large-patch14")
    follow(edited, prompts, metadata=[{"source_image": ..., "source_caption": ..., "target_caption": ...}])

- `edit_preservation`: similarity to the source outside the mask (everywhere without one). `metric="l1"`:
  1 - mean |edited - source| (in [0, 1]); `"mse"`: 1 - mean (edited - source)^2; `"clip"`: cosine of CLIP image
  embeddings (`weights=` a CLIP directory) of the two images with the edit region filled with grey in both, so
  only what should be kept is compared.
- `clip_direction`: the directional CLIP similarity of InstructPix2Pix / StyleGAN-NADA, cos(E_img(edited) -
  E_img(source), E_txt(target_caption) - E_txt(source_caption)); needs both captions in the metadata.
- `edit_region_color`: instruction following on the synthetic shapes edits ("make the circle red"): the soft
  fraction of the mask's pixels close to the target colour (`metadata["target_color"]`, else the instruction's
  last word); checkable by eye, used by the CPU edit demo.
- `vlm_edit_judge` (in `mmrl.rewards.vlm_judge`): a VLM judge shown the source and the edited image.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from mmrl.pipelines.shapes import COLORS
from mmrl.rewards.base import RewardModel, RewardOutput, register, to_image_list
from mmrl.rewards.image._common import HFClip, TorchImageReward

__all__ = ["EditPreservation", "ClipDirection", "EditRegionColor", "source_and_mask", "source_images"]


def source_images(metadata: Sequence[dict] | None, name: str) -> list:
    """`metadata[i]["source_image"]` of every sample, as given; ValueError naming the key when one is missing."""
    if metadata is None or any(not m or m.get("source_image") is None for m in metadata):
        raise ValueError(f"reward '{name}' compares an edit with its source: pass metadata=[{{'source_image': ...}}] "
                         f"(a path, bytes, PIL image or [3, H, W] tensor) for every image")
    return [m["source_image"] for m in metadata]


def source_and_mask(metadata: Sequence[dict] | None, like: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(sources [B, 3, H, W], keep masks [B, 1, H, W] with 1 = must be preserved) for the edited images `like`,
    sources resized (bilinear, antialiased) and masks (nearest) to their size."""
    from mmrl.pipelines.images import load_image

    b, _, h, w = like.shape
    sources, keep = [], torch.ones(b, 1, h, w, device=like.device)
    for i, (m, src) in enumerate(zip(metadata, source_images(metadata, name))):
        if not isinstance(src, torch.Tensor):
            src = to_image_list([src])[0]
        src = src.float().to(like.device)
        if src.dim() == 4:
            src = src[0]
        if tuple(src.shape[-2:]) != (h, w):
            src = F.interpolate(src[None], size=(h, w), mode="bilinear", antialias=True, align_corners=False)[0]
        sources.append(src[:3])
        if m.get("mask") is not None:
            mask = m["mask"]
            if isinstance(mask, torch.Tensor):
                gray = mask.float().reshape(-1, *mask.shape[-2:])[:1]
            else:
                import numpy as np

                gray = torch.from_numpy(np.asarray(load_image(mask).convert("L"), dtype="float32") / 255.0)[None]
            gray = F.interpolate(gray[None].to(like.device), size=(h, w), mode="nearest")[0]
            keep[i] = (gray <= 0.5).float()
    return torch.stack(sources), keep


def _masked_mean(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Mean of x [B, C, H, W] over the pixels where weight [B, 1, H, W] is 1 (0 where the weight is all 0)."""
    num = (x * weight).sum(dim=(1, 2, 3))
    den = weight.sum(dim=(1, 2, 3)) * x.shape[1]
    return torch.where(den > 0, num / den.clamp(min=1), torch.zeros_like(num))


@register("edit_preservation")
class EditPreservation(TorchImageReward):
    """Preservation: the edited image's similarity to its source outside the edit mask (1 = unchanged)."""

    name = "edit_preservation"

    def __init__(self, metric: str = "l1", weights: Any = None, processor: Any = None, batch_size: int = 32,
                 device: Any = None, dtype: Any = "float32"):
        if metric not in ("l1", "mse", "clip"):
            raise ValueError(f"edit_preservation: metric must be 'l1', 'mse' or 'clip', got {metric!r}")
        super().__init__(batch_size, device, dtype, differentiable=False)
        self.metric, self.clip = metric, None
        if metric == "clip":
            self.clip = HFClip.from_paths(weights, processor, "edit_preservation (metric='clip')", "edit_preservation")
            self._freeze()

    def modules(self):
        return [self.clip.model] if self.clip is not None else []

    def _score(self, x, prompts, metadata):
        src, keep = source_and_mask(metadata, x, self.name)
        kept = keep.mean(dim=(1, 2, 3)).cpu()
        if self.metric == "clip":
            fill = 0.5 * (1 - keep)  # the edit region grey in both images: only what should be kept is compared
            scores = (self.clip.image_embeds(x * keep + fill) * self.clip.image_embeds(src * keep + fill)).sum(-1)
            return RewardOutput(scores.float().cpu(), {"kept_fraction": kept})
        diff = (x - src).abs() if self.metric == "l1" else (x - src).pow(2)
        err = _masked_mean(diff, keep)
        return RewardOutput((1.0 - err).float().cpu(), {"error": err.float().cpu(), "kept_fraction": kept})


@register("clip_direction")
class ClipDirection(TorchImageReward):
    """Edit direction: CLIP cosine of (edited - source) image change with the (target - source) caption change."""

    name = "clip_direction"

    def __init__(self, weights: Any = None, processor: Any = None, batch_size: int = 32, device: Any = None,
                 dtype: Any = "float32"):
        super().__init__(batch_size, device, dtype, differentiable=False)
        self.clip = HFClip.from_paths(weights, processor, "clip_direction")
        self._freeze()

    def modules(self):
        return [self.clip.model]

    def _score(self, x, prompts, metadata):
        # source: Brooks et al. 2023 (InstructPix2Pix) sec. 4: CLIP directional similarity (Gal et al. 2022)
        src, _ = source_and_mask(metadata, x, self.name)
        missing = [i for i, m in enumerate(metadata) if not (m.get("source_caption") and m.get("target_caption"))]
        if missing:
            raise ValueError(f"reward 'clip_direction' needs metadata 'source_caption' and 'target_caption' (the "
                             f"image described before and after the edit); image {missing[0]} lacks them")
        d_img = self.clip.image_embeds(x) - self.clip.image_embeds(src)
        d_txt = (self.clip.text_embeds([m["target_caption"] for m in metadata], x.device)
                 - self.clip.text_embeds([m["source_caption"] for m in metadata], x.device))
        scores = F.cosine_similarity(d_img.float(), d_txt.float(), dim=-1)
        return RewardOutput(scores.cpu(), {"image_change": d_img.norm(dim=-1).float().cpu()})


@register("edit_region_color")
class EditRegionColor(RewardModel):
    """Edit following: the share of the mask's pixels in the target colour (synthetic shapes edits)."""

    name = "edit_region_color"
    needs_prompts = True

    def __init__(self, sigma: float = 0.25, batch_size: int = 256, device: Any = None):
        self.sigma, self.batch_size = float(sigma), batch_size

    def _target(self, prompt: str, meta: dict) -> str:
        color = meta.get("target_color") or (prompt.split()[-1] if prompt.split() else "")
        if color not in COLORS:
            raise ValueError(f"edit_region_color: no known target colour for {prompt!r} (metadata 'target_color' or "
                             f"the instruction's last word; known: {sorted(COLORS)})")
        return color

    def score_images(self, images, prompts, metadata):
        metadata = metadata or [{} for _ in prompts]
        if any(not m or m.get("mask") is None for m in metadata):
            raise ValueError("reward 'edit_region_color' scores the edited region: pass metadata=[{'mask': ..., "
                             "'source_image': ...}] (the shapes edit rows carry both)")
        _, keep = source_and_mask(metadata, images, self.name)
        region = 1 - keep
        colors = [self._target(p, m) for p, m in zip(prompts, metadata)]
        ref = torch.tensor([COLORS[c] for c in colors], dtype=torch.float32, device=images.device)[:, :, None, None]
        d2 = (images.float() - ref / 255.0).pow(2).sum(1, keepdim=True)
        near = torch.exp(-d2 / (2 * self.sigma ** 2))
        return RewardOutput(_masked_mean(near, region).cpu(), {"target_color": colors})
