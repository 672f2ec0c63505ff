"""What `mmrl.Trainer` writes under `output_dir/inputs/` for the recipes to read as files: the datasets (lists as
JSON lines, a `datasets.Dataset` with `save_to_disk`), a loaded model object (`save_pretrained` into `inputs/model`),
and the reward functions registered in the zoo while a run (or an evaluation) uses them."""

from __future__ import annotations

import filecmp
import json
import math
import numbers
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from mmrl.config import ConfigError

INPUTS_DIR = "inputs"
VLM_TEXT = ("prompt", "problem")  # the prompt column and its alias (geometry3k's name)
VLM_IMAGES = ("images", "image")  # the image column (a list per row, or one image) and TRL's single-image name


# ------------------------------------------------------------------------------------------ reward functions
def reward_specs(funcs: Any, weights: Sequence[float] | None) -> list[tuple[str, Any, float]]:
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


@contextmanager
def rewards_registered(rewards: list[tuple[str, Any, float]]) -> Iterator[None]:
    """The Python reward functions in the zoo under their config names for the duration of the block (the zoo
    builds a reward by name with the run's keyword arguments, device=...: the same object is returned)."""
    from mmrl.rewards.registry import _REGISTRY

    saved = {name: _REGISTRY.get(name) for name, model, _ in rewards if model is not None}
    try:
        for name, model, _ in rewards:
            if model is not None:
                _REGISTRY[name] = (lambda m: lambda **_: m)(model)
        yield
    finally:
        for name, before in saved.items():
            if before is None:
                _REGISTRY.pop(name, None)
            else:
                _REGISTRY[name] = before


# ------------------------------------------------------------------------------------------ dataset rows
def prompt_row(row: Any, i: int) -> dict:
    """A diffusion prompt: a string, or a mapping with `prompt` (other keys: metadata for the rewards)."""
    if isinstance(row, str):
        return {"prompt": row}
    if isinstance(row, Mapping) and "prompt" in row:
        if not isinstance(row["prompt"], str):  # not trained on as its str()
            raise ConfigError(f"train/eval prompts: item {i}: 'prompt' is {type(row['prompt']).__name__} "
                              f"{row['prompt']!r:.60}, expected a string (the prompt text)")
        return dict(row)
    raise ConfigError(f"train/eval prompts: item {i} must be a string or a mapping with 'prompt', got {row!r:.80}")


def check_vqa_columns(columns: Sequence[str], first: Any, where: str, needs_answer: bool) -> None:
    """A VLM dataset's columns: `prompt` (alias `problem`) as text, at most one of `images` / `image`, and `answer`
    when a zoo reward scores against it."""
    if not any(c in columns for c in VLM_TEXT):
        raise ConfigError(f"{where}: no 'prompt' column (the question text; 'problem' is read as an alias), got "
                          f"columns {sorted(columns)}")
    if all(c in columns for c in VLM_IMAGES):
        raise ConfigError(f"{where}: both 'images' and 'image' columns; give the images in one of them")
    if needs_answer and "answer" not in columns:
        raise ConfigError(f"{where}: no 'answer' column, which the zoo rewards score against (exact_match, ...); add "
                          f"it, or score with a Python reward function")
    text = next(first[c] for c in VLM_TEXT if c in columns) if isinstance(first, Mapping) else None
    if text is not None and not isinstance(text, str):
        raise ConfigError(f"{where}: 'prompt' is {type(text).__name__} {text!r:.60}; expected text (TRL's "
                          f"conversational prompts, lists of messages, are not read: give the user text, its images "
                          f"in 'image' / 'images' and the system message as data.system_prompt)")


def vqa_row(image_dir: Path, needs_answer: bool) -> Callable[[Any, int], dict]:
    """A VLM row as the recipe's loader reads it: the text under `prompt`, images as file paths under `images` (an
    in-memory image is saved losslessly beside the rows), `answer` ("" when no zoo reward needs it)."""
    def convert(row: Any, i: int) -> dict:
        if not isinstance(row, Mapping):
            raise ConfigError(f"vlm dataset: row {i} must be a mapping with 'prompt' (and 'image' / 'images', "
                              f"'answer'), got {row!r:.80}")
        check_vqa_columns(list(row), row, f"vlm dataset: row {i}", needs_answer)
        out = dict(row)
        if "prompt" not in out:
            out["prompt"] = out.pop("problem")
        out.setdefault("answer", "")
        images = out.pop("image") if "image" in out else out.get("images") or []
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


