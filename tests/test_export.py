"""`mmrl export`: every format loads in the tool it is for and reproduces mmrl's policy.

Diffusion: short Flow-GRPO runs on the tiny SD3 (CFG on) and the tiny FLUX (guidance embedding) write real
checkpoints; each export is loaded by plain diffusers and, called with the exported sampling settings and mmrl eval's
seed, draws mmrl's deterministic (ODE) images to float tolerance. VLM: short GRPO runs on the tiny Qwen2-VL (LoRA and
full fine-tuning); the merged directory loads with `from_pretrained` and gives mmrl's logits and greedy answer.
"""

from __future__ import annotations

import io
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch

from mmrl import cli
from mmrl.config import load_config
from mmrl.export import export

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["a red circle on a blue background", "a green square on a white background"]
IMAGE_TOL = 1e-4     # measured max |diff| of the diffusers path vs mmrl's: <= 4e-6 (SD3 and FLUX, all formats)


def _diffusion_run(root: Path, model_path: Path, *extra: str) -> Path:
    from mmrl.diffusion import flow_grpo

    out = root / "run"
    cfg = load_config(ROOT / "configs/diffusion/flow_grpo_tiny.yaml", [
        f"output_dir={out}", f"model.path={model_path}", f"data.train_prompts={ROOT}/assets/prompts/shapes_train.txt",
        f"data.eval_prompts={ROOT}/assets/prompts/shapes_eval.txt", "train.max_steps=2", "train.save_every=2",
        "rollout.num_steps=3", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.eval_num_steps=4",
        "log.sample_every=0", "log.eval_every=0", "optim.lr=0.05", "algo.clip_range=0.5", *extra])
    flow_grpo.train(cfg)
    return out


@pytest.fixture(scope="module")
def sd3_run(tmp_path_factory):
    return _diffusion_run(tmp_path_factory.mktemp("sd3"), ROOT / "assets/tiny_sd3_shapes",
                          "rollout.eval_guidance_scale=3.0")


@pytest.fixture(scope="module")
def flux_run(tmp_path_factory):
    from mmrl.tiny import build_tiny_flux

    root = tmp_path_factory.mktemp("flux")
    return _diffusion_run(root, build_tiny_flux(root / "flux"), "rollout.eval_guidance_scale=3.5",
                          "rollout.guidance_scale=3.5")


def mmrl_ode_images(run: Path, meta: dict, base: bool = False) -> torch.Tensor:
    """mmrl's evaluation images of the run's newest checkpoint (or the base model): `mmrl eval`'s path (the family's
    FlowModel, the checkpoint applied, ODE sampling, prompt i seeded `prompt_seed(seed, i)`), kept in float."""
    from mmrl.diffusion.models import load_flow_model
    from mmrl.diffusion.sampling import sample_groups
    from mmrl.eval.harness import apply_checkpoint, prompt_seed, resolve_checkpoint

    cfg = load_config(run / "config.yaml")
    model = load_flow_model(cfg.model.path, "cpu", torch.float32, cfg.model.max_sequence_length or None)
    if not base:
        apply_checkpoint(model, resolve_checkpoint(run)[0], "default")
    s = meta["sampling"]
    out = []
    for i, prompt in enumerate(PROMPTS):
        gen = torch.Generator().manual_seed(prompt_seed(cfg.seed, i))
        with torch.no_grad():
            traj = sample_groups(model, model.encode_prompts([prompt]), 1, num_steps=s["num_inference_steps"],
                                 height=s["height"], width=s["width"], guidance_scale=s["guidance_scale"],
                                 noise_level=0.0, generator=gen)
        out.append(traj.images.float())
    return torch.cat(out)


def pipeline_images(pipe, run: Path, sampling: dict) -> torch.Tensor:
    """What a diffusers user gets: the pipeline called with the exported settings and mmrl eval's seeds."""
    from mmrl.eval.harness import prompt_seed

    seed = load_config(run / "config.yaml").seed
    pipe.set_progress_bar_config(disable=True)
    out = [pipe(p, **sampling, generator=torch.Generator().manual_seed(prompt_seed(seed, i)),
                output_type="pt").images for i, p in enumerate(PROMPTS)]
    return torch.cat(out).float()


def _pipeline_class(meta: dict):
    import diffusers

    return getattr(diffusers, meta["pipeline_class"])


