"""What `mmrl eval`'s first argument names, resolved before any model loads: a config file (with `--checkpoint`, or
none: the base model), a run directory / `checkpoints/step_N/` / its `adapters/` (evaluated with the config.yaml it
was trained with), or a directory `mmrl export` wrote (a VLM: `--format transformers` or `peft`; its config from the
checkpoint it was exported from, or `--config`). Every problem is one line naming the path and what to pass."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

from mmrl.config import RECIPES, load_config, load_yaml

EXPORT_META = "mmrl_export.json"  # what `mmrl export` writes into every export (mmrl.export.EXPORT_META)
VLM_EXPORT_FORMATS = ("transformers", "peft")


@dataclasses.dataclass
class EvalTarget:
    """A policy to evaluate and the config it runs with."""

    cfg: Any                           # the config, overrides applied
    config_file: Path
    checkpoint: Path | None = None     # a run directory, checkpoints/step_N/ or its adapters/ (None: base or export)
    export: Path | None = None         # an mmrl export directory
    export_meta: dict | None = None    # its mmrl_export.json

    @property
    def family(self) -> str:
        """"diffusion", "vlm" or "joint": which trainer family the config belongs to."""
        return family(self.cfg.algorithm)


def family(algorithm: str) -> str:
    return RECIPES[algorithm].split(".")[1] if algorithm in RECIPES else ""


def resolve_target(target: str | Path, *, config: str | Path | None = None, checkpoint: str | Path | None = None,
                   overrides: Sequence[str] = ()) -> EvalTarget:
    """`target` (see the module docstring) -> the config to load (with `overrides`) and the weights to evaluate."""
    from mmrl.eval.harness import resolve_checkpoint

    path = Path(target)
    if path.is_file() or path.suffix in (".yaml", ".yml"):  # a config (a missing one: load_config's own line)
        if config is not None:
            raise ValueError(f"mmrl eval: --config {config} and the config {path} both given; pass one (--config goes "
                             f"with a run, checkpoint or export directory)")
        cfg = load_config(path, list(overrides))
        if checkpoint is not None:
            adapters, _ = resolve_checkpoint(checkpoint, verify=False)  # (verified when the evaluation loads it)
            check_same_family(cfg.algorithm, path, own_config(adapters), f"--checkpoint {checkpoint}")
        return EvalTarget(cfg, path, Path(checkpoint) if checkpoint is not None else None)
    if not path.exists():
        raise FileNotFoundError(f"mmrl eval {path}: not found (expected CONFIG.yaml, a run directory, "
                                f"checkpoints/step_N/ or a directory written by mmrl export)")
    if checkpoint is not None:
        raise ValueError(f"mmrl eval {path}: --checkpoint goes with a config file; a directory is the checkpoint "
                         f"itself (mmrl eval RUN_OR_CHECKPOINT [--config CONFIG.yaml])")
    if (path / EXPORT_META).is_file():
        return _export_target(path, config, overrides)
    adapters, _ = resolve_checkpoint(path, what="mmrl eval", verify=False)  # (verified when the evaluation loads it)
    own = own_config(adapters)
    if config is None and own is None:
        raise FileNotFoundError(f"mmrl eval {path}: no config.yaml beside {adapters} (a checkpoint's step directory "
                                f"holds one); pass --config CONFIG.yaml, the config it was trained with")
    cfg_file = Path(config) if config is not None else own
    cfg = load_config(cfg_file, list(overrides))
    check_same_family(cfg.algorithm, cfg_file, own, f"mmrl eval {path}")
    return EvalTarget(cfg, cfg_file, path)


def own_config(adapters: Path) -> Path | None:
    """The config.yaml a checkpoint was written with: its step directory's, else its run directory's."""
    candidates = [adapters.parent / "config.yaml", adapters.parent.parent.parent / "config.yaml"]
    return next((c for c in candidates if c.is_file()), None)


def check_same_family(algorithm: str, config: Path, own: Path | None, what: str) -> None:
    """A config of another trainer family (diffusion / vlm) than the checkpoint's own config.yaml is refused in one
    line naming both (the weights would otherwise be loaded into the wrong kind of model)."""
    if own is None or Path(config).resolve() == own.resolve():
        return
    try:
        written_by = load_yaml(own).get("algorithm")
    except (ValueError, OSError):  # an unreadable own config: the given one is all there is to go by
        return
    if family(written_by) and family(written_by) != family(algorithm):
        raise ValueError(f"{what} was written by {written_by} ({family(written_by)}) per its {own}, but the config "
                         f"{config} is {algorithm} ({family(algorithm)}); pass the config it was trained with (or "
                         f"evaluate the run alone: mmrl eval RUN)")


def _export_target(path: Path, config: str | Path | None, overrides: Sequence[str]) -> EvalTarget:
    meta = json.loads((path / EXPORT_META).read_text())
    fmt = meta.get("format")
    if fmt not in VLM_EXPORT_FORMATS:
        raise ValueError(f"mmrl eval {path}: a {fmt} export (diffusion); mmrl eval scores the run it came from: "
                         f"mmrl eval RUN (or CONFIG.yaml --checkpoint RUN)")
    source = Path(str(meta.get("source", {}).get("checkpoint", "")))  # .../checkpoints/step_N/adapters/<state>
    own = own_config(source.parent) if source.name else None
    if config is None and own is None:
        raise FileNotFoundError(f"mmrl eval {path}: the export holds no training config and its checkpoint's "
                                f"config.yaml is gone ({source.parent.parent / 'config.yaml'}); pass --config "
                                f"CONFIG.yaml, the config the run was trained with")
    cfg_file = Path(config) if config is not None else own
    cfg = load_config(cfg_file, list(overrides))
    if family(cfg.algorithm) != "vlm":
        raise ValueError(f"mmrl eval {path}: a {fmt} export (a VLM) needs a VLM config; {cfg_file} is "
                         f"{cfg.algorithm} ({family(cfg.algorithm)})")
    return EvalTarget(cfg, cfg_file, export=path, export_meta=meta)
