"""Exports of a diffusion checkpoint: a diffusers LoRA directory, a merged diffusers pipeline, a kohya-style LoRA file.

Which pipeline and which defaults: the base model's `model_index.json` names its diffusers pipeline class, the family
registry (`mmrl.diffusion.models.MODEL_FAMILIES`) maps it to mmrl's FlowModel (for the text length mmrl encodes
prompts with when the config leaves `model.max_sequence_length` at 0). The sampling settings mmrl evaluated with
(`rollout.eval_num_steps`, `rollout.eval_guidance_scale`, `rollout.height` x `rollout.width`, the text length) go
into every export's `mmrl_export.json`, its README.md and (LoRA files) the safetensors metadata: a diffusers pipeline
called with them and the same seed draws mmrl's `mmrl eval` images.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from mmrl.export.source import ExportSource

# families whose kohya-style file (keys `lora_transformer_<module path, "." -> "_">.lora_down.weight` / `.lora_up.weight`
# / `.alpha`) is read by another tool; source: ComfyUI comfy/lora.py `model_lora_keys_unet` maps exactly these
# ("OneTrainer") keys for SD3 and Flux, and diffusers' FluxLoraLoaderMixin converts them
# (`_convert_kohya_flux_lora_to_diffusers`). diffusers has no such converter for SD3 (mmrl's `kohya_to_diffusers` is
# the inverse used to check the file).
KOHYA_READERS = {"sd3": "ComfyUI", "flux": "ComfyUI, diffusers' FluxPipeline.load_lora_weights"}
KOHYA_PREFIX = "lora_transformer"


def pipeline_family(base: Path) -> tuple[str, Any]:
    """(diffusers pipeline class name, mmrl FlowModel class) of a pipeline directory, through the family registry."""
    from mmrl.diffusion.models import MODEL_FAMILIES, available_families

    index = base / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"mmrl export: {base} has no model_index.json: expected the diffusers pipeline "
                                f"directory the run was trained from (--base PATH)")
    cls_name = json.loads(index.read_text()).get("_class_name", "")
    if cls_name not in MODEL_FAMILIES:
        raise ValueError(f"mmrl export: {base}: pipeline class {cls_name!r} is not a registered family; registered: "
                         f"{available_families()}")
    return cls_name, MODEL_FAMILIES[cls_name]


def sampling_settings(src: ExportSource) -> dict:
    """The pipeline call arguments that reproduce mmrl's evaluation images (seeded like `mmrl eval`)."""
    _, family = pipeline_family(src.base)
    cfg = src.config
    return {"num_inference_steps": cfg.rollout.eval_num_steps, "guidance_scale": cfg.rollout.eval_guidance_scale,
            "height": cfg.rollout.height, "width": cfg.rollout.width,
            "max_sequence_length": cfg.model.max_sequence_length or family.default_max_sequence_length}


def export_metadata(src: ExportSource, fmt: str) -> dict:
    cls_name, family = pipeline_family(src.base)
    return {"format": fmt, "base_model": str(src.base), "pipeline_class": cls_name, "family": family.family,
            "sampling": sampling_settings(src), "source": src.provenance()}


def _usage(meta: dict, load: str, model_dir: str) -> str:
    s = meta["sampling"]
    call = ", ".join(f"{k}={v!r}" for k, v in s.items())
    return (f"```python\nimport torch\nfrom diffusers import {meta['pipeline_class']}\n\n"
            f"pipe = {meta['pipeline_class']}.from_pretrained({model_dir!r})\n{load}"
            f"image = pipe(\"a red circle on a blue background\", {call},\n"
            f"             generator=torch.Generator().manual_seed(0)).images[0]\n```\n")


def _model_card(meta: dict, title: str, usage: str, tags: list[str]) -> str:
    src = meta["source"]
    return (f"---\nbase_model: {meta['base_model']}\nlibrary_name: diffusers\ntags: {json.dumps(tags)}\n---\n\n"
            f"# {title}\n\nExported by `mmrl export` from {src['checkpoint']} (algorithm {src['algorithm']}, step "
            f"{src['step']}, policy state {src['state']!r}). Base model: {meta['base_model']} "
            f"({meta['pipeline_class']}).\n\nmmrl evaluated it with these pipeline arguments; with them and the same seed "
            f"the images are mmrl's:\n\n{usage}\n`mmrl_export.json` holds the same settings and the checkpoint's "
            f"sha256.\n")


def _require_lora(src: ExportSource, fmt: str) -> None:
    if src.mode != "lora":
        raise ValueError(f"mmrl export --format {fmt}: {src.state_dir} is a full fine-tuning checkpoint (no LoRA); "
                         f"use --format diffusers (a merged pipeline directory)")