@pytest.mark.slow
@pytest.mark.parametrize("run_fixture", ["sd3_run", "flux_run"])
def test_every_diffusion_export_reproduces_mmrl_images(run_fixture, request, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from mmrl.export.diffusion import kohya_to_diffusers

    run = request.getfixturevalue(run_fixture)
    lora = export(run, "diffusers-lora", tmp_path / "lora")
    ours = mmrl_ode_images(run, lora)
    base_images = mmrl_ode_images(run, lora, base=True)
    assert (ours - base_images).abs().max() > 50 * IMAGE_TOL  # the trained LoRA changes the images: a real check
    Pipe = _pipeline_class(lora)
    s = lora["sampling"]
    assert s["max_sequence_length"] == (128 if lora["family"] == "sd3" else 512)

    # 1. diffusers LoRA directory: metadata names the base model and the sampling settings
    with safe_open(str(tmp_path / "lora" / "pytorch_lora_weights.safetensors"), "pt") as f:
        header = f.metadata()
    assert header["mmrl.base_model"] == str((ROOT / "assets/tiny_sd3_shapes").resolve()) or run_fixture == "flux_run"
    assert json.loads(header["mmrl.sampling"]) == s
    assert json.loads((tmp_path / "lora" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        lora["base_model"]
    own = next((run / "checkpoints").glob("step_*/adapters/default/adapter_config.json"))
    assert json.loads(own.read_text())["base_model_name_or_path"] == lora["base_model"]  # the run's own, too
    assert "base_model: " + lora["base_model"] in (tmp_path / "lora" / "README.md").read_text()
    pipe = Pipe.from_pretrained(lora["base_model"])
    pipe.load_lora_weights(str(tmp_path / "lora"))
    got = pipeline_images(pipe, run, s)
    diffs = {"diffusers-lora": (got - ours).abs().max().item()}

    # 2. merged, self-contained pipeline
    merged = export(run, "diffusers", tmp_path / "merged")
    assert merged["dtype"] == "float32"
    with safe_open(str(next((tmp_path / "merged" / "transformer").glob("*.safetensors"))), "pt") as f:
        assert not [k for k in f.keys() if "lora" in k]
    got = pipeline_images(Pipe.from_pretrained(str(tmp_path / "merged")), run, s)
    diffs["diffusers"] = (got - ours).abs().max().item()

    # 3. kohya-style file through diffusers' loader (FLUX: diffusers' own kohya converter; SD3: mmrl's inverse)
    kohya = export(run, "kohya", tmp_path / "kohya")
    file = tmp_path / "kohya" / kohya["file"]
    sd = load_file(str(file))
    alpha = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())["lora_alpha"]
    assert all(k.startswith("lora_transformer_") and k.endswith((".lora_down.weight", ".lora_up.weight", ".alpha"))
               for k in sd)
    assert {float(v) for k, v in sd.items() if k.endswith(".alpha")} == {float(alpha)}
    pipe = Pipe.from_pretrained(lora["base_model"])
    pipe.load_lora_weights(str(file) if lora["family"] == "flux" else kohya_to_diffusers(sd, pipe.transformer))
    got = pipeline_images(pipe, run, s)
    diffs["kohya"] = (got - ours).abs().max().item()
    print(f"[export] {lora['family']} max |diffusers - mmrl| per format: {diffs}")
    assert max(diffs.values()) < IMAGE_TOL, diffs


@pytest.mark.slow
def test_the_exported_text_length_matters(sd3_run, tmp_path):
    """Without the exported max_sequence_length (128 for SD3 in mmrl; the pipeline's default is 256) the images
    differ from mmrl's: the setting the LoRA metadata carries is needed."""
    meta = export(sd3_run, "diffusers-lora", tmp_path / "lora")
    pipe = _pipeline_class(meta).from_pretrained(meta["base_model"])
    pipe.load_lora_weights(str(tmp_path / "lora"))
    default_len = {k: v for k, v in meta["sampling"].items() if k != "max_sequence_length"}
    ours = mmrl_ode_images(sd3_run, meta)
    assert (pipeline_images(pipe, sd3_run, default_len) - ours).abs().max() > 10 * IMAGE_TOL


def test_kohya_keys_round_trip_exactly():
    """peft -> kohya -> diffusers keys on a real SD3 transformer: names and weights come back, the scale alpha/rank is
    folded into lora_B."""
    from mmrl.export.diffusion import kohya_to_diffusers, peft_to_kohya
    from diffusers import SD3Transformer2DModel

    tr = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
                               num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                               pooled_projection_dim=32, out_channels=4, pos_embed_max_size=32)
    g = torch.Generator().manual_seed(0)
    mods = ["transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.to_out.0", "transformer_blocks.1.attn.add_k_proj"]
    peft_sd = {}
    for m in mods:
        peft_sd[f"base_model.model.{m}.lora_A.weight"] = torch.randn(4, 32, generator=g)
        peft_sd[f"base_model.model.{m}.lora_B.weight"] = torch.randn(32, 4, generator=g)
    kohya = peft_to_kohya(peft_sd, alpha=8.0)
    assert "lora_transformer_transformer_blocks_1_attn_to_out_0.lora_down.weight" in kohya
    assert float(kohya["lora_transformer_transformer_blocks_0_attn_to_q.alpha"]) == 8.0
    back = kohya_to_diffusers(kohya, tr)
    for m in mods:
        assert torch.equal(back[f"transformer.{m}.lora_A.weight"], peft_sd[f"base_model.model.{m}.lora_A.weight"])
        assert torch.equal(back[f"transformer.{m}.lora_B.weight"], peft_sd[f"base_model.model.{m}.lora_B.weight"] * 2)
    with pytest.raises(ValueError, match="no module 'transformer_blocks_9_attn_to_q'"):
        kohya_to_diffusers({"lora_transformer_transformer_blocks_9_attn_to_q.lora_down.weight": torch.zeros(1)}, tr)


# ---------------------------------------------------------------------------------------------------------- VLM
def _vlm_run(root: Path, tiny: Path, *extra: str) -> Path:
    from mmrl.vlm import grpo

    out = root / "run"
    cfg = load_config({
        "algorithm": "vlm_grpo", "output_dir": str(out), "device": "cpu", "seed": 3,
        "model": {"path": str(tiny), "train_vision": True},
        "data": {"kind": "shapes", "template": "{question}", "colors": ["red", "green", "blue", "yellow"],
                 "shape_size": [0.5, 0.7], "eval_size": 4},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        "reward": {"name": "exact_match"}, "update": {"micro_batch_size": 4},
        "warm_start": {"steps": 3, "batch_size": 4, "lr": 1e-2},
        "log": {"sample_every": 0, "eval_every": 0}, "train": {"max_steps": 1, "save_every": 1},
        "optim": {"lr": 1e-2},
    }, list(extra))
    grpo.train(cfg)
    return out


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from mmrl.tiny import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "qwen2_vl", seed=0)


