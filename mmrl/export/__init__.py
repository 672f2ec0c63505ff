"""`mmrl export RUN_OR_CHECKPOINT --format F --out DIR`: a trained policy in the formats other tools load.

    from mmrl.export import export
    meta = export("runs/flow_grpo_tiny", "diffusers-lora", "exports/lora")   # newest checkpoint, state "default"

Formats (`FORMATS`), by the trainer family that wrote the checkpoint:

| format | family | what `DIR` holds | loads with |
|---|---|---|---|
| `diffusers-lora` | diffusion, LoRA | `pytorch_lora_weights.safetensors` (+ peft's files) | `pipe.load_lora_weights(DIR)` |
| `diffusers` | diffusion | a merged, self-contained pipeline | `<Pipeline>.from_pretrained(DIR)` |
| `kohya` | diffusion, LoRA (SD3, FLUX) | one `.safetensors` file with kohya-style keys | ComfyUI; FLUX also diffusers |
| `transformers` | VLM | a merged model with processor, tokenizer, generation config | `from_pretrained(DIR)`, `vllm serve DIR` |
| `peft` | VLM, LoRA | the adapter, its config naming the base model, the processor | `PeftModel.from_pretrained(base, DIR)` |

Every export also writes `mmrl_export.json` (base model, sampling settings, checkpoint path, step, state, sha256 of
the weights) and a README.md model card with the loading code. `DIR` is written atomically (a temp directory
renamed at the end) and must be new or empty unless `overwrite=True`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

from mmrl.export.source import ExportSource, resolve_source, write_json

__all__ = ["FORMATS", "ExportSource", "export", "resolve_source"]


def _diffusion(name: str) -> Callable:
    def run(src: ExportSource, out: Path, **kw: Any) -> dict:
        from mmrl.export import diffusion

        return getattr(diffusion, name)(src, out, **kw)

    return run


def _vlm(name: str) -> Callable:
    def run(src: ExportSource, out: Path, **kw: Any) -> dict:
        from mmrl.export import vlm

        return getattr(vlm, name)(src, out, **kw)

    return run


# format -> (trainer family, writer, one line for the help)
FORMATS: dict[str, tuple[str, Callable, str]] = {
    "diffusers-lora": ("diffusion", _diffusion("export_diffusers_lora"), "diffusers LoRA directory (load_lora_weights)"),
    "diffusers": ("diffusion", _diffusion("export_diffusers_pipeline"), "merged diffusers pipeline directory"),
    "kohya": ("diffusion", _diffusion("export_kohya"), "kohya-style LoRA file (ComfyUI)"),
    "transformers": ("vlm", _vlm("export_transformers"), "merged transformers model directory (vLLM can serve it)"),
    "peft": ("vlm", _vlm("export_peft"), "peft LoRA adapter directory naming its base model"),
}


def export(checkpoint: str | Path, fmt: str, out: str | Path, *, state: str = "default",
           config: str | Path | None = None, base: str | Path | None = None, dtype: str = "auto",
           overwrite: bool = False) -> dict:
    """Write the policy state `state` of `checkpoint` (a run directory, `checkpoints/step_N/` or its `adapters/`)
    in format `fmt` into the directory `out`; returns the metadata also written to `out/mmrl_export.json`.
    `config` / `base` replace the checkpoint's config.yaml / its `model.path`; `dtype` (auto = the base model's
    stored dtype) applies to the merged formats."""
    if fmt not in FORMATS:
        raise ValueError(f"mmrl export: unknown --format {fmt!r}; valid: {sorted(FORMATS)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        what = "is a file" if not out.is_dir() else "is not empty"
        raise ValueError(f"mmrl export: --out {out} {what}; give a new or empty directory (or --overwrite)")
    src = resolve_source(checkpoint, state=state, config=config, base=base)
    family, writer, _ = FORMATS[fmt]
    if family != src.family_kind:
        valid = sorted(f for f, (fam, _, _) in FORMATS.items() if fam == src.family_kind)
        raise ValueError(f"mmrl export: --format {fmt} is for {family} checkpoints; {src.state_dir} is a "
                         f"{src.family_kind} checkpoint ({src.config.algorithm}): valid formats {valid}")
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        meta = writer(src, tmp, final=out.resolve(), dtype=dtype)
        meta["out"] = str(out.resolve())
        write_json(tmp / "mmrl_export.json", meta)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta

