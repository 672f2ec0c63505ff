"""Experiment trackers a run reports to, beside the always-on metrics.jsonl: TensorBoard and Weights & Biases.

`log.trackers: [jsonl, tensorboard, wandb]` (jsonl is always on and needs no entry). Each tracker receives the
resolved config once, every metrics row (`Run.log`) and every sample grid's images with their captions (prompt,
reward: `Run.save_samples`). Only the main process reports. The PNG reward curve of `plots/` stays the offline
default; a tracker draws its own curves.

- tensorboard: event files in `<run>/tensorboard/` (torch.utils.tensorboard): scalars, one sample grid per step
  (`samples/<name>`; video samples: one animated GIF of the grid), captions also as text, the config as text.
  Extra `[trackers]`.
- wandb: `wandb.init(project=log.wandb_project, mode=log.wandb_mode, dir=<run>, id=<stable id>, resume="allow")`;
  the id is kept in `<run>/wandb_id.txt` so a resumed run continues the same W&B run (video samples: MP4s).
  `wandb_mode: offline` (the default) writes `<run>/wandb/offline-run-*` for a later `wandb sync`; `online` needs
  network and a login.
"""

from __future__ import annotations

import math
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

TRACKERS = ("jsonl", "tensorboard", "wandb")


def _scalars(row: dict) -> dict[str, float]:
    """The finite numbers of a metrics row (nulls and non-numbers are left out)."""
    out = {}
    for k, v in row.items():
        if isinstance(v, bool):
            v = float(v)
        if isinstance(v, (int, float)) and math.isfinite(float(v)):
            out[k] = float(v)
    return out


