"""`reward.running_norm` (LightRFT's reward_running_norm) in vlm_multiturn and flow_grpo: the shared config keys
(`mmrl.training.RunningNormFields`), statistics equal to a hand computation over the rewards the run saw (updated
with the step's rewards, then applied), checkpointed so a resume continues them, and nothing changes when it is off.
"""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path

import pytest
import torch

from mmrl.config import load_config
from mmrl.testing import RESUMED_RUN, assert_same_path, metrics_rows, without_time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MMRL_NO_PROGRESS", "1")
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
RUNNING = ("reward/running_mean", "reward/running_std", "reward/running_count")


def _hand_stats(rewards: list[float]) -> tuple[float, float, int]:
    """(mean, unbiased std, count) of every reward seen so far, as the running statistics must be."""
    return statistics.fmean(rewards), statistics.stdev(rewards), len(rewards)


def _check_running(row: dict, rewards: list[float]) -> None:
    mean, std, count = _hand_stats(rewards)
    assert row["reward/running_count"] == count
    assert row["reward/running_mean"] == pytest.approx(mean, rel=1e-9, abs=1e-12)
    assert row["reward/running_std"] == pytest.approx(std, rel=1e-9)


def test_shared_keys_and_builder():
    """One declaration (`RunningNormFields`) gives the three keys to all three recipes' `reward:` section; the
    builder registers the normaliser in the checkpointed objects, or returns None when off."""
    from mmrl.core.running_norm import RunningRewardNorm
    from mmrl.training import RunningNormFields

    for algo in ("vlm_grpo", "vlm_multiturn", "flow_grpo"):
        cfg = load_config({"algorithm": algo}, ["reward.running_norm=true", "reward.running_norm_center=true",
                                                "reward.running_norm_clip=2.5"])
        assert isinstance(cfg.reward, RunningNormFields)
        stateful: dict = {}
        norm = cfg.reward.build_running_norm(stateful)
        assert isinstance(norm, RunningRewardNorm) and stateful == {"reward_norm": norm}
        assert (norm.center, norm.clip) == (True, 2.5)
        off = load_config({"algorithm": algo}).reward
        assert (off.running_norm, off.running_norm_center, off.running_norm_clip) == (False, False, 0.0)
        assert off.build_running_norm(stateful := {}) is None and stateful == {}
        with pytest.raises(ValueError, match="reward.running_norm_clip: expected >= 0"):
            load_config({"algorithm": algo}, ["reward.running_norm_clip=-1"])
    # the base section's own checks still run (flow_grpo: reward.history)
    with pytest.raises(ValueError, match="reward.history"):
        load_config({"algorithm": "flow_grpo"}, ["reward.history=-1"])


# ---------------------------------------------------------------------------------------------- vlm_multiturn

def test_turn_advantages_normalise_turn_rewards_by_hand():
    """Credit assignment with a normaliser = credit assignment of the normalised turn rewards: mean and std of the
    5 turn rewards [1, -2, 0.5, 3, 1] (after the update with them), every mode."""
    from mmrl.core.running_norm import RunningRewardNorm
    from mmrl.vlm.credit import turn_advantages
    from mmrl.vlm.episodes import Episode, Turn

    def ep(i, rewards, anchors):
        e = Episode(index=i, task="t", seed=0, group=0, prompt_len=10)
        for k, (r, a) in enumerate(zip(rewards, anchors)):
            e.turns.append(Turn(10 + 5 * k, 12 + 5 * k, reward=r, anchor=a))
        e.ids = [0] * (10 + 5 * len(rewards))
        return e

    raw = [[1.0, -2.0], [0.5, 3.0, 1.0]]
    flat = [r for rs in raw for r in rs]
    mean, std = statistics.fmean(flat), statistics.stdev(flat)
    anchors = [["X", "Y"], ["X", "X", "Y"]]
    for mode in ("grpo", "turn_grpo", "gigpo"):
        norm = RunningRewardNorm(center=True)
        got = turn_advantages([ep(i, rs, a) for i, (rs, a) in enumerate(zip(raw, anchors))], mode, 0.5,
                              reward_norm=norm)
        normed = [[(r - mean) / (std + 1e-8) for r in rs] for rs in raw]
        want = turn_advantages([ep(i, rs, a) for i, (rs, a) in enumerate(zip(normed, anchors))], mode, 0.5)
        assert norm.count == 5 and norm.mean == pytest.approx(mean)
        assert torch.allclose(got, want, atol=1e-6), mode
    # center off: the turn rewards are only divided by the std, which group advantages (scale_by_std) ignore
    plain = turn_advantages([ep(i, rs, a) for i, (rs, a) in enumerate(zip(raw, anchors))], "grpo", 0.5)
    scaled = turn_advantages([ep(i, rs, a) for i, (rs, a) in enumerate(zip(raw, anchors))], "grpo", 0.5,
                             reward_norm=RunningRewardNorm())
    assert torch.allclose(plain, scaled, atol=1e-5)  # group advantages are scale-invariant (scale_by_std)


