"""What `mmrl.Trainer` works out from the model and the data: the recipe (`recipe_of`) and the settings a recipe's
defaults cannot know (`fit`). A key is fitted only while it holds the recipe's default: the image size and the
mini-batch when that default would fail with this model or batch, the VLM prompt template when there is a
train_dataset; a key you set is kept (one that cannot work with the model is refused here, in one line, before
anything loads). Every fitted key is recorded with its reason in `Trainer.derived`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmrl.config import RECIPES, ConfigError, config_name, recipe_module

VLM_TEMPLATE = "{prompt}"  # the prompt as written, as TRL uses it


@dataclass
class ModelInfo:
    """What the trainer reads from a model without loading its weights."""

    kind: str                       # "diffusion" | "vlm"
    shown: str                      # how messages name it: the path, or "a loaded <Class>"
    path: Path | None = None        # a directory (None: an object, saved under inputs/model by train())
    transformer: dict = field(default_factory=dict)  # diffusion: the transformer's config
    vae: dict = field(default_factory=dict)          # diffusion: the VAE's config


def _module_of(obj: Any) -> str:
    return type(obj).__module__.split(".")[0]


def inspect_model(model: Any, processing_class: Any = None) -> ModelInfo | None:
    """The kind of `model` (a directory path, a loaded diffusers pipeline or transformers model) and the configs the
    defaults come from; one-line errors for anything else."""
    if model is None:
        if processing_class is not None:
            raise ConfigError("processing_class: given without a model object; it is the processor of a loaded "
                              "transformers model (model=...)")
        return None
    if isinstance(model, (str, Path)):
        if processing_class is not None:
            raise ConfigError("processing_class: the processor is loaded from the model directory; pass it only with a "
                              "loaded model object")
        return _inspect_dir(Path(model))
    if _module_of(model) == "peft":
        raise ConfigError("model: a peft model; pass its base model and the LoRA settings as "
                          "peft_config=LoraConfig(...) (model.lora)")
    if _module_of(model) == "diffusers" and hasattr(model, "components") and hasattr(model, "save_pretrained"):
        if processing_class is not None:
            raise ConfigError("processing_class: a diffusers pipeline carries its own tokenizers; leave it out")
        return ModelInfo("diffusion", f"a loaded {type(model).__name__}", None,
                         dict(model.transformer.config) if getattr(model, "transformer", None) is not None else {},
                         dict(model.vae.config) if getattr(model, "vae", None) is not None else {})
    if _module_of(model) == "transformers" and hasattr(model, "save_pretrained") and hasattr(model, "config"):
        if getattr(model.config, "vision_config", None) is None:
            raise ConfigError(f"model: a loaded {type(model).__name__} has no vision tower; the VLM recipes train "
                              f"image-text-to-text models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)")
        return ModelInfo("vlm", f"a loaded {type(model).__name__}")
    raise ConfigError(f"model: expected a local model directory, a diffusers pipeline or a transformers model, got "
                      f"{type(model).__name__}")


def _inspect_dir(path: Path) -> ModelInfo:
    if (path / "model_index.json").is_file():
        configs = [_json(path / part / "config.json") for part in ("transformer", "vae")]
        return ModelInfo("diffusion", str(path), path, *configs)
    if (path / "config.json").is_file():
        config = _json(path / "config.json")
        if "vision_config" not in config:
            raise ConfigError(f"model '{path}' is a transformers {config.get('model_type', '?')} model without a "
                              f"vision tower; the VLM recipes train image-text-to-text models (Qwen2-VL, Qwen2.5-VL, "
                              f"Qwen3-VL)")
        return ModelInfo("vlm", str(path), path)
    what = "does not exist" if not path.exists() else "holds neither model_index.json nor config.json"
    hint = "; hub ids are not downloaded: download the snapshot first" if not path.exists() and \
        len(path.parts) == 2 and not path.is_absolute() else ""
    raise FileNotFoundError(f"model.path '{path}' {what}: expected a local diffusers pipeline directory "
                            f"(model_index.json) or transformers vision-language model directory (config.json){hint}")


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


# ------------------------------------------------------------------------------------------ the recipe
def recipe_of(args: Any, info: ModelInfo | None) -> Any:
    """The config the run starts from: `args` (a recipe config, a YAML path, a dict or a recipe name) or, without
    it, the model's recipe with its defaults (a diffusers pipeline -> flow_grpo, a transformers VLM -> vlm_grpo)."""
    import copy

    from mmrl.config import RunConfig, default_config, load_config

    if args is None:
        if info is None:
            raise ConfigError("Trainer: pass model= (a diffusers pipeline or transformers VLM, a directory or a loaded "
                              "object) or args= (a recipe config such as mmrl.FlowGRPOConfig(...))")
        cfg = default_config("flow_grpo" if info.kind == "diffusion" else "vlm_grpo")
    elif isinstance(args, RunConfig):
        cfg = copy.deepcopy(args)
    elif isinstance(args, str) and args in RECIPES:
        cfg = default_config(args)
    elif isinstance(args, (str, Path, dict)):
        cfg = load_config(args)
    else:
        raise ConfigError(f"Trainer: args must be a recipe config (mmrl.FlowGRPOConfig(...), mmrl.VLMGRPOConfig(...), "
                          f"...), a YAML path or a dict, got {type(args).__name__}")
    family = family_of(cfg.algorithm)
    if info is not None and family != info.kind and not (family == "joint" and info.kind == "vlm"):
        fits = "mmrl.FlowGRPOConfig (or NFTConfig, AWMConfig, DGPOConfig, DPOConfig)" if info.kind == "diffusion" \
            else "mmrl.VLMGRPOConfig (= mmrl.GRPOConfig)"
        kind = "diffusers pipeline" if info.kind == "diffusion" else "transformers VLM"
        raise ConfigError(f"args is a {config_name(cfg.algorithm)} ({cfg.algorithm}, {family} models) but model "
                          f"{info.shown} is a {kind}: use {fits}")
    return cfg


