"""Every diffusion recipe (Flow-GRPO, DiffusionNFT, AWM, online DPO) on every model family: 2 steps of training,
then a run interrupted after step 1 and resumed gives the same metrics and weights as the uninterrupted one, with
LoRA and with full fine-tuning; 2-rank DDP (torchrun) for Qwen-Image. Video families train on [B, C, F, h, w]
latents with video rewards, edit families on shapes edit rows with edit rewards, through the same code.

The families are the registered ones: each family's file declares its tiny case(s) (`FlowModel.tiny_cases`: the
builder and the smallest rollout its latent grid takes), read here through `mmrl.diffusion.models.tiny_cases()`, so
a new family is tested by every recipe without a change here."""

import importlib
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mmrl.config import load_config
from mmrl import tiny
from mmrl.diffusion.models import MODEL_FAMILIES, available_families, tiny_cases
from mmrl.testing import RESUMED_RUN, assert_same_path, child_env, metrics_rows, run_torchrun, without_time

REPO = Path(__file__).resolve().parents[2]
PROMPTS = str(REPO / "assets" / "prompts" / "shapes_train.txt")

IMAGE_REWARD = {"jpeg_compressibility": 1.0}
VIDEO_REWARD = {"motion_amount": 1.0,
                "frames": {"reward": "video_frames", "image_reward": "jpeg_compressibility", "weight": 0.1}}
EDIT_REWARD = {"edit_region_color": 1.0, "edit_preservation": 0.5}  # read the source image and mask of each row

CASES = tiny_cases()


def reward_of(case) -> dict:
    """Edit families train on shapes edit rows with the edit rewards, video families on videos, the others on
    images."""
    cls = MODEL_FAMILIES[case.pipeline]
    return EDIT_REWARD if cls.needs_source_image else VIDEO_REWARD if cls.is_video else IMAGE_REWARD


RECIPES = {
    "flow_grpo": {"update": {"micro_batch_size": 4, "mini_batch_size": 2}, "algo": {"kl": {"coef": 0.01}, "ema": True},
                  "rollout": {"window_size": 2}},
    "nft": {"update": {"micro_batch_size": 4, "mini_batch_size": 2}, "algo": {"kl": {"coef": 0.1}}},
    "awm": {"update": {"micro_batch_size": 4}, "algo": {"num_train_timesteps": 2, "kl": {"coef": 0.1}}},
    "dpo": {"update": {"micro_batch_size": 2}, "algo": {"mode": "online", "beta": 100.0, "pairing": "all_pairs"}},
}


@pytest.fixture(scope="module")
def edit_file(tmp_path_factory):
    from mmrl.pipelines.edits import make_shapes_edit_file

    return make_shapes_edit_file(tmp_path_factory.mktemp("edits"), n=8, seed=1)


def _config_dict(recipe, family, path, out, lora: bool, max_steps: int, edit_file=None) -> dict:
    rollout, reward = CASES[family].rollout, reward_of(CASES[family])
    d = {
        "algorithm": recipe, "output_dir": str(out), "seed": 11, "device": "cpu",
        "model": {"path": str(path), "max_sequence_length": 16, "lora": {"rank": 4 if lora else 0, "alpha": 8}},
        "data": {"train_prompts": str(edit_file) if reward is EDIT_REWARD else PROMPTS},
        "rollout": {"prompts_per_step": 2, "num_steps": 2, "group_size": 2, "eval_num_steps": 2, **rollout},
        "train": {"max_steps": max_steps, "save_every": 1},
        "optim": {"lr": 1e-3 if lora else 1e-5},
        "reward": {"components": reward},
        "log": {"sample_every": 1 if max_steps == 2 else 0},
    }
    for key, section in RECIPES[recipe].items():
        d[key] = {**d.get(key, {}), **section}
    return d


def _weights(out: Path, step: int) -> dict:
    files = sorted((out / "checkpoints" / f"step_{step}" / "adapters").rglob("*.safetensors"))
    assert files, f"no weights in {out}"
    return {f"{f.parent.name}/{k}": v for f in files for k, v in load_file(str(f)).items()}


def assert_resume_is_exact(full: Path, split: Path) -> list[dict]:
    a, b = metrics_rows(full), metrics_rows(split)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    assert_same_path([without_time(r) for r in a], [without_time(r) for r in b], why=RESUMED_RUN)
    assert_same_path(_weights(full, 2), _weights(split, 2), why=RESUMED_RUN)
    return a


def families_without_a_tiny_case() -> list[str]:
    """Registered pipeline classes whose FlowModel declares no tiny case of its own (a parent's is the parent's)."""
    return [name for name in available_families() if not vars(MODEL_FAMILIES[name]).get("tiny_cases")]


