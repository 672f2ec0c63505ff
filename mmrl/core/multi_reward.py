"""Several rewards, one advantage: how the components of a weighted reward are turned into advantages.

components [B, K] (one column per reward), weights [K], a per-reward normaliser `normalise(r[B]) -> adv[B]`
(the recipe's own group statistics: per prompt, per group, ...) and a mode:

    sum_then_normalise  A = normalise(sum_k w_k r_k)                  GRPO on the weighted sum (the usual way)
    normalise_then_sum  A_k = normalise(r_k);  S = sum_k w_k A_k;     GDPO: every reward normalised in its own
                        A = (S - mean_B S) / (std_B S + eps)           group first, then batch-whitened

Why: with the sum first, a reward with a large spread drowns the others, and different reward combinations
collapse to the same advantage (e.g. two binary rewards: (1, 0) and (0, 1) in a group both give the same
normalised sum); per-reward normalisation keeps each reward's ranking inside the group.

Exactness kept here: rows outside `mask` (samples dropped for a NaN/inf reward) get 0 and enter no statistic; a
row whose every per-reward advantage is exactly 0 (its group's rewards were all equal in every component) keeps
advantage 0 after the whitening (GDPO's batch mean of S is 0 up to rounding since each A_k has group mean 0; we
make it exact so such groups are still recognised as carrying no signal).

source: GDPO, Liu et al. 2026, arXiv 2601.05242; NVlabs/GDPO trl-GDPO/trl-0.18.0-gdpo/trl/trainer/grpo_trainer.py
at b080e63 (per-reward group mean / unbiased std + 1e-4, weighted sum, batch mean / unbiased std + 1e-4);
Flow-Factory (X-GenGroup/Flow-Factory at a0b2bc5) src/flow_factory/advantage/advantage_processor.py
`compute_gdpo` / `compute_weighted_sum` (`advantage_aggregation: sum | gdpo`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

Tensor = torch.Tensor

__all__ = ["AGGREGATIONS", "weighted_sum", "multi_reward_advantages"]

AGGREGATIONS = ("sum_then_normalise", "normalise_then_sum")


def _components(components: Tensor, weights: Tensor | Sequence[float]) -> tuple[Tensor, Tensor]:
    c = components if components.is_floating_point() else components.to(torch.get_default_dtype())
    if c.dim() == 1:
        c = c[:, None]
    if c.dim() != 2:
        raise ValueError(f"components: expected shape [B, K] (one column per reward), got {tuple(components.shape)}")
    w = torch.as_tensor(weights, dtype=c.dtype, device=c.device).reshape(-1)
    if w.shape[0] != c.shape[1]:
        raise ValueError(f"weights: expected {c.shape[1]} (one per reward column), got {w.shape[0]}")
    return c, w


def weighted_sum(components: Tensor, weights: Tensor | Sequence[float]) -> Tensor:
    """sum_k w_k r_k: components [B, K], weights [K] -> [B] (a NaN/inf in any column stays NaN/inf)."""
    c, w = _components(components, weights)
    return (c * w).sum(-1)


def multi_reward_advantages(components: Tensor, weights: Tensor | Sequence[float],
                            normalise: Callable[[Tensor], Tensor], mode: str = "sum_then_normalise",
                            mask: Tensor | None = None, eps: float = 1e-4) -> Tensor:
    """Advantages [B] of a weighted multi-reward batch (module docstring).

    components [B, K], weights [K]; `normalise(r[B]) -> adv[B]` is applied to the weighted sum
    (`sum_then_normalise`) or to every column (`normalise_then_sum`, then the weighted sum is whitened over the
    rows of `mask` with the unbiased std + eps). mask [B] bool (None = all rows): rows outside it get 0.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"advantage aggregation: expected one of {list(AGGREGATIONS)}, got {mode!r}")
    c, w = _components(components, weights)
    m = torch.ones(c.shape[0], dtype=torch.bool, device=c.device) if mask is None else mask.to(c.device).bool()
    if m.shape != (c.shape[0],):
        raise ValueError(f"mask: expected shape [{c.shape[0]}], got {tuple(m.shape)}")
    zero = torch.zeros((), dtype=c.dtype, device=c.device)
    if mode == "sum_then_normalise":
        return torch.where(m, normalise(weighted_sum(c, w)).to(c.dtype), zero)
    per = torch.stack([normalise(c[:, k]).to(c.dtype) for k in range(c.shape[1])], dim=1)  # [B, K]
    per = torch.where(m[:, None], per, zero)
    s = (per * w).sum(-1)
    n = int(m.sum())
    if n == 0:
        return torch.zeros_like(s)
    mean = s[m].mean()
    std = s[m].std() if n > 1 else zero  # unbiased, as GDPO's torch.std
    out = (s - mean) / (std + eps)
    silent = (per == 0).all(-1) | ~m  # no reward moved this row: exactly 0 (see the module docstring)
    return torch.where(silent, zero, out)