def family_of(algorithm: str) -> str:
    """"diffusion" | "vlm" | "joint"."""
    return RECIPES[algorithm].split(".")[1]


# ------------------------------------------------------------------------------------------ fitting
def _at_default(cfg: Any, dotted: str) -> bool:
    from mmrl.trl_names import get_key

    return get_key(cfg, dotted) == get_key(recipe_module(cfg.algorithm).Config(), dotted)


def _set(cfg: Any, derived: dict, dotted: str, value: Any, why: str) -> None:
    from mmrl.config import apply_overrides

    apply_overrides(cfg, [f"{dotted}={json.dumps(value)}"])
    derived[dotted] = f"{value!r}: {why}"


def image_limits(info: ModelInfo) -> tuple[int | None, int | None, str]:
    """(the model's own image side, the largest side its position embedding takes, how they were worked out) in
    pixels, from the transformer's `sample_size` / `pos_embed_max_size` / `patch_size` and the VAE's scale."""
    t, vae = info.transformer, info.vae
    blocks = vae.get("block_out_channels")
    scale = 2 ** (len(blocks) - 1) if blocks else int(vae.get("scale_factor_spatial", 8))
    patch = t.get("patch_size", 1)
    patch = patch[-1] if isinstance(patch, (list, tuple)) else int(patch or 1)
    sample, pmax = t.get("sample_size"), t.get("pos_embed_max_size")
    own = sample * scale if isinstance(sample, int) else None
    most = pmax * patch * scale if isinstance(pmax, int) else None
    why = (f"transformer sample_size {sample} x VAE scale {scale}" if own else "") + \
        (f"; at most pos_embed_max_size {pmax} x patch {patch} x VAE scale {scale} = {most}" if most else "")
    return own, most, why


