"""Every diffusion export format on every model family, loaded by the tool it names (docs/export.md's table).

For each tiny family pipeline (`mmrl.diffusion.models.tiny_cases()`, Wan 2.2 A14B's two experts included) a LoRA checkpoint is
written the way training writes it (`build_policy_states`, `PolicyStates.save`) with a non-zero update. mmrl's own
policy is that checkpoint applied by `mmrl eval`'s path (`apply_checkpoint`), sampled through the family's diffusers
pipeline. Each export is then loaded by its consumer with the code of its own model card (`README.md`, executed):
diffusers' `load_lora_weights` / `from_pretrained`, with no "No LoRA keys" warning for the transformer, and the
images must differ from the base model's and equal mmrl's policy's. The kohya file is also applied by ComfyUI's key
rule (comfy/lora.py `model_lora_keys_unet`: key `lora_transformer_<diffusers module, "." -> "_">`, update
`up @ down * alpha / rank`), re-implemented here: ComfyUI is not installable from PyPI, so ComfyUI itself is not run.
A format a family's tools cannot load is refused in one line before anything is written.
"""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import pytest
import torch
import yaml

from mmrl.export import export

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4  # measured max |diff| of the loaded exports vs mmrl's policy: <= 2e-6 (merged), 0 (LoRA files)
FAMILIES = ["StableDiffusion3Pipeline", "FluxPipeline", "FluxKontextPipeline", "QwenImagePipeline",
            "QwenImageEditPipeline", "QwenImageEditPlusPipeline", "WanPipeline", "WanPipeline:2.2_a14b",
            "ZImagePipeline", "Flux2Pipeline", "Flux2KleinPipeline"]
KOHYA = {"StableDiffusion3Pipeline": "sd3", "FluxPipeline": "flux"}  # the families --format kohya is written for
# families whose exports are written but not yet loaded by their consumer in this test (docs/export.md says so)
NOT_CHECKED = {"LTX2Pipeline": "video + audio state: its pipeline call is not wired into this test yet",
               "HunyuanVideo15Pipeline": "its VAE decodes one sample at a time (diffusers 0.42): not wired in yet"}


def _tiny_case(cls: str, variant: str | None):
    """The family's own tiny case (`mmrl.diffusion.models.tiny_cases`) of that builder variant."""
    from mmrl.diffusion.models import tiny_cases

    (case,) = [c for c in tiny_cases().values() if c.pipeline == cls and c.options.get("variant") == variant]
    return case


def test_every_registered_family_is_covered():
    from mmrl.diffusion.models import tiny_cases

    assert {f.split(":")[0] for f in FAMILIES} | set(NOT_CHECKED) == {case.pipeline for case in tiny_cases().values()}


def _size(cls: str) -> int:
    return 64 if cls in ("StableDiffusion3Pipeline", "FluxPipeline") else 32


