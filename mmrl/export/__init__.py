"""`mmrl export RUN_OR_CHECKPOINT --format F --out DIR`: a trained policy in the formats other tools load.

    from mmrl.export import export
    meta = export("runs/flow_grpo_tiny", "diffusers-lora", "exports/lora")   # newest checkpoint, state "default"

Formats (`FORMATS`), by the trainer family that wrote the checkpoint:

| format | family | what `DIR` holds | loads with |
|---|---|---|---|
| `diffusers-lora` | diffusion, LoRA | `pytorch_lora_weights.safetensors` (+ peft's files) | `pipe.load_lora_weights(DIR)` |
| `diffusers` | diffusion | a merged, self-contained pipeline | `<Pipeline>.from_pretrained(DIR)` |
| `kohya` | diffusion, LoRA (SD3, FLUX) | one `.safetensors` file with kohya-style keys | ComfyUI; FLUX also diffusers |

A format no tool loads for the checkpoint's family (kohya beyond SD3 and FLUX) is refused in one line before anything
is written. `meta["loaded_by"]` (and the model card) names the tools that load the export.
| `transformers` | VLM | a merged model with processor, tokenizer, generation config | `from_pretrained(DIR)`, `vllm serve DIR` |
| `peft` | VLM, LoRA | the adapter, its config naming the base model, the processor | `PeftModel.from_pretrained(base, DIR)` |

Every export also writes `mmrl_export.json` (base model, sampling settings, checkpoint path, step, state, sha256 of
the weights) and a README.md model card: what it is (base model, recipe, step, format) and the loading code. `DIR` is written atomically (a temp directory
renamed at the end) and must be new or empty; `overwrite=True` replaces an earlier export there (a directory holding
`mmrl_export.json`), never anything else: a run directory, a checkpoint, other files, or a directory that is, holds
or lies inside the run, checkpoint or base model being exported are refused in one line.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from mmrl.export.source import ExportSource, resolve_source, write_json
from mmrl.run.files import COMPLETE_MARKER, RunError, disk_full

__all__ = ["EXPORT_META", "FORMATS", "ExportSource", "export", "resolve_source"]

EXPORT_META = "mmrl_export.json"  # written last by every export: the mark of a directory --overwrite may replace
RUN_ENTRIES = ("config.yaml", "metrics.jsonl", "checkpoints")  # what `mmrl train` writes into a run directory


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
    "kohya": ("diffusion", _diffusion("export_kohya"), "kohya-style LoRA file: ComfyUI (SD3, FLUX), diffusers (FLUX)"),
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
    _check_out(out, overwrite)
    src = resolve_source(checkpoint, state=state, config=config, base=base)
    _check_apart(out, src)
    family, writer, _ = FORMATS[fmt]
    if family != src.family_kind:
        valid = sorted(f for f, (fam, _, _) in FORMATS.items() if fam == src.family_kind)
        raise ValueError(f"mmrl export: --format {fmt} is for {family} checkpoints; {src.state_dir} is a "
                         f"{src.family_kind} checkpoint ({src.config.algorithm}): valid formats {valid}")
    if family == "diffusion":  # a format no tool loads for this checkpoint's family: refused before anything is written
        from mmrl.export.diffusion import refusal

        problem = refusal(src, fmt)
        if problem is not None:
            raise ValueError(problem)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)  # a read-only or missing disk fails here, before the weights are read
        meta = writer(src, tmp, final=out.resolve(), dtype=dtype)
        meta["out"] = str(out.resolve())
        write_json(tmp / EXPORT_META, meta)
        _swap_in(tmp, out)
    except Exception as exc:
        problem = _write_problem(exc, out, tmp)
        if problem is None:
            raise
        raise RunError(problem) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _holds(directory: Path) -> str | None:
    """What the non-empty `directory` holds, in words, when it is not an earlier export (None when it is one:
    `mmrl_export.json` in it and nothing of a run or a checkpoint)."""
    names = sorted(p.name for p in directory.iterdir())
    if COMPLETE_MARKER in names:
        return f"a checkpoint: its {COMPLETE_MARKER} marker"
    run = [n + ("/" if (directory / n).is_dir() else "") for n in RUN_ENTRIES if n in names]
    if run:
        return f"a run directory: {', '.join(run)}"
    if EXPORT_META in names:
        return None
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"{len(names)} entr{'y' if len(names) == 1 else 'ies'}: {shown}"


def _check_out(out: Path, overwrite: bool) -> None:
    """--out must be new, empty or (with --overwrite) an earlier export: ValueError naming what else it holds."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"mmrl export: --out {out} is a file; give a new or empty directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    holds = _holds(out)
    if holds is not None:  # --overwrite would delete it: never
        raise ValueError(f"mmrl export: --out {out} is not an earlier export (it holds {holds}); --overwrite replaces "
                         f"only a directory mmrl export wrote (with {EXPORT_META}): give a new or empty directory")
    if not overwrite:
        raise ValueError(f"mmrl export: --out {out} holds an earlier export; pass --overwrite to replace it, or give "
                         f"a new or empty directory")


def _check_apart(out: Path, src: ExportSource) -> None:
    """--out must not be, hold or lie inside the run, the checkpoint or the base model the export reads (an export
    there would replace them, or sit in a run directory that resuming and pruning manage)."""
    adapters = src.state_dir.parent
    read = [("the checkpoint being exported", adapters.parent if src.step is not None else adapters),
            ("the base model it applies to", src.base)]
    if src.step is not None and adapters.parent.parent.name == "checkpoints":
        read.insert(0, ("the run being exported", adapters.parent.parent.parent))
    target = out.resolve()
    for what, path in read:
        path = path.resolve()
        if target == path or path in target.parents or target in path.parents:
            where = "is" if target == path else "is inside" if path in target.parents else "contains"
            raise ValueError(f"mmrl export: --out {out} {where} {what} ({path}); give a directory outside it")


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename the finished export `tmp` to `out`; an earlier export (or an empty directory) there is moved aside
    first and deleted only once the new one is in place."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.parent / f".tmp-old-{out.name}-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write_problem(exc: Exception, out: Path, tmp: Path) -> str | None:
    """One line for a failure to write the export (a full disk, a read-only or unwritable --out); None for any other
    error (the writers' own one-line errors, a problem reading the checkpoint or the base model)."""
    if isinstance(exc, (ValueError, RunError)) or (isinstance(exc, OSError) and exc.errno is None):
        return None
    if isinstance(exc, OSError) and exc.errno not in (errno.ENOSPC, errno.EDQUOT):  # read-only, no permission, ...
        failed, written = Path(exc.filename or "").absolute(), (tmp.absolute(), out.absolute())
        if exc.filename is not None and (failed in written or failed in written[0].parents
                                         or any(w in failed.parents for w in written)):
            return (f"mmrl export: cannot write --out {out}: {exc.strerror} ({exc.filename}); give --out a directory "
                    f"on a writable disk")
        return None
    if disk_full(exc, out.parent):
        return (f"mmrl export: no space left on the device of {out.parent} while writing --out {out} "
                f"({type(exc).__name__}: {str(exc)[:120]}); the partial export was removed and {out} is as it was: "
                f"free space, or give --out on another disk")
    return None
