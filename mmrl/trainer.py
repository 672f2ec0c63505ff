"""The Python trainer API: a recipe run from Python objects instead of a YAML file, in the shape TRL users know.

    import mmrl

    def brightness(images, prompts, **kwargs):                 # one float per image, images float NCHW in [0, 1]
        return images.mean(dim=(1, 2, 3))

    trainer = mmrl.Trainer("flow_grpo", model="assets/tiny_sd3_shapes", reward_funcs=[brightness, "jpeg_compressibility"],
                           reward_weights=[1.0, 0.1], train_dataset=["a red circle on a blue background", ...],
                           output_dir="runs/api", overrides={"train.max_steps": 20})
    summary = trainer.train()                                  # what `mmrl train` prints; checkpoints as usual

It is a thin layer over the recipes' `train(cfg)`, not a second engine: the arguments become a config (written to
`output_dir/config.yaml` like any run), prompts and rows are written under `output_dir/inputs/` and named by
`data.*`, reward functions are registered in the reward zoo for the run under the names `python:<function name>`
and named by the reward section. So a run started here is the same run `mmrl train` makes: same checkpoints,
metrics, sample grids, resume (call `train()` again with the same arguments), `mmrl eval` and `mmrl export`.

Arguments:
- `recipe`: a recipe name (`"flow_grpo"`, `"vlm_grpo"`, ...: its defaults), a YAML path, a dict, or a config object.
- `model`: `model.path` (a local diffusers pipeline / transformers model directory).
- `reward_funcs`: one or a list of: a Python function (see `mmrl.rewards.callable`: image rewards take `images`,
  text rewards `completions`; dataset columns arrive as keyword lists), a zoo name (`"ocr"`), or a RewardModel;
  `reward_weights` (default 1 each) weight them in a composite reward.
- `train_dataset` / `eval_dataset`: diffusion recipes take prompts (a list of strings, of dicts with `prompt` and
  metadata columns, or a `datasets.Dataset` with a `prompt` column); `vlm_grpo` takes visual QA rows (dicts or a
  `datasets.Dataset` with `problem`, `answer` and optionally `images`: PIL images or paths).
- `overrides`: dotted config keys (`{"train.max_steps": 20}` or `["train.max_steps=20"]`).
- `callbacks`: functions `f(step, metrics)` or objects with `on_log(step, metrics)`, `on_samples(step, name, images,
  captions)`, `on_train_end(summary)`; called on the main process.
"""

from __future__ import annotations

import copy
import json
import math
import numbers
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from mmrl.config import RECIPES, ConfigError, RunConfig, apply_overrides, default_config, load_config, recipe_module

__all__ = ["Trainer"]

INPUTS_DIR = "inputs"


class Trainer:
    """A recipe run built from Python objects (see the module docstring); `train()` runs it."""

    def __init__(self, recipe: str | Path | dict | RunConfig, *, model: str | Path | None = None,
                 reward_funcs: Any = None, reward_weights: Sequence[float] | None = None,
                 train_dataset: Any = None, eval_dataset: Any = None, output_dir: str | Path | None = None,
                 overrides: Mapping[str, Any] | Sequence[str] = (), callbacks: Sequence[Any] = ()):
        self.config = _base_config(recipe)
        self.family = RECIPES[self.config.algorithm].split(".")[1]  # "diffusion" | "vlm"
        items = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in overrides.items()] \
            if isinstance(overrides, Mapping) else list(overrides)
        if model is not None:
            items.insert(0, f"model.path={model}")
        if output_dir is not None:
            items.insert(0, f"output_dir={output_dir}")
        apply_overrides(self.config, items)
        self.rewards = _reward_specs(reward_funcs, reward_weights)
        if self.rewards and self.config.algorithm == "vlm_multiturn":
            raise ConfigError("vlm_multiturn takes its rewards from its environments (env.tasks); reward_funcs is not "
                              "used: pass rewards through an Env (mmrl.vlm.envs)")
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.callbacks = list(callbacks)
        if self.rewards:
            self._set_reward_config()

    # ------------------------------------------------------------------ config
    def _set_reward_config(self) -> None:
        names = {name: weight for name, _, weight in self.rewards}
        if self.family == "diffusion":
            self.config.reward.components = names
        elif len(names) == 1 and next(iter(names.values())) == 1.0:
            self.config.reward.name, self.config.reward.kwargs = next(iter(names)), {}
        else:
            self.config.reward.name, self.config.reward.kwargs = "composite", {"components": names}

    def _write_inputs(self, cfg: RunConfig) -> None:
        """Datasets -> files under output_dir/inputs/, named by `cfg`'s data keys (the recipes read files)."""
        inputs = Path(cfg.output_dir) / INPUTS_DIR
        d = cfg.data if hasattr(cfg, "data") else None
        if self.family == "diffusion":
            if self.train_dataset is not None:
                d.train_prompts = _write_dataset(self.train_dataset, inputs / "train_prompts", _prompt_row)
            if self.eval_dataset is not None:
                d.eval_prompts = _write_dataset(self.eval_dataset, inputs / "eval_prompts", _prompt_row)
        elif cfg.algorithm == "vlm_grpo":
            if self.train_dataset is not None:
                d.kind = "geo3k"
                d.path = _write_dataset(self.train_dataset, inputs / "train", _vqa_row(inputs / "images" / "train"))
            if self.eval_dataset is not None:
                d.val_path = _write_dataset(self.eval_dataset, inputs / "eval", _vqa_row(inputs / "images" / "eval"))
        elif self.train_dataset is not None or self.eval_dataset is not None:
            raise ConfigError(f"{cfg.algorithm}: train_dataset / eval_dataset are not used by this recipe (its data "
                              f"comes from env.tasks or the config's data section)")

    # ------------------------------------------------------------------ running
    def train(self) -> dict:
        """Run the recipe (resuming from `output_dir`'s newest checkpoint, as `mmrl train` does); returns its summary."""
        from mmrl.rewards.registry import _REGISTRY
        from mmrl.run.trackers import callbacks_active

        cfg = copy.deepcopy(self.config)
        saved = {name: _REGISTRY.get(name) for name, model, _ in self.rewards if model is not None}
        out, inputs = Path(cfg.output_dir), Path(cfg.output_dir) / INPUTS_DIR
        before = (out.exists(), set(inputs.iterdir()) if inputs.is_dir() else None)
        try:
            for name, model, _ in self.rewards:
                if model is not None:  # the zoo builds it by name with the run's kwargs (device=...): same object
                    _REGISTRY[name] = _constant_factory(model)
            self._write_inputs(cfg)
            with callbacks_active(self.callbacks):
                summary = recipe_module(cfg.algorithm).train(cfg)
        except BaseException:
            _remove_new_inputs(out, *before)
            raise
        finally:
            for name, before in saved.items():
                if before is None:
                    _REGISTRY.pop(name, None)
                else:
                    _REGISTRY[name] = before
        self.last_config = cfg
        for cb in self.callbacks:
            if hasattr(cb, "on_train_end"):
                cb.on_train_end(summary)
        return summary


def _remove_new_inputs(out: Path, dir_existed: bool, inputs_before: set[Path] | None) -> None:
    """A start that failed before the run wrote a metrics row or a checkpoint leaves nothing (the recipe removes
    what its own start created): the inputs this call wrote go too, and `out` when this call created it."""
    if (out / "metrics.jsonl").exists() or any((out / "checkpoints").glob("step_*")):
        return  # the run had started: its inputs stay with it (a rerun resumes on them)
    inputs = out / INPUTS_DIR
    new = [inputs] if inputs_before is None else \
        [p for p in (inputs.iterdir() if inputs.is_dir() else ()) if p not in inputs_before]
    for p in new:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if not dir_existed and out.is_dir() and not any(out.iterdir()):
        out.rmdir()


def _base_config(recipe: Any) -> RunConfig:
    if isinstance(recipe, RunConfig):
        return copy.deepcopy(recipe)
    if isinstance(recipe, str) and recipe in RECIPES:
        return default_config(recipe)
    if isinstance(recipe, (str, Path, dict)):
        return load_config(recipe)
    raise ConfigError(f"Trainer: recipe must be a recipe name {sorted(RECIPES)}, a YAML path, a dict or a config, "
                      f"got {type(recipe).__name__}")


def _constant_factory(model: Any) -> Callable[..., Any]:
    def build(**_: Any) -> Any:
        return model

    return build


def _reward_specs(funcs: Any, weights: Sequence[float] | None) -> list[tuple[str, Any, float]]:
    """[(name in the config, RewardModel to register or None for a zoo name, weight)]."""
    from mmrl.rewards import RewardModel, available, from_callable

    if funcs is None:
        return []
    funcs = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
    weights = [1.0] * len(funcs) if weights is None else list(weights)
    for i, w in enumerate(weights):  # a NaN weight makes every summed reward NaN: refused here, not at step 1
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
            raise ConfigError(f"reward_weights[{i}]: expected a finite number, got {w!r}")
    weights = [float(w) for w in weights]
    if len(weights) != len(funcs):
        raise ConfigError(f"reward_weights: {len(weights)} weights for {len(funcs)} reward functions")
    out, used = [], set()
    for f, w in zip(funcs, weights):
        if isinstance(f, str):
            if f not in available():
                raise ConfigError(f"reward_funcs: unknown reward {f!r}; available: {available()}")
            name, model = f, None
        else:
            model = f if isinstance(f, RewardModel) else from_callable(f)
            name = f"python:{model.name}"
        base, k = name, 2
        while name in used:  # two functions of one name: python:f, python:f_2
            name, k = f"{base}_{k}", k + 1
        used.add(name)
        out.append((name, model, w))
    return out