VARY_ENV = "_rn_vary"


def _register_vary_env():
    """Two text turns; the turn reward depends on the response text, so rewards differ within and across groups."""
    from mmrl.vlm.envs import Env, Observation, register_env
    from mmrl.vlm.envs.base import make_env

    try:
        make_env(VARY_ENV)
        return
    except Exception:
        pass

    @register_env(VARY_ENV)
    class VaryEnv(Env):
        stop_strings = ("<|im_end|>",)
        max_turns = 2

        def reset(self, seed, **task):
            self.seed, self.turn = seed, 0
            return Observation(f"Task {seed}: say something.", anchor=("task", seed % 3))

        def step(self, action_text):
            self.turn += 1
            r = (sum(map(ord, action_text)) + self.seed) % 7 / 3 - 1
            return Observation("Again." if self.turn < 2 else ""), r, self.turn >= 2, {}


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    from mmrl.tiny import build_tiny_qwen2_vl

    _register_vary_env()
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("rn_mt") / "qwen2_vl")


def _mt_cfg(out, model_path, *overrides):
    return load_config({
        "algorithm": "vlm_multiturn", "output_dir": str(out), "seed": 0, "device": "cpu", "num_threads": 1,
        "model": {"path": str(model_path)},
        "env": {"tasks": {VARY_ENV: {}}, "eval_episodes": 1, "max_workers": 2},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_turns": 2, "max_new_tokens": 3, "max_seq_len": 256},
        "algo": {"advantage": "gigpo", "dynamic_sampling": False}, "optim": {"lr": 0.01},
        "update": {"micro_batch_size": 2, "mini_batch_size": 2}, "train": {"max_steps": 2, "save_every": 1}},
        list(overrides))


def _capture_turn_rewards(monkeypatch) -> list[list[float]]:
    """Per step: the turn rewards of the (global) training episodes that go into the advantages."""
    from mmrl.vlm import multiturn

    seen: list[list[float]] = []
    real = multiturn.turn_advantages

    def spy(episodes, *args, **kwargs):
        seen.append([float(torch.tensor(t.reward, dtype=torch.float32)) for ep in episodes for t in ep.turns])
        return real(episodes, *args, **kwargs)

    monkeypatch.setattr(multiturn, "turn_advantages", spy)
    return seen


