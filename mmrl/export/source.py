"""What `mmrl export` reads: a run directory, `checkpoints/step_N/` or its `adapters/`, resolved to one saved policy
state, the config it was trained with and the base model it applies to."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from mmrl.config import RECIPES, load_config


@dataclasses.dataclass
class ExportSource:
    """One saved policy state and everything needed to rebuild the policy from it."""

    state_dir: Path          # adapters/<state>/: adapter_model.safetensors (LoRA) or model.safetensors (full)
    mode: str                # "lora" | "full"
    state: str               # "default" | "old"
    step: int | None         # training step of the checkpoint (None: a bare adapters/ directory)
    config: Any              # the RunConfig the checkpoint was trained with
    config_file: Path | None
    base: Path               # the base model directory (model.path, absolute)

    @property
    def family_kind(self) -> str:
        """"diffusion" or "vlm": which trainer family wrote the checkpoint."""
        return RECIPES[self.config.algorithm].split(".")[1]

    def provenance(self) -> dict:
        """What an export records about where its weights came from."""
        from mmrl.eval.harness import sha256_file

        weights = self.state_dir / ("adapter_model.safetensors" if self.mode == "lora" else "model.safetensors")
        return {"checkpoint": str(self.state_dir.resolve()), "step": self.step, "state": self.state, "mode": self.mode,
                "algorithm": self.config.algorithm, "sha256": sha256_file(weights)}


def resolve_source(path: str | Path, *, state: str = "default", config: str | Path | None = None,
                   base: str | Path | None = None) -> ExportSource:
    """`path` (a run directory, `checkpoints/step_N/` or its `adapters/`) -> the saved state `state`, its config
    (the checkpoint's own `config.yaml`, or `config` when given) and the base model (`model.path`, or `base`).
    Every problem is one ValueError / FileNotFoundError line naming the path and what to pass instead."""
    from mmrl.adapters import FULL_WEIGHTS_NAME, PEFT_WEIGHTS_NAME
    from mmrl.eval.harness import resolve_checkpoint, state_dir

    adapters, step = resolve_checkpoint(path, what="mmrl export")
    sub = state_dir(adapters, state)
    if (sub / PEFT_WEIGHTS_NAME).is_file():
        mode = "lora"
    elif (sub / FULL_WEIGHTS_NAME).is_file():
        mode = "full"
    else:
        raise FileNotFoundError(f"mmrl export: {sub} holds neither {PEFT_WEIGHTS_NAME} (LoRA) nor {FULL_WEIGHTS_NAME} "
                                f"(full fine-tuning)")
    candidates = [adapters.parent / "config.yaml", adapters.parent.parent.parent / "config.yaml"]
    own = next((c for c in candidates if c.is_file()), None)  # the config.yaml the checkpoint was written with
    if config is None:
        if own is None:
            raise FileNotFoundError(f"mmrl export: no config.yaml beside {adapters} (the checkpoint's step directory "
                                    f"holds one); pass --config CONFIG.yaml, the config it was trained with")
        config = own
    cfg = load_config(config)
    if cfg.algorithm not in RECIPES:
        raise ValueError(f"mmrl export: {config}: unknown algorithm {cfg.algorithm!r}")
    if own is not None and Path(config).resolve() != own.resolve():
        _same_family(cfg.algorithm, config, own)
    base_path = Path(base if base is not None else cfg.model.path).expanduser()
    if not base_path.exists():
        hint = "" if base is not None else " (model.path of the checkpoint's config, relative paths are taken " \
                                           "from the current directory)"
        raise FileNotFoundError(f"mmrl export: base model {base_path} not found{hint}; pass --base PATH, the model "
                                f"the checkpoint was trained from")
    return ExportSource(state_dir=sub, mode=mode, state=state, step=step, config=cfg, config_file=Path(config),
                        base=base_path.resolve())


def _same_family(algorithm: str, config: str | Path, own: Path) -> None:
    """`--config` of another trainer family (diffusion / vlm) than the checkpoint's own config.yaml is refused,
    naming both: the export would otherwise call the checkpoint by the --config's family."""
    from mmrl.config import load_yaml

    try:
        written_by = load_yaml(own).get("algorithm")
    except (ValueError, OSError):  # an unreadable own config: --config is all there is to go by
        return
    if written_by not in RECIPES:
        return
    family, theirs = RECIPES[algorithm].split(".")[1], RECIPES[written_by].split(".")[1]
    if family != theirs:
        raise ValueError(f"mmrl export: --config {config} is a {algorithm} ({family}) config, but the checkpoint was "
                         f"written by {written_by} ({theirs}) per its {own}; pass the config it was trained with (or "
                         f"leave --config out)")


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
