"""Which config keys may change when a run resumes, and what a resume with changed keys is refused for.

The promise: every key a resume reports as changed takes effect from the resumed step on, or the resume is refused
at start with one line naming the key. Keys fall into three groups:

- frozen (`FROZEN_ON_RESUME`): the saved state would not fit (model and adapter shapes) or would silently mean
  something else (a data position in another prompt file or another subset, another seed's noise, a warm start
  that only runs before step 1);
- refused for one direction of change (`CONDITIONAL_ON_RESUME`): a change that asks for a policy state the
  checkpoint does not hold (an EMA "old" policy turned on, a KL reference snapshot in full fine-tuning);
- every other key: read by the recipe from the config after the resume. The state a checkpoint restores is built
  from the config first and then loaded, so a restored object never carries an old setting past the resume:
  optimizer hyper-parameters and the LR schedule are re-applied from the config after loading
  (`mmrl.training.optim.LRSchedule.apply_config`), the reward history keeps the newest `reward.history` values, and
  state a newly enabled option needs (the running reward statistics of `reward.running_norm`) starts empty.

Mapping-valued fields (`reward.components`, `env.tasks`, ...) are compared as one value, so a component added or
removed is reported too.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import typing
import warnings
from pathlib import Path
from typing import Any, Callable

FROZEN_ON_RESUME = ("algorithm", "seed", "model.", "data.train_prompts", "data.preference_file", "data.image_root",
                    "data.kind", "data.path", "data.limit", "data.min_score_gap", "algo.mode", "env.tasks",
                    "env.modules", "warm_start.",
                    "rollout.worker", "rollout.max_staleness")  # a checkpoint holds the batches these put in flight
"""A key is frozen when it equals an entry or lies under it (an entry ending in "." or naming a section)."""
MUTABLE_ON_RESUME = ("model.gradient_checkpointing",)
_NOT_COMPARED = ("output_dir", "train.resume", "train.overwrite")


def _ema_turned_on(old: Any, new: Any, current: dict[str, Any]) -> str | None:
    if not old and new:
        return "the checkpoint holds no EMA ('old') policy state to continue from"
    return None


def _reference_snapshot_added(old: Any, new: Any, current: dict[str, Any]) -> str | None:
    if (old or 0) > 0 or not (new or 0) > 0 or current.get("model.lora.rank", 1) != 0:
        return None
    return ("full fine-tuning keeps the KL reference as a copy of the weights taken at step 0, and this run's "
            "checkpoints hold none (they were written with the KL term off)")


CONDITIONAL_ON_RESUME: dict[str, Callable[[Any, Any, dict[str, Any]], str | None]] = {
    "algo.ema": _ema_turned_on,
    "algo.kl.coef": _reference_snapshot_added,
}
"""key -> rule(saved value, current value, current flat config) -> why the change cannot take effect, or None."""


def mapping_fields(cls: type, prefix: str = "") -> set[str]:
    """Dotted names of the mapping-valued (`dict[...]`) fields of a config dataclass and its sections."""
    out: set[str] = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out |= mapping_fields(tp, f"{prefix}{f.name}.")
        elif typing.get_origin(tp) is dict or tp is dict:
            out.add(prefix + f.name)
    return out


def flatten(d: Any, prefix: str = "", leaves: set[str] | frozenset = frozenset()) -> dict[str, Any]:
    """{dotted key: value} of a nested dict; the dotted names in `leaves` stay whole (mapping-valued fields)."""
    out: dict[str, Any] = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and key not in leaves:
            out.update(flatten(v, key + ".", leaves))
        else:
            out[key] = v
    return out


def config_changes(saved: dict, current: dict, leaves: set[str] | frozenset = frozenset()
                   ) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) for every key present in both configs whose value differs (sections
    compared key by key, the mapping-valued fields named in `leaves` as a whole; keys that another mmrl version
    added or removed are not reported)."""
    a, b = flatten(saved, leaves=leaves), flatten(current, leaves=leaves)
    return [(k, a[k], b[k]) for k in b if k in a and a[k] != b[k] and k not in _NOT_COMPARED]


def is_frozen_on_resume(key: str) -> bool:
    if key in MUTABLE_ON_RESUME:
        return False
    return any(key == f or key.startswith(f if f.endswith(".") else f + ".") for f in FROZEN_ON_RESUME)