def test_multiturn_running_norm_hand_stats_and_resume(tiny_vl, tmp_path, monkeypatch):
    """(a) the logged running mean/std/count equal those of every turn reward the advantages saw so far (the step's
    included: update, then apply); (b) the statistics are in the checkpoint and a run resumed after step 1 logs
    exactly the uninterrupted run's step 2."""
    from mmrl.run.directory import Run
    from mmrl.vlm.multiturn import train

    on = ("reward.running_norm=true", "reward.running_norm_center=true")
    seen = _capture_turn_rewards(monkeypatch)
    train(_mt_cfg(tmp_path / "full", tiny_vl, *on))
    rows = [r for r in metrics_rows(tmp_path / "full") if r["step"] > 0]
    assert len(seen) == 2 and len(set(seen[0] + seen[1])) > 2  # varied rewards: a real check of the statistics
    for step, row in enumerate(rows, 1):
        _check_running(row, [r for s in seen[:step] for r in s])
    state = Run.load_state(tmp_path / "full" / "checkpoints" / "step_1")
    assert state["stateful"]["reward_norm"]["count"] == len(seen[0])

    train(_mt_cfg(tmp_path / "split", tiny_vl, *on, "train.max_steps=1"))
    train(_mt_cfg(tmp_path / "split", tiny_vl, *on))  # resumes from step 1 with its statistics
    split = [r for r in metrics_rows(tmp_path / "split") if r["step"] > 0]
    assert [r["step"] for r in split] == [1, 2]
    # (the 1-step run evaluated after its last step: step 1 rows differ by those eval/ keys)
    assert {k: split[0][k] for k in RUNNING} == {k: rows[0][k] for k in RUNNING}
    assert_same_path(without_time(split[1]), without_time(rows[1]), why=RESUMED_RUN)


def test_multiturn_running_norm_off_changes_nothing(tiny_vl, tmp_path, monkeypatch):
    """(c) off (the default): no statistics logged or checkpointed, and the advantages are those of the raw turn
    rewards (the same run with the normaliser's update/apply replaced by identity logs the same metrics)."""
    from mmrl.run.directory import Run
    from mmrl.vlm import credit
    from mmrl.vlm.multiturn import train

    train(_mt_cfg(tmp_path / "off", tiny_vl))
    rows = metrics_rows(tmp_path / "off")
    assert not any(k in r for r in rows for k in RUNNING)
    assert "reward_norm" not in Run.load_state(tmp_path / "off" / "checkpoints" / "step_2")["stateful"]
    # an explicit `reward_norm=None` path vs the credit function as it was (no normaliser argument at all)
    real = credit.turn_advantages
    calls = []

    def old_signature(episodes, mode, gamma, omega=1.0, scale_by_std=True, *rest, episode_stats="episode"):
        assert episode_stats == "episode"  # (algo.gigpo_episode_stats: the default, the credit as it was)
        calls.append(rest)
        return real(episodes, mode, gamma, omega, scale_by_std)

    from mmrl.vlm import multiturn
    monkeypatch.setattr(multiturn, "turn_advantages", old_signature)
    train(_mt_cfg(tmp_path / "old", tiny_vl))
    assert calls and all(rest in ((), (None,)) for rest in calls)
    assert_same_path([without_time(r) for r in metrics_rows(tmp_path / "old")], [without_time(r) for r in rows],
                     why="reward_norm=None and the old signature run the same credit computation")


# ---------------------------------------------------------------------------------------------- flow_grpo

@pytest.fixture(scope="module")
def tiny_sd3_path(tmp_path_factory):
    from mmrl.tiny import build_tiny_sd3

    return build_tiny_sd3(tmp_path_factory.mktemp("rn_sd3") / "pipe")


def _fg_cfg(out, model_path, *overrides):
    return load_config({
        "algorithm": "flow_grpo", "output_dir": str(out), "seed": 3,
        "model": {"path": str(model_path), "lora": {"rank": 4, "alpha": 8}},
        "data": {"train_prompts": str(REPO / "assets" / "prompts" / "shapes_train.txt")},
        "rollout": {"prompts_per_step": 2, "height": 64, "width": 64, "num_steps": 3, "group_size": 3,
                    "guidance_scale": 1.0, "eval_num_steps": 2, "timestep_fraction": 0.99},
        "train": {"max_steps": 2, "save_every": 1}, "optim": {"lr": 1e-3},
        "update": {"micro_batch_size": 4, "mini_batch_size": 3},
        "algo": {"kl": {"coef": 0.0}, "ema": False},
        "reward": {"components": {"jpeg_compressibility": 1.0}}, "log": {"sample_every": 0}}, list(overrides))