# ------------------------------------------------------------------------------------------- datasets -> files
def _prompt_row(row: Any, i: int) -> dict:
    if isinstance(row, str):
        return {"prompt": row}
    if isinstance(row, Mapping) and "prompt" in row:
        if not isinstance(row["prompt"], str):  # not trained on as its str()
            raise ConfigError(f"train/eval prompts: item {i}: 'prompt' is {type(row['prompt']).__name__} "
                              f"{row['prompt']!r:.60}, expected a string (the prompt text)")
        return dict(row)
    raise ConfigError(f"train/eval prompts: item {i} must be a string or a mapping with 'prompt', got {row!r:.80}")


def _vqa_row(image_dir: Path) -> Callable[[Any, int], dict]:
    def convert(row: Any, i: int) -> dict:
        if not isinstance(row, Mapping) or "problem" not in row or "answer" not in row:
            raise ConfigError(f"vlm_grpo dataset: row {i} must be a mapping with 'problem', 'answer' (and optionally "
                              f"'images'), got {row!r:.80}")
        out = dict(row)
        images = out.get("images") or []
        images = images if isinstance(images, (list, tuple)) else [images]
        refs = []
        for j, im in enumerate(images):
            if isinstance(im, (str, Path)):
                refs.append(str(Path(im).resolve()))
            else:  # an in-memory image: saved losslessly beside the rows
                from mmrl.pipelines.images import load_image

                image_dir.mkdir(parents=True, exist_ok=True)
                path = image_dir / f"{i:06d}_{j}.png"
                tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
                load_image(im).save(tmp)
                os.replace(tmp, path)  # each process of a launch writes the same file: never half of one
                refs.append(str(path.resolve()))
        out["images"] = refs
        return out

    return convert


def _write_dataset(data: Any, stem: Path, convert: Callable[[Any, int], dict]) -> str:
    """A list (written as `<stem>.jsonl`) or a `datasets.Dataset` (`save_to_disk` into `<stem>/`); returns the path.
    A run that already has checkpoints keeps its inputs: different data for it is refused (its data position would
    silently mean other rows)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    has_checkpoint = any((stem.parent.parent / "checkpoints").glob("step_*"))
    if _is_hf_dataset(data):
        target = stem
        fingerprint = str(getattr(data, "_fingerprint", None))
        marker = stem.parent / f"{stem.name}.fingerprint"
        if marker.is_file() and target.is_dir() and marker.read_text().strip() == fingerprint:
            return str(target)  # written before (an earlier call, or another process of the same launch)
        if has_checkpoint and marker.is_file():
            raise ConfigError(_changed(target))
        # written beside and renamed: processes of one launch (each runs this) never see half a dataset
        tmp = stem.with_name(f".{stem.name}.tmp-{os.getpid()}")
        data.save_to_disk(str(tmp))
        shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:  # another process renamed its identical copy first
            shutil.rmtree(tmp, ignore_errors=True)
        _atomic_write(marker, f"{fingerprint}\n")
        return str(target)
    if isinstance(data, (str, bytes)) or not isinstance(data, Sequence):
        raise ConfigError(f"dataset: expected a list or a datasets.Dataset, got {type(data).__name__}")
    target = stem.with_suffix(".jsonl")
    text = "".join(json.dumps(convert(row, i), ensure_ascii=False, default=str) + "\n" for i, row in enumerate(data))
    if not text:
        raise ConfigError(f"dataset for {target.name}: empty")
    if target.is_file() and target.read_text() == text:
        return str(target)
    if has_checkpoint and target.is_file():
        raise ConfigError(_changed(target))
    _atomic_write(target, text)
    return str(target)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _changed(target: Path) -> str:
    return (f"the dataset differs from the one this run was started with ({target}); a resumed run keeps its data: "
            f"use a new output_dir (or train.resume=never train.overwrite=true to start over)")


def _is_hf_dataset(data: Any) -> bool:
    return type(data).__module__.startswith("datasets") and hasattr(data, "save_to_disk")