def export_diffusers_lora(src: ExportSource, out: Path, final: Path | None = None, **_: Any) -> dict:
    """`out/pytorch_lora_weights.safetensors` (diffusers' pipeline format, `pipe.load_lora_weights(out)`) with the
    base model and sampling settings in its metadata, peft's `adapter_model.safetensors` + `adapter_config.json`
    (naming the base model), `mmrl_export.json` and a README.md model card."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mmrl.adapters import DIFFUSERS_WEIGHTS_NAME, PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME

    _require_lora(src, "diffusers-lora")
    meta = export_metadata(src, "diffusers-lora")
    weights = src.state_dir / DIFFUSERS_WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"mmrl export: {weights} not found (a diffusion checkpoint's LoRA state holds it)")
    with safe_open(str(weights), "pt") as f:
        header = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    header.update({"mmrl.base_model": meta["base_model"], "mmrl.pipeline_class": meta["pipeline_class"],
                   "mmrl.sampling": json.dumps(meta["sampling"], sort_keys=True)})
    save_file(tensors, str(out / DIFFUSERS_WEIGHTS_NAME), metadata=header)
    shutil.copyfile(src.state_dir / PEFT_WEIGHTS_NAME, out / PEFT_WEIGHTS_NAME)
    adapter_config = json.loads((src.state_dir / PEFT_CONFIG_NAME).read_text())
    adapter_config["base_model_name_or_path"] = meta["base_model"]
    (out / PEFT_CONFIG_NAME).write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    usage = _usage(meta, f"pipe.load_lora_weights({str(final or out)!r})\n", meta["base_model"])
    (out / "README.md").write_text(_model_card(meta, "LoRA trained with mmrl", usage, ["lora", "text-to-image", "mmrl"]))
    return meta


def _stored_dtype(base: Path) -> torch.dtype:
    """The dtype of the base pipeline's transformer weights as stored (what `--dtype auto` keeps)."""
    from safetensors import safe_open

    files = sorted((base / "transformer").glob("*.safetensors"))
    if not files:
        return torch.float32
    names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    with safe_open(str(files[0]), "pt") as f:
        stored = {f.get_slice(k).get_dtype() for k in f.keys()}
    floats = [names[d] for d in ("BF16", "F16", "F32") if d in stored]
    return floats[0] if floats else torch.float32


def export_diffusers_pipeline(src: ExportSource, out: Path, final: Path | None = None, dtype: str = "auto",
                              **_: Any) -> dict:
    """A self-contained diffusers pipeline directory (`<Pipeline>.from_pretrained(out)`): the base pipeline with the
    LoRA fused into the transformer by diffusers (`load_lora_weights`, `fuse_lora`, `unload_lora_weights`) or the
    full fine-tuning weights copied in, saved with `save_pretrained` in `dtype` (auto: the base's stored dtype)."""
    import diffusers

    from mmrl.adapters import DIFFUSERS_WEIGHTS_NAME, FULL_WEIGHTS_NAME
    from mmrl.eval.harness import copy_full_weights
    from mmrl.runtime import resolve_dtype

    meta = export_metadata(src, "diffusers")
    torch_dtype = _stored_dtype(src.base) if dtype == "auto" else resolve_dtype(dtype)
    pipe = getattr(diffusers, meta["pipeline_class"]).from_pretrained(str(src.base), torch_dtype=torch_dtype)
    if src.mode == "lora":
        if not hasattr(pipe, "fuse_lora"):
            raise ValueError(f"mmrl export: diffusers' {meta['pipeline_class']} cannot load LoRAs (no "
                             f"load_lora_weights); export --format diffusers-lora and merge with peft instead")
        pipe.load_lora_weights(str(src.state_dir / DIFFUSERS_WEIGHTS_NAME), adapter_name="mmrl")
        pipe.fuse_lora(lora_scale=1.0, adapter_names=["mmrl"])
        pipe.unload_lora_weights()
    else:
        copy_full_weights(pipe.transformer, src.state_dir / FULL_WEIGHTS_NAME)
    leftover = [n for n, _ in pipe.transformer.named_parameters() if "lora_" in n]
    if leftover:  # fuse + unload must leave a plain transformer: a saved LoRA layer would not load elsewhere
        raise RuntimeError(f"mmrl export: LoRA layers left in the merged transformer: {leftover[:3]}")
    pipe.save_pretrained(str(out), safe_serialization=True)
    meta["dtype"] = str(torch_dtype).replace("torch.", "")
    usage = _usage(meta, "", str(final or out))
    (out / "README.md").write_text(_model_card(meta, "Pipeline fine-tuned with mmrl (merged)", usage,
                                               ["text-to-image", "mmrl"]))
    return meta