def prepare_hf_vqa(data: Any, where: str, needs_answer: bool) -> Any:
    """A `datasets.Dataset` of VLM rows, checked, with an empty `answer` column added when none is needed."""
    check_vqa_columns(data.column_names, data[0] if len(data) else None, where, needs_answer)
    return data if "answer" in data.column_names else data.add_column("answer", [""] * len(data))


# ------------------------------------------------------------------------------------------ files
def has_checkpoint(out: Path) -> bool:
    return any((out / "checkpoints").glob("step_*"))


def write_dataset(data: Any, stem: Path, convert: Callable[[Any, int], dict], keep: bool = True) -> str:
    """A list (written as `<stem>.jsonl`) or a `datasets.Dataset` (`save_to_disk` into `<stem>/`); returns the path.
    With `keep`, a run that already has checkpoints keeps its inputs: different data for it is refused (its data
    position would silently mean other rows)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    locked = keep and has_checkpoint(stem.parent.parent)
    if is_hf_dataset(data):
        target = stem
        fingerprint = str(getattr(data, "_fingerprint", None))
        marker = stem.parent / f"{stem.name}.fingerprint"
        if marker.is_file() and target.is_dir() and marker.read_text().strip() == fingerprint:
            return str(target)  # written before (an earlier call, or another process of the same launch)
        if locked and marker.is_file():
            raise ConfigError(_changed(target))
        # written beside and renamed: processes of one launch (each runs this) never see half a dataset
        tmp = stem.with_name(f".{stem.name}.tmp-{os.getpid()}")
        data.save_to_disk(str(tmp))
        shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:  # another process renamed its identical copy first
            shutil.rmtree(tmp, ignore_errors=True)
        atomic_write(marker, f"{fingerprint}\n")
        return str(target)
    if isinstance(data, (str, bytes)) or not isinstance(data, Sequence):
        raise ConfigError(f"dataset: expected a list or a datasets.Dataset, got {type(data).__name__}")
    target = stem.with_suffix(".jsonl")
    text = "".join(json.dumps(convert(row, i), ensure_ascii=False, default=str) + "\n" for i, row in enumerate(data))
    if not text:
        raise ConfigError(f"dataset for {target.name}: empty")
    if target.is_file() and target.read_text() == text:
        return str(target)
    if locked and target.is_file():
        raise ConfigError(_changed(target))
    atomic_write(target, text)
    return str(target)


def write_model(model: Any, processor: Any, target: Path) -> str:
    """A loaded diffusers pipeline / transformers model (+ its processor) saved with `save_pretrained` into
    `target`, which the run then loads as `model.path`. Saved beside and compared: an identical earlier save stays;
    a different model for a run that has checkpoints is refused (they were trained from the earlier one)."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(str(tmp))
        if processor is not None:
            processor.save_pretrained(str(tmp))
        if target.is_dir():
            if _same_files(tmp, target):
                return str(target)
            if has_checkpoint(target.parent.parent):
                raise ConfigError(f"the model differs from the one this run was started with ({target}); a resumed run "
                                  f"keeps its base model: use a new output_dir")
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    if names != sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()):
        return False
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def remove_new_inputs(out: Path, dir_existed: bool, inputs_before: set[Path] | None) -> None:
    """A start that failed before the run wrote a metrics row or a checkpoint leaves nothing (the recipe removes
    what its own start created): the inputs this call wrote go too, and `out` when this call created it."""
    if (out / "metrics.jsonl").exists() or has_checkpoint(out):
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


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _changed(target: Path) -> str:
    return (f"the dataset differs from the one this run was started with ({target}); a resumed run keeps its data: "
            f"use a new output_dir (or train.resume=never train.overwrite=true to start over)")


def is_hf_dataset(data: Any) -> bool:
    return type(data).__module__.startswith("datasets") and hasattr(data, "save_to_disk")
