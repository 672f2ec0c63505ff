"""Credit assignment over multi-turn episodes, all from ``mmrl.core``, and the episode filters of a step.

With r_k = reward of turn k, G_k = ``discounted_returns`` over turns with ``algo.gamma``, and episode return
R = G_1 = sum_k gamma^(k-1) r_k (``algo.advantage``):
  grpo       A(turn k of episode i) = group_advantages(R)_i             (episodes of one task = a group)
  turn_grpo  A = group_advantages(G_k) over all turns of the group's episodes (AReaL's individual mode)
  gigpo      A = group_advantages(R)_i + omega * group_advantages(G_k | same group and same anchor)
             (`episode_stats="step"`: the episode part's statistics over turn rows, verl-agent's default)
DAPO dynamic sampling keeps only groups whose episode returns are not all equal (`informative_groups`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch

from mmrl.core import discounted_returns, gigpo_advantages, group_advantages, hash_anchors
from mmrl.training import check_rewards
from mmrl.vlm.episodes import Episode, gather_episodes, task_specs

Advantage = Literal["grpo", "turn_grpo", "gigpo"]
ADVANTAGES = ("grpo", "turn_grpo", "gigpo")


def turn_rewards(episodes: Sequence[Episode]) -> tuple[torch.Tensor, torch.Tensor]:
    """(turn rewards[E, K], valid mask[E, K]) with K = the most turns."""
    K = max([len(ep.turns) for ep in episodes] + [1])
    rewards = torch.zeros(len(episodes), K)
    mask = torch.zeros(len(episodes), K, dtype=torch.bool)
    for i, ep in enumerate(episodes):
        for k, t in enumerate(ep.turns):
            rewards[i, k], mask[i, k] = t.reward, True
    return rewards, mask


def episode_returns(episodes: Sequence[Episode], gamma: float) -> torch.Tensor:
    """R_i = sum_k gamma^(k-1) r_k (0 for an episode without turns)."""
    if not episodes:
        return torch.zeros(0)
    rewards, mask = turn_rewards(episodes)
    returns = discounted_returns(rewards, mask, gamma)
    return torch.where(mask[:, 0], returns[:, 0], torch.zeros(()))


def turn_advantages(episodes: Sequence[Episode], mode: str, gamma: float, omega: float = 1.0,
                    scale_by_std: bool = True, reward_norm: Any = None, episode_stats: str = "episode") -> torch.Tensor:
    """Advantage of every turn, [E, K] (0 where an episode has no such turn); see the module docstring.
    `reward_norm` (a `RunningRewardNorm`, reward.running_norm): updated with every turn reward of `episodes`
    (pass the global batch), then the turn rewards are normalised before the returns and advantages."""
    if mode not in ADVANTAGES:
        raise ValueError(f"algo.advantage: expected one of {list(ADVANTAGES)}, got {mode!r}")
    rewards, mask = turn_rewards(episodes)
    if reward_norm is not None:
        rewards[mask] = reward_norm(rewards[mask])  # update with this batch, then normalise (as vlm_grpo)
    returns = discounted_returns(rewards, mask, gamma)
    R = torch.where(mask[:, 0], returns[:, 0], torch.zeros(()))
    gid = torch.tensor([ep.group for ep in episodes], dtype=torch.long)
    if mode == "grpo":
        a = group_advantages(R, gid, scale_by_std=scale_by_std)
        return torch.where(mask, a[:, None].expand_as(mask), torch.zeros(()))
    e_idx, k_idx = mask.nonzero(as_tuple=True)
    out = torch.zeros_like(returns)
    if mode == "turn_grpo":
        out[e_idx, k_idx] = group_advantages(returns[e_idx, k_idx], gid[e_idx], scale_by_std=scale_by_std)
        return out
    # None anchors never group: give each its own key
    anchors = [episodes[e].turns[k].anchor for e, k in zip(e_idx.tolist(), k_idx.tolist())]
    anchors = [("__no_anchor__", j) if a is None else ("anchor", a) for j, a in enumerate(anchors)]
    out[e_idx, k_idx] = gigpo_advantages(R, gid, returns[e_idx, k_idx], e_idx, hash_anchors(anchors), omega=omega,
                                         scale_by_std=scale_by_std, episode_stats=episode_stats)
    return out


def token_advantages(episodes: Sequence[Episode], turn_adv: torch.Tensor) -> list[torch.Tensor]:
    """Per episode, advantages over ids[prompt_len:] (each turn's value on its response tokens, 0 elsewhere)."""
    out = []
    for i, ep in enumerate(episodes):
        a = torch.zeros(max(0, len(ep.ids) - ep.prompt_len))
        for k, t in enumerate(ep.turns):
            a[t.start - ep.prompt_len:t.end - ep.prompt_len] = turn_adv[i, k]
        out.append(a)
    return out


def rewards_finite(ep: Episode) -> bool:
    """Every turn reward of the episode is a finite number."""
    return all(math.isfinite(t.reward) for t in ep.turns)


def check_turn_rewards(episodes: Sequence[Episode], on_nonfinite: str) -> int:
    """Validate every turn reward (`mmrl.training.check_rewards`, per environment). `on_nonfinite="error"`: a NaN/inf
    reward raises naming the environment, the episode (group, seed) and the turn; `"drop_sample"`: returns how many
    episodes hold one (the recipe trains without them; `rewards_finite` tells which)."""
    by_task: dict[str, list[tuple[Episode, int]]] = defaultdict(list)
    for ep in episodes:
        by_task[ep.task] += [(ep, k) for k in range(len(ep.turns))]
    for task, rows in by_task.items():
        check_rewards(torch.tensor([ep.turns[k].reward for ep, k in rows], dtype=torch.float64), None, on_nonfinite,
                      reward=f"environment {task}",
                      labels=[f"episode {ep.index} of group {ep.group}, seed {ep.seed}, turn {k + 1}"
                              for ep, k in rows])
    return sum(not rewards_finite(ep) for ep in episodes)


def informative_groups(episodes: Sequence[Episode], returns: torch.Tensor) -> list[int]:
    """Groups (in first-seen order) whose episode returns are not all equal (DAPO dynamic sampling)."""
    by_group: dict[int, list[float]] = {}
    for ep, r in zip(episodes, returns.tolist()):
        by_group.setdefault(ep.group, []).append(r)
    return [g for g, rs in by_group.items() if len(rs) > 1 and max(rs) - min(rs) > 1e-9]



@dataclass
class StepEpisodes:
    """One step's rollouts: `local` (this rank's episodes), `all` (every rank's, rank order; light copies under
    several processes) with `src` (the rank of each), `kept` (group ids to train on, at most prompts_per_step),
    `rounds` (dynamic-sampling rounds), `nonfinite` (episodes with a NaN/inf turn reward), `task_cursor` (next seed)."""

    local: list[Episode] = field(default_factory=list)
    all: list[Episode] = field(default_factory=list)
    src: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    rounds: int = 0
    nonfinite: int = 0
    task_cursor: int = 0

    def trainable(self, ep: Episode) -> bool:
        return ep.group in self.kept and ep.policy_tokens > 0 and rewards_finite(ep)

    def train_rows(self, rank: int) -> tuple[list[Episode], list[Episode], int]:
        """(this rank's training episodes, every rank's in rank-major order, the offset of this rank's in them)."""
        sel = sorted((i for i, ep in enumerate(self.all) if self.trainable(ep)),
                     key=lambda i: self.src[i])  # rank-major, each rank's own order (stable sort)
        return ([ep for ep in self.local if self.trainable(ep)], [self.all[i] for i in sel],
                sum(self.src[i] < rank for i in sel))


def collect_groups(ctx: Any, rollout: Callable[[list[dict], int], list[Episode]], tasks: dict[str, dict],
                   task_cursor: int, prompts_per_step: int, group_size: int, gamma: float, dynamic: bool,
                   max_rounds: int, on_nonfinite: str) -> StepEpisodes:
    """Roll out `prompts_per_step` groups (`rollout(specs, round)` runs this rank's share); with `dynamic` (DAPO)
    keep the informative groups and refill the rest in up to `max_rounds` extra rounds (a refill rounds up to whole
    groups on every rank). Decisions use the gathered episodes, so every rank runs the same rounds; NaN/inf turn
    rewards raise or drop their episode (`on_nonfinite`); a group left with < 2 finite episodes is not kept."""
    world = ctx.world_size
    out = StepEpisodes(task_cursor=task_cursor)
    min_group = min(2, group_size)
    while True:
        need = prompts_per_step if out.rounds == 0 else prompts_per_step - len(out.kept)
        n_new = -(-need // world) * world
        specs = ctx.shard(task_specs(tasks, out.task_cursor, n_new, out.task_cursor, group_size))
        out.task_cursor += n_new
        eps = rollout(specs, out.rounds)
        out.local += eps
        g_eps, g_src = gather_episodes(ctx, eps)
        out.nonfinite += check_turn_rewards(g_eps, on_nonfinite)  # every rank raises, or drops the same episodes
        out.all += g_eps
        out.src += g_src
        fin = [ep for ep in out.all if rewards_finite(ep)]  # all of them unless drop_sample dropped some
        if not dynamic:
            sizes: dict[int, int] = defaultdict(int)
            for ep in fin:
                sizes[ep.group] += 1
            out.kept = sorted(g for g in {ep.group for ep in out.all} if sizes[g] >= min_group)
            break
        out.kept = informative_groups(fin, episode_returns(fin, gamma))
        out.rounds += 1
        if len(out.kept) >= prompts_per_step or out.rounds > max_rounds:
            break
    out.kept = out.kept[:prompts_per_step]
    return out