@pytest.fixture(scope="module")
def vlm_lora_run(tmp_path_factory, tiny_vlm):
    return _vlm_run(tmp_path_factory.mktemp("vlm_lora"), tiny_vlm, "model.lora.rank=8", "model.lora.alpha=16",
                    "model.lora.init=gaussian", "warm_start.params=[]")


@pytest.fixture(scope="module")
def vlm_full_run(tmp_path_factory, tiny_vlm):
    return _vlm_run(tmp_path_factory.mktemp("vlm_full"), tiny_vlm, "model.lora.rank=0")


def _question(processor):
    """One templated question with its image, as the processor returns it (mm_token_type_ids included)."""
    from PIL import Image

    from mmrl.vlm.common import messages_from_text, render_prompt

    image = Image.new("RGB", (56, 56), "white")
    image.paste((220, 30, 30), (14, 14, 42, 42))
    text = render_prompt(processor, messages_from_text("<image>What color is the square?"))
    return dict(processor(text=[text], images=[image], return_tensors="pt"))


def mmrl_policy_logits(run: Path, batch: dict, base: bool = False) -> torch.Tensor:
    """Logits of the run's newest checkpoint as mmrl holds it (the saved state loaded into PolicyStates)."""
    from mmrl.adapters import FULL_WEIGHTS_NAME, PolicyStates
    from mmrl.eval.harness import copy_full_weights, resolve_checkpoint, state_dir
    from mmrl.vlm.common import load_policy

    cfg = load_config(run / "config.yaml")
    model, _ = load_policy(cfg.model.path)
    if not base:
        sub = state_dir(resolve_checkpoint(run)[0], "default")
        if (sub / FULL_WEIGHTS_NAME).is_file():
            copy_full_weights(model, sub / FULL_WEIGHTS_NAME)
        else:
            model = PolicyStates(model, None, ref_adapter_path=sub).model
    with torch.no_grad():
        return model(**batch).logits.float()