class TensorBoardTracker:
    def __init__(self, run_dir: Path, config: dict):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ValueError(f"log.trackers: tensorboard needs the tensorboard package ({exc}); pip install "
                             f"'mmrl[trackers]'") from None
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        import yaml

        self.writer.add_text("config", "```\n" + yaml.safe_dump(config, sort_keys=False) + "\n```", 0)

    def log(self, step: int, row: dict) -> None:
        for k, v in _scalars(row).items():
            if k != "step":
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def images(self, step: int, name: str, images: Sequence[Any], captions: Sequence[str] | None) -> None:
        """One grid image per step under `samples/<name>` (TensorBoard's step slider pages through them), the
        captions also as text."""
        import numpy as np

        from mmrl.run.plots import make_image_grid

        grid = make_image_grid(list(images), list(captions) if captions else None)
        self.writer.add_image(f"samples/{name}", np.asarray(grid.convert("RGB")), step, dataformats="HWC")
        if captions:
            self.writer.add_text(f"samples/{name}", "\n\n".join(f"{i}: {c}" for i, c in enumerate(captions)), step)
        self.writer.flush()

    def videos(self, step: int, name: str, videos: Sequence[Any], captions: Sequence[str] | None, fps: int) -> None:
        """uint8 [F, H, W, 3] clips as one animated GIF of their grid per step under `samples/<name>` (frame t: the
        grid of every clip's frame t, as the run's MP4 grid; what torch's add_video writes, without needing
        moviepy), the captions also as text."""
        import numpy as np
        from torch.utils.tensorboard.summary import Summary

        from mmrl.pipelines.videos import gif_bytes
        from mmrl.run.plots import make_image_grid

        frames = np.stack([np.asarray(make_image_grid(_frames_at(videos, t))) for t in range(len(videos[0]))])
        image = Summary.Image(height=frames.shape[1], width=frames.shape[2], colorspace=3,
                              encoded_image_string=gif_bytes(frames, fps))
        self.writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=f"samples/{name}", image=image)]),
                                                   step)
        if captions:
            self.writer.add_text(f"samples/{name}", "\n\n".join(f"{i}: {c}" for i, c in enumerate(captions)), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _frames_at(videos: Sequence[Any], t: int) -> list:
    """Frame `t` of every uint8 [F, H, W, 3] clip, as PIL images."""
    from PIL import Image

    return [Image.fromarray(clip[t]) for clip in videos]


class WandbTracker:
    def __init__(self, run_dir: Path, config: dict, project: str, mode: str):
        try:
            import wandb
        except ImportError as exc:
            raise ValueError(f"log.trackers: wandb needs the wandb package ({exc}); pip install 'mmrl[trackers]'") from None
        id_file = run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self.wandb = wandb
        self.run = wandb.init(project=project, dir=str(run_dir), mode=mode, id=run_id, resume="allow",
                              name=run_dir.name, config=config, reinit="finish_previous")

    def log(self, step: int, row: dict) -> None:
        self.run.log({k: v for k, v in _scalars(row).items() if k != "step"}, step=step)

    def images(self, step: int, name: str, images: Sequence[Any], captions: Sequence[str] | None) -> None:
        caps = list(captions) if captions else [None] * len(images)
        self.run.log({f"samples/{name}": [self.wandb.Image(im.convert("RGB"), caption=c) for im, c in zip(images, caps)]},
                     step=step)

    def videos(self, step: int, name: str, videos: Sequence[Any], captions: Sequence[str] | None, fps: int) -> None:
        """uint8 [F, H, W, 3] clips as MP4 `wandb.Video`s (encoded here, so wandb needs no moviepy)."""
        import io

        from mmrl.pipelines.videos import encode_mp4

        caps = list(captions) if captions else [None] * len(videos)
        self.run.log({f"samples/{name}": [self.wandb.Video(io.BytesIO(encode_mp4(v, fps)), caption=c, format="mp4")
                                          for v, c in zip(videos, caps)]}, step=step)

    def close(self) -> None:
        self.run.finish()


# In-process listeners (the Python trainer API's `callbacks`): each gets every metrics row and sample grid like a
# tracker does, on the main process. Set for the duration of a run by `callbacks_active`.
_CALLBACKS: list = []


CALLBACK_METHODS = ("on_log", "on_samples", "on_videos", "on_save")


class CallbackTracker:
    """A callback as a tracker: a function `f(step, metrics)`, or an object with any of `on_log(step, metrics)`,
    `on_samples(step, name, images, captions)` (PIL images), `on_videos(step, name, videos, captions, fps)` (uint8
    [F, H, W, 3] clips), `on_save(step, checkpoint_dir)` (a complete checkpoint); an object whose `stop_requested`
    is true ends the run after the step (`stop_requested`)."""

    def __init__(self, callback: Any):
        self.callback = callback

    def log(self, step: int, row: dict) -> None:
        an_object = any(hasattr(self.callback, k) for k in CALLBACK_METHODS)  # else a function f(step, metrics)
        fn = getattr(self.callback, "on_log", None if an_object else self.callback)
        if fn is not None:
            fn(step, dict(row))

    def images(self, step: int, name: str, images: Sequence[Any], captions: Sequence[str] | None) -> None:
        fn = getattr(self.callback, "on_samples", None)
        if fn is not None:
            fn(step, name, list(images), list(captions or []))

    def videos(self, step: int, name: str, videos: Sequence[Any], captions: Sequence[str] | None, fps: int) -> None:
        fn = getattr(self.callback, "on_videos", None)
        if fn is not None:
            fn(step, name, list(videos), list(captions or []), fps)

    def saved(self, step: int, checkpoint: Path) -> None:
        fn = getattr(self.callback, "on_save", None)
        if fn is not None:
            fn(step, checkpoint)

    @property
    def stop_requested(self) -> bool:
        return bool(getattr(self.callback, "stop_requested", False))

    def close(self) -> None:
        pass


def check_callback(cb: Any, where: str = "callback") -> None:
    """TypeError unless `cb` is a function f(step, metrics) or an object with one of the callback methods."""
    if not (callable(cb) or any(hasattr(cb, k) for k in CALLBACK_METHODS)):
        raise TypeError(f"{where} {cb!r:.80}: expected a function f(step, metrics), an object with "
                        f"{' / '.join(CALLBACK_METHODS)}, or a transformers TrainerCallback")


def stop_requested(ctx: Any, run: Any) -> bool:
    """True when a callback asked the run to end after this step (a transformers callback's
    `control.should_training_stop`), the same on every rank (the main process decides)."""
    if not _CALLBACKS:
        return False
    asked = any(getattr(t, "stop_requested", False) for t in run.trackers)
    return bool(ctx.max_int(int(asked))) if ctx.enabled else asked


@contextmanager
def callbacks_active(callbacks: Sequence[Any]) -> Iterator[None]:
    """Every run started inside the block reports to `callbacks` too (see CallbackTracker)."""
    for cb in callbacks:
        check_callback(cb)
    before = list(_CALLBACKS)
    _CALLBACKS[:] = before + list(callbacks)
    try:
        yield
    finally:
        _CALLBACKS[:] = before


def _check_writable(name: str, directory: Path) -> None:
    """ValueError naming the tracker and the folder when the tracker could not write there (read-only, a file in
    the way, no permission): found before the tracker starts, whose own writer threads would print tracebacks."""
    from mmrl.run.files import probe_writable

    try:
        probe_writable(directory)
    except OSError as exc:
        raise ValueError(f"log.trackers: {name} cannot write into {directory} ({exc.strerror or exc}); make it "
                         f"writable, or leave {name} out of log.trackers") from None


def make_trackers(names: Sequence[str], run_dir: Path, config: dict, project: str = "mmrl",
                  wandb_mode: str = "offline") -> list:
    """Trackers for `log.trackers` (unknown names -> ValueError with the valid list; jsonl is always on), plus the
    active callbacks. A folder a tracker cannot write into is a ValueError naming it, before anything trains;
    trackers already started are closed."""
    out: list = [CallbackTracker(cb) for cb in _CALLBACKS]
    try:
        for name in names:
            if name not in TRACKERS:
                raise ValueError(f"log.trackers: unknown tracker {name!r}; valid: {list(TRACKERS)}")
            if name == "tensorboard":
                _check_writable(name, run_dir / "tensorboard")
                out.append(TensorBoardTracker(run_dir, config))
            elif name == "wandb":
                _check_writable(name, run_dir)  # wandb_id.txt
                _check_writable(name, run_dir / "wandb")
                out.append(WandbTracker(run_dir, config, project, wandb_mode))
    except BaseException as exc:
        for tracker in out:
            tracker.close()
        if isinstance(exc, OSError):  # a write the check above could not foresee (a full disk, ...)
            raise ValueError(f"log.trackers: cannot start {name} in {run_dir} ({exc.strerror or exc})") from None
        raise
    return out
