"""Images and curves written into a run directory: sample grids with captions (PNG; videos: MP4 grids through
`mmrl.videos`) and the reward curve PNG."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch


def to_pil_images(images: Any) -> list:
    """float NCHW [0,1] tensors (1 or 3 channels) or PIL images -> a list of RGB PIL images."""
    from PIL import Image

    if isinstance(images, torch.Tensor):
        if images.dim() != 4 or images.shape[1] not in (1, 3):
            raise ValueError(f"save_image_grid: expected images [N, 3 or 1, H, W], got {tuple(images.shape)}")
        images = images.expand(-1, 3, -1, -1)
        arr = (images.detach().float().clamp(0, 1).cpu().permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
        return [Image.fromarray(a) for a in arr]
    return [im.convert("RGB") for im in images]


def save_image_grid(images: Any, captions: list[str] | None, path: str | Path, cols: int | None = None,
                    min_cell: int = 128) -> Path:
    """Save a grid of float NCHW [0,1] images with a caption under each (prompt, reward...)."""
    grid = image_grid(to_pil_images(images), captions, cols, min_cell)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path


def image_grid(pils: list, captions: list[str] | None, cols: int | None = None, min_cell: int = 128):
    """RGB PIL images -> one PIL grid image, cells scaled up to at least `min_cell` px, a caption under each."""
    from PIL import Image, ImageDraw, ImageFont

    n = len(pils)
    if n == 0:
        raise ValueError("save_image_grid: no images")
    if captions is not None and len(captions) != n:
        raise ValueError(f"save_image_grid: {n} images but {len(captions)} captions")
    cols = cols or min(n, 8)
    rows = math.ceil(n / cols)
    w, h = pils[0].size
    scale = max(1, math.ceil(min_cell / max(w, h)))
    cw, ch = w * scale, h * scale
    cap_h = 28 if captions else 0
    grid = Image.new("RGB", (cols * cw, rows * (ch + cap_h)), "white")
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    for i, im in enumerate(pils):
        r, c = divmod(i, cols)
        grid.paste(im.resize((cw, ch), Image.NEAREST), (c * cw, r * (ch + cap_h)))
        if captions:
            text = str(captions[i])
            chars = max(4, cw // 6)
            lines = [text[:chars], text[chars:2 * chars]]
            for j, line in enumerate(lines):
                draw.text((c * cw + 2, r * (ch + cap_h) + ch + 2 + 12 * j), line, fill="black", font=font)
    return grid


def write_samples(directory: Path, trackers: list, step: int, images: torch.Tensor, captions: list[str] | None = None,
                  name: str | None = None) -> Path:
    """`Run.save_samples`: images [N, 3, H, W] -> a PNG grid (`directory/<name or step_N.png>`); videos
    [N, F, 3, H, W] -> an MP4 grid (same name, `.mp4`; `mmrl.videos`). Each tracker gets the samples one by one
    with their captions (prompt, reward): images, or videos where the tracker takes them."""
    kind = "eval" if (name or "").startswith("eval") else "rollout"
    path = Path(directory) / (name or f"step_{step:06d}.png")
    if isinstance(images, torch.Tensor) and images.dim() == 5:
        from mmrl.videos import DEFAULT_FPS, to_uint8_frames

        path = save_video_grid(images, captions, path.with_suffix(".mp4"))
        clips = [to_uint8_frames(v) for v in images]
        for tracker in trackers:
            tracker.videos(int(step), kind, clips, captions, DEFAULT_FPS)
        return path
    save_image_grid(images, captions, path)
    if trackers:
        pils = to_pil_images(images)
        for tracker in trackers:
            tracker.images(int(step), kind, pils, captions)
    return path


def plot_reward_curve(rows: list[dict], path: str | Path, keys: tuple[str, ...] = ("reward/mean",)) -> Path | None:
    """Reward (mean +- std band) against step; eval rewards too when logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    plotted = False
    for key in keys:
        pts = [(r["step"], r[key], r.get(key.replace("/mean", "/std"))) for r in rows if r.get(key) is not None]
        if not pts:
            continue
        steps = np.array([p[0] for p in pts])
        mean = np.array([p[1] for p in pts], dtype=float)
        ax.plot(steps, mean, label=key)
        if all(p[2] is not None for p in pts):
            std = np.array([p[2] for p in pts], dtype=float)
            ax.fill_between(steps, mean - std, mean + std, alpha=0.2)
        plotted = True
    evals = [(r["step"], r["eval/reward/mean"]) for r in rows if r.get("eval/reward/mean") is not None]
    if evals:
        ax.plot([e[0] for e in evals], [e[1] for e in evals], "o-", label="eval/reward/mean")
        plotted = True
    if not plotted:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def save_video_grid(videos: torch.Tensor, captions: Sequence[str] | None, path: str | Path,
                    fps: int | None = None, cols: int | None = None) -> Path:
    """Videos [N, F, 3, H, W] in [0, 1] -> one MP4 (or GIF) whose every frame is the grid of the N videos' frames,
    with a caption under each (as `plots.save_image_grid` draws them)."""
    from mmrl.videos import DEFAULT_FPS, write_video

    if videos.dim() != 5 or videos.shape[2] != 3:
        raise ValueError(f"save_video_grid: expected videos [N, F, 3, H, W], got {tuple(videos.shape)}")
    frames = [np.asarray(image_grid(to_pil_images(videos[:, t]), list(captions) if captions else None, cols))
              for t in range(videos.shape[1])]
    return write_video(np.stack(frames), path, fps or DEFAULT_FPS)
