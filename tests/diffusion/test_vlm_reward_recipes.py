"""The Qwen-VL reward models of issue 30 (HPSv3, EditReward) inside a recipe: one Flow-GRPO step on the tiny SD3 /
the tiny edit model with the reward built from its tiny authors'-format checkpoint (mmrl.tiny.hpsv3)."""

import pytest

from mmrl.config import recipe_module
from mmrl.testing import metrics_rows
from mmrl.tiny.hpsv3 import build_tiny_hpsv3

from .test_guard import _cfg


@pytest.fixture(scope="module")
def tiny_hpsv3(tmp_path_factory):
    return build_tiny_hpsv3(tmp_path_factory.mktemp("hpsv3") / "tiny")


def test_hpsv3_in_flow_grpo(tmp_path, tiny_sd3_path, tiny_hpsv3):
    reward = {"hpsv3": {"weight": 1.0, "weights": str(tiny_hpsv3), "processor": str(tiny_hpsv3 / "base"),
                        "dtype": "float32"}}
    cfg = _cfg("flow_grpo", tmp_path / "run", tiny_sd3_path, ["train.max_steps=1"], reward={"components": reward})
    recipe_module(cfg.algorithm).train(cfg)
    row = metrics_rows(tmp_path / "run")[0]
    # the tiny random HPSv3 scores around -0.18 (mu); every image was scored
    assert -1.0 < row["reward/hpsv3"] < 1.0 and row["reward/mean"] == pytest.approx(row["reward/hpsv3"])
