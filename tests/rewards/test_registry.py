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
