"""Every diffusion recipe (flow_grpo, nft, awm, online dpo) trains 2 steps on every model family, LoRA and full
fine-tuning, and a run interrupted after step 1 resumes to exactly the same metrics and weights; 2-rank DDP
(torchrun) for Qwen-Image.

FAMILIES below is the one list of families the recipes are tested on (a family registered in
`mmrl.diffusion.models` and missing here fails `test_every_registered_family_is_tested`): add a family with its
tiny builder in `mmrl.tiny.FAMILY_BUILDERS` and its rollout settings here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mmrl.config import load_config
from mmrl.diffusion.models import available_families
from mmrl.testing import child_env, metrics_rows, run_torchrun, without_time

REPO = Path(__file__).resolve().parents[2]
TEXT_PROMPTS = str(REPO / "assets" / "prompts" / "shapes_train.txt")

# pipeline class -> rollout settings for its tiny model: the guidance the family uses (CFG above 1, or its guidance
# embedding), whether it edits a source image (then the data are shapes edit rows and the rewards edit rewards)
FAMILIES: dict[str, dict] = {
    "StableDiffusion3Pipeline": {"guidance_scale": 1.0},
    "FluxPipeline": {"guidance_scale": 3.5},
    "QwenImagePipeline": {"guidance_scale": 4.0},                      # true CFG with the norm rescale
    "QwenImageEditPipeline": {"guidance_scale": 4.0, "edit": True},
    "QwenImageEditPlusPipeline": {"guidance_scale": 4.0, "edit": True},
    "FluxKontextPipeline": {"guidance_scale": 2.5, "edit": True},      # guidance embedding
}
RECIPES = {
    "flow_grpo": {"update": {"micro_batch_size": 2, "mini_batch_size": 0}, "algo": {"kl": {"coef": 0.01}}},
    "nft": {"update": {"micro_batch_size": 2, "mini_batch_size": 0}, "algo": {"timestep_fraction": 0.5}},
    "awm": {"update": {"micro_batch_size": 2, "mini_batch_size": 0},
            "algo": {"num_train_timesteps": 1, "timestep_fraction": 1.0}},
    "dpo": {"update": {"micro_batch_size": 2}, "algo": {"mode": "online", "beta": 100.0},
            "rollout": {"noise_level": 0.7}},
}
TEXT_REWARD = {"jpeg_compressibility": 1.0}
EDIT_REWARD = {"edit_region_color": 1.0, "edit_preservation": 0.5}


@pytest.fixture(scope="module")
def edit_file(tmp_path_factory):
    from mmrl.pipelines.edits import make_shapes_edit_file

    return make_shapes_edit_file(tmp_path_factory.mktemp("edits"), n=8, seed=1)


def family_config(recipe: str, family: str, model_path, out, edit_file, *, lora: bool, max_steps: int) -> dict:
    f = FAMILIES[family]
    d = {
        "algorithm": recipe, "output_dir": str(out), "seed": 3, "device": "cpu",
        "model": {"path": str(model_path), "lora": {"rank": 4 if lora else 0, "alpha": 8}},
        "data": {"train_prompts": str(edit_file) if f.get("edit") else TEXT_PROMPTS},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "height": 64, "width": 64, "num_steps": 2,
                    "guidance_scale": f["guidance_scale"], "eval_num_steps": 2,
                    "eval_guidance_scale": f["guidance_scale"]},
        "optim": {"lr": 1e-3},
        "train": {"max_steps": max_steps, "save_every": 1},
        "reward": {"components": EDIT_REWARD if f.get("edit") else TEXT_REWARD},
        "log": {"sample_every": 1, "num_samples": 4},
    }
    for section, keys in RECIPES[recipe].items():
        d[section] = {**d.get(section, {}), **keys}
    return d


def _train(d: dict):
    from mmrl.config import RECIPES as RECIPE_MODULES
    import importlib

    cfg = load_config(d)
    return importlib.import_module(RECIPE_MODULES[cfg.algorithm]).train(cfg)


def _weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    files = sorted((out / "checkpoints" / f"step_{step}" / "adapters").rglob("*.safetensors"))
    assert files, f"no adapter weights in {out}"
    return {f"{f.parent.name}/{k}": v for f in files for k, v in load_file(str(f)).items()}


def assert_resume_is_exact(full: Path, half: Path) -> None:
    a, b = metrics_rows(full), metrics_rows(half)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    assert [without_time(r) for r in a] == [without_time(r) for r in b]
    wa, wb = _weights(full, 2), _weights(half, 2)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_every_registered_family_is_tested():
    assert sorted(FAMILIES) == available_families()


@pytest.mark.slow
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_trains_and_resumes_exactly(recipe, family, lora, tiny_family, edit_file, tmp_path):
    path = tiny_family(family)
    _train(family_config(recipe, family, path, tmp_path / "full", edit_file, lora=lora, max_steps=2))
    _train(family_config(recipe, family, path, tmp_path / "half", edit_file, lora=lora, max_steps=1))
    _train(family_config(recipe, family, path, tmp_path / "half", edit_file, lora=lora, max_steps=2))  # resumes
    assert_resume_is_exact(tmp_path / "full", tmp_path / "half")
    rows = metrics_rows(tmp_path / "full")
    assert all(torch.isfinite(torch.tensor(r["reward/mean"])) for r in rows)
    trained = rows[-1].get("train/updates", rows[-1].get("train/pairs"))
    assert trained is not None
    grid = tmp_path / "full" / "samples" / "step_000001.png"
    assert grid.is_file()
    if FAMILIES[family].get("edit"):  # the edit rewards read the source image and mask from the data rows
        assert any(k.startswith("reward/edit_region_color") for k in rows[0])


@pytest.mark.slow
@pytest.mark.parametrize("recipe, lora", [("flow_grpo", True), ("flow_grpo", False), ("nft", True), ("awm", True),
                                          ("dpo", True)])
def test_qwen_image_two_rank_ddp_resumes_exactly(recipe, lora, tiny_family, edit_file, tmp_path):
    """torchrun, 2 CPU processes (gloo): 2 steps in one go equal 1 step then a resumed second step."""
    path = tiny_family("QwenImagePipeline")
    env = child_env()
    for name, steps in (("full", [2]), ("half", [1, 2])):
        for max_steps in steps:
            d = family_config(recipe, "QwenImagePipeline", path, tmp_path / name, edit_file, lora=lora,
                              max_steps=max_steps)
            d["dist"] = {"strategy": "ddp", "backend": "gloo"}
            d["rollout"]["prompts_per_step"] = 2  # one prompt (one group) per rank
            cfg_file = tmp_path / f"{name}_{max_steps}.yaml"
            cfg_file.write_text(yaml.safe_dump(d))
            proc = run_torchrun(["-m", "mmrl.cli", "train", str(cfg_file)], cwd=REPO, env=env)
            assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "resumed from" in proc.stdout
    assert_resume_is_exact(tmp_path / "full", tmp_path / "half")
