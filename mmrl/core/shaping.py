"""Reward shaping and group filters of the DAPO recipe (pure tensor functions)."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float) -> Tensor:
    """DAPO soft overlong punishment: 0 up to max_len - buffer, then linearly down to -factor at max_len.

    lengths[B] -> penalty[B] float32 (<= 0); buffer <= 0 -> zeros."""
    # source: DAPO arXiv 2503.14476 eq. 13; verl dapo reward manager (overlong_buffer)
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    exceed = lengths.float() - (max_len - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0)


def keep_groups(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """DAPO dynamic sampling filter: bool[B], True for samples whose group (equal `group_ids`) has rewards that
    differ (max > min); vectorised with scatter_reduce."""
    # source: DAPO arXiv 2503.14476 sec. 3.2 (dynamic sampling)
    _, inv = torch.unique(group_ids, return_inverse=True)
    g = int(inv.max()) + 1
    lo = torch.full((g,), float("inf")).scatter_reduce(0, inv, rewards.float(), "amin")
    hi = torch.full((g,), float("-inf")).scatter_reduce(0, inv, rewards.float(), "amax")
    return (hi > lo)[inv]