@pytest.mark.slow
@pytest.mark.parametrize("run_fixture", ["vlm_lora_run", "vlm_full_run"])
def test_vlm_transformers_export_loads_and_equals_mmrl_policy(run_fixture, request, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText, AutoProcessor

    run = request.getfixturevalue(run_fixture)
    meta = export(run, "transformers", tmp_path / "merged")
    out = tmp_path / "merged"
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "processor_config.json", "chat_template.jinja", "README.md", "mmrl_export.json"} <= files, files
    base_keys = set(safe_open(str(Path(meta["base_model"]) / "model.safetensors"), "pt").keys())
    assert set(safe_open(str(out / "model.safetensors"), "pt").keys()) == base_keys  # the layout vLLM loads
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] and gen.get("pad_token_id") is not None
    model = AutoModelForImageTextToText.from_pretrained(str(out))
    processor = AutoProcessor.from_pretrained(str(out))
    batch = _question(processor)
    with torch.no_grad():
        got = model(**batch).logits.float()
    ours = mmrl_policy_logits(run, batch)
    assert (ours - mmrl_policy_logits(run, batch, base=True)).abs().max() > 1e-3  # training changed the policy
    diff = (got - ours).abs().max().item()
    print(f"[export] VLM {meta['source']['mode']}: max |logits(transformers export) - logits(mmrl)| = {diff:.2e}")
    assert diff < 1e-4
    with torch.no_grad():
        greedy = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert greedy.shape[1] > batch["input_ids"].shape[1]


