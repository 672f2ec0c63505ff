"""Video rewards: videos float [B, F, 3, H, W] in [0, 1] (or uint8, or video file paths) -> scores [B].

```python
load("video_frames", image_reward="pickscore", weights="/ckpt/pickscore", aggregate="mean")  # any image reward
load("video_frames", image_reward="clip_score", weights=..., aggregate="frame", frame=0)     # the first frame
load("temporal_consistency")                       # cosine of adjacent frames' features (pixels, or CLIP: weights=)
load("motion_amount")                              # mean |frame[t+1] - frame[t]| in [0, 1]
```

- `video_frames`: an image reward of the zoo applied to every `every`-th frame (prompts and metadata repeated per
  frame, all frames of a batch scored in one call), then `aggregate`: `mean` (Flow-Factory's video PickScore),
  `min` (the worst frame), `max`, or `frame` (the frame at index `frame`: Flow-Factory's CLIP and UniRL's
  VideoPickScore score the first, verl-omni's HPSv3 every 4th frame averaged). `details["frames"]`: [B, F'] per
  frame.
- `temporal_consistency`: mean over adjacent frame pairs of cos(feat_t, feat_t+1): `features="clip"` uses a local
  transformers CLIP's normalised image embeddings (as VBench's consistency dimensions compare frame embeddings),
  `features="pixels"` the frames themselves, area-downsampled to `size` x `size` (no weights; a coarse proxy
  whose values sit close to 1). Higher = steadier.
- `motion_amount`: mean over adjacent pairs of the mean absolute pixel change; 0 for a still video. Give it a
  negative weight in a composite to penalise motion, a positive one to ask for it.

A video reward given images (a batch [B, 3, H, W]) and an image reward given videos fail with one line naming the
reward and what to use instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from mmrl.rewards.base import RewardModel, RewardOutput, _check_len, load, register

AGGREGATES = ("mean", "min", "max", "frame")


def to_video_tensor(videos: Any, name: str = "video reward") -> torch.Tensor:
    """Videos as a float [B, F, 3, H, W] tensor in [0, 1]: from such a tensor (float or uint8), a list of
    [F, 3, H, W] tensors, or a list of video file paths (`mmrl.pipelines.videos.read_video`). All videos share one shape."""
    if isinstance(videos, (str, Path)):
        videos = [videos]
    if isinstance(videos, (list, tuple)):
        from mmrl.pipelines.videos import read_video

        items = [torch.from_numpy(read_video(v)).permute(0, 3, 1, 2) if isinstance(v, (str, Path)) else v
                 for v in videos]
        shapes = {tuple(t.shape) for t in items}
        if len(shapes) > 1:
            raise ValueError(f"reward '{name}': videos have different shapes {sorted(shapes)}; resize them to one")
        videos = torch.stack(items) if items else torch.zeros(0, 1, 3, 1, 1)
    if not isinstance(videos, torch.Tensor):
        raise TypeError(f"reward '{name}': expected videos as a tensor [B, F, 3, H, W] or a list of files, got "
                        f"{type(videos).__name__}")
    if videos.dim() == 4 and videos.shape[1] in (1, 3):
        raise ValueError(f"reward '{name}' scores videos [B, F, 3, H, W], got images {tuple(videos.shape)}; use an "
                         f"image reward (or rollout.num_frames > 1 with a video model)")
    if videos.dim() != 5 or videos.shape[2] != 3:
        raise ValueError(f"reward '{name}': expected videos [B, F, 3, H, W], got shape {tuple(videos.shape)}")
    if videos.dtype == torch.uint8:
        videos = videos.float() / 255.0
    elif not videos.is_floating_point():
        raise ValueError(f"reward '{name}': videos must be float in [0, 1] or uint8, got {videos.dtype}")
    if videos.numel() and not bool(torch.isfinite(videos).all()):
        raise ValueError(f"reward '{name}': the videos contain NaN/inf values")
    if videos.numel() and (videos.min() < -1e-3 or videos.max() > 1 + 1e-3):
        raise ValueError(f"reward '{name}': float videos must be in [0, 1], got range "
                         f"[{videos.min().item():.3f}, {videos.max().item():.3f}]")
    return videos


class VideoRewardModel(RewardModel):
    """Base class of video rewards: `__call__(images=videos, prompts, metadata)` checks and converts the videos
    (`to_video_tensor`), splits them into chunks of `batch_size` videos and calls `score_videos`."""

    kind = "video"
    batch_size = 8

    def __call__(self, images: Any = None, prompts: Sequence[str] | None = None,
                 metadata: Sequence[dict] | None = None, completions: Sequence[str] | None = None) -> RewardOutput:
        if images is None:
            raise ValueError(f"reward '{self.name}' scores videos: pass images=<videos [B, F, 3, H, W]>")
        videos = to_video_tensor(images, self.name)
        n = videos.shape[0]
        if n == 0:
            raise ValueError(f"reward '{self.name}': empty batch (no videos)")
        if self.needs_prompts and prompts is None:
            raise ValueError(f"reward '{self.name}' needs prompts (one per video)")
        prompts = _check_len(prompts, n, "prompts", self.name)
        metadata = _check_len(metadata, n, "metadata", self.name)
        return self._chunked(n, lambda s: self.score_videos(videos[s], None if prompts is None else prompts[s],
                                                            None if metadata is None else metadata[s]))

    def score_videos(self, videos: torch.Tensor, prompts: list[str] | None,
                     metadata: list[dict] | None) -> RewardOutput:
        raise NotImplementedError


def _need_frames(videos: torch.Tensor, least: int, name: str) -> None:
    if videos.shape[1] < least:
        raise ValueError(f"reward '{name}' needs videos of >= {least} frames, got {videos.shape[1]}")


@register("video_frames")
class VideoFrames(VideoRewardModel):
    """An image reward per frame, aggregated per video (see the module docstring)."""

    name = "video_frames"

    def __init__(self, image_reward: Any = None, aggregate: str = "mean", frame: int = 0, every: int = 1,
                 batch_size: int = 8, device: Any = None, **image_reward_kwargs: Any):
        if image_reward is None:
            raise ValueError("video_frames: give image_reward=<name of an image reward of the zoo>, e.g. pickscore")
        if aggregate not in AGGREGATES:
            raise ValueError(f"video_frames: aggregate must be one of {list(AGGREGATES)}, got {aggregate!r}")
        if every < 1:
            raise ValueError(f"video_frames: every must be >= 1, got {every}")
        kwargs = dict(image_reward_kwargs) if device is None else {"device": device, **image_reward_kwargs}
        self.image_reward = load(image_reward, **kwargs)
        if self.image_reward.kind != "image":
            raise ValueError(f"video_frames: image_reward '{image_reward}' scores {self.image_reward.kind}, not images")
        self.aggregate, self.frame, self.every = aggregate, int(frame), int(every)
        self.batch_size = int(batch_size)
        self.needs_prompts = bool(getattr(self.image_reward, "needs_prompts", False))
        self.name = f"video_frames({getattr(self.image_reward, 'name', image_reward)}, {aggregate})"

    def to(self, device: Any) -> "VideoFrames":
        self.image_reward.to(device)
        return self

    def score_videos(self, videos, prompts, metadata):
        b = videos.shape[0]
        if self.aggregate == "frame":
            if not -videos.shape[1] <= self.frame < videos.shape[1]:
                raise ValueError(f"reward '{self.name}': frame {self.frame} is outside the {videos.shape[1]} frames")
            frames = videos[:, [self.frame]]
        else:
            frames = videos[:, :: self.every]
        f = frames.shape[1]
        def per_frame_list(xs):  # a video's frames are adjacent rows
            return None if xs is None else [x for x in xs for _ in range(f)]

        out = self.image_reward(images=frames.reshape(b * f, *frames.shape[2:]), prompts=per_frame_list(prompts),
                                metadata=per_frame_list(metadata))
        per_frame = out.scores.float().reshape(b, f)
        scores = {"mean": per_frame.mean(1), "min": per_frame.amin(1), "max": per_frame.amax(1),
                  "frame": per_frame[:, 0]}[self.aggregate]
        return RewardOutput(scores, {"frames": per_frame.detach()})


@register("temporal_consistency")
class TemporalConsistency(VideoRewardModel):
    """Mean cosine similarity of adjacent frames' features (see the module docstring)."""

    name = "temporal_consistency"
    unit = "adjacent-frame cosine similarity"
    score_range = (-1.0, 1.0)

    def __init__(self, features: str = "pixels", weights: Any = None, processor: Any = None, size: int = 32,
                 batch_size: int = 8, device: Any = None):
        if features not in ("pixels", "clip"):
            raise ValueError(f"temporal_consistency: features must be 'pixels' or 'clip', got {features!r}")
        self.features, self.size, self.batch_size = features, int(size), int(batch_size)
        self.device = torch.device(device or "cpu")
        self.clip = None
        if features == "clip":
            from mmrl.rewards.image._common import HFClip

            self.clip = HFClip.from_paths(weights, processor, "temporal_consistency (features=clip)",
                                          "temporal_consistency")
            self.clip.model.eval().requires_grad_(False).to(self.device)
        elif weights is not None:
            raise ValueError("temporal_consistency: weights are used with features='clip' only")

    def to(self, device: Any) -> "TemporalConsistency":
        self.device = torch.device(device)
        if self.clip is not None:
            self.clip.model.to(self.device)
        return self

    @torch.no_grad()
    def _features(self, frames: torch.Tensor) -> torch.Tensor:
        """frames [N, 3, H, W] -> [N, D]."""
        x = frames.to(self.device, torch.float32)
        if self.clip is not None:
            return self.clip.image_embeds(x).float()
        return F.adaptive_avg_pool2d(x, (self.size, self.size)).flatten(1)

    def score_videos(self, videos, prompts, metadata):
        _need_frames(videos, 2, self.name)
        b, f = videos.shape[:2]
        feats = self._features(videos.reshape(b * f, *videos.shape[2:])).reshape(b, f, -1)
        sims = F.cosine_similarity(feats[:, 1:], feats[:, :-1], dim=-1, eps=1e-8)  # [B, F - 1]
        return RewardOutput(sims.mean(1).cpu(), {"pairs": sims.cpu()})


