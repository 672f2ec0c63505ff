"""Per-prompt reward normalisation (Flow-GRPO / DDPO's stat tracker), vectorised over groups.

    adv_i = (r_i - mean_g) / (std_g + eps)       g = the prompt (group) of sample i

`std_g` is the population std of the group's rewards (`std_mode="group"`) or of the whole batch (`"global"`).
A group whose rewards are all equal gets advantage 0. Non-finite rewards (samples dropped upstream) get 0 and
enter no statistic. With a `RewardHistory` the group statistics also cover the last N rewards of the prompt seen
in earlier batches (DDPO's per-prompt buffer).

source: flow_grpo/stat_tracking.py (np.std + 1e-4); ddpo-pytorch/ddpo_pytorch/stat_tracking.py (buffer)
"""

from __future__ import annotations

from typing import Sequence

import torch

Tensor = torch.Tensor

__all__ = ["STD_MODES", "group_normalize", "RewardHistory", "PerPromptStatTracker"]

STD_MODES = ("group", "global")


def group_normalize(rewards: Tensor, group_ids: Tensor, std_mode: str = "group", eps: float = 1e-4,
                    prior_values: Tensor | None = None, prior_groups: Tensor | None = None) -> Tensor:
    """Advantages [B] (float32) of `rewards[B]` normalised within groups `group_ids[B]` (any integer labels).

    `prior_values[M]` / `prior_groups[M]`: earlier rewards of the same groups (labels in `group_ids`' space) that
    join each group's mean/std (a history buffer). Non-finite rewards get 0 and are left out of all statistics
    (the global std included). No per-group Python loop: groups are reduced with index_add / scatter_reduce."""
    if std_mode not in STD_MODES:
        raise ValueError(f"std_mode: expected one of {list(STD_MODES)}, got {std_mode!r}")
    r = rewards.detach().double().cpu().reshape(-1)
    adv = torch.zeros_like(r)
    ok = torch.isfinite(r)
    if not bool(ok.any()):
        return adv.float()
    gids = group_ids.cpu().reshape(-1)
    vals, groups = r[ok], gids[ok]
    if prior_values is not None and prior_values.numel():
        vals = torch.cat([prior_values.detach().double().cpu().reshape(-1), vals])
        groups = torch.cat([prior_groups.cpu().reshape(-1), groups])
    labels, inv = torch.unique(torch.cat([groups, gids]), return_inverse=True)
    g_vals, g_rows = inv[:len(groups)], inv[len(groups):]  # compact ids of the statistic values / of the batch
    n = len(labels)
    count = torch.zeros(n, dtype=torch.float64).index_add_(0, g_vals, torch.ones_like(vals))
    mean = torch.zeros(n, dtype=torch.float64).index_add_(0, g_vals, vals) / count.clamp(min=1)
    dev2 = (vals - mean[g_vals]).pow(2)  # two passes (mean, then deviations), as np.std / torch.std
    std = (torch.zeros(n, dtype=torch.float64).index_add_(0, g_vals, dev2) / count.clamp(min=1)).sqrt() + eps
    if std_mode == "global":
        std = torch.full_like(std, float(r[ok].std(unbiased=False)) + eps)
    vmax = torch.full((n,), -torch.inf, dtype=torch.float64).scatter_reduce(0, g_vals, vals, "amax")
    vmin = torch.full((n,), torch.inf, dtype=torch.float64).scatter_reduce(0, g_vals, vals, "amin")
    live = ok & (vmax > vmin)[g_rows]
    adv[live] = (r[live] - mean[g_rows[live]]) / std[g_rows[live]]
    return adv.float()


