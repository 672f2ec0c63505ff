"""The run directory of a training run (`Run`): created or resumed under its lock (`mmrl.run.lock`) and the resume
rules (`mmrl.run.resume`), config.yaml, metrics.jsonl, atomic checkpoints (`Run.checkpoint`, files checked by
`mmrl.run.files`), samples and the reward curve (`mmrl.run.plots`), the trackers (`mmrl.run.trackers`); and the
runs a process has open (`close_runs`, for `mmrl.run.start.closes_runs`)."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
import warnings
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from mmrl.run.files import (COMPLETE_MARKER, RunError, checkpoint_step, disk_full, list_checkpoints, load_state_file,
                            verify_checkpoint, write_manifest)
from mmrl.run.lock import RunLock, StartRecord
from mmrl.run.plots import plot_reward_curve, write_samples
from mmrl.run.resume import preflight
from mmrl.runtime import resolve_device, resolve_dtype, seed_everything

_STARTED_RUN_DIR: Path | None = None  # run directory of the newest Run this process opened (past its checks)
_OPEN_RUNS: list[weakref.ref] = []  # Runs of this process not closed yet (`close_runs`), oldest first


def close_runs(since: int = 0, failed: bool = False) -> None:
    """Close the open Runs of this process opened after the first `since` (`Run.close`): what a recipe's train()
    opened, once it has returned or raised (`mmrl.run.closes_runs`)."""
    for ref in list(_OPEN_RUNS[since:]):
        run = ref()
        if run is not None:
            run.close(failed=failed)


def open_runs() -> int:
    """How many Runs of this process are open."""
    return len(_OPEN_RUNS)


def started_run_dir() -> Path | None:
    """The run directory of the newest `Run` that passed its start-up checks in this process, if any."""
    return _STARTED_RUN_DIR


def _jsonable(value: Any) -> Any:
    """A metric value as strict JSON: tensors / numpy values -> numbers or (nested) lists, NaN/inf -> null
    (metrics.jsonl never holds the non-standard NaN / Infinity literals)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().float().cpu()
        value = value.item() if value.numel() == 1 else value.tolist()
    elif isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, (np.floating, np.integer, np.bool_)):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


