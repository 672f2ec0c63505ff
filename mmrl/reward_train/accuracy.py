"""Held-out pairwise accuracy of a reward model and its 95% Wilson score interval, and the Bradley-Terry loss."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

Z95 = 1.959963984540054  # the standard normal's 0.975 quantile: a two-sided 95% interval


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Mean of -log sigmoid(s_chosen - s_rejected) over pairs: the negative log-likelihood of the preferences under
    Bradley-Terry, P(chosen > rejected) = sigmoid(s_chosen - s_rejected).
    # source: yuvalkirstain/PickScore trainer/criterions/clip_criterion.py at ca44324 (CLIPCriterion.calc_loss with
    #   in_batch_negatives false: cross-entropy over the pair's two logits logit_scale * cos(text, image), which for
    #   a label (1, 0) is exactly this loss on the scores the zoo's `pickscore` returns)"""
    return -F.logsigmoid(chosen.float() - rejected.float()).mean()


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion correct / n (Wilson 1927): the interval that stays inside
    [0, 1] and is sensible for few pairs or an accuracy near 0 or 1 (the normal approximation is not). n = 0: (0, 1).

        centre = (p + z^2 / 2n) / (1 + z^2 / n),  half = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2)"""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= correct <= n:
        raise ValueError(f"wilson_interval: correct must be in 0..{n}, got {correct}")
    p, z2 = correct / n, z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def pair_accuracy(chosen: torch.Tensor, rejected: torch.Tensor, prefix: str = "eval/") -> dict[str, float]:
    """{prefix}pair_accuracy (share of pairs whose chosen image scores strictly higher: an equal score is not a
    correct prediction, as PickScore's evaluation counts), its 95% Wilson interval (`_lo`, `_hi`), the pair count,
    the mean score margin and the Bradley-Terry loss of the pairs."""
    chosen, rejected = chosen.detach().float().cpu(), rejected.detach().float().cpu()
    n = int(chosen.numel())
    correct = int((chosen > rejected).sum())
    lo, hi = wilson_interval(correct, n)
    return {f"{prefix}pair_accuracy": correct / n if n else 0.0, f"{prefix}pair_accuracy_lo": lo,
            f"{prefix}pair_accuracy_hi": hi, f"{prefix}pairs": n,
            f"{prefix}margin": float((chosen - rejected).mean()) if n else 0.0,
            f"{prefix}loss": float(bradley_terry_loss(chosen, rejected)) if n else 0.0}
