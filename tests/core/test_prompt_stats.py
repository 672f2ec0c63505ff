"""core.prompt_stats (vectorised per-prompt normalisation + history) and core.pairing equal the earlier
per-prompt-loop implementations on fixed inputs (the old code is kept here as the reference)."""

import pytest
import torch

from mmrl.core.pairing import build_pairs
from mmrl.core.prompt_stats import PerPromptStatTracker, RewardHistory, group_normalize


class LoopTracker:
    """The earlier mmrl.diffusion.flow_grpo.PerPromptStatTracker (one Python loop per prompt)."""

    def __init__(self, std_mode="group", history=0, eps=1e-4):
        self.std_mode, self.history, self.eps = std_mode, int(history), eps
        self.buffers = {}

    def update(self, prompts, rewards):
        r = rewards.detach().double().cpu()
        adv = torch.zeros_like(r)
        ok = torch.isfinite(r)
        global_std = r[ok].std(unbiased=False) + self.eps
        for p in dict.fromkeys(prompts):
            rows = torch.tensor([i for i, q in enumerate(prompts) if q == p and ok[i]], dtype=torch.long)
            if len(rows) == 0:
                continue
            vals = torch.cat([torch.tensor(self.buffers.get(p, []), dtype=torch.float64), r[rows]])
            if vals.max() > vals.min():
                std = global_std if self.std_mode == "global" else vals.std(unbiased=False) + self.eps
                adv[rows] = (r[rows] - vals.mean()) / std
            if self.history > 0:
                self.buffers[p] = vals[-self.history:].tolist()
        return adv.float()


def _batches(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    names = ["a", "b", "c", "d", "e"]
    out = []
    for k in range(n):
        prompts = [names[int(i)] for i in torch.randint(0, 5, (12,), generator=g)]
        r = torch.randn(12, generator=g)
        r[torch.randint(0, 12, (2,), generator=g)] = 0.5  # ties
        if k % 2:
            r[3], r[7] = float("nan"), float("inf")  # dropped samples
        out.append((prompts, r))
    out.append((["a", "a", "b", "b"], torch.tensor([2.0, 2.0, 1.0, float("nan")])))  # a constant group, a lone one
    return out


@pytest.mark.parametrize("std_mode", ["group", "global"])
@pytest.mark.parametrize("history", [0, 1, 3, 8])
def test_tracker_equals_loop_implementation(std_mode, history):
    old, new = LoopTracker(std_mode, history), PerPromptStatTracker(std_mode, history)
    for prompts, r in _batches():
        a_old, a_new = old.update(prompts, r), new.update(prompts, r)
        assert torch.allclose(a_new, a_old, atol=1e-6, rtol=0), (a_new, a_old)
        assert torch.equal(a_new == 0, a_old == 0)
        assert new.state_dict()["buffers"] == old.buffers  # the same stored values (checkpoint format)


def test_tracker_by_hand_and_resume():
    tr = PerPromptStatTracker("group")
    adv = tr.update(["a", "a", "b", "b"], torch.tensor([1.0, 3.0, 5.0, 5.0]))  # a: mean 2, std 1; b constant
    assert adv.tolist() == pytest.approx([-1 / 1.0001, 1 / 1.0001, 0.0, 0.0], abs=1e-6)
    h = PerPromptStatTracker("group", history=4)
    h.update(["a", "a"], torch.tensor([0.0, 2.0]))
    state = h.state_dict()
    assert state == {"buffers": {"a": [0.0, 2.0]}}  # the earlier checkpoint format
    adv2 = h.update(["a", "a"], torch.tensor([4.0, 6.0]))  # stats of [0, 2, 4, 6]: mean 3, std sqrt(5)
    s = 5 ** 0.5 + 1e-4
    assert adv2.tolist() == pytest.approx([1 / s, 3 / s], abs=1e-6)
    h2 = PerPromptStatTracker("group", history=4)
    h2.load_state_dict(state)
    assert torch.equal(h2.update(["a", "a"], torch.tensor([4.0, 6.0])), adv2)
    with pytest.raises(ValueError, match="std_mode"):
        PerPromptStatTracker("batch")


def test_history_keeps_last_values_in_order():
    h = RewardHistory(3)
    ids = h.ids(["x", "y", "x", "x", "x"])
    h.push(ids, torch.tensor([1.0, 2.0, 3.0, float("nan"), 4.0]))
    h.push(h.ids(["x", "y"]), torch.tensor([5.0, 6.0]))
    assert h.state_dict() == {"buffers": {"x": [3.0, 4.0, 5.0], "y": [2.0, 6.0]}}


def test_group_normalize_ignores_group_label_values():
    r = torch.tensor([1.0, 3.0, 0.0, 4.0])
    a = group_normalize(r, torch.tensor([7, 7, -2, -2]))
    b = group_normalize(r, torch.tensor([0, 0, 1, 1]))
    assert torch.equal(a, b)
    assert group_normalize(torch.tensor([float("nan")] * 3), torch.zeros(3, dtype=torch.long)).tolist() == [0.0] * 3


def test_build_pairs_by_hand():
    scores = torch.tensor([0.1, 0.9, 0.5, 2.0, 2.0, 1.0, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    pairs = lambda *a, **k: list(zip(*(t.tolist() for t in build_pairs(scores, groups, *a, **k))))  # noqa: E731
    assert pairs("best_worst") == [(1, 0), (3, 5)]  # group 1: first of the tie; group 2 (one member): none
    assert pairs("best_worst", margin=0.9) == [(3, 5)]
    assert pairs("all_pairs") == [(1, 0), (1, 2), (2, 0), (3, 5), (4, 5)]
    assert pairs("all_pairs", margin=0.5) == [(1, 0), (3, 5), (4, 5)]
    assert pairs("all_pairs", max_pairs=2) == [(3, 5), (4, 5)]
    with pytest.raises(ValueError, match="pairing"):
        build_pairs(scores, groups, "random")
