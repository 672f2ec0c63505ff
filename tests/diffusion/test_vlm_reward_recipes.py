"""The Qwen-VL reward models of issue 30 (HPSv3, EditReward) inside a recipe: one Flow-GRPO step on the tiny SD3 /
the tiny FLUX.1 Kontext edit model, with the reward built from its tiny authors'-format checkpoint (mmrl.tiny.hpsv3)."""

import pytest

from mmrl import cli
from mmrl.config import recipe_module
from mmrl.testing import metrics_rows
from mmrl.tiny.hpsv3 import build_tiny_edit_reward, build_tiny_hpsv3

from .test_editing import EDIT_CONFIG, SMALL
from .test_guard import _cfg


def test_hpsv3_in_flow_grpo(tmp_path, tiny_sd3_path):
    tiny = build_tiny_hpsv3(tmp_path / "hpsv3")
    reward = {"hpsv3": {"weight": 1.0, "weights": str(tiny), "processor": str(tiny / "base"), "dtype": "float32"}}
    cfg = _cfg("flow_grpo", tmp_path / "run", tiny_sd3_path, ["train.max_steps=1"], reward={"components": reward})
    recipe_module(cfg.algorithm).train(cfg)
    row = metrics_rows(tmp_path / "run")[0]
    # the tiny random HPSv3 scores around -0.18 (mu); every image was scored
    assert -1.0 < row["reward/hpsv3"] < 1.0 and row["reward/mean"] == pytest.approx(row["reward/hpsv3"])


def test_edit_reward_in_the_edit_recipe(tmp_path, tiny_family):
    """The edit recipe hands each rollout's source image to the reward through the row's metadata."""
    tiny = build_tiny_edit_reward(tmp_path / "edit_reward")
    out = tmp_path / "run"
    reward = (f"reward.components={{edit_reward: {{weight: 1.0, weights: {tiny / 'checkpoint'}, "
              f"processor: {tiny / 'base'}, dtype: float32}}}}")
    assert cli.main(["train", EDIT_CONFIG, f"output_dir={out}", f"model.path={tiny_family('FluxKontextPipeline')}",
                     "train.max_steps=1", "log.eval_every=0", *SMALL, reward]) == 0
    row = metrics_rows(out)[0]
    assert -1.0 < row["reward/edit_reward"] < 1.0 and row["reward/mean"] == pytest.approx(row["reward/edit_reward"])
