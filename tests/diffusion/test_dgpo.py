"""DGPO recipe (mmrl.diffusion.dgpo): first-step values, the reference / "old" choices, configs and errors, exact
resume, metric names, reward rise on the tiny shapes model."""

import math
import os
from pathlib import Path

import pytest
import torch

from mmrl.config import load_config
from mmrl.diffusion.dgpo import Config, train
from mmrl.testing import RESUMED_RUN, assert_same_path, metrics_rows, without_time

REPO = Path(__file__).resolve().parents[2]
PROMPTS = str(REPO / "assets" / "prompts" / "shapes_train.txt")
SHAPES_MODEL = Path(os.environ.get("MMRL_SHAPES_MODEL", REPO / "assets" / "tiny_sd3_shapes"))


def _cfg(out, model_path, overrides=(), **sections) -> Config:
    d = {
        "algorithm": "dgpo", "output_dir": str(out), "seed": 3, "device": "cpu",
        "model": {"path": str(model_path), "lora": {"rank": 4, "alpha": 8}},
        "data": {"train_prompts": PROMPTS},
        "rollout": {"prompts_per_step": 2, "height": 64, "width": 64, "num_steps": 3, "group_size": 3,
                    "eval_num_steps": 2, "guidance_scale": 1.0},
        "algo": {"num_train_timesteps": 2, "trunc_steps": 2, "kl": {"coef": 0.1}},
        "train": {"max_steps": 2, "save_every": 0},
        "optim": {"lr": 1e-3},
        "update": {"micro_batch_size": 3, "mini_batch_size": 0},
        "reward": {"components": {"jpeg_compressibility": 1.0}},
        "log": {"sample_every": 0},
    }
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return load_config(d, list(overrides))


def test_first_step(tmp_path, tiny_sd3_path):
    """LoRA B = 0 at the start: policy = reference = "old", so every group weight is sigmoid(0) = 1/2, nothing is
    clipped and the KL is 0 (up to the rounding of two forwards)."""
    train(_cfg(tmp_path / "run", tiny_sd3_path, ["train.max_steps=1"]))
    row = metrics_rows(tmp_path / "run")[0]
    assert row["policy/group_weight"] == pytest.approx(0.5, abs=1e-5)
    assert row["policy/clipfrac"] == 0.0 and row["kl/ref"] < 1e-12 and row["train/updates"] == 1
    # 6 images x 3 DPM-Solver++ steps (rollout) + 6 images x M = 2 points x 3 passes (policy, ref, old)
    assert row["cost/transformer_evals"] == 6 * 3 + 6 * 2 * 3
    assert row["policy/old_decay"] == 0.0 and row["rollout/from_old"] == 0.0
    for key in ("reward/mean", "policy/loss", "policy/dgpo_loss", "policy/dsm_loss", "policy/grad_norm"):
        assert math.isfinite(row[key]), key


def test_reference_old_and_rollouts_from_old(tmp_path, tiny_sd3_path):
    """`ref: old` and no KL: no reference pass at all; `old_rollout_after: 1` samples step 2 with the EMA policy; two
    updates per step (mini-batches of whole groups)."""
    train(_cfg(tmp_path / "run", tiny_sd3_path, ["update.mini_batch_size=3"], algo={
        "ref": "old", "kl": {"coef": 0.0}, "old_rollout_after": 1, "clip": False}))
    rows = metrics_rows(tmp_path / "run")
    assert [r["rollout/from_old"] for r in rows] == [0.0, 1.0] and [r["train/updates"] for r in rows] == [2, 2]
    assert "kl/ref" not in rows[0] and "policy/clipfrac" not in rows[0]
    # per step: 6 x 3 rollout + 6 x 2 points x 2 passes (policy, old)
    assert rows[0]["cost/transformer_evals"] == 6 * 3 + 6 * 2 * 2
    assert rows[1]["policy/old_decay"] == pytest.approx(0.003)  # the 4th update used min(0.001 * 3, 0.3)