def _lora_scale(src: ExportSource) -> tuple[float, int]:
    """(lora_alpha, rank) of the checkpoint's adapter_config.json (one alpha for every module)."""
    from mmrl.adapters import PEFT_CONFIG_NAME

    cfg = json.loads((src.state_dir / PEFT_CONFIG_NAME).read_text())
    if cfg.get("alpha_pattern") or cfg.get("rank_pattern"):
        raise ValueError(f"mmrl export --format kohya: {src.state_dir} uses per-module rank/alpha patterns; the kohya "
                         f"file has one alpha per module: export --format diffusers-lora instead")
    return float(cfg["lora_alpha"]), int(cfg["r"])


def peft_to_kohya(peft_sd: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """peft LoRA tensors (`base_model.model.<module>.lora_A.weight`) -> kohya keys
    (`lora_transformer_<module with "_">.lora_down.weight`, `.lora_up.weight`, `.alpha`). The renaming is diffusers'
    own `convert_state_dict_to_kohya`; its alpha is the rank (scale 1), so the trained `alpha` is written instead
    (the kohya scale is alpha / rank, as peft's)."""
    from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya

    named = {f"{KOHYA_PREFIX}.{k.removeprefix('base_model.model.')}": v for k, v in peft_sd.items()}
    kohya = convert_state_dict_to_kohya(named)
    return {k: (torch.tensor(alpha, dtype=torch.float32) if k.endswith(".alpha") else v.contiguous())
            for k, v in kohya.items()}


def kohya_to_diffusers(kohya_sd: dict[str, torch.Tensor], transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The inverse of `peft_to_kohya` for `transformer` (module names looked up, "_" is ambiguous): diffusers keys
    `transformer.<module>.lora_A.weight` / `lora_B.weight` with the scale alpha / rank folded into lora_B, so
    `pipe.load_lora_weights(result)` (which then uses scale 1) applies the same update."""
    by_flat = {name.replace(".", "_"): name for name, _ in transformer.named_modules() if name}
    out = {}
    for key, down in kohya_sd.items():
        if not key.endswith(".lora_down.weight"):
            continue
        stem = key[: -len(".lora_down.weight")]
        flat = stem.removeprefix(f"{KOHYA_PREFIX}_")
        if flat not in by_flat:
            raise ValueError(f"kohya LoRA key {key}: no module {flat!r} in the transformer")
        up = kohya_sd[f"{stem}.lora_up.weight"]
        scale = float(kohya_sd[f"{stem}.alpha"]) / down.shape[0] if f"{stem}.alpha" in kohya_sd else 1.0
        name = by_flat[flat]
        out[f"transformer.{name}.lora_A.weight"] = down
        out[f"transformer.{name}.lora_B.weight"] = up * scale
    return out


def export_kohya(src: ExportSource, out: Path, **_: Any) -> dict:
    """`out/<name>.safetensors`: the LoRA with kohya-style keys (see KOHYA_READERS) and sd-scripts' `ss_network_*`
    metadata, plus `mmrl_export.json`."""
    from safetensors.torch import load_file, save_file

    from mmrl.adapters import PEFT_WEIGHTS_NAME

    _require_lora(src, "kohya")
    meta = export_metadata(src, "kohya")
    if meta["family"] not in KOHYA_READERS:
        raise ValueError(f"mmrl export --format kohya: no kohya key layout is defined for family {meta['family']!r} "
                         f"({meta['pipeline_class']}); defined: {sorted(KOHYA_READERS)}. Use --format diffusers-lora "
                         f"or --format diffusers")
    alpha, rank = _lora_scale(src)
    kohya = peft_to_kohya(load_file(str(src.state_dir / PEFT_WEIGHTS_NAME)), alpha)
    step = f"_step_{src.step}" if src.step is not None else ""
    name = f"mmrl_{meta['family']}_lora{step}.safetensors"
    header = {"ss_network_module": "networks.lora", "ss_network_dim": str(rank), "ss_network_alpha": str(alpha),
              "mmrl.base_model": meta["base_model"], "mmrl.pipeline_class": meta["pipeline_class"],
              "mmrl.sampling": json.dumps(meta["sampling"], sort_keys=True)}
    save_file(kohya, str(out / name), metadata=header)
    meta.update(file=name, readers=KOHYA_READERS[meta["family"]])
    return meta
