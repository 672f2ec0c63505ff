"""Reward-model zoo: `load(name, **kw)`, `available()`; every model returns RewardOutput(scores[B], details)."""

from mmrl.rewards.base import (  # noqa: F401
    RewardModel,
    RewardOutput,
    available,
    load,
    register,
    register_lazy,
    to_image_list,
    to_image_tensor,
)