def _capture_flow(monkeypatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(rewards scored per step, rewards the per-prompt stat tracker received per step)."""
    from mmrl.core.prompt_stats import PerPromptStatTracker
    from mmrl.diffusion import scoring

    scored, tracked = [], []
    # the rollout step scores through score_images (mmrl.diffusion.rollout.rollout_and_score, the code the
    # synchronous loop and the rollout process share)
    real_score, real_update = scoring.score_images, PerPromptStatTracker.update

    def score_spy(*args, **kwargs):
        scores, metrics = real_score(*args, **kwargs)
        scored.append(scores.clone())
        return scores, metrics

    def update_spy(self, prompts, rewards, *args, **kwargs):
        tracked.append(torch.as_tensor(rewards).clone())
        return real_update(self, prompts, rewards, *args, **kwargs)

    monkeypatch.setattr(scoring, "score_images", score_spy)
    monkeypatch.setattr(PerPromptStatTracker, "update", update_spy)
    return scored, tracked


def test_flow_grpo_running_norm_hand_stats_and_resume(tiny_sd3_path, tmp_path, monkeypatch):
    """(a) the logged running mean/std/count equal those of every reward scored so far (the logged reward/mean is
    their per-step mean), and the stat tracker gets (r - running mean) / running std with the step included;
    (b) the statistics are checkpointed and a resumed run logs exactly the uninterrupted run's step 2."""
    from mmrl.diffusion.flow_grpo import train
    from mmrl.run.directory import Run

    on = ("reward.running_norm=true", "reward.running_norm_center=true")
    scored, tracked = _capture_flow(monkeypatch)
    train(_fg_cfg(tmp_path / "full", tiny_sd3_path, *on))
    rows = metrics_rows(tmp_path / "full")
    assert len(scored) == len(tracked) == len(rows) == 2
    for step, row in enumerate(rows, 1):
        assert row["reward/mean"] == pytest.approx(float(scored[step - 1].mean()), rel=1e-6)
        seen = [float(r) for s in scored[:step] for r in s]
        _check_running(row, seen)
        mean, std, _ = _hand_stats(seen)
        want = (scored[step - 1].double() - mean) / (std + 1e-8)
        assert torch.allclose(tracked[step - 1].double(), want, atol=1e-5)
        assert not torch.allclose(tracked[step - 1], scored[step - 1])  # really normalised
    state = Run.load_state(tmp_path / "full" / "checkpoints" / "step_1")
    assert state["stateful"]["reward_norm"]["count"] == 6

    train(_fg_cfg(tmp_path / "split", tiny_sd3_path, *on, "train.max_steps=1"))
    train(_fg_cfg(tmp_path / "split", tiny_sd3_path, *on))  # resume=auto picks step_1
    split = metrics_rows(tmp_path / "split")
    assert [r["step"] for r in split] == [1, 2]
    assert_same_path([without_time(r) for r in split], [without_time(r) for r in rows], why=RESUMED_RUN)


def test_flow_grpo_running_norm_off_changes_nothing(tiny_sd3_path, tmp_path, monkeypatch):
    """(c) off (the default): the tracker gets the raw rewards bit for bit, no statistics are logged or
    checkpointed."""
    from mmrl.diffusion.flow_grpo import train
    from mmrl.run.directory import Run

    scored, tracked = _capture_flow(monkeypatch)
    train(_fg_cfg(tmp_path / "off", tiny_sd3_path, "train.max_steps=1"))
    assert len(scored) == len(tracked) == 1 and torch.equal(scored[0], tracked[0])
    rows = metrics_rows(tmp_path / "off")
    assert not any(k in r for r in rows for k in RUNNING)
    assert "reward_norm" not in Run.load_state(tmp_path / "off" / "checkpoints" / "step_1")["stateful"]
    assert all(math.isfinite(r["policy/loss"]) for r in rows)
