"""Images and curves written into a run directory: sample grids with captions (PNG; videos: MP4 grids through
`mmrl.pipelines.videos`) and the reward curve PNG."""

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


def make_image_grid(images: Any, captions: list[str] | None = None, cols: int | None = None, min_cell: int = 128,
                    max_caption_lines: int = 6, title: str | None = None):
    """A grid of images (float NCHW [0,1] or PIL) as one PIL image, each with its caption under it, word-wrapped to
    the cell width (whole words; a word longer than a line is split), at most `max_caption_lines` lines (the last
    one ends in "..." when cut). Put what must stay visible (the reward) at the start of a caption. `title`: a
    line (wrapped to the grid's width) above the grid, for what holds for every cell."""
    from PIL import Image, ImageDraw, ImageFont

    pils = to_pil_images(images)
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
    chars = max(4, cw // 6)  # the default bitmap font is 6 px wide
    wrapped = [caption_lines(str(c), chars, max_caption_lines) for c in captions] if captions else []
    line_h = 12
    cap_h = (max(len(x) for x in wrapped) * line_h + 4) if wrapped else 0
    head = caption_lines(title, max(4, cols * cw // 6), 4) if title else []
    top = len(head) * line_h + 4 if head else 0
    grid = Image.new("RGB", (cols * cw, top + rows * (ch + cap_h)), "white")
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    for j, line in enumerate(head):
        draw.text((2, 2 + line_h * j), line, fill="black", font=font)
    for i, im in enumerate(pils):
        r, c = divmod(i, cols)
        grid.paste(im.resize((cw, ch), Image.NEAREST), (c * cw, top + r * (ch + cap_h)))
        for j, line in enumerate(wrapped[i] if wrapped else []):
            draw.text((c * cw + 2, top + r * (ch + cap_h) + ch + 2 + line_h * j), line, fill="black", font=font)
    return grid


def caption_lines(text: str, width: int, max_lines: int) -> list[str]:
    """`text` wrapped at word boundaries into lines of at most `width` characters, at most `max_lines` of them."""
    import textwrap

    lines = textwrap.wrap(text, width=width, break_long_words=True, break_on_hyphens=False) or [""]
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = (lines[-1][: max(0, width - 3)] + "...")
    return lines


def save_image_grid(images: Any, captions: list[str] | None, path: str | Path, cols: int | None = None,
                    min_cell: int = 128, title: str | None = None) -> Path:
    """Save a grid of float NCHW [0,1] images with a caption under each (reward first, then the prompt ...) and an
    optional `title` above it."""
    grid = make_image_grid(images, captions, cols=cols, min_cell=min_cell, title=title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path


def write_samples(directory: Path, trackers: list, step: int, images: torch.Tensor, captions: list[str] | None = None,
                  name: str | None = None, title: str | None = None, audio: torch.Tensor | None = None,
                  sample_rate: int | None = None, fps: float | None = None) -> Path:
    """`Run.save_samples`: images [N, 3, H, W] -> a PNG grid (`directory/<name or step_N.png>`, `title` above it);
    videos [N, F, 3, H, W] -> an MP4 grid (same name, `.mp4`; `mmrl.pipelines.videos`). Each tracker gets the samples
    with their captions (reward, prompt): images (TensorBoard draws them as one grid per step), or videos where the
    tracker takes them. `audio` [N, C, S] at `sample_rate` (an audio-video family's sound): sample i also gets
    `<name>_s<i>.wav` and, for videos, `<name>_s<i>.mp4` with its sound track at `fps` frames per second."""
    kind = "eval" if (name or "").startswith("eval") else "rollout"
    path = Path(directory) / (name or f"step_{step:06d}.png")
    if audio is not None:
        write_sample_sounds(path, images, audio, sample_rate, fps)
    if isinstance(images, torch.Tensor) and images.dim() == 5:
        from mmrl.pipelines.videos import DEFAULT_FPS, to_uint8_frames

        path = save_video_grid(images, captions, path.with_suffix(".mp4"))
        clips = [to_uint8_frames(v) for v in images]
        for tracker in trackers:
            tracker.videos(int(step), kind, clips, captions, DEFAULT_FPS)
        return path
    save_image_grid(images, captions, path, title=title)
    if trackers:
        pils = to_pil_images(images)
        for tracker in trackers:
            tracker.images(int(step), kind, pils, captions)
    return path


def write_sample_sounds(grid: Path, images: torch.Tensor, audio: torch.Tensor, sample_rate: int | None,
                        fps: float | None) -> None:
    """Beside the grid `grid`: `<stem>_s<i>.wav` per sample and, for videos [N, F, 3, H, W], `<stem>_s<i>.mp4` (the
    video with its sound)."""
    from mmrl.pipelines.videos import DEFAULT_FPS, write_video, write_wav

    if not sample_rate or audio.dim() != 3 or audio.shape[0] != images.shape[0]:
        raise ValueError(f"save_samples: audio must be [N, C, S] for the {images.shape[0]} samples with a sample_rate, "
                         f"got {tuple(audio.shape)} at {sample_rate!r}")
    for i, wave in enumerate(audio):
        stem = grid.with_name(f"{grid.stem}_s{i}")
        write_wav(wave, sample_rate, stem.with_suffix(".wav"))
        if images.dim() == 5:
            write_video(images[i], stem.with_suffix(".mp4"), fps or DEFAULT_FPS, audio=wave, sample_rate=sample_rate)


_EVAL_RATES = {"eval/accuracy": "eval accuracy (greedy)", "eval/success_rate": "eval success rate"}


def plot_reward_curve(rows: list[dict], path: str | Path, keys: tuple[str, ...] = ("reward/mean",),
                      unit: str = "score", value_range: tuple[float | None, float | None] = (None, None)
                      ) -> Path | None:
    """The training reward (mean of the sampled rollouts, +- std band clipped to `value_range`, the reward's possible
    scores) against step, the eval reward when logged, and eval accuracy / success rate on a right-hand [0, 1] axis.
    The y axis names the reward and its `unit`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=100)
    lo, hi = (-np.inf if value_range[0] is None else value_range[0]), (np.inf if value_range[1] is None
                                                                        else value_range[1])
    plotted = False
    for key in keys:
        pts = [(r["step"], r[key], r.get(key.replace("/mean", "/std"))) for r in rows if r.get(key) is not None]
        if not pts:
            continue
        steps = np.array([p[0] for p in pts])
        mean = np.array([p[1] for p in pts], dtype=float)
        label = "train reward (sampled rollouts)" if key == "reward/mean" else key
        ax.plot(steps, mean, label=label)
        if all(p[2] is not None for p in pts):
            std = np.array([p[2] for p in pts], dtype=float)
            ax.fill_between(steps, np.clip(mean - std, lo, hi), np.clip(mean + std, lo, hi), alpha=0.2,
                            label="+- 1 std over samples")
        plotted = True
    evals = [(r["step"], r["eval/reward/mean"]) for r in rows if r.get("eval/reward/mean") is not None]
    if evals:
        ax.plot([e[0] for e in evals], [e[1] for e in evals], "o-", label="eval reward")
        plotted = True
    handles, labels = ax.get_legend_handles_labels()
    rates = {k: [(r["step"], r[k]) for r in rows if r.get(k) is not None] for k in _EVAL_RATES}
    rates = {k: v for k, v in rates.items() if v}
    if rates:
        ax2 = ax.twinx()
        for k, pts in rates.items():
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], "s--", color="tab:green", label=_EVAL_RATES[k])
        ax2.set_ylim(-0.02, 1.02)
        ax2.set_ylabel(" / ".join(_EVAL_RATES[k] for k in rates))
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
        plotted = True
    if not plotted:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel(f"reward ({unit})" if len(unit) <= 40 else f"reward\n({unit})")
    ax.grid(alpha=0.3)
    ax.legend(handles, labels, fontsize="small", loc="best")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def save_video_grid(videos: torch.Tensor, captions: Sequence[str] | None, path: str | Path,
                    fps: int | None = None, cols: int | None = None) -> Path:
    """Videos [N, F, 3, H, W] in [0, 1] -> one MP4 (or GIF) whose every frame is the grid of the N videos' frames,
    with a caption under each (as `make_image_grid` draws them)."""
    from mmrl.pipelines.videos import DEFAULT_FPS, write_video

    if videos.dim() != 5 or videos.shape[2] != 3:
        raise ValueError(f"save_video_grid: expected videos [N, F, 3, H, W], got {tuple(videos.shape)}")
    frames = [np.asarray(make_image_grid(videos[:, t], list(captions) if captions else None, cols))
              for t in range(videos.shape[1])]
    return write_video(np.stack(frames), path, fps or DEFAULT_FPS)
