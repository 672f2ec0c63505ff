import json
import math

import pytest
import torch

from mmrl.core.running_norm import RunningRewardNorm, batch_moments, running_normalize


def test_one_batch_equals_many_batches_equals_torch_std():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(97, generator=gen, dtype=torch.float64) * 3 + 5
    one, many = RunningRewardNorm(), RunningRewardNorm()
    one.update(rewards)
    for chunk in torch.split(rewards, [1, 10, 3, 40, 43]):
        many.update(chunk)
    assert one.count == many.count == 97
    assert many.mean == pytest.approx(one.mean, rel=1e-12) and many.std == pytest.approx(one.std, rel=1e-12)
    assert one.mean == pytest.approx(float(rewards.mean()), rel=1e-12)
    assert one.std == pytest.approx(float(rewards.std()), rel=1e-12)  # unbiased, as LightRFT's running std
    x = torch.tensor([0.0, 5.0, 10.0])
    torch.testing.assert_close(one.normalize(x), many.normalize(x))


def test_per_rank_moments_merge_like_the_gathered_batch():
    a, b = torch.tensor([1.0, 2.0, 4.0]), torch.tensor([10.0, -3.0])
    merged, gathered = RunningRewardNorm(), RunningRewardNorm()
    merged.update_moments(*batch_moments(a))
    merged.update_moments(*batch_moments(b))
    gathered.update(torch.cat([a, b]))
    assert merged.state_dict() == pytest.approx(gathered.state_dict())


def test_normalize_hand_values_center_and_clip():
    norm = RunningRewardNorm(center=True)
    out = norm(torch.tensor([1.0, 3.0]))  # update, then normalise: mean 2, std sqrt(2)
    torch.testing.assert_close(out, torch.tensor([-1.0, 1.0]) / math.sqrt(2))
    scale_only = RunningRewardNorm(center=False, clip=1.0)
    scale_only.update(torch.tensor([1.0, 3.0]))
    # r / sqrt(2): 3 -> 2.12 clipped to 1, 1 -> 0.707, -5 -> -3.5 clipped to -1
    torch.testing.assert_close(scale_only.normalize(torch.tensor([3.0, 1.0, -5.0])),
                               torch.tensor([1.0, 1 / math.sqrt(2), -1.0]))
    assert running_normalize(torch.tensor([4.0]), mean=2.0, std=2.0, center=True, eps=0.0).item() == 1.0
    fresh = RunningRewardNorm()
    assert fresh.std == 1.0 and fresh.normalize(torch.tensor([2.5])).item() == pytest.approx(2.5)


def test_non_finite_rewards_are_ignored_and_passed_through():
    norm = RunningRewardNorm(center=True)
    out = norm(torch.tensor([1.0, float("nan"), 3.0, float("-inf")]))
    assert norm.count == 2 and norm.mean == 2.0
    assert math.isnan(out[1]) and out[3] == float("-inf")
    torch.testing.assert_close(out[[0, 2]], torch.tensor([-1.0, 1.0]) / math.sqrt(2))


def test_state_dict_roundtrip_and_bad_state():
    norm = RunningRewardNorm(center=True, clip=3.0)
    norm.update(torch.tensor([0.5, 2.0, 7.0]))
    state = json.loads(json.dumps(norm.state_dict()))  # plain JSON-able floats
    restored = RunningRewardNorm(center=True, clip=3.0)
    restored.load_state_dict(state)
    for n in (norm, restored):
        n.update(torch.tensor([1.0, -2.0]))
    x = torch.tensor([-4.0, 0.0, 9.0])
    assert torch.equal(norm.normalize(x), restored.normalize(x))
    with pytest.raises(ValueError, match="missing keys"):
        restored.load_state_dict({"count": 3})
    with pytest.raises(ValueError, match="M2 >= 0"):
        restored.load_state_dict({"count": 3, "mean": 0.0, "m2": -1.0})
    with pytest.raises(ValueError, match="clip"):
        RunningRewardNorm(clip=0.0)
