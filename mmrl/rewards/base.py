"""Reward protocol, `load` and input normalisation shared by every reward model.

`load(name, **kw) -> RewardModel`; `reward(images, prompts, metadata) -> RewardOutput(scores[B], details)`.
Heavy models are imported lazily: the registry (registry.py) maps names to modules imported on first use.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

# the registry lives in registry.py (no mmrl imports); its names stay importable from here
from mmrl.rewards.registry import _LAZY, _REGISTRY, available, create, register, register_lazy  # noqa: F401


@dataclass
class RewardOutput:
    """`scores`: float tensor [B] (higher is better); `details`: per-sample extras (lists/tensors of length B)
    and scalars (e.g. component scores of a composite)."""

    scores: torch.Tensor
    details: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.scores.shape[0])


class RewardModel:
    """Base class. Image rewards implement `score_images`, text rewards `score_texts`.

    Calling the model validates and normalises inputs, splits them into chunks of `batch_size`
    and concatenates the outputs.
    """

    name: str = "reward"
    kind: str = "image"  # "image" | "text" | "video" (mmrl.rewards.video.VideoRewardModel)
    differentiable: bool = False
    batch_size: int = 32
    needs_prompts: bool = False
    unit: str = "score"  # what one score means, for plot axes (e.g. "JPEG kB", "1 = correct")
    score_range: tuple[float | None, float | None] = (None, None)  # (lowest, highest) possible score; None: unbounded

    def __call__(self, images: Any = None, prompts: Sequence[str] | None = None,
                 metadata: Sequence[dict] | None = None, completions: Sequence[str] | None = None) -> RewardOutput:
        if self.kind == "text":
            if completions is None:
                raise ValueError(f"reward '{self.name}' scores text: pass completions=[...]")
            n = len(completions)
            if n == 0:
                raise ValueError(f"reward '{self.name}': empty batch (no completions)")
            prompts = _check_len(prompts, n, "prompts", self.name)
            metadata = _check_len(metadata, n, "metadata", self.name)
            return self._chunked(n, lambda s: self.score_texts(list(completions[s]),
                                                              None if metadata is None else list(metadata[s]),
                                                              None if prompts is None else list(prompts[s])))
        if images is not None and not isinstance(images, torch.Tensor):
            images = to_image_list(images)
            if len({tuple(t.shape) for t in images}) > 1:  # mixed sizes: each size is its own batch
                return score_by_size(self, images, prompts, metadata)
        images, prompts, metadata = self._image_inputs(images, prompts, metadata)
        n = images.shape[0]
        return self._chunked(n, lambda s: self.score_images(images[s],
                                                           None if prompts is None else list(prompts[s]),
                                                           None if metadata is None else list(metadata[s])))

    def _image_inputs(self, images: Any, prompts: Any, metadata: Any) -> tuple[torch.Tensor, Any, Any]:
        """(images as a float NCHW tensor, prompts, metadata) checked: images given and non-empty, prompts when
        needed, one prompt / metadata entry per image."""
        if images is None:
            raise ValueError(f"reward '{self.name}' scores images: pass images=...")
        if isinstance(images, torch.Tensor) and images.dim() == 5:
            raise ValueError(f"reward '{self.name}' scores images [B, 3, H, W], got videos {tuple(images.shape)} "
                             f"([B, F, 3, H, W]); score them per frame: load('video_frames', "
                             f"image_reward='{self.name}', aggregate='mean' | 'min' | 'frame')")
        if not (isinstance(images, torch.Tensor) and self.differentiable):
            images = to_image_tensor(images)
        else:
            images = _check_image_tensor(images)
        n = images.shape[0]
        if n == 0:
            raise ValueError(f"reward '{self.name}': empty batch (no images)")
        if self.needs_prompts and prompts is None:
            raise ValueError(f"reward '{self.name}' needs prompts (one per image)")
        return images, _check_len(prompts, n, "prompts", self.name), _check_len(metadata, n, "metadata", self.name)

    def score_images(self, images: torch.Tensor, prompts: list[str] | None, metadata: list[dict] | None) -> RewardOutput:
        raise NotImplementedError(f"{type(self).__name__} does not score images")

    def score_texts(self, completions: list[str], metadata: list[dict] | None, prompts: list[str] | None) -> RewardOutput:
        raise NotImplementedError(f"{type(self).__name__} does not score text")

    def _chunked(self, n: int, fn: Callable[[slice], RewardOutput]) -> RewardOutput:
        bs = max(1, int(self.batch_size or n))
        outs = [fn(slice(i, min(n, i + bs))) for i in range(0, n, bs)]
        return concat_outputs(outs)

    def to(self, device: Any) -> "RewardModel":
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, differentiable={self.differentiable})"


def concat_outputs(outs: list[RewardOutput]) -> RewardOutput:
    if len(outs) == 1:
        return outs[0]
    scores = torch.cat([o.scores for o in outs])
    details: dict[str, Any] = {}
    for key in outs[0].details:
        vals = [o.details.get(key) for o in outs]
        if all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in vals):
            details[key] = torch.cat(vals)
        elif all(isinstance(v, list) for v in vals):
            details[key] = [x for v in vals for x in v]
        else:
            details[key] = vals[-1]
    return RewardOutput(scores, details)


def score_by_size(reward: Any, images: list[torch.Tensor], prompts: Sequence[str] | None,
                  metadata: Sequence[dict] | None) -> RewardOutput:
    """`reward` on images of different sizes (CHW tensors): one call per size, results back in input order
    (scores and per-sample details; other details come from the last call)."""
    n = len(images)
    name = getattr(reward, "name", "reward")
    prompts, metadata = _check_len(prompts, n, "prompts", name), _check_len(metadata, n, "metadata", name)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(images):
        groups.setdefault(tuple(t.shape), []).append(i)
    outs, order = [], []
    for idx in groups.values():
        outs.append(reward(images=torch.stack([images[i] for i in idx]),
                           prompts=None if prompts is None else [prompts[i] for i in idx],
                           metadata=None if metadata is None else [metadata[i] for i in idx]))
        order += idx
    joined = concat_outputs(outs)
    back = torch.argsort(torch.tensor(order))  # position in `joined` of input i
    details = {}
    for k, v in joined.details.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n:
            details[k] = v[back.to(v.device)]
        elif isinstance(v, list) and len(v) == n:
            details[k] = [v[j] for j in back.tolist()]
        else:
            details[k] = v
    return RewardOutput(joined.scores[back.to(joined.scores.device)], details)


def _check_len(seq: Sequence | None, n: int, what: str, name: str):
    if seq is None:
        return None
    if isinstance(seq, (str, bytes)):
        seq = [seq]
    if len(seq) != n:
        raise ValueError(f"reward '{name}': got {n} inputs but {len(seq)} {what}; pass one per input")
    return list(seq)


# ------------------------------------------------------------------------------------- images


def _check_image_tensor(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 3:
        t = t.unsqueeze(0)
    if t.dim() != 4 or t.shape[1] not in (1, 3, 4):
        raise ValueError(f"image tensor must be NCHW or CHW with 1, 3 or 4 channels, got shape {tuple(t.shape)}")
    if t.dtype == torch.uint8:
        t = t.float() / 255.0
    elif not t.is_floating_point():
        raise ValueError(f"image tensor must be float in [0,1] or uint8, got {t.dtype}")
    if t.numel() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).flatten(1).any(1).nonzero()[0])
        raise ValueError(f"image tensor contains NaN/inf values (first in image {bad}); "
                         "check the decoder / sampler output before scoring")
    if t.numel() and (t.min() < -1e-3 or t.max() > 1 + 1e-3):
        raise ValueError(f"float image tensor must be in [0,1] (canonical), got range [{t.min().item():.3f}, {t.max().item():.3f}]; "
                         "map [-1,1] images with (x + 1) / 2")
    if t.shape[1] == 1:
        t = t.expand(-1, 3, -1, -1)
    elif t.shape[1] == 4:
        t = t[:, :3]
    return t


def to_image_list(images: Any) -> list[torch.Tensor]:
    """Any supported image input -> list of float CHW RGB tensors in [0,1] (sizes may differ)."""
    if isinstance(images, torch.Tensor):
        t = _check_image_tensor(images)
        return list(t.unbind(0))
    if isinstance(images, np.ndarray):
        if images.ndim == 4:
            images = list(images)
        else:
            images = [images]
    if not isinstance(images, (list, tuple)):
        images = [images]
    out = []
    for i, im in enumerate(images):
        if isinstance(im, torch.Tensor):
            out.append(_check_image_tensor(im)[0])
            continue
        from mmrl.pipelines.images import load_image

        try:
            pil = load_image(im)
        except ValueError as exc:  # keep the class (ImageNotFoundError is also a FileNotFoundError)
            raise type(exc)(f"image {i}: {exc}") from None
        arr = np.asarray(pil, dtype=np.uint8)
        out.append(torch.from_numpy(arr.copy()).permute(2, 0, 1).float() / 255.0)
    return out


def to_image_tensor(images: Any) -> torch.Tensor:
    """Any supported input (tensor NCHW/CHW in [0,1] or uint8, PIL, uint8/float arrays, paths, bytes)
    -> float NCHW RGB tensor in [0,1]. All images must share one size."""
    if isinstance(images, torch.Tensor):
        return _check_image_tensor(images)
    lst = to_image_list(images)
    if not lst:
        return torch.zeros(0, 3, 1, 1)
    sizes = {tuple(t.shape) for t in lst}
    if len(sizes) > 1:
        raise ValueError(f"images have different sizes {sorted(sizes)}; resize them to one size first")
    return torch.stack(lst)


def to_pil_list(images: torch.Tensor) -> list:
    from PIL import Image

    arr = (images.detach().float().clamp(0, 1).cpu().permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    return [Image.fromarray(a) for a in arr]


# ------------------------------------------------------------------------------------- loading


def load(name: Any, **kwargs: Any) -> RewardModel:
    """`load("pickscore", weights=..., device=...)`; a mapping `{name: weight}` (or `{name: {weight:, ...}}`)
    builds a weighted composite."""
    if isinstance(name, RewardModel):
        return name
    if isinstance(name, dict):  # the "composite" reward (composite.py) is found through the registry, not imported
        return create("composite", components=name, **kwargs)
    if not isinstance(name, str):
        raise TypeError(f"reward name must be a string or a mapping, got {type(name).__name__}")
    return create(name, **kwargs)


# ------------------------------------------------------------------------------------- JPEG


def jpeg_size_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """Encoded JPEG size in kB (1000 bytes) of each image at `quality`."""
    sizes = []
    for pil in to_pil_list(images):
        buf = io.BytesIO()
        pil.save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


@register("jpeg_incompressibility")
class JpegIncompressibility(RewardModel):
    """Reward = JPEG size in kB at quality 95 (larger file = more detail).
    # source: DDPO (Black et al. 2023), ddpo-pytorch rewards.jpeg_incompressibility."""

    name = "jpeg_incompressibility"
    sign = 1.0
    unit = "JPEG kB"
    score_range = (0.0, None)

    def __init__(self, quality: int = 95, batch_size: int = 64, device: Any = None):
        self.quality = int(quality)
        self.batch_size = batch_size

    def score_images(self, images, prompts, metadata):
        kb = jpeg_size_kb(images, self.quality)
        return RewardOutput(self.sign * kb, {"jpeg_kb": kb})


@register("jpeg_compressibility")
class JpegCompressibility(JpegIncompressibility):
    """Reward = -JPEG size in kB at quality 95 (smaller file = simpler image).
    # source: DDPO (Black et al. 2023), ddpo-pytorch rewards.jpeg_compressibility."""

    name = "jpeg_compressibility"
    sign = -1.0
    unit = "-JPEG kB"
    score_range = (None, 0.0)
