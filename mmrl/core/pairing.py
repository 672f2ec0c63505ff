"""Preference pairs inside groups of scored samples (online Diffusion-DPO: pairs from the policy's own images).

best_worst: per group the highest and the lowest score (first index on ties), if their gap > margin.
all_pairs:  every (i, j) of a group with scores[i] - scores[j] > margin.
Vectorised over the [B, B] same-group mask (no per-group loop).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

__all__ = ["PAIRINGS", "build_pairs"]

PAIRINGS = ("best_worst", "all_pairs")


def build_pairs(scores: Tensor, group_ids: Tensor, pairing: str = "best_worst", margin: float = 0.0,
                max_pairs: int = 0) -> tuple[Tensor, Tensor]:
    """Indices (chosen[N], rejected[N]) of preference pairs inside each group of scores[B] (`group_ids[B]`).

    max_pairs > 0 keeps the pairs with the largest gaps (stable order otherwise: by chosen index, then rejected)."""
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing: expected one of {list(PAIRINGS)}, got {pairing!r}")
    scores = scores.detach().double().cpu()
    group_ids = group_ids.cpu()
    same = group_ids[:, None] == group_ids[None, :]
    gap = scores[:, None] - scores[None, :]
    if pairing == "all_pairs":
        ok = same & (gap > margin)
    else:
        big = torch.finfo(torch.float64).max
        g_max = torch.where(same, scores[None, :].expand_as(gap), torch.full_like(gap, -big)).max(1).values
        g_min = torch.where(same, scores[None, :].expand_as(gap), torch.full_like(gap, big)).min(1).values
        idx = torch.arange(len(scores))

        def first(mask: Tensor) -> Tensor:  # per row: the first same-group index where mask holds
            return torch.where(mask & same, idx[None, :], len(scores)).min(1).values

        best, worst = first(scores[None, :] == g_max[:, None]), first(scores[None, :] == g_min[:, None])
        ok = torch.zeros_like(same)
        rep = torch.unique(first(torch.ones_like(same)))  # one row per group: its first member
        ok[best[rep], worst[rep]] = (g_max[rep] - g_min[rep]) > margin
    w, l = ok.nonzero(as_tuple=True)
    if max_pairs > 0 and len(w) > max_pairs:
        keep = torch.sort(torch.argsort(gap[w, l], descending=True, stable=True)[:max_pairs]).values
        w, l = w[keep], l[keep]
    return w, l