def test_every_registered_family_is_tested():
    """Each registered family declares its own tiny case(s), built by a builder `mmrl tiny` knows: every recipe
    below then runs on it."""
    assert families_without_a_tiny_case() == []
    assert sorted({case.pipeline for case in CASES.values()}) == available_families()
    assert all(case.build in tiny.BUILDERS.values() for case in CASES.values())


def test_a_family_without_its_own_tiny_case_is_named(monkeypatch):
    class Untested(MODEL_FAMILIES["FluxPipeline"]):  # FLUX.1's case is FLUX.1's
        family = "untested"

    monkeypatch.setitem(MODEL_FAMILIES, "UntestedPipeline", Untested)
    assert families_without_a_tiny_case() == ["UntestedPipeline"]
    assert "UntestedPipeline" not in {case.pipeline for case in tiny_cases().values()}


@pytest.mark.slow
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("family", list(CASES))
def test_recipe_trains_and_resumes_exactly(family, recipe, lora, tmp_path, tiny_case, edit_file):
    path = tiny_case(family)
    train = importlib.import_module(f"mmrl.diffusion.{recipe}").train
    torch.manual_seed(0)
    full, split = tmp_path / "full", tmp_path / "split"
    train(load_config(_config_dict(recipe, family, path, full, lora, 2, edit_file)))
    train(load_config(_config_dict(recipe, family, path, split, lora, 1, edit_file)))
    train(load_config(_config_dict(recipe, family, path, split, lora, 2, edit_file)))  # resume=auto picks step_1
    a = assert_resume_is_exact(full, split)
    assert all(r["policy/grad_norm"] > 0 for r in a)  # it trained (a LoRA's first step: B = 0, A moves)
    if recipe == "flow_grpo":
        assert max(r["diag/logprob_drift"] for r in a) < 1e-4
    video = CASES[family].rollout.get("num_frames", 1) > 1
    assert (full / "samples" / f"step_000001.{'mp4' if video else 'png'}").is_file()
    if MODEL_FAMILIES[CASES[family].pipeline].has_audio:  # the grid's samples with their sound
        assert (full / "samples" / "step_000001_s0.wav").is_file()
    ckpt = full / "checkpoints" / "step_2" / "adapters" / "default"
    assert (ckpt / ("adapter_model.safetensors" if lora else "model.safetensors")).is_file()
    if reward_of(CASES[family]) is EDIT_REWARD:  # the edit rewards read each row's source image and mask
        assert all(0 <= r["reward/edit_region_color"] <= 1 and 0 <= r["reward/edit_preservation"] <= 1 for r in a)


@pytest.mark.slow
@pytest.mark.parametrize("recipe, lora", [("flow_grpo", True), ("flow_grpo", False)])
def test_qwen_image_two_rank_ddp_resumes_exactly(recipe, lora, tiny_family, tmp_path):
    """torchrun, 2 CPU processes (gloo), one prompt group per rank: 2 steps in one run equal 1 step then a resumed
    second step (metrics of both ranks' samples and the weights rank 0 saved). Qwen-Image's last block has parameters
    no output uses (the family's `has_unused_parameters`): without DDP looking for them the second backward fails.
    Flow-GRPO only (3 torchrun starts each): the other recipes' DDP paths are the shared ones the SD3 tests run."""
    path = tiny_family("QwenImagePipeline")
    env = child_env()
    for name, steps in (("full", [2]), ("split", [1, 2])):
        for max_steps in steps:
            d = _config_dict(recipe, "qwen_image", path, tmp_path / name, lora, max_steps)
            d["dist"] = {"strategy": "ddp", "backend": "gloo"}
            cfg_file = tmp_path / f"{name}_{max_steps}.yaml"
            cfg_file.write_text(yaml.safe_dump(d))
            proc = run_torchrun(["-m", "mmrl.cli", "train", str(cfg_file)], cwd=REPO, env=env)
            assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "resumed from" in proc.stdout
    rows = assert_resume_is_exact(tmp_path / "full", tmp_path / "split")
    assert all(r["policy/grad_norm"] > 0 for r in rows)


def test_offline_dpo_refuses_video_in_one_line(tmp_path):
    from mmrl.diffusion.dpo import train

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "a", "chosen": "a.png", "rejected": "b.png"}\n')
    cfg = load_config({"algorithm": "dpo", "output_dir": str(tmp_path / "run"), "model": {"path": str(tmp_path)},
                       "data": {"preference_file": str(pairs)}, "rollout": {"num_frames": 5}})
    with pytest.raises(ValueError, match=r"^algo.mode=offline trains on image preference pairs; rollout.num_frames=5"):
        train(cfg)