class Run:
    """The run directory of one training run and everything written into it.

    ``Run(cfg)`` needs only the common keys of ``mmrl.config.RunConfig``.
    """

    def __init__(self, cfg: Any, write_config: bool = True):
        from mmrl.config import to_yaml

        global _STARTED_RUN_DIR
        _STARTED_RUN_DIR = None  # until this run has passed its checks
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
        self.metrics_path = self.dir / "metrics.jsonl"
        if self.dir.exists() and not self.dir.is_dir():
            raise ValueError(f"output_dir: {str(self.dir)!r} exists and is not a directory")
        self.is_main = write_config
        self.lock, self.trackers = None, []
        self.start = StartRecord([self.dir, self.ckpt_dir, self.samples_dir, self.plots_dir, self.metrics_path],
                                 self.dir / "config.yaml")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if write_config:  # only the main process writes, so only it holds the directory's lock
                self.lock = RunLock.acquire(self.dir, owner=self)
                if self.lock.note:
                    print(f"[mmrl] {self.lock.note}", file=sys.stderr, flush=True)
            for d in (self.ckpt_dir, self.samples_dir, self.plots_dir):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self.close(failed=True)
            raise ValueError(f"output_dir: cannot create the run directory {str(self.dir)!r}: {exc}") from None
        except BaseException:
            self.close(failed=True)
            raise
        try:
            self._open(cfg, to_yaml(cfg))
        except BaseException:
            self.close(failed=True)
            raise
        _OPEN_RUNS.append(weakref.ref(self))
        _STARTED_RUN_DIR = self.dir.resolve()

    def _open(self, cfg: Any, config_text: str) -> None:
        """The start of a run past its directory and lock: clean-up, resume checks, config.yaml, trackers."""
        if int(getattr(cfg, "num_threads", 0) or 0) > 0:
            torch.set_num_threads(int(cfg.num_threads))
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype)
        seed_everything(cfg.seed)
        self._config_text = config_text
        self._verified: dict[Path, str | None] = {}  # checkpoint -> None (sound) or why it is not
        self._warned: set[Path] = set()
        if self.is_main:  # under the lock: a half-written checkpoint of an interrupted run is never used
            for child in self.ckpt_dir.glob(".tmp-*"):
                shutil.rmtree(child, ignore_errors=True)
        resuming = self._preflight()
        # config.yaml of a run being resumed is replaced only once the resume has worked (first metrics row or
        # checkpoint): a refused or failed resume leaves the run's own config.yaml as it was
        self._config_pending = self.is_main
        if self.is_main and not (resuming and (self.dir / "config.yaml").is_file()):
            self._write_config()
        self._t0 = time.time()
        self.trackers = self._make_trackers() if self.is_main else []

    def close(self, failed: bool = False) -> None:
        """End this run's hold on its directory (idempotent): trackers closed, the lock released. `failed` and
        nothing written yet (no metrics row, checkpoint or sample): what the start created is removed too, so a run
        that fails its start-up (a bad path, a bad size, a model that does not load) leaves nothing behind."""
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception:  # noqa: BLE001 - a tracker that cannot close loses only its own files
                pass
        self.trackers = []
        if self.lock is not None and failed and not self.start.wrote:  # only under its own lock
            self.start.undo(self.dir)
            global _STARTED_RUN_DIR
            _STARTED_RUN_DIR = None  # nothing to resume from: no "rerun to resume" hint
        if self.lock is not None:
            self.lock.release(owner=self)
            self.lock = None
        _OPEN_RUNS[:] = [r for r in _OPEN_RUNS if r() is not None and r() is not self]

    def _make_trackers(self) -> list:
        """`log.trackers` (tensorboard, wandb) of the config and the active callbacks; jsonl is always on
        (mmrl.run.trackers)."""
        log = getattr(self.cfg, "log", None)
        names = [n for n in (getattr(log, "trackers", None) or []) if n != "jsonl"]
        if names:  # what a failed start removes again (callbacks write nothing into the run directory)
            self.start.note(self.dir / "tensorboard", self.dir / "wandb", self.dir / "wandb_id.txt")
        from mmrl.config import to_dict
        from mmrl.run.trackers import make_trackers

        return make_trackers(names, self.dir, to_dict(self.cfg), project=getattr(log, "wandb_project", "mmrl"),
                             wandb_mode=getattr(log, "wandb_mode", "offline"))

    def check_lock(self) -> None:
        """Before every write into the run directory: this run still holds it (`RunLock.check`). When another run
        has taken it, RunError, without the "rerun to resume" hint (the directory is that run's now)."""
        if self.lock is None:
            return
        try:
            self.lock.check()
        except RunError:
            global _STARTED_RUN_DIR
            _STARTED_RUN_DIR = None
            raise

    def _write_config(self) -> None:
        if self._config_pending:
            self.check_lock()
            tmp = self.dir / "config.yaml.tmp"
            tmp.write_text(self._config_text)
            os.replace(tmp, self.dir / "config.yaml")
            self._config_pending = False

    def _preflight(self) -> Path | None:
        """`mmrl.run.resume.preflight`: refuse a start that would discard the directory's run, check the config
        changes of a resume. Returns the checkpoint to resume from."""
        return preflight(self)

    # ---------------------------------------------------------------- metrics
    def log(self, step: int, metrics: dict[str, Any]) -> dict:
        """Append one JSON line `{"step": step, **metrics}` to metrics.jsonl (flushed)."""
        self.check_lock()
        self._write_config()  # a resumed run's config.yaml, now that the resume has worked
        self.start.wrote = True
        row = {"step": int(step)}
        row.update({k: _jsonable(v) for k, v in metrics.items()})
        line = json.dumps(row, allow_nan=False)  # strict JSON: _jsonable turned NaN/inf into null
        with open(self.metrics_path, "a") as f:
            f.write(line + "\n")
            f.flush()
        for tracker in self.trackers:
            tracker.log(int(step), row)
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
        self.check_lock()
        rows = [r for r in self.read_metrics() if r.get("step", 0) <= step]
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, self.metrics_path)

    # ---------------------------------------------------------------- checkpoints
    def find_resume(self) -> Path | None:
        """Checkpoint to resume from according to `train.resume` (auto | never | PATH).

        Every candidate is verified against its MANIFEST.json. An explicit PATH that fails is an error naming
        the file; with `auto` a corrupt newest checkpoint is skipped for the previous sound one, with a warning."""
        mode = str(self.cfg.train.resume)
        if mode == "never":
            return None
        if mode != "auto":
            checkpoint_step(mode)  # validates
            problem = self._check(Path(mode))
            if problem:
                raise RunError(f"train.resume={mode}: {problem}")
            return Path(mode)
        ckpts = list_checkpoints(self.ckpt_dir)
        sound_step, sound = next(((s, p) for s, p in reversed(ckpts) if self._check(p) is None), (-1, None))
        if ckpts and sound is None and not getattr(self.cfg.train, "overwrite", False):  # never a silent restart
            raise RunError(f"every checkpoint of {self.dir} is unusable ({'; '.join(self._check(p) for _, p in ckpts)})"
                           f": starting again from step 0 would overwrite the run's metrics.jsonl; restore a sound "
                           f"checkpoint, or pass train.overwrite=true to start again from step 0")
        for step, path in ckpts:  # the newer ones skipped (older unusable ones do not matter)
            if step > sound_step and path not in self._warned:
                self._warned.add(path)
                instead = "the previous complete checkpoint" if sound is not None else "step 0 (train.overwrite=true)"
                warnings.warn(f"{self._check(path)}; resuming from {instead} instead", RuntimeWarning, stacklevel=2)
        return sound

    def _check(self, path: Path) -> str | None:
        path = Path(path)
        if path not in self._verified:
            try:
                verify_checkpoint(path)
                self._verified[path] = None
            except RunError as exc:
                self._verified[path] = str(exc)
        return self._verified[path]

    @contextmanager
    def checkpoint(self, step: int) -> Iterator[Path]:
        """Write a checkpoint atomically: yields a temp dir; on success marks it complete and renames it
        to checkpoints/step_<N>/, deletes complete checkpoints with a step > N (an abandoned timeline) and
        prunes to keep_last. An exception (or a kill) leaves no step_<N> behind."""
        self.check_lock()
        tmp = self.ckpt_dir / f".tmp-step_{step}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        try:
            try:
                yield tmp
                (tmp / "config.yaml").write_text(self._config_text)  # the config this state was trained with
                write_manifest(tmp)
                (tmp / COMPLETE_MARKER).write_text(json.dumps({"step": step, "time": time.time()}))
            except Exception as exc:
                if disk_full(exc, self.ckpt_dir):
                    newest = list_checkpoints(self.ckpt_dir)
                    keep = f"the newest complete checkpoint is {newest[-1][1]}" if newest else "no complete checkpoint exists yet"
                    raise RunError(f"no space left on the device of {self.ckpt_dir} while writing checkpoint step_{step} "
                                   f"({type(exc).__name__}: {str(exc)[:120]}); nothing half-written was kept and "
                                   f"{keep}: free space, then rerun to resume") from exc
                raise
            self.check_lock()  # (a long save: the directory is still this run's)
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
        self._verified[final] = None
        self.start.wrote = True
        self._write_config()
        self._drop_later_than(step)
        self._prune()
        for tracker in self.trackers:  # the callbacks' on_save
            saved = getattr(tracker, "saved", None)
            if saved is not None:
                saved(step, final)

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
        """state.pt of a checkpoint, loaded with `weights_only=True` (tensors, containers, numbers and the numpy
        arrays of the RNG state only): a foreign run directory cannot run code here."""
        path = Path(directory) / "state.pt"
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint state file missing: {path}")
        return load_state_file(path)

    # ---------------------------------------------------------------- progress and outputs
    def progress(self, total: int, initial: int = 0, desc: str | None = None):
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc=desc or getattr(self.cfg, "algorithm", "train"),
                    dynamic_ncols=True, disable=os.environ.get("MMRL_NO_PROGRESS") == "1")

    def save_samples(self, step: int, images: torch.Tensor, captions: list[str] | None = None,
                     name: str | None = None, title: str | None = None, **sound: Any) -> Path:
        """A grid of the samples in samples/ (PNG with `title` above it; videos [N, F, 3, H, W]: MP4), also sent to
        the trackers; `sound`: `audio`, `sample_rate`, `fps` of `write_samples` (a WAV and an MP4 with sound per
        sample)."""
        self.check_lock()
        self.start.wrote = True
        return write_samples(self.samples_dir, self.trackers, step, images, captions, name, title, **sound)

    def finish(self, extra: dict | None = None, axis: dict | None = None) -> dict:
        """Write plots/reward_curve.png (`axis`: the reward's `unit` and `value_range`, `mmrl.training.summary.
        reward_axis`) and return a summary of the run's metrics."""
        self.check_lock()
        rows = self.read_metrics()
        summary: dict[str, Any] = {"output_dir": str(self.dir), "steps_logged": len(rows)}
        if rows:
            plot_reward_curve(rows, self.plots_dir / "reward_curve.png", **(axis or {}))
            rewards = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
            if rewards:
                k = min(5, len(rewards))
                summary["reward_first"] = float(np.mean(rewards[:k]))
                summary["reward_last"] = float(np.mean(rewards[-k:]))
        summary["wall_s"] = time.time() - self._t0
        self.close()
        if extra:
            summary.update(extra)
        return summary


