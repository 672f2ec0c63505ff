"""Exports of a diffusion checkpoint: a diffusers LoRA directory, a merged diffusers pipeline, a kohya-style LoRA file.

Which pipeline and which defaults: the base model's `model_index.json` names its diffusers pipeline class, the family
registry (`mmrl.diffusion.models.MODEL_FAMILIES`) maps it to mmrl's FlowModel (for the text length mmrl encodes
prompts with when the config leaves `model.max_sequence_length` at 0). The sampling settings mmrl evaluated with
(`rollout.eval_num_steps`, `rollout.eval_guidance_scale`, `rollout.height` x `rollout.width`, the text length, the
frames of a video family) go into every export's `mmrl_export.json`, its README.md and (LoRA files) the safetensors
metadata: for SD3 and FLUX a diffusers pipeline called with them and the same seed draws mmrl's `mmrl eval` images.

Who loads what (`loaded_by`, also in the model card; tests/test_export.py and tests/test_export_families.py load every
pair below with it): `diffusers-lora` and `diffusers` load in diffusers for every registered family; `kohya` is
written for SD3 (ComfyUI) and FLUX (ComfyUI and diffusers) and refused for the other families before anything is
written (`refusal`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from mmrl.export.source import ExportSource

# families whose kohya-style file (keys `lora_transformer_<module path, "." -> "_">.lora_down.weight` / `.lora_up.weight`
# / `.alpha`) another tool reads, and which. Source: ComfyUI comfy/lora.py `model_lora_keys_unet` maps exactly these
# ("OneTrainer") keys for its SD3 and Flux models only; diffusers converts them for FLUX
# (`FluxLoraLoaderMixin.lora_state_dict`: `_convert_kohya_flux_lora_to_diffusers`), while
# `SD3LoraLoaderMixin.lora_state_dict` converts no key layout at all (it would load nothing: "No LoRA keys
# associated to SD3Transformer2DModel"). diffusers' converters of other families expect other layouts (sd-scripts'
# `lora_unet_` keys with the original model's module names), which mmrl does not write.
KOHYA_READERS = {
    "sd3": "ComfyUI (Load LoRA node; its LoRA key map reads these keys for SD3). Not diffusers: "
           "StableDiffusion3Pipeline.load_lora_weights reads no kohya keys (it would load nothing): export "
           "--format diffusers-lora for diffusers",
    "flux": "ComfyUI (Load LoRA node) and diffusers' FluxPipeline.load_lora_weights(file) (its kohya converter)",
}
KOHYA_PREFIX = "lora_transformer"
SAME_IMAGES = ("sd3", "flux")  # families whose exported call was checked to draw mmrl's eval images (test_export.py)
EXPERTS = {"high": "transformer", "low": "transformer_2"}  # Wan 2.2 A14B: mmrl's WanExperts -> pipeline components
EXPERT_WEIGHTS_NAME = "pytorch_lora_weights_transformer_2.safetensors"  # the LoRA of transformer_2


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


def has_experts(base: Path) -> bool:
    """The pipeline holds a second transformer (Wan 2.2 A14B's `transformer_2`): mmrl trains both as one module."""
    return json.loads((base / "model_index.json").read_text()).get("transformer_2", [None])[0] is not None


def sampling_settings(src: ExportSource) -> dict:
    """The pipeline call arguments of mmrl's evaluation (seeded like `mmrl eval`)."""
    _, family = pipeline_family(src.base)
    cfg = src.config
    out = {"num_inference_steps": cfg.rollout.eval_num_steps, "guidance_scale": cfg.rollout.eval_guidance_scale,
           "height": cfg.rollout.height, "width": cfg.rollout.width,
           "max_sequence_length": cfg.model.max_sequence_length or family.default_max_sequence_length}
    if family.is_video:
        out["num_frames"] = cfg.rollout.num_frames
    if "guidance_scale_2" in (cfg.model.family_options or {}):
        out["guidance_scale_2"] = cfg.model.family_options["guidance_scale_2"]
    return out


def export_metadata(src: ExportSource, fmt: str) -> dict:
    cls_name, family = pipeline_family(src.base)
    return {"format": fmt, "base_model": str(src.base), "pipeline_class": cls_name, "family": family.family,
            "sampling": sampling_settings(src), "source": src.provenance()}


def refusal(src: ExportSource, fmt: str) -> str | None:
    """One line when `fmt` cannot be written for this checkpoint (checked before anything is written), else None."""
    if fmt in ("diffusers-lora", "kohya") and src.mode != "lora":
        return (f"mmrl export --format {fmt}: {src.state_dir} is a full fine-tuning checkpoint (no LoRA); use "
                f"--format diffusers (a merged pipeline directory)")
    cls_name, family = pipeline_family(src.base)
    if fmt == "kohya" and family.family not in KOHYA_READERS:
        return (f"mmrl export: --format kohya is not loadable for {cls_name} (family {family.family!r}): mmrl's kohya "
                f"keys ({KOHYA_PREFIX}_<module>) are read by ComfyUI for SD3 and FLUX and by diffusers' loader for "
                f"FLUX only; use --format diffusers-lora (pipe.load_lora_weights) or --format diffusers (a merged "
                f"pipeline)")
    if fmt == "kohya":
        try:
            _lora_scale(src)
        except ValueError as exc:
            return str(exc)
    return None


def _usage(meta: dict, load: str, model_dir: str) -> str:
    from mmrl.diffusion.models import MODEL_FAMILIES

    family = MODEL_FAMILIES[meta["pipeline_class"]]
    s = meta["sampling"]
    call = ", ".join(f"{k}={v!r}" for k, v in s.items())
    source = "image=Image.open(\"source.png\"), " if family.needs_source_image else ""
    pil = "from PIL import Image\n" if family.needs_source_image else ""
    out = "video = pipe(" if family.is_video else "image = pipe("
    first = ").frames[0]" if family.is_video else ").images[0]"
    same = ("mmrl evaluated it with these pipeline arguments; with them and the same seed the images are mmrl's"
            if meta["family"] in SAME_IMAGES else
            "mmrl evaluated it with these settings (that this call draws exactly mmrl's images is checked for SD3 and "
            "FLUX only)")
    return (f"{same}:\n\n```python\nimport torch\n{pil}from diffusers import {meta['pipeline_class']}\n\n"
            f"pipe = {meta['pipeline_class']}.from_pretrained({model_dir!r})\n{load}"
            f"{out}{source}prompt=\"a red circle on a blue background\", {call},\n"
            f"             generator=torch.Generator().manual_seed(0){first}\n```\n")


def _model_card(meta: dict, title: str, usage: str, tags: list[str]) -> str:
    src = meta["source"]
    return (f"---\nbase_model: {meta['base_model']}\nlibrary_name: diffusers\ntags: {json.dumps(tags)}\n---\n\n"
            f"# {title}\n\nExported by `mmrl export --format {meta['format']}` from {src['checkpoint']} (recipe "
            f"{src['algorithm']}, step {src['step']}, policy state {src['state']!r}). Base model: {meta['base_model']} "
            f"({meta['pipeline_class']}).\n\nLoaded by: {meta['loaded_by']}.\n\n{usage}\n"
            f"`mmrl_export.json` holds the sampling settings and the checkpoint's sha256.\n")


def lora_files(src: ExportSource) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]]:
    """The checkpoint's LoRA in diffusers' pipeline format, per file of the export: file name -> (tensors keyed
    `transformer.<module>.lora_A.weight` / `lora_B.weight`, safetensors metadata with the adapter config diffusers
    reads). One file (the checkpoint's own `pytorch_lora_weights.safetensors`); Wan 2.2 A14B (both experts in one
    adapter, `high.` / `low.`) two: `transformer`'s and `transformer_2`'s (`EXPERT_WEIGHTS_NAME`), as
    `pipe.load_lora_weights(..., load_into_transformer_2=True)` takes them."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from mmrl.adapters import DIFFUSERS_WEIGHTS_NAME, PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME

    weights = src.state_dir / DIFFUSERS_WEIGHTS_NAME
    if weights.is_file():
        with safe_open(str(weights), "pt") as f:
            return {DIFFUSERS_WEIGHTS_NAME: ({k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {}))}
    peft = load_file(str(src.state_dir / PEFT_WEIGHTS_NAME))
    if not has_experts(src.base):
        raise FileNotFoundError(f"mmrl export: {weights} not found (a diffusion checkpoint's LoRA state holds it)")
    config = json.loads((src.state_dir / PEFT_CONFIG_NAME).read_text())
    header = {"format": "pt", "lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()},
                                                                  sort_keys=True)}
    out = {}
    for expert, name in zip(EXPERTS, (DIFFUSERS_WEIGHTS_NAME, EXPERT_WEIGHTS_NAME)):
        pre = f"base_model.model.{expert}."
        out[name] = ({"transformer." + k[len(pre):]: v for k, v in peft.items() if k.startswith(pre)}, dict(header))
    if sum(len(t) for t, _ in out.values()) != len(peft):
        raise ValueError(f"mmrl export: {src.state_dir / PEFT_WEIGHTS_NAME}: LoRA keys outside the experts "
                         f"{sorted(EXPERTS)} of {src.base} (transformer_2)")
    return out


def _load_calls(names: list[str], where: str) -> str:
    """The `pipe.load_lora_weights` lines that load the LoRA files `names` of directory `where`."""
    from mmrl.adapters import DIFFUSERS_WEIGHTS_NAME

    return "".join(f"pipe.load_lora_weights({where!r})\n" if n == DIFFUSERS_WEIGHTS_NAME else
                   f"pipe.load_lora_weights({where!r}, weight_name={n!r}, load_into_transformer_2=True)\n"
                   for n in names)


def export_diffusers_lora(src: ExportSource, out: Path, final: Path | None = None, **_: Any) -> dict:
    """`out/pytorch_lora_weights.safetensors` (diffusers' pipeline format, `pipe.load_lora_weights(out)`; Wan 2.2
    A14B: also `transformer_2`'s file) with the base model and sampling settings in its metadata, peft's
    `adapter_model.safetensors` + `adapter_config.json` (naming the base model), `mmrl_export.json` and a README.md
    model card."""
    from safetensors.torch import save_file

    from mmrl.adapters import PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME

    meta = export_metadata(src, "diffusers-lora")
    files = lora_files(src)
    for name, (tensors, header) in files.items():
        header.update({"mmrl.base_model": meta["base_model"], "mmrl.pipeline_class": meta["pipeline_class"],
                       "mmrl.sampling": json.dumps(meta["sampling"], sort_keys=True)})
        save_file(tensors, str(out / name), metadata=header)
    shutil.copyfile(src.state_dir / PEFT_WEIGHTS_NAME, out / PEFT_WEIGHTS_NAME)
    adapter_config = json.loads((src.state_dir / PEFT_CONFIG_NAME).read_text())
    adapter_config["base_model_name_or_path"] = meta["base_model"]
    (out / PEFT_CONFIG_NAME).write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    meta["loaded_by"] = f"diffusers' {meta['pipeline_class']}.load_lora_weights(DIR)" + (
        f" and, for transformer_2, load_lora_weights(DIR, weight_name={EXPERT_WEIGHTS_NAME!r}, "
        f"load_into_transformer_2=True)" if len(files) > 1 else "")
    usage = _usage(meta, _load_calls(list(files), str(final or out)), meta["base_model"])
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
    from safetensors.torch import save_file

    from mmrl.adapters import FULL_WEIGHTS_NAME
    from mmrl.eval.harness import copy_full_weights
    from mmrl.runtime import resolve_dtype

    meta = export_metadata(src, "diffusers")
    torch_dtype = _stored_dtype(src.base) if dtype == "auto" else resolve_dtype(dtype)
    pipe = getattr(diffusers, meta["pipeline_class"]).from_pretrained(str(src.base), torch_dtype=torch_dtype)
    components = ["transformer"] + (["transformer_2"] if has_experts(src.base) else [])
    if src.mode == "lora":
        if not hasattr(pipe, "fuse_lora"):
            raise ValueError(f"mmrl export: diffusers' {meta['pipeline_class']} cannot load LoRAs (no "
                             f"load_lora_weights); export --format diffusers-lora and merge with peft instead")
        for i, (tensors, header) in enumerate(lora_files(src).values()):
            # as a file (not a dict): diffusers reads the adapter config (lora_alpha) from its metadata
            file = out / f".lora-{i}.safetensors"
            save_file(tensors, str(file), metadata=header)
            pipe.load_lora_weights(str(out), weight_name=file.name, adapter_name=f"mmrl{i}",
                                   **({"load_into_transformer_2": True} if i else {}))
            file.unlink()
        pipe.fuse_lora(components=components, lora_scale=1.0)
        pipe.unload_lora_weights()
    elif len(components) > 1:  # both experts trained as one module (mmrl's WanExperts: high. / low.)
        from mmrl.diffusion.models.wan import WanExperts

        copy_full_weights(WanExperts(pipe.transformer, pipe.transformer_2, 0.0), src.state_dir / FULL_WEIGHTS_NAME)
    else:
        copy_full_weights(pipe.transformer, src.state_dir / FULL_WEIGHTS_NAME)
    leftover = [n for c in components for n, _ in getattr(pipe, c).named_parameters() if "lora_" in n]
    if leftover:  # fuse + unload must leave a plain transformer: a saved LoRA layer would not load elsewhere
        raise RuntimeError(f"mmrl export: LoRA layers left in the merged transformer: {leftover[:3]}")
    pipe.save_pretrained(str(out), safe_serialization=True)
    meta["dtype"] = str(torch_dtype).replace("torch.", "")
    meta["loaded_by"] = f"diffusers' {meta['pipeline_class']}.from_pretrained(DIR)"
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


def export_kohya(src: ExportSource, out: Path, final: Path | None = None, **_: Any) -> dict:
    """`out/<name>.safetensors`: the LoRA with kohya-style keys (see KOHYA_READERS) and sd-scripts' `ss_network_*`
    metadata, plus `mmrl_export.json` and a README.md model card saying which tools load it and how."""
    from safetensors.torch import load_file, save_file

    from mmrl.adapters import PEFT_WEIGHTS_NAME

    meta = export_metadata(src, "kohya")
    alpha, rank = _lora_scale(src)
    kohya = peft_to_kohya(load_file(str(src.state_dir / PEFT_WEIGHTS_NAME)), alpha)
    step = f"_step_{src.step}" if src.step is not None else ""
    name = f"mmrl_{meta['family']}_lora{step}.safetensors"
    header = {"ss_network_module": "networks.lora", "ss_network_dim": str(rank), "ss_network_alpha": str(alpha),
              "mmrl.base_model": meta["base_model"], "mmrl.pipeline_class": meta["pipeline_class"],
              "mmrl.sampling": json.dumps(meta["sampling"], sort_keys=True)}
    save_file(kohya, str(out / name), metadata=header)
    meta.update(file=name, loaded_by=KOHYA_READERS[meta["family"]])
    file = str((final or out) / name)
    comfy = (f"ComfyUI: copy `{name}` into `ComfyUI/models/loras/` and pick it in a `LoraLoaderModelOnly` (\"Load "
             f"LoRA\") node after the model loader, strength 1.0 (the file's `.alpha` keys carry the scale "
             f"alpha / rank = {alpha:g} / {rank}).\n\n")
    if meta["family"] == "flux":
        usage = comfy + "diffusers (its kohya converter):\n\n" + _usage(
            meta, f"pipe.load_lora_weights({file!r})\n", meta["base_model"])
    else:
        usage = comfy + (f"diffusers' {meta['pipeline_class']} does not read kohya keys (load_lora_weights would load "
                         f"nothing and warn \"No LoRA keys\"): for diffusers, export `--format diffusers-lora`.\n")
    (out / "README.md").write_text(_model_card(meta, "kohya-style LoRA trained with mmrl", usage,
                                               ["lora", "kohya", "comfyui", "text-to-image", "mmrl"]))
    return meta
