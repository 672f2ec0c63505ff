"""Running reward normalisation (`reward.running_norm`): scale rewards by statistics of every reward seen so far.

    update: count, mean, M2 over all finite rewards seen (Welford, merged batch-wise with Chan et al.'s parallel
            formula: the result is the same whether the rewards arrive in one batch or many)
    apply:  r' = (r - mean) / (std + eps)   with center=True      (LightRFT --reward_running_norm_minus_mean)
            r' = r / (std + eps)            with center=False     (LightRFT --reward_running_norm, the default)
            then clamp to [-clip, clip] when clip is set           (LightRFT --reward_clip)
std is the unbiased sample std (n - 1), 1 before two rewards were seen. Call `update` with the step's rewards,
then `normalize` them (the current batch counts, as in LightRFT/OpenRLHF). Non-finite rewards (dropped samples)
are left out of the statistics and come back unchanged.
Distributed: every rank must hold the same state; gather the step's rewards from all ranks and `update` with the
gathered tensor (or merge per-rank `batch_moments` with `update_moments`).

source: LightRFT lightrft/trainer/utils.py RunningMoments (from OpenRLHF / alibaba ROLL) and its reward_running_norm
options; Welford 1962; Chan, Golub, LeVeque 1979 (parallel variance).
"""

from __future__ import annotations

import math
from typing import Any

import torch

Tensor = torch.Tensor


def batch_moments(rewards: Tensor) -> tuple[int, float, float]:
    """(count, mean, M2 = sum (r - mean)^2) of the finite entries of rewards[...], in float64."""
    r = rewards.detach().reshape(-1).to(torch.float64)
    r = r[torch.isfinite(r)]
    if r.numel() == 0:
        return 0, 0.0, 0.0
    mean = r.mean()
    return int(r.numel()), float(mean), float(((r - mean) ** 2).sum())


def running_normalize(rewards: Tensor, mean: float, std: float, center: bool = False, clip: float | None = None,
                      eps: float = 1e-8) -> Tensor:
    """Pure form: ((rewards - mean if center else rewards) / (std + eps)), clamped to +-clip when clip is set.

    rewards[...] -> same shape and dtype; non-finite entries are returned unchanged."""
    if std < 0 or eps < 0:
        raise ValueError(f"std/eps: expected >= 0, got {std}, {eps}")
    if clip is not None and clip <= 0:
        raise ValueError(f"clip: expected > 0 or None, got {clip}")
    r = rewards.to(torch.float64)
    out = ((r - mean) if center else r) / (std + eps)
    if clip is not None:
        out = out.clamp(-clip, clip)
    return torch.where(torch.isfinite(r), out, r).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


class RunningRewardNorm:
    """Stateful running normaliser; `state_dict()` / `load_state_dict()` go into checkpoints (plain floats).

    >>> norm = RunningRewardNorm(center=True)
    >>> norm.update(torch.tensor([1.0, 3.0]))
    >>> norm.normalize(torch.tensor([1.0, 3.0]))   # mean 2, std sqrt(2)
    tensor([-0.7071,  0.7071])
    """

    def __init__(self, center: bool = False, clip: float | None = None, eps: float = 1e-8) -> None:
        if clip is not None and clip <= 0:
            raise ValueError(f"reward.running_norm clip: expected > 0 or None, got {clip}")
        if eps < 0:
            raise ValueError(f"reward.running_norm eps: expected >= 0, got {eps}")
        self.center, self.clip, self.eps = bool(center), clip, float(eps)
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    @property
    def var(self) -> float:
        """Unbiased variance of all rewards seen (1.0 before two were seen)."""
        return self.m2 / (self.count - 1) if self.count > 1 else 1.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update_moments(self, count: int, mean: float, m2: float) -> None:
        """Merge a batch given by its (count, mean, M2) (Chan et al.): exact, order-independent up to rounding."""
        if count < 0 or m2 < 0:
            raise ValueError(f"moments: expected count >= 0 and M2 >= 0, got {count}, {m2}")
        if count == 0:
            return
        total = self.count + count
        delta = mean - self.mean
        self.m2 += m2 + delta * delta * self.count * count / total
        self.mean += delta * count / total
        self.count = total

    def update(self, rewards: Tensor) -> None:
        """Add the finite entries of rewards[...] to the statistics."""
        self.update_moments(*batch_moments(rewards))

    def normalize(self, rewards: Tensor) -> Tensor:
        """Apply the current statistics (no update). rewards[...] -> same shape."""
        return running_normalize(rewards, self.mean, self.std, self.center, self.clip, self.eps)

    def __call__(self, rewards: Tensor) -> Tensor:
        """update(rewards) then normalize(rewards)."""
        self.update(rewards)
        return self.normalize(rewards)

    def metrics(self) -> dict[str, float]:
        return {"reward/running_mean": self.mean, "reward/running_std": self.std, "reward/running_count": self.count}

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"count", "mean", "m2"} - set(state)
        if missing:
            raise ValueError(f"running reward norm state: missing keys {sorted(missing)} (expected count, mean, m2)")
        count, mean, m2 = int(state["count"]), float(state["mean"]), float(state["m2"])
        if count < 0 or m2 < 0 or not (math.isfinite(mean) and math.isfinite(m2)):
            raise ValueError(f"running reward norm state: expected count >= 0, finite mean and M2 >= 0, got "
                             f"count={count}, mean={mean}, m2={m2}")
        self.count, self.mean, self.m2 = count, mean, m2