@register("motion_amount")
class MotionAmount(VideoRewardModel):
    """Mean absolute change between adjacent frames, in [0, 1] (see the module docstring)."""

    name = "motion_amount"
    unit = "mean frame-to-frame change"
    score_range = (0.0, 1.0)

    def __init__(self, batch_size: int = 8, device: Any = None):
        self.batch_size = int(batch_size)

    def score_videos(self, videos, prompts, metadata):
        _need_frames(videos, 2, self.name)
        diffs = (videos[:, 1:].float() - videos[:, :-1].float()).abs().flatten(2).mean(-1)  # [B, F - 1]
        return RewardOutput(diffs.mean(1), {"pairs": diffs})


def sample_video(frames: int = 5, size: int = 32, seed: int = 0, speed: int = 2) -> torch.Tensor:
    """A small synthetic clip [frames, 3, size, size] in [0, 1]: a bright square moving `speed` px per frame on a
    dark background (for examples and tests of the video rewards)."""
    g = np.random.default_rng(seed)
    bg = g.uniform(0.0, 0.2, size=3)
    video = np.tile(bg[:, None, None], (frames, 1, size, size)).astype(np.float32)
    side = max(2, size // 4)
    for t in range(frames):
        x0 = min(size - side, 2 + t * speed)
        video[t, :, size // 3: size // 3 + side, x0: x0 + side] = 0.9
    return torch.from_numpy(video)
