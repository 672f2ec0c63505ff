"""vlm_grpo: several rewards combined per reward (GDPO, `reward.aggregation`) and judges on the eval prompts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mmrl.core import group_advantages
from mmrl.core.multi_reward import multi_reward_advantages
from mmrl.rewards import load
from mmrl.testing import metrics_rows
from mmrl.vlm import grpo
from mmrl.vlm.rollout_collect import reward_components

sys.path.insert(0, str(Path(__file__).parent))
from test_grpo import _cfg, tiny_path  # noqa: E402,F401  (the tiny Qwen2-VL fixture)


def test_reward_components_by_hand():
    comp = load({"exact_match": 1.0, "format": {"weight": 0.5, "style": "think_answer"}})
    scores = torch.tensor([1.5, 0.0, 0.4])
    comps = {"exact_match": torch.tensor([1.0, 0.0, 1.0]), "format": torch.tensor([1.0, 0.0, 0.0]),
             "overlong": torch.tensor([0.0, 0.0, -0.6])}
    c, w = reward_components(comp, scores, comps, overlong=True)
    torch.testing.assert_close(c, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, -0.6]]))
    assert w == [1.0, 0.5, 1.0]
    single, w1 = reward_components(load("exact_match"), scores, {"overlong": comps["overlong"]}, True)
    torch.testing.assert_close(single, torch.tensor([[1.5, 0.0], [0.0, 0.0], [1.0, -0.6]]))  # 0.4 - (-0.6)
    assert w1 == [1.0, 1.0]
    assert reward_components(comp, torch.zeros(0), {}, overlong=True)[0].shape == (0, 3)  # kept nothing


def test_gdpo_and_judges_in_the_recipe(tiny_path, tmp_path):  # noqa: F811
    out = tmp_path / "gdpo"
    reward = ['reward.name=composite', 'reward.kwargs={components: {exact_match: 1.0, format: {weight: 0.5}}}',
              "reward.aggregation=normalise_then_sum", "reward.overlong_buffer=2",
              "log.judges={match: {reward: exact_match}}", "log.eval_every=1", "data.eval_size=8"]  # 8: a verdict
    summary = grpo.train(_cfg(tiny_path, out, *reward))
    rows = metrics_rows(out)
    assert all("reward/exact_match" in r and "reward/format" in r for r in rows)
    assert all(r["eval/judge/match"] == r["eval/accuracy"] for r in rows)  # the judge = accuracy here
    assert all("eval/hacking" in r for r in rows) and summary["hacking_alarm"] is False
    with pytest.raises(ValueError, match="normalise_then_sum"):
        grpo.train(_cfg(tiny_path, tmp_path / "bad", "reward.aggregation=normalise_then_sum", "algo.kl.coef=0.1",
                        "algo.kl.in_reward=true"))
    with pytest.raises(ValueError, match="log.judges"):
        grpo.train(_cfg(tiny_path, tmp_path / "bad2", "log.judges={m: {reward: exact_match}}", "data.eval_size=0"))


def test_gdpo_on_the_estimator_by_hand():
    # what the recipe computes for algo.advantage=grpo: each component through the estimator, weighted, whitened
    c = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    g = torch.tensor([0, 0, 1, 1])
    out = multi_reward_advantages(c, [1.0, 0.5], lambda r: group_advantages(r, g), "normalise_then_sum")
    a = 0.5 / ((0.5) ** 0.5 + 1e-6)  # every column of both groups is (1, 0): +-0.5 / unbiased std sqrt(0.5)
    per = torch.tensor([[a, -a], [-a, a], [a, a], [-a, -a]])
    s = per @ torch.tensor([1.0, 0.5])
    torch.testing.assert_close(out, (s - s.mean()) / (s.std() + 1e-4))
