"""The reward registry (mmrl/rewards/registry.py) behind `mmrl.rewards.load / available / register`."""

import pytest
import torch

import mmrl.rewards as rewards
from mmrl.rewards import base, registry
from mmrl.rewards.composite import CompositeReward


def test_one_registry_behind_every_import_path():
    assert rewards.register is base.register is registry.register
    assert rewards.available is base.available is registry.available
    assert base._REGISTRY is registry._REGISTRY and base._LAZY is registry._LAZY
    assert rewards.load is base.load
    assert {"composite", "jpeg_compressibility", "pickscore"} <= set(registry.available())


def test_create_builds_by_name_and_rejects_unknown_names():
    assert type(registry.create("jpeg_compressibility", quality=50)).__name__ == "JpegCompressibility"
    with pytest.raises(ValueError, match=r"unknown reward 'nope'; available: \[.*'jpeg_compressibility'"):
        registry.create("nope")


def test_mapping_spec_builds_the_registered_composite():
    """load({name: weight}) goes through the registered "composite" reward (no import of composite.py from
    base.py) and scores like CompositeReward.from_mapping; a RewardModel passes through unchanged."""
    imgs = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    spec = {"jpeg_compressibility": 1.0, "jpeg_incompressibility": {"weight": 0.5, "quality": 50}}
    model = rewards.load(spec, normalize="batch")
    assert isinstance(model, CompositeReward) and model.normalize == "batch"
    assert torch.equal(model(imgs).scores, CompositeReward.from_mapping(spec, normalize="batch")(imgs).scores)
    assert rewards.load(model) is model
    with pytest.raises(TypeError, match="must be a string or a mapping, got int"):
        rewards.load(3)


def test_reward_arguments_are_checked_by_kind_before_the_reward_is_built():
    """int / float / bool arguments get a value of that kind (a word for a number failed inside the reward, unnamed);
    YAML's `1e-3` (a string: no dot) counts as a number, as it does for config floats."""
    registry.check_reward_arguments("number_match", {"tol": "1e-3"}, "reward.kwargs")
    registry.check_reward_arguments("jpeg_incompressibility", {"quality": 50, "batch_size": 2}, "x")
    with pytest.raises(ValueError, match=r"^reward.kwargs.tol: reward 'number_match' takes a number for 'tol' "
                                         r"\(default 1e-06\), got 'abc'$"):
        registry.check_reward_arguments("number_match", {"tol": "abc"}, "reward.kwargs")
    with pytest.raises(ValueError, match=r"^x.lowercase: reward 'exact_match' takes true or false for 'lowercase' "
                                         r"\(default True\), got 'no'$"):
        registry.check_reward_arguments("exact_match", {"lowercase": "no"}, "x")