def fit(cfg: Any, info: ModelInfo | None, has_train: bool) -> dict[str, str]:
    """Fit the recipe's defaults to the model and data (module docstring); returns {key: "value: reason"}."""
    derived: dict[str, str] = {}
    family = family_of(cfg.algorithm)
    if family == "diffusion" and info is not None and info.transformer:
        own, most, why = image_limits(info)
        for key in ("rollout.height", "rollout.width", "rollout.eval_height", "rollout.eval_width"):
            value = _get(cfg, key)
            if most is None or value <= most:
                continue
            if _at_default(cfg, key) and own is not None and own <= most:
                _set(cfg, derived, key, own, f"the model's own size ({why})")
            else:
                raise ConfigError(f"{key}={value}: model {info.shown} takes images of at most {most} px ({why}); "
                                  f"use {own or most} or less")
    if family != "joint":
        batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        mini = cfg.update.mini_batch_size
        if mini and batch % mini and _at_default(cfg, "update.mini_batch_size"):
            recipe = recipe_module(cfg.algorithm).Config()
            updates = recipe.rollout.prompts_per_step * recipe.rollout.group_size // mini  # the recipe's updates/step
            value = batch // updates if batch % updates == 0 else 0
            _set(cfg, derived, "update.mini_batch_size", value,
                 f"the recipe's {mini} does not divide the batch of {batch} (rollout.prompts_per_step x group_size); "
                 + (f"{updates} updates per step, as the recipe's default" if value else "one update per step"))
    if cfg.algorithm == "vlm_grpo" and has_train and _at_default(cfg, "data.template"):
        _set(cfg, derived, "data.template", VLM_TEMPLATE, "train_dataset's prompts are used as written (TRL's way)")
    return derived


def _get(cfg: Any, dotted: str) -> Any:
    from mmrl.trl_names import get_key

    return get_key(cfg, dotted)


def steps_for_epochs(cfg: Any, epochs: float, rows: int) -> int:
    """num_train_epochs as steps: every step draws rollout.prompts_per_step prompts."""
    return max(1, math.ceil(epochs * rows / cfg.rollout.prompts_per_step))


def apply_peft_config(cfg: Any, peft_config: Any) -> dict[str, str]:
    """A peft `LoraConfig` (TRL's peft_config) as the recipe's `model.lora` section; settings the recipes do not
    have (dropout, bias, DoRA, ...) are refused."""
    from mmrl.config import apply_overrides

    if type(peft_config).__name__ != "LoraConfig":
        raise ConfigError(f"peft_config: expected a peft LoraConfig, got {type(peft_config).__name__}")
    lora = cfg.model.lora
    unsupported = {"lora_dropout": 0.0, "bias": "none", "use_dora": False, "use_rslora": False,
                   "modules_to_save": None}
    for key, plain in unsupported.items():
        value = getattr(peft_config, key, plain)
        if value != plain and not (key == "modules_to_save" and not value):
            raise ConfigError(f"peft_config.{key}={value!r}: not supported (model.lora takes r, lora_alpha, "
                              f"target_modules, init_lora_weights); leave it at {plain!r}")
    targets = peft_config.target_modules
    if isinstance(targets, str):
        raise ConfigError(f"peft_config.target_modules={targets!r}: give module names (a list), not a regex")
    items = {"model.lora.rank": int(peft_config.r), "model.lora.alpha": int(peft_config.lora_alpha)}
    if targets:
        items["model.lora.target_modules"] = sorted(targets)
    init = peft_config.init_lora_weights
    items["model.lora.init"] = str(init).lower() if isinstance(init, bool) else str(init)
    if not hasattr(lora, "init"):
        items.pop("model.lora.init")
    apply_overrides(cfg, [f"{k}={json.dumps(v)}" for k, v in items.items()])
    return {k: f"{v!r}: peft_config" for k, v in items.items()}