def test_shipped_config_and_defaults():
    cfg = load_config(REPO / "configs" / "diffusion" / "dgpo_tiny.yaml")
    assert cfg.algorithm == "dgpo" and cfg.rollout.ode_solver == "dpm2"
    d = Config()  # published SD3.5 settings (config/dgpo.py: beta_dpo 100, 4 timesteps, trunc 6, clip 1e-2, beta 0.02)
    assert (d.algo.beta, d.algo.num_train_timesteps, d.algo.trunc_steps, d.algo.clip_range, d.algo.kl.coef) == (
        100.0, 4, 6, 1e-2, 0.02)
    assert d.algo.shared_noise and d.algo.clip and d.algo.ref == "ref" and d.algo.train_guidance_scale == 1.0


def test_bad_config_errors(tmp_path, tiny_sd3_path):
    with pytest.raises(ValueError, match="multiples of rollout.group_size=3"):
        train(_cfg(tmp_path / "a", tiny_sd3_path, ["update.micro_batch_size=4"]))
    with pytest.raises(ValueError, match="trunc_steps=3 must be < rollout.num_steps=3"):
        train(_cfg(tmp_path / "b", tiny_sd3_path, ["algo.trunc_steps=3"]))
    with pytest.raises(ValueError, match="num_train_timesteps=4"):
        _cfg(tmp_path / "c", tiny_sd3_path, ["algo.num_train_timesteps=4"])
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        _cfg(tmp_path / "d", tiny_sd3_path, ["rollout.group_size=1", "update.micro_batch_size=1"])


def test_metric_names(tmp_path, tiny_sd3_path, check_metric_names):
    train(_cfg(tmp_path / "run", tiny_sd3_path, ["train.max_steps=1"]))
    keys = check_metric_names(metrics_rows(tmp_path / "run"))
    assert "policy/group_weight" in keys and "cost/transformer_evals" in keys


def test_resume_equals_uninterrupted_run(tmp_path, tiny_sd3_path):
    extra = ["train.save_every=2", "update.mini_batch_size=3", "algo.old_rollout_after=3"]
    train(_cfg(tmp_path / "full", tiny_sd3_path, ["train.max_steps=4", *extra]))
    train(_cfg(tmp_path / "half", tiny_sd3_path, ["train.max_steps=2", *extra]))
    train(_cfg(tmp_path / "half", tiny_sd3_path, ["train.max_steps=4", *extra]))
    a, b = metrics_rows(tmp_path / "full"), metrics_rows(tmp_path / "half")
    assert [r["step"] for r in b] == [1, 2, 3, 4] and b[-1]["rollout/from_old"] == 1.0
    assert_same_path([without_time(r) for r in a], [without_time(r) for r in b], why=RESUMED_RUN)
    from safetensors.torch import load_file

    for state in ("default", "old"):
        fa = load_file(str(tmp_path / "full/checkpoints/step_4/adapters" / state / "adapter_model.safetensors"))
        fb = load_file(str(tmp_path / "half/checkpoints/step_4/adapters" / state / "adapter_model.safetensors"))
        assert_same_path(fa, fb, why=RESUMED_RUN)


@pytest.mark.slow
def test_dgpo_tiny_raises_reward(tmp_path):
    if not (SHAPES_MODEL / "model_index.json").is_file():
        pytest.skip("assets/tiny_sd3_shapes not built")
    torch.set_num_threads(1)
    cfg = load_config(REPO / "configs" / "diffusion" / "dgpo_tiny.yaml",
                      [f"output_dir={tmp_path / 'run'}", f"model.path={SHAPES_MODEL}", f"data.train_prompts={PROMPTS}",
                       "data.eval_prompts=", "train.max_steps=25", "log.sample_every=0", "train.resume=never"])
    summary = train(cfg)
    print("dgpo_tiny first-5 vs last-5 mean reward:", summary["reward_first5"], summary["reward_last5"])
    assert summary["reward_last5"] > summary["reward_first5"] + 0.5 * summary["reward_first_std"]