class RewardHistory:
    """The last `size` finite rewards of every prompt, as a tensor [P, size] (oldest first per row) + fill counts.

    The recipe owns it (inside its `PerPromptStatTracker`) and checkpoints it: `state_dict()` is
    {"buffers": {prompt: [rewards, oldest first]}} (the format of the earlier per-prompt list tracker)."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"reward history size: expected >= 1, got {size}")
        self.size = int(size)
        self.rows: dict[str, int] = {}
        self.values = torch.zeros(0, self.size, dtype=torch.float64)
        self.counts = torch.zeros(0, dtype=torch.long)

    def ids(self, prompts: Sequence[str]) -> Tensor:
        """Row ids [B] of `prompts` (new prompts get empty rows)."""
        for p in dict.fromkeys(prompts):
            if p not in self.rows:
                self.rows[p] = len(self.rows)
        grow = len(self.rows) - len(self.counts)
        if grow:
            self.values = torch.cat([self.values, torch.zeros(grow, self.size, dtype=torch.float64)])
            self.counts = torch.cat([self.counts, torch.zeros(grow, dtype=torch.long)])
        return torch.tensor([self.rows[p] for p in prompts], dtype=torch.long)

    def prior(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(values[M], row ids[M]) stored for the distinct rows in `ids`, oldest first within a row."""
        rows = torch.unique(ids)
        pos = torch.arange(self.size)
        mask = pos[None, :] < self.counts[rows][:, None]
        return self.values[rows][mask], rows[:, None].expand(-1, self.size)[mask]

    def push(self, ids: Tensor, rewards: Tensor) -> None:
        """Append the finite `rewards[B]` to their rows `ids[B]` (batch order), keeping each row's last `size`."""
        r = rewards.detach().double().cpu().reshape(-1)
        ok = torch.isfinite(r)
        ids, r = ids[ok], r[ok]
        if not len(ids):
            return
        # a value's position in its row's sequence (stored values, then this batch in order)
        order = torch.sort(ids, stable=True).indices
        sorted_ids = ids[order]
        starts = torch.searchsorted(sorted_ids, sorted_ids, right=False)
        rank = torch.empty_like(ids)
        rank[order] = torch.arange(len(ids)) - starts
        added = torch.zeros_like(self.counts).index_add_(0, ids, torch.ones_like(ids))
        total = self.counts + added
        # the stored values and the new ones as one (row, position, value) list, then the last `size` per row
        pos = torch.arange(self.size)
        old_mask = pos[None, :] < self.counts[:, None]
        old_rows = torch.arange(len(self.counts))[:, None].expand(-1, self.size)[old_mask]
        all_rows = torch.cat([old_rows, ids])
        all_pos = torch.cat([pos[None, :].expand(len(self.counts), -1)[old_mask], self.counts[ids] + rank])
        all_vals = torch.cat([self.values[old_mask], r])
        new_pos = all_pos - (total[all_rows] - self.size).clamp(min=0)
        keep = new_pos >= 0
        values = torch.zeros_like(self.values)
        values[all_rows[keep], new_pos[keep]] = all_vals[keep]
        self.values, self.counts = values, total.clamp(max=self.size)

    def state_dict(self) -> dict:
        return {"buffers": {p: self.values[i, :int(self.counts[i])].tolist() for p, i in self.rows.items()
                            if int(self.counts[i])}}

    def load_state_dict(self, state: dict) -> None:
        buffers = state["buffers"]
        self.rows = {}
        self.values = torch.zeros(0, self.size, dtype=torch.float64)
        self.counts = torch.zeros(0, dtype=torch.long)
        if buffers:
            ids = self.ids(list(buffers))
            for i, vals in zip(ids.tolist(), buffers.values()):  # once per resume: the stored lists -> rows
                v = torch.tensor(vals[-self.size:], dtype=torch.float64)
                self.values[i, :len(v)] = v
                self.counts[i] = len(v)


class PerPromptStatTracker:
    """Per-prompt advantages of a batch of (prompt, reward) pairs: `group_normalize` with prompt texts as groups.

    history=0 uses the current batch only (Flow-GRPO clears its tracker each epoch); history=N keeps the last N
    finite rewards of each prompt in a `RewardHistory` (checkpointed through `state_dict`)."""

    def __init__(self, std_mode: str = "group", history: int = 0, eps: float = 1e-4):
        if std_mode not in STD_MODES:
            raise ValueError(f"reward.std_mode: expected one of {list(STD_MODES)}, got {std_mode!r}")
        self.std_mode, self.eps = std_mode, eps
        self.history = RewardHistory(history) if history > 0 else None

    def update(self, prompts: Sequence[str], rewards: Tensor) -> Tensor:
        """Advantages [B] (float32); with a history, this batch's finite rewards are then stored."""
        if self.history is None:
            index = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
            ids = torch.tensor([index[p] for p in prompts], dtype=torch.long)
            return group_normalize(rewards, ids, self.std_mode, self.eps)
        ids = self.history.ids(prompts)
        prior_values, prior_ids = self.history.prior(ids)
        adv = group_normalize(rewards, ids, self.std_mode, self.eps, prior_values, prior_ids)
        self.history.push(ids, rewards)
        return adv

    def state_dict(self) -> dict:
        return self.history.state_dict() if self.history is not None else {"buffers": {}}

    def load_state_dict(self, state: dict) -> None:
        if self.history is not None:
            self.history.load_state_dict(state)
