"""Exports of a VLM checkpoint: a merged, self-contained transformers directory, or a peft adapter naming its base.

The merged directory is what `AutoModelForImageTextToText.from_pretrained(out)` and `AutoProcessor.from_pretrained(out)`
load, in the standard Hugging Face layout (config.json, safetensors weights with the names transformers saves,
generation_config.json, the processor's and tokenizer's files, the chat template), which is what vLLM serves
(`vllm serve OUT`). The model class and the processor come from the base model's own config through transformers'
Auto classes, so every Qwen-VL generation transformers knows (and any other image-text-to-text model) exports alike.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mmrl.export.source import ExportSource


def _sampling(cfg: Any) -> dict:
    r = cfg.rollout
    return {k: getattr(r, k) for k in ("temperature", "top_p", "top_k", "max_new_tokens", "system_prompt")
            if hasattr(r, k)}


def export_metadata(src: ExportSource, fmt: str) -> dict:
    model_type = json.loads((src.base / "config.json").read_text()).get("model_type") \
        if (src.base / "config.json").is_file() else None
    if model_type is None:
        raise FileNotFoundError(f"mmrl export: {src.base} has no config.json with a model_type: expected the "
                                f"transformers model directory the run was trained from (--base PATH)")
    return {"format": fmt, "base_model": str(src.base), "model_type": model_type,
            "rollout_sampling": _sampling(src.config), "source": src.provenance()}


def _model_card(meta: dict, title: str, usage: str) -> str:
    src = meta["source"]
    return (f"---\nbase_model: {meta['base_model']}\nlibrary_name: transformers\npipeline_tag: image-text-to-text\n"
            f"tags: [\"mmrl\", \"reinforcement-learning\"]\n---\n\n# {title}\n\nExported by `mmrl export --format "
            f"{meta['format']}` from {src['checkpoint']} (recipe {src['algorithm']}, step {src['step']}, policy state "
            f"{src['state']!r}, {src['mode']}). Base model: {meta['base_model']} ({meta['model_type']}).\n\n"
            f"Loaded by: {meta['loaded_by']}.\n\n{usage}\n"
            f"`mmrl_export.json` records the rollout sampling settings of training and the checkpoint's sha256.\n")


def merged_model(src: ExportSource, dtype: str = "auto"):
    """(model, processor): the base model with the checkpoint's LoRA merged in by peft (`merge_and_unload`) or its
    full fine-tuning weights copied in."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmrl.adapters import FULL_WEIGHTS_NAME
    from mmrl.eval.harness import copy_full_weights
    from mmrl.runtime import resolve_dtype

    torch_dtype = "auto" if dtype == "auto" else resolve_dtype(dtype)
    processor = AutoProcessor.from_pretrained(str(src.base))
    model = AutoModelForImageTextToText.from_pretrained(str(src.base), dtype=torch_dtype)
    if src.mode == "lora":
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(src.state_dir)).merge_and_unload()
    else:
        copy_full_weights(model, src.state_dir / FULL_WEIGHTS_NAME)
    leftover = [n for n, _ in model.named_parameters() if "lora_" in n]
    if leftover:
        raise RuntimeError(f"mmrl export: LoRA layers left in the merged model: {leftover[:3]}")
    return model, processor


def export_transformers(src: ExportSource, out: Path, final: Path | None = None, dtype: str = "auto",
                        **_: Any) -> dict:
    """`out/`: weights + config.json + generation_config.json + processor + tokenizer + chat template."""
    from transformers import GenerationConfig

    meta = export_metadata(src, "transformers")
    model, processor = merged_model(src, dtype)
    if model.generation_config is None or not (src.base / "generation_config.json").is_file():
        # a base without generation_config.json: derive it from the model config, as save_pretrained would
        model.generation_config = GenerationConfig.from_model_config(model.config)
    model.save_pretrained(str(out), safe_serialization=True)
    processor.save_pretrained(str(out))
    if not (out / "generation_config.json").is_file():
        model.generation_config.save_pretrained(str(out))
    meta["dtype"] = str(model.dtype).replace("torch.", "")
    where = str(final or out)
    meta["loaded_by"] = "transformers' AutoModelForImageTextToText.from_pretrained(DIR); vLLM (vllm serve DIR)"
    usage = ("```python\nfrom transformers import AutoModelForImageTextToText, AutoProcessor\n\n"
             f"model = AutoModelForImageTextToText.from_pretrained({where!r})\n"
             f"processor = AutoProcessor.from_pretrained({where!r})\n```\n\nServe it with vLLM: `vllm serve {where}`.\n")
    (out / "README.md").write_text(_model_card(meta, "Vision-language model fine-tuned with mmrl (merged)", usage))
    return meta


def export_peft(src: ExportSource, out: Path, final: Path | None = None, **_: Any) -> dict:
    """`out/`: the LoRA in peft's format (`PeftModel.from_pretrained(base_model, out)`) with adapter_config.json
    naming its base model, plus the base's processor and tokenizer files."""
    from transformers import AutoProcessor

    from mmrl.adapters import PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME

    if src.mode != "lora":
        raise ValueError(f"mmrl export --format peft: {src.state_dir} is a full fine-tuning checkpoint (no LoRA); use "
                         f"--format transformers (a merged model directory)")
    meta = export_metadata(src, "peft")
    shutil.copyfile(src.state_dir / PEFT_WEIGHTS_NAME, out / PEFT_WEIGHTS_NAME)
    adapter_config = json.loads((src.state_dir / PEFT_CONFIG_NAME).read_text())
    adapter_config["base_model_name_or_path"] = meta["base_model"]
    (out / PEFT_CONFIG_NAME).write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    AutoProcessor.from_pretrained(str(src.base)).save_pretrained(str(out))
    meta["loaded_by"] = "peft's PeftModel.from_pretrained(base, DIR) on the base model it names"
    usage = ("```python\nfrom peft import PeftModel\nfrom transformers import AutoModelForImageTextToText, "
             "AutoProcessor\n\n"
             f"base = AutoModelForImageTextToText.from_pretrained({meta['base_model']!r})\n"
             f"model = PeftModel.from_pretrained(base, {str(final or out)!r})\n"
             f"processor = AutoProcessor.from_pretrained({str(final or out)!r})\n```\n")
    (out / "README.md").write_text(_model_card(meta, "LoRA adapter trained with mmrl", usage))
    return meta