@pytest.mark.slow
def test_vlm_peft_export_names_its_base(vlm_lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    meta = export(vlm_lora_run, "peft", tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == meta["base_model"]
    # the run's own checkpoint names it too (it was null before)
    own = next((vlm_lora_run / "checkpoints").glob("step_*/adapters/default/adapter_config.json"))
    assert json.loads(own.read_text())["base_model_name_or_path"] == meta["base_model"]
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(cfg["base_model_name_or_path"]),
                                      str(tmp_path / "adapter"))
    batch = _question(AutoProcessor.from_pretrained(str(tmp_path / "adapter")))
    with torch.no_grad():
        got = model(**batch).logits.float()
    assert (got - mmrl_policy_logits(vlm_lora_run, batch)).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------------ errors and CLI
@pytest.mark.slow
def test_wrong_format_for_the_family_and_bad_out_are_one_line_errors(vlm_full_run, sd3_run, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"--format diffusers-lora is for diffusion checkpoints; .* is a vlm "
                                         r"checkpoint \(vlm_grpo\): valid formats \['peft', 'transformers'\]"):
        export(vlm_full_run, "diffusers-lora", tmp_path / "x")
    with pytest.raises(ValueError, match="full fine-tuning checkpoint .* use --format transformers"):
        export(vlm_full_run, "peft", tmp_path / "x")
    with pytest.raises(ValueError, match="unknown --format 'onnx'; valid: "):
        export(sd3_run, "onnx", tmp_path / "x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(ValueError, match=r"is not an earlier export \(it holds 1 entry: f\); --overwrite replaces"):
        export(sd3_run, "kohya", tmp_path / "full", overwrite=True)
    assert cli.main(["export", str(tmp_path / "nowhere"), "--format", "kohya", "--out", str(tmp_path / "k")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmrl: error: mmrl export ") and "not found" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "k").exists()


def _files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _export_error(capsys, *argv: str) -> str:
    """`mmrl export ARGV` fails with exit code 2 and one line (no traceback); returns that line without the prefix."""
    assert cli.main(["export", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mmrl: error: mmrl export: "), err
    return err.removeprefix("mmrl: error: ").removesuffix("  (MMRL_DEBUG=1 shows the traceback)")


@pytest.mark.slow
def test_overwrite_replaces_only_an_earlier_export(sd3_run, tmp_path, capsys):
    """--overwrite never deletes a run, a checkpoint or other files, and --out never is, holds or lies inside the run
    or checkpoint being exported; an earlier export is replaced (issue 27: `--out RUN --overwrite` emptied the run)."""
    before = _files(sd3_run)
    step = sd3_run / "checkpoints" / "step_2"
    rule = ("--overwrite replaces only a directory mmrl export wrote (with mmrl_export.json): give a new or empty "
            "directory")
    lora = ["--format", "diffusers-lora"]
    assert _export_error(capsys, str(sd3_run), *lora, "--out", str(sd3_run), "--overwrite") == (
        f"mmrl export: --out {sd3_run} is not an earlier export (it holds a run directory: config.yaml, metrics.jsonl, "
        f"checkpoints/); {rule}")
    assert _export_error(capsys, str(step), *lora, "--out", str(step), "--overwrite") == (
        f"mmrl export: --out {step} is not an earlier export (it holds a checkpoint: its COMPLETE marker); {rule}")
    assert _export_error(capsys, str(sd3_run), *lora, "--out", str(sd3_run / "exports" / "lora")) == (
        f"mmrl export: --out {sd3_run / 'exports' / 'lora'} is inside the run being exported ({sd3_run}); give a "
        f"directory outside it")
    other = tmp_path / "notes"
    other.mkdir()
    (other / "a.txt").write_text("mine")
    assert _export_error(capsys, str(sd3_run), *lora, "--out", str(other), "--overwrite") == (
        f"mmrl export: --out {other} is not an earlier export (it holds 1 entry: a.txt); {rule}")
    assert _files(sd3_run) == before and (other / "a.txt").read_text() == "mine"

    # an earlier export: refused without --overwrite, replaced with it (nothing of the old one left)
    out = tmp_path / "lora"
    assert cli.main(["export", str(sd3_run), *lora, "--out", str(out)]) == 0
    assert _export_error(capsys, str(sd3_run), "--format", "kohya", "--out", str(out)) == (
        f"mmrl export: --out {out} holds an earlier export; pass --overwrite to replace it, or give a new or empty "
        f"directory")
    assert cli.main(["export", str(sd3_run), "--format", "kohya", "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "mmrl_export.json",
                                                     "mmrl_sd3_lora_step_2.safetensors"]
    # ... unless it holds the run being exported
    shutil.copytree(sd3_run, out / "run")
    assert _export_error(capsys, str(out / "run"), *lora, "--out", str(out), "--overwrite") == (
        f"mmrl export: --out {out} contains the run being exported ({out / 'run'}); give a directory outside it")
    assert _files(out / "run") == before
    capsys.readouterr()


@pytest.mark.slow
def test_export_to_a_read_only_or_full_disk_is_one_line(sd3_run, tmp_path, capsys):
    """Real mounts (root only, as tests/test_runtime.py's full disk): a read-only disk fails before the weights are
    read, a full one while they are written; neither leaves a partial export, and an earlier export stays whole."""
    import subprocess

    ro, small = tmp_path / "ro", tmp_path / "small"
    ro.mkdir()
    small.mkdir()
    mounts = [["-o", "ro,size=64k", str(ro)], ["-o", "size=128k", str(small)]]  # 128k: one kohya export fits
    if any(subprocess.run(["mount", "-t", "tmpfs", *m[:2], "tmpfs", m[2]], capture_output=True).returncode
           for m in mounts):
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        line = _export_error(capsys, str(sd3_run), "--format", "kohya", "--out", str(ro / "k"))
        assert line.startswith(f"mmrl export: cannot write --out {ro / 'k'}: Read-only file system ({ro / '.tmp-k-'}") \
            and line.endswith("); give --out a directory on a writable disk"), line
        assert cli.main(["export", str(sd3_run), "--format", "kohya", "--out", str(small / "k")]) == 0
        earlier = _files(small / "k")
        line = _export_error(capsys, str(sd3_run), "--format", "kohya", "--out", str(small / "k"), "--overwrite")
        assert line.startswith(f"mmrl export: no space left on the device of {small} while writing --out "
                               f"{small / 'k'} (SafetensorError: ") and line.endswith(
            f"the partial export was removed and {small / 'k'} is as it was: free space, or give --out on another "
            f"disk"), line
        assert _files(small / "k") == earlier and sorted(p.name for p in small.iterdir()) == ["k"]
        assert not list(ro.iterdir())
    finally:
        for m in mounts:
            subprocess.run(["umount", "-l", m[2]], capture_output=True)


@pytest.mark.slow
def test_kohya_for_a_family_without_a_key_layout_says_so(sd3_run, tmp_path, monkeypatch):
    from mmrl.export import diffusion

    monkeypatch.delitem(diffusion.KOHYA_READERS, "sd3")
    with pytest.raises(ValueError, match=re.escape(
            "mmrl export: --format kohya is not loadable for StableDiffusion3Pipeline (family 'sd3'): mmrl's kohya "
            "keys (lora_transformer_<module>) are read by ComfyUI for SD3 and FLUX and by diffusers' loader for FLUX "
            "only; use --format diffusers-lora (pipe.load_lora_weights) or --format diffusers (a merged pipeline)")):
        export(sd3_run, "kohya", tmp_path / "k")
    assert not list(tmp_path.iterdir())  # nothing left behind, not even the temp directory


@pytest.mark.slow
def test_the_sd3_kohya_file_says_diffusers_cannot_load_it(sd3_run, tmp_path, capsys):
    """diffusers' SD3 loader reads no kohya key (it loaded nothing, warning "No LoRA keys", and drew the base
    model's images; the export had no model card): the card and the printed `loaded_by` name ComfyUI and send
    diffusers users to --format diffusers-lora."""
    assert cli.main(["export", str(sd3_run), "--format", "kohya", "--out", str(tmp_path / "k")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["loaded_by"] == (
        "ComfyUI (Load LoRA node; its LoRA key map reads these keys for SD3). Not diffusers: "
        "StableDiffusion3Pipeline.load_lora_weights reads no kohya keys (it would load nothing): export --format "
        "diffusers-lora for diffusers")
    card = (tmp_path / "k" / "README.md").read_text()
    assert f"Loaded by: {printed['loaded_by']}." in card and "copy `mmrl_sd3_lora_step_2.safetensors` into " \
        "`ComfyUI/models/loras/`" in card and "(the file's `.alpha` keys carry the scale alpha / rank = " in card
    assert "diffusers' StableDiffusion3Pipeline does not read kohya keys" in card
    from diffusers import StableDiffusion3Pipeline
    from diffusers.utils import logging as dlog

    pipe, log = StableDiffusion3Pipeline.from_pretrained(printed["base_model"]), io.StringIO()
    dlog.get_logger("diffusers").addHandler(handler := logging.StreamHandler(log))
    try:  # what the card says: diffusers' SD3 loader loads nothing of it
        pipe.load_lora_weights(str(tmp_path / "k" / "mmrl_sd3_lora_step_2.safetensors"))
    finally:
        dlog.get_logger("diffusers").removeHandler(handler)
    assert "No LoRA keys associated to SD3Transformer2DModel" in log.getvalue()


@pytest.mark.slow
def test_cli_export_of_a_run_directory(sd3_run, tmp_path, capsys):
    assert cli.main(["export", str(sd3_run), "--format", "diffusers-lora", "--out", str(tmp_path / "l")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["source"]["step"] == 2 and printed["out"] == str((tmp_path / "l").resolve())
    meta = json.loads((tmp_path / "l" / "mmrl_export.json").read_text())
    assert meta["sampling"]["guidance_scale"] == 3.0 and meta["source"]["sha256"]
    assert str(tmp_path / "l") in (tmp_path / "l" / "README.md").read_text()  # the final path, not the temp dir


def test_a_config_of_another_family_is_refused_naming_the_checkpoints_own(tmp_path):
    """`--config` of a VLM run for a diffusion checkpoint was taken at its word: the error said the checkpoint was a
    vlm checkpoint. The checkpoint's own config.yaml says what wrote it."""
    import shutil

    ck = tmp_path / "ckpt"
    (ck / "adapters" / "default").mkdir(parents=True)
    (ck / "adapters" / "default" / "adapter_model.safetensors").write_bytes(b"")
    shutil.copy(ROOT / "configs/diffusion/flow_grpo_tiny.yaml", ck / "config.yaml")
    vlm = ROOT / "configs/vlm/grpo_tiny_shapes.yaml"
    with pytest.raises(ValueError, match=re.escape(f"mmrl export: --config {vlm} is a vlm_grpo (vlm) config, but the "
                                                   f"checkpoint was written by flow_grpo (diffusion) per its "
                                                   f"{ck / 'config.yaml'}; pass the config it was trained with")):
        export(ck / "adapters", "diffusers-lora", tmp_path / "out", config=vlm, base=ROOT / "assets/tiny_sd3_shapes")
    assert not (tmp_path / "out").exists()


def test_the_family_comes_from_the_registry_and_an_unknown_pipeline_is_one_line(tmp_path):
    from mmrl.diffusion.models import MODEL_FAMILIES
    from mmrl.export.diffusion import pipeline_family

    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    assert pipeline_family(tmp_path) == ("StableDiffusion3Pipeline", MODEL_FAMILIES["StableDiffusion3Pipeline"])
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "SomeFuturePipeline"}))
    with pytest.raises(ValueError, match=r"pipeline class 'SomeFuturePipeline' is not a registered family; "
                                         r"registered: \[.*'FluxPipeline'.*\]"):
        pipeline_family(tmp_path)
    with pytest.raises(FileNotFoundError, match="has no model_index.json"):
        pipeline_family(tmp_path / "nowhere")
