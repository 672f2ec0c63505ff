"""What every recipe shares at run time: device/dtype, seeding, the run directory, metrics JSONL,
atomic checkpoints with exact resume, sample grids and the reward-curve plot."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
COMPLETE_MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` -> cuda when available, else cpu. Asking for cuda on a machine without it is an error."""
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: unknown device {name!r}; expected auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{name}' requested but CUDA is not available on this machine; use device=cpu or auto")
    return dev


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = str(name).lower().replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype '{name}'; valid: {sorted(_DTYPES)}")
    return _DTYPES[key]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def get_rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach().float().cpu()
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


def list_checkpoints(ckpt_root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (those with the COMPLETE marker) under `ckpt_root`, oldest first."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and (child / COMPLETE_MARKER).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def checkpoint_step(path: str | Path) -> int:
    """Step number of a checkpoint directory (checks that it is complete)."""
    path = Path(path)
    m = _STEP_DIR.match(path.name)
    if not path.is_dir() or not m:
        raise FileNotFoundError(f"not a checkpoint directory (expected .../step_<N>/): {path}")
    if not (path / COMPLETE_MARKER).is_file():
        raise FileNotFoundError(f"checkpoint {path} is incomplete (no {COMPLETE_MARKER} marker): it was interrupted while being written")
    return int(m.group(1))


class Run:
    """The run directory of one training run and everything written into it.

    ``Run(cfg)`` needs only the common keys of ``mmrl.config.RunConfig``.
    """

    def __init__(self, cfg: Any, write_config: bool = True):
        from mmrl.config import to_yaml

        self.cfg = cfg
        train = getattr(cfg, "train", None)
        for key in ("max_steps", "save_every", "keep_last"):
            value = getattr(train, key, 0)
            if isinstance(value, int) and value < 0:
                raise ValueError(f"train.{key} must be >= 0, got {value}")
        self.dir = Path(cfg.output_dir)
        self.ckpt_dir = self.dir / "checkpoints"
        self.samples_dir = self.dir / "samples"
        self.plots_dir = self.dir / "plots"
        if self.dir.exists() and not self.dir.is_dir():
            raise ValueError(f"output_dir: {str(self.dir)!r} exists and is not a directory")
        try:
            for d in (self.dir, self.ckpt_dir, self.samples_dir, self.plots_dir):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"output_dir: cannot create the run directory {str(self.dir)!r}: {exc}") from None
        self.metrics_path = self.dir / "metrics.jsonl"
        if int(getattr(cfg, "num_threads", 0) or 0) > 0:
            torch.set_num_threads(int(cfg.num_threads))
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype)
        seed_everything(cfg.seed)
        if write_config:
            tmp = self.dir / "config.yaml.tmp"
            tmp.write_text(to_yaml(cfg))
            os.replace(tmp, self.dir / "config.yaml")
        # a half-written checkpoint from an interrupted run is never used; clear it away
        for child in self.ckpt_dir.glob(".tmp-*"):
            shutil.rmtree(child, ignore_errors=True)
        self._t0 = time.time()

    # ---------------------------------------------------------------- metrics
    def log(self, step: int, metrics: dict[str, Any]) -> dict:
        """Append one JSON line `{"step": step, **metrics}` to metrics.jsonl (flushed)."""
        row = {"step": int(step)}
        row.update({k: _jsonable(v) for k, v in metrics.items()})
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
        return row

    def read_metrics(self) -> list[dict]:
        if not self.metrics_path.is_file():
            return []
        rows = []
        for line in self.metrics_path.read_text().splitlines():
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by an interruption
                    continue
        return rows

    def truncate_metrics(self, step: int) -> None:
        """Keep only rows with step <= `step` (called on resume so no step is logged twice)."""
        rows = [r for r in self.read_metrics() if r.get("step", 0) <= step]
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, self.metrics_path)

    # ---------------------------------------------------------------- checkpoints
    def find_resume(self) -> Path | None:
        """Checkpoint to resume from according to `train.resume` (auto | never | PATH)."""
        mode = str(self.cfg.train.resume)
        if mode == "never":
            return None
        if mode == "auto":
            ckpts = list_checkpoints(self.ckpt_dir)
            return ckpts[-1][1] if ckpts else None
        checkpoint_step(mode)  # validates
        return Path(mode)

    @contextmanager
    def checkpoint(self, step: int) -> Iterator[Path]:
        """Write a checkpoint atomically: yields a temp dir; on success marks it complete and renames it
        to checkpoints/step_<N>/, deletes complete checkpoints with a step > N (an abandoned timeline) and
        prunes to keep_last. An exception (or a kill) leaves no step_<N> behind."""
        tmp = self.ckpt_dir / f".tmp-step_{step}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        try:
            yield tmp
            (tmp / COMPLETE_MARKER).write_text(json.dumps({"step": step, "time": time.time()}))
            final = self.ckpt_dir / f"step_{step}"
            if final.exists():  # re-saving the same step (e.g. after a resume): swap atomically-ish
                old = self.ckpt_dir / f".tmp-old-step_{step}-{os.getpid()}"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._drop_later_than(step)
        self._prune()

    def _drop_later_than(self, step: int) -> None:
        """Checkpoints with a higher step than the one just written belong to an abandoned timeline (a run
        restarted with resume=never, or resumed from an older PATH; metrics.jsonl was cut back the same
        way). Left in place, pruning would delete the new checkpoint and auto-resume would jump back to them."""
        for s, path in list_checkpoints(self.ckpt_dir):
            if s > step:
                shutil.rmtree(path, ignore_errors=True)

    def _prune(self) -> None:
        keep = int(getattr(self.cfg.train, "keep_last", 0) or 0)
        if keep <= 0:
            return
        for _, path in list_checkpoints(self.ckpt_dir)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def save_state(directory: str | Path, **objects: Any) -> None:
        """torch.save a dict of state (optimizer state dicts, RNG, trackers, data position) to state.pt."""
        torch.save(objects, Path(directory) / "state.pt")

    @staticmethod
    def load_state(directory: str | Path) -> dict:
        path = Path(directory) / "state.pt"
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint state file missing: {path}")
        return torch.load(path, map_location="cpu", weights_only=False)

    # ---------------------------------------------------------------- progress and outputs
    def progress(self, total: int, initial: int = 0, desc: str | None = None):
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc=desc or getattr(self.cfg, "algorithm", "train"),
                    dynamic_ncols=True, disable=os.environ.get("MMRL_NO_PROGRESS") == "1")

    def save_samples(self, step: int, images: torch.Tensor, captions: list[str] | None = None,
                     name: str | None = None) -> Path:
        path = self.samples_dir / (name or f"step_{step:06d}.png")
        save_image_grid(images, captions, path)
        return path

    def finish(self, extra: dict | None = None) -> dict:
        """Write plots/reward_curve.png and return a summary of the run's metrics."""
        rows = self.read_metrics()
        summary: dict[str, Any] = {"output_dir": str(self.dir), "steps_logged": len(rows)}
        if rows:
            plot_reward_curve(rows, self.plots_dir / "reward_curve.png")
            rewards = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
            if rewards:
                k = min(5, len(rewards))
                summary["reward_first"] = float(np.mean(rewards[:k]))
                summary["reward_last"] = float(np.mean(rewards[-k:]))
        summary["wall_s"] = time.time() - self._t0
        if extra:
            summary.update(extra)
        return summary


def save_image_grid(images: Any, captions: list[str] | None, path: str | Path, cols: int | None = None,
                    min_cell: int = 128) -> Path:
    """Save a grid of float NCHW [0,1] images with a caption under each (prompt, reward...)."""
    from PIL import Image, ImageDraw, ImageFont

    if isinstance(images, torch.Tensor):
        if images.dim() != 4 or images.shape[1] not in (1, 3):
            raise ValueError(f"save_image_grid: expected images [N, 3 or 1, H, W], got {tuple(images.shape)}")
        images = images.expand(-1, 3, -1, -1)
        arr = (images.detach().float().clamp(0, 1).cpu().permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
        pils = [Image.fromarray(a) for a in arr]
    else:
        pils = [im.convert("RGB") for im in images]
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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
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


class Timer:
    """Accumulates wall time per named phase: `with timer("rollout"): ...`; `timer.pop()` -> metrics."""

    def __init__(self, sync_cuda: bool = False):
        self.times: dict[str, float] = {}
        self.sync = sync_cuda and torch.cuda.is_available()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t

    def pop(self, prefix: str = "time/") -> dict[str, float]:
        out = {f"{prefix}{k}_s": v for k, v in self.times.items()}
        self.times = {}
        return out