def lora_checkpoint(root: Path, cls: str, variant: str | None, rank: int = 4) -> tuple[Path, Path]:
    """(base pipeline, run directory) with one checkpoint as training writes it: a LoRA (rank 4, alpha 8: scale 2)
    whose lora_B is drawn at random, or (rank 0) full fine-tuning with noise added to the attention queries."""
    from mmrl.config import load_config
    from mmrl.diffusion.common import build_policy_states, load_recipe_model
    base = _tiny_case(cls, variant).build_at(root / "base")
    d = {"algorithm": "flow_grpo", "output_dir": str(root / "run"), "device": "cpu",
         "model": {"path": str(base), "lora": {"rank": rank, "alpha": 8}},
         "data": {"train_prompts": str(ROOT / "assets/prompts/shapes_train.txt")},
         "rollout": {"height": _size(cls), "width": _size(cls), "eval_num_steps": 2, "eval_guidance_scale": 3.0,
                     **({"num_frames": 5} if cls == "WanPipeline" else {})}}
    cfg = load_config(d)
    states = build_policy_states(load_recipe_model(cfg, "cpu", torch.float32), cfg.model, old=False, ref=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in states.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            elif rank == 0 and name.endswith("to_q.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    step = root / "run" / "checkpoints" / "step_1"
    states.save(step / "adapters")
    (step / "config.yaml").write_text(yaml.safe_dump(d))
    (step / "COMPLETE").write_text("{}")
    return base, root / "run"


def images(pipe, cls: str, sampling: dict) -> torch.Tensor:
    """The pipeline called with the exported settings and one seed (edit families: one source image)."""
    from PIL import Image

    kw = {k: v for k, v in sampling.items() if k != "max_sequence_length"}  # the tiny text encoders are short
    if "Edit" in cls or "Kontext" in cls:
        kw["image"] = Image.new("RGB", (_size(cls), _size(cls)), (200, 30, 30))
    if "Kontext" in cls:  # not the default ~1024^2 copy of the source: minutes on a CPU
        kw.update(max_area=_size(cls) ** 2, _auto_resize=False)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt="a red circle", **kw, generator=torch.Generator().manual_seed(0), output_type="pt")
    return torch.as_tensor(out.frames if cls == "WanPipeline" else out.images).float()


def run_card(out: Path, tmp_path: Path, monkeypatch, cls: str):
    """Execute the python block of the export's model card (the consumer's loading code, as a user would run it:
    the tiny text encoders take 16 tokens); returns its `pipe` and the diffusers log it wrote."""
    from PIL import Image

    card = (out / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", card, re.S).group(1).replace("max_sequence_length=512",
                                                                         "max_sequence_length=16")
    code = code.replace("max_sequence_length=128", "max_sequence_length=16")
    if "Kontext" in cls:  # as images(): a source of the sample's size
        code = code.replace('image=Image.open("source.png"), ', 'image=Image.open("source.png"), max_area='
                            f'{_size(cls) ** 2}, _auto_resize=False, ')
    monkeypatch.chdir(tmp_path)
    Image.new("RGB", (_size(cls), _size(cls)), (200, 30, 30)).save(tmp_path / "source.png")
    log, handler = io.StringIO(), None
    handler = logging.StreamHandler(log)
    logging.getLogger("diffusers").addHandler(handler)
    try:
        scope: dict = {}
        exec(compile(code, str(out / "README.md"), "exec"), scope)
    finally:
        logging.getLogger("diffusers").removeHandler(handler)
    return scope["pipe"], log.getvalue()


def comfyui_apply(kohya: dict[str, torch.Tensor], transformer: torch.nn.Module) -> int:
    """ComfyUI's rule for these keys (SD3 and Flux branches of comfy/lora.py `model_lora_keys_unet`, the "lora"
    patch of comfy/weight_adapter): the module named by `lora_transformer_<module with "_">` gets
    `W += up @ down * alpha / rank`. Returns the number of patched modules; an unknown key is an error (ComfyUI would
    log "lora key not loaded" and skip it)."""
    by_flat = {name.replace(".", "_"): m for name, m in transformer.named_modules() if name}
    stems = {k.rsplit(".", 2)[0] if k.endswith("weight") else k.rsplit(".", 1)[0] for k in kohya}
    with torch.no_grad():
        for stem in stems:
            module = by_flat[stem.removeprefix("lora_transformer_")]
            down, up = kohya[f"{stem}.lora_down.weight"], kohya[f"{stem}.lora_up.weight"]
            module.weight += up @ down * float(kohya[f"{stem}.alpha"]) / down.shape[0]
    return len(stems)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_each_export_loads_in_its_consumer_and_draws_mmrl_images(family, tmp_path, monkeypatch):
    import diffusers
    from safetensors.torch import load_file

    from mmrl.config import load_config
    from mmrl.diffusion.common import load_recipe_model
    from mmrl.eval.harness import apply_checkpoint, resolve_checkpoint

    cls, _, variant = family.partition(":")
    base, run = lora_checkpoint(tmp_path / "ckpt", cls, variant or None)
    model = load_recipe_model(load_config(run / "checkpoints/step_1/config.yaml"), "cpu", torch.float32)
    apply_checkpoint(model, resolve_checkpoint(run)[0])  # mmrl eval's path
    Pipe = getattr(diffusers, cls)
    sampling = None
    diffs = {}
    for fmt in ("diffusers-lora", "diffusers", "kohya"):
        out = tmp_path / fmt
        if fmt == "kohya" and cls not in KOHYA:
            with pytest.raises(ValueError) as err:
                export(run, fmt, out)
            assert str(err.value) == (
                f"mmrl export: --format kohya is not loadable for {cls} (family {model.family!r}): mmrl's kohya keys "
                f"(lora_transformer_<module>) are read by ComfyUI for SD3 and FLUX and by diffusers' loader for FLUX "
                f"only; use --format diffusers-lora (pipe.load_lora_weights) or --format diffusers (a merged "
                f"pipeline)")
            assert not [p.name for p in tmp_path.iterdir() if "kohya" in p.name]  # nothing written, no temp dir
            continue
        meta = export(run, fmt, out)
        sampling = meta["sampling"]
        card = (out / "README.md").read_text()
        assert f"Exported by `mmrl export --format {fmt}` from " in card and "(recipe flow_grpo, step 1," in card
        assert f"base_model: {base.resolve()}" in card and f"Loaded by: {meta['loaded_by']}." in card
        if fmt == "kohya" and cls == "StableDiffusion3Pipeline":  # ComfyUI only: no python block to run
            assert "does not read kohya keys" in card and "```python" not in card
        else:
            pipe, log = run_card(out, tmp_path, monkeypatch, cls)
            transformer = type(pipe.transformer).__name__
            assert f"No LoRA keys associated to {transformer}" not in log, log
            diffs[fmt] = (images(pipe, cls, sampling) - images(model.pipe, cls, sampling)).abs().max().item()
        if fmt == "kohya":  # ComfyUI's key rule on a plain base pipeline
            pipe = Pipe.from_pretrained(str(base))
            assert comfyui_apply(load_file(str(out / meta["file"])), pipe.transformer) == \
                len(load_file(str(out / meta["file"]))) // 3
            diffs["kohya (ComfyUI's key rule)"] = (images(pipe, cls, sampling)
                                                   - images(model.pipe, cls, sampling)).abs().max().item()
    changed = (images(Pipe.from_pretrained(str(base)), cls, sampling)
               - images(model.pipe, cls, sampling)).abs().max().item()
    print(f"[export] {family}: max |consumer - mmrl| {diffs}; |base - mmrl| {changed:.3g}")
    assert changed > 10 * TOL  # the LoRA changes the images: the checks above can fail
    assert max(diffs.values()) < TOL, diffs


def test_kohya_is_refused_before_anything_is_read_for_a_family_no_tool_loads(tmp_path):
    """The family comes from the base model's model_index.json: the refusal needs no weights (fast)."""
    ck = tmp_path / "run" / "checkpoints" / "step_3"
    (ck / "adapters" / "default").mkdir(parents=True)
    (ck / "adapters" / "default" / "adapter_model.safetensors").write_bytes(b"")
    (ck / "COMPLETE").write_text("{}")
    base = tmp_path / "wan"
    base.mkdir()
    (base / "model_index.json").write_text('{"_class_name": "WanPipeline", "transformer_2": [null, null]}')
    (ck / "config.yaml").write_text(yaml.safe_dump({"algorithm": "flow_grpo", "model": {"path": str(base)}}))
    with pytest.raises(ValueError, match=re.escape(
            "mmrl export: --format kohya is not loadable for WanPipeline (family 'wan'): mmrl's kohya keys")):
        export(tmp_path / "run", "kohya", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "wan"]


@pytest.mark.slow
def test_full_fine_tuning_of_both_wan22_experts_merges(tmp_path):
    """Wan 2.2 A14B full fine-tuning saves both experts as one module (`high.` / `low.` names): the merged pipeline
    puts them into `transformer` and `transformer_2` (copying them into `transformer` alone failed)."""
    import diffusers

    from mmrl.config import load_config
    from mmrl.diffusion.common import load_recipe_model
    from mmrl.eval.harness import apply_checkpoint, resolve_checkpoint

    base, run = lora_checkpoint(tmp_path / "ckpt", "WanPipeline", "2.2_a14b", rank=0)
    model = load_recipe_model(load_config(run / "checkpoints/step_1/config.yaml"), "cpu", torch.float32)
    apply_checkpoint(model, resolve_checkpoint(run)[0])
    meta = export(run, "diffusers", tmp_path / "merged")
    ours = images(model.pipe, "WanPipeline", meta["sampling"])
    got = images(diffusers.WanPipeline.from_pretrained(str(tmp_path / "merged")), "WanPipeline", meta["sampling"])
    base_images = images(diffusers.WanPipeline.from_pretrained(str(base)), "WanPipeline", meta["sampling"])
    assert (ours - base_images).abs().max() > 10 * TOL and (got - ours).abs().max() < TOL
