"""Every diffusion recipe (Flow-GRPO, DiffusionNFT, AWM, online DPO) on every model family: 2 steps of training,
then a run interrupted after step 1 and resumed gives the same metrics as the uninterrupted one, with LoRA and with
full fine-tuning. Video families train on [B, C, F, h, w] latents with video rewards through the same code."""

import importlib
from pathlib import Path

import pytest
import torch

from mmrl.config import load_config
from mmrl.testing import RESUMED_RUN, assert_same_path, metrics_rows, without_time

REPO = Path(__file__).resolve().parents[2]
PROMPTS = str(REPO / "assets" / "prompts" / "shapes_train.txt")

IMAGE_REWARD = {"jpeg_compressibility": 1.0}
VIDEO_REWARD = {"motion_amount": 1.0,
                "frames": {"reward": "video_frames", "image_reward": "jpeg_compressibility", "weight": 0.1}}

# family -> (tiny checkpoint fixture, rollout settings, reward). Sizes are the smallest each latent grid takes.
FAMILIES = {
    "wan21": ("tiny_wan_path", {"height": 32, "width": 32, "num_frames": 5, "guidance_scale": 3.0}, VIDEO_REWARD),
    "wan22_a14b": ("tiny_wan22_path", {"height": 32, "width": 32, "num_frames": 5, "guidance_scale": 3.0},
                   VIDEO_REWARD),
    "z_image": ("tiny_z_image_path", {"height": 32, "width": 32, "guidance_scale": 2.0}, IMAGE_REWARD),
    "flux2": ("tiny_flux2_path", {"height": 32, "width": 32, "guidance_scale": 3.5}, IMAGE_REWARD),
    "flux2_klein": ("tiny_flux2_klein_path", {"height": 32, "width": 32, "guidance_scale": 3.0}, IMAGE_REWARD),
}

RECIPES = {
    "flow_grpo": {"update": {"micro_batch_size": 4, "mini_batch_size": 2}, "algo": {"kl": {"coef": 0.01}, "ema": True},
                  "rollout": {"window_size": 2}},
    "nft": {"update": {"micro_batch_size": 4, "mini_batch_size": 2}, "algo": {"kl": {"coef": 0.1}}},
    "awm": {"update": {"micro_batch_size": 4}, "algo": {"num_train_timesteps": 2, "kl": {"coef": 0.1}}},
    "dpo": {"update": {"micro_batch_size": 2}, "algo": {"mode": "online", "beta": 100.0, "pairing": "all_pairs"}},
}


def _cfg(recipe, family, path, out, lora: bool, max_steps: int):
    _, rollout, reward = FAMILIES[family]
    d = {
        "algorithm": recipe, "output_dir": str(out), "seed": 11, "device": "cpu",
        "model": {"path": str(path), "max_sequence_length": 16, "lora": {"rank": 4 if lora else 0, "alpha": 8}},
        "data": {"train_prompts": PROMPTS},
        "rollout": {"prompts_per_step": 2, "num_steps": 2, "group_size": 2, "eval_num_steps": 2, **rollout},
        "train": {"max_steps": max_steps, "save_every": 1},
        "optim": {"lr": 1e-3 if lora else 1e-5},
        "reward": {"components": reward},
        "log": {"sample_every": 1 if max_steps == 2 else 0},
    }
    for key, section in RECIPES[recipe].items():
        d[key] = {**d.get(key, {}), **section}
    return load_config(d)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_recipe_trains_and_resumes_exactly(family, recipe, lora, tmp_path, request):
    path = request.getfixturevalue(FAMILIES[family][0])
    train = importlib.import_module(f"mmrl.diffusion.{recipe}").train
    torch.manual_seed(0)
    full = tmp_path / "full"
    train(_cfg(recipe, family, path, full, lora, 2))
    split = tmp_path / "split"
    train(_cfg(recipe, family, path, split, lora, 1))
    train(_cfg(recipe, family, path, split, lora, 2))  # resume=auto picks step_1
    a, b = metrics_rows(full), metrics_rows(split)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    assert_same_path([without_time(r) for r in a], [without_time(r) for r in b], why=RESUMED_RUN)
    assert all(r["policy/grad_norm"] > 0 for r in a)  # it trained (a LoRA's first step: B = 0, A moves)
    if recipe == "flow_grpo":
        assert max(r["diag/logprob_drift"] for r in a) < 1e-4
    video = FAMILIES[family][1].get("num_frames", 1) > 1
    assert (full / "samples" / f"step_000001.{'mp4' if video else 'png'}").is_file()
    ckpt = full / "checkpoints" / "step_2" / "adapters" / "default"
    assert (ckpt / ("adapter_model.safetensors" if lora else "model.safetensors")).is_file()


def test_offline_dpo_refuses_video_in_one_line(tmp_path):
    from mmrl.diffusion.dpo import train

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "a", "chosen": "a.png", "rejected": "b.png"}\n')
    cfg = load_config({"algorithm": "dpo", "output_dir": str(tmp_path / "run"), "model": {"path": str(tmp_path)},
                       "data": {"preference_file": str(pairs)}, "rollout": {"num_frames": 5}})
    with pytest.raises(ValueError, match=r"^algo.mode=offline trains on image preference pairs; rollout.num_frames=5"):
        train(cfg)

