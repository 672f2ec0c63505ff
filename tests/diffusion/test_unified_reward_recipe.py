"""UnifiedReward (the local Qwen2.5-VL judge, `mmrl.rewards.unified_reward`) inside Flow-GRPO on the tiny SD3: one
step pointwise, one step as Pref-GRPO uses it (the Think judge's group win rate next to a second reward, combined
the GDPO way), and the shipped Pref-GRPO config's published settings."""

from pathlib import Path

import pytest

from mmrl.config import load_config
from mmrl.diffusion.flow_grpo import train
from mmrl.testing import metrics_rows
from mmrl.tiny import build_tiny_unified_reward

from .test_flow_grpo import _cfg

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def judge_path(tmp_path_factory):
    return build_tiny_unified_reward(tmp_path_factory.mktemp("ur") / "judge", seed=0)


def test_one_step_pointwise(tmp_path, tiny_sd3_path, judge_path):
    out = tmp_path / "run"
    train(_cfg(out, tiny_sd3_path, ["train.max_steps=1"],
               reward={"components": {"unified_reward": {"weights": str(judge_path), "max_new_tokens": 4,
                                                         "batch_size": 6}}}))
    (row,) = metrics_rows(out)
    # random replies never hold a "Final Score": every image scores 0, the run goes on
    assert row["reward/unified_reward"] == 0.0


def test_one_step_think_win_rate_with_gdpo(tmp_path, tiny_sd3_path, judge_path):
    out = tmp_path / "run"
    train(_cfg(out, tiny_sd3_path, ["train.max_steps=1"],
               reward={"components": {
                   "ur_think": {"reward": "unified_reward", "mode": "think", "weight": 0.4, "weights": str(judge_path),
                                "max_new_tokens": 4, "batch_size": 6},
                   "jpeg_compressibility": 0.6},
                   "aggregation": "normalise_then_sum"}))
    (row,) = metrics_rows(out)
    # no <answer> in a random reply: every pair is a tie, every image's win rate 0.5
    assert row["reward/ur_think"] == 0.5 and "reward/jpeg_compressibility" in row


def test_pref_grpo_config_published_settings():
    cfg = load_config(REPO / "configs" / "diffusion" / "flow_grpo_flux_unified_reward_think.yaml")
    comps = cfg.reward.components
    assert (comps["unified_reward_think"]["mode"], comps["unified_reward_think"]["weight"]) == ("think", 0.4)
    assert comps["unified_reward_think"]["prompt_template"] == "pref_grpo_think" and comps["clip"]["weight"] == 0.6
    assert cfg.reward.aggregation == "normalise_then_sum"
    assert (cfg.rollout.group_size, cfg.rollout.num_steps, cfg.rollout.noise_level, cfg.rollout.timestep_fraction) == \
        (8, 25, 0.7, 0.6)
    assert (cfg.optim.lr, cfg.algo.clip_range, cfg.algo.adv_clip_max, cfg.algo.kl.coef) == (1e-5, 1e-4, 5.0, 0.0)