def refused_changes(changes: list[tuple[str, Any, Any]], current: dict[str, Any]) -> list[str]:
    """Why each refused change (frozen key, or a conditional rule that says no) cannot take effect: one phrase
    per change, naming the key and both values."""
    out = []
    for key, old, new in changes:
        if is_frozen_on_resume(key):
            out.append(f"{key}: {old!r} -> {new!r}")
            continue
        rule = CONDITIONAL_ON_RESUME.get(key)
        why = rule(old, new, current) if rule is not None else None
        if why:
            out.append(f"{key}: {old!r} -> {new!r} ({why})")
    return out


def check_resume_config(cfg: Any, resume: Path, run_dir: Path, report: bool = True) -> None:
    """Compare `cfg` with the config `resume` was trained with (its own config.yaml, else the run's): refuse changes
    that cannot take effect (ConfigError naming each), print the others (`report`)."""
    import yaml

    from mmrl.config import ConfigError, to_dict

    saved_path = resume / "config.yaml" if (resume / "config.yaml").is_file() else run_dir / "config.yaml"
    if not saved_path.is_file():
        return
    try:
        saved = yaml.safe_load(saved_path.read_text()) or {}
    except Exception as exc:  # noqa: BLE001 - an unreadable saved config only loses the comparison
        warnings.warn(f"resume: cannot read {saved_path} to compare configs ({exc})", RuntimeWarning, stacklevel=3)
        return
    current = to_dict(cfg)
    changes = config_changes(saved, current, mapping_fields(type(cfg)))
    refused = refused_changes(changes, flatten(current))
    if refused:
        raise ConfigError(f"cannot resume {resume} with a changed {'; '.join(refused)} (saved in {saved_path}); "
                          f"these cannot change mid-run: use another output_dir, or train.resume=never "
                          f"train.overwrite=true to start again")
    if changes and report:
        print(f"[mmrl] resuming {resume} with config changes (saved in {saved_path}); each takes effect from the "
              f"resumed step on:", file=sys.stderr)
        for k, a, b in changes:
            print(f"[mmrl]   {k}: {a!r} -> {b!r}", file=sys.stderr)


def preflight(run: Any) -> Path | None:
    """Refuse a start that would discard what `run`'s directory holds (unless train.overwrite), then check the config
    changes of a resume (`check_resume_config`). Returns the checkpoint to resume from (`run.find_resume()`)."""
    from mmrl.run.files import RunError, checkpoint_step, list_checkpoints

    cfg, mode = run.cfg, str(run.cfg.train.resume)
    overwrite = bool(getattr(cfg.train, "overwrite", False))
    ckpts = list_checkpoints(run.ckpt_dir)
    lost: list[str] = []
    doomed: list[Path] = []
    if mode == "never":
        rows = run.read_metrics()
        doomed = [p for _, p in ckpts]
        if doomed:
            lost.append(f"{len(doomed)} checkpoint(s) ({', '.join(p.name for p in doomed)})")
        if rows:
            lost.append(f"{len(rows)} row(s) of metrics.jsonl (steps {rows[0].get('step')}..{rows[-1].get('step')})")
    elif mode != "auto":
        target = checkpoint_step(mode)
        doomed = [p for step, p in ckpts if step > target]
        if doomed:
            lost.append(f"the later checkpoint(s) {', '.join(p.name for p in doomed)} (a resumed run continues "
                        f"from step {target}, so they would be deleted at its first save)")
    if lost and not overwrite:
        raise RunError(f"output_dir {run.dir} already holds a run and train.resume={mode} would discard "
                       f"{' and '.join(lost)}; resume it with train.resume=auto, choose another output_dir, or "
                       f"pass train.overwrite=true to discard them")
    resume = run.find_resume()  # an unusable PATH or refused config change stops the start before anything goes
    if resume is not None:
        check_resume_config(cfg, resume, run.dir, report=run.is_main)
    if lost and run.is_main:
        for p in doomed:
            shutil.rmtree(p, ignore_errors=True)
        if mode == "never":
            run.truncate_metrics(0)
        print(f"[mmrl] train.overwrite=true: discarded {' and '.join(lost)} in {run.dir}", file=sys.stderr)
    return resume
