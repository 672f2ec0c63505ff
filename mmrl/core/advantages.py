"""Advantage estimators: pure tensor functions, no config objects, no per-sample Python loops.

Sequence-level estimators share one call signature so trainers can pick them by name from YAML:

    estimator(rewards: FloatTensor[B], group_ids: LongTensor[B], **kw) -> FloatTensor[B]

`group_ids` are arbitrary integers (a prompt index, a hash, ...): they need not be contiguous or sorted.
Grouping goes through `torch.unique(..., return_inverse=True)` + `index_add_`/`scatter_reduce_`.

Conventions:
- std is the unbiased sample std (divides by n - 1), like `torch.std` and verl's GRPO.
- The group estimators (grpo, dr_grpo, rloo, cpgd, and both parts of GiGPO) give a group whose rewards are all
  equal, including a group of one, advantage exactly 0. (verl's GRPO gives a singleton group mean 0 / std 1,
  i.e. its raw reward; we give 0: one sample carries no relative signal.)
- The REINFORCE++ estimators whiten over the whole batch after (or without) the group baseline, as verl does, so
  an all-equal group is NOT exactly 0 there: `reinforce_pp` has no groups at all (a group's advantage is its
  reward's batch z-score); `reinforce_pp_baseline` subtracts the group mean (0 for an all-equal group) and then
  the batch mean of those centred values, which is 0 only up to rounding at sequence level (e.g. 1.3e-8) and
  not 0 at all over tokens of unequal response lengths (the token-weighted mean of the centred scores).
  tests/core/test_advantages.py checks each case.
- Masked positions never influence any output and are returned as 0 (selection by `torch.where`, so
  nan/inf stored there are harmless).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Hashable, Sequence

import torch

Tensor = torch.Tensor

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor]] = {}


def register_advantage(name: str) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    """Decorator: register `fn(rewards[B], group_ids[B], **kw) -> adv[B]` under `name`."""

    def deco(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return deco


def get_advantage_estimator(name: str) -> Callable[..., Tensor]:
    """Look up a registered estimator; unknown names raise ValueError listing the valid ones."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid: {sorted(ADVANTAGE_ESTIMATORS)}"
        ) from None


# ----------------------------------------------------------------------------------------------
# helpers


def _float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def _check_1d(name: str, x: Tensor, n: int | None = None) -> None:
    if x.dim() != 1 or (n is not None and x.shape[0] != n):
        want = f"[{n}]" if n is not None else "[B]"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(x.shape)}")


def _as_mask(mask: Tensor | None, like: Tensor, name: str = "mask") -> Tensor:
    if mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    if mask.shape != like.shape:
        raise ValueError(f"{name}: expected shape {tuple(like.shape)}, got {tuple(mask.shape)}")
    return mask.to(like.device).bool()


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary ids[B] to contiguous indices inv[B] in [0, G)."""
    _, inv = torch.unique(group_ids, return_inverse=True)
    return inv, int(inv.max()) + 1 if inv.numel() else 0


def _group_stats(values: Tensor, inv: Tensor, num_groups: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-sample (group mean, unbiased group std, group count, group-is-constant) for values[N]."""
    count = torch.bincount(inv, minlength=num_groups).to(values.dtype)
    total = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, inv, values)
    mean = total / count
    sq = torch.zeros_like(total).index_add_(0, inv, (values - mean[inv]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    vmax = torch.full_like(total, -math.inf).scatter_reduce_(0, inv, values, "amax")
    vmin = torch.full_like(total, math.inf).scatter_reduce_(0, inv, values, "amin")
    return mean[inv], std[inv], count[inv], (vmax == vmin)[inv]


def masked_whiten(values: Tensor, mask: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """(x - mean) / (std + eps) over the valid entries of values[...] (any shape); masked -> 0.

    Unbiased std. verl's `masked_whiten` uses `rsqrt(var + 1e-8)`; we use `std + eps` like our GRPO.
    """
    values = _float(values)
    m = _as_mask(mask, values)
    x = torch.where(m, values, torch.zeros_like(values))
    n = m.sum()
    mean = x.sum() / n.clamp(min=1)
    var = torch.where(m, (values - mean) ** 2, torch.zeros_like(values)).sum() / (n - 1).clamp(min=1)
    return torch.where(m, (values - mean) / (var.sqrt() + eps), torch.zeros_like(values))


def broadcast_to_tokens(adv: Tensor, mask: Tensor) -> Tensor:
    """Sequence advantage adv[B] -> token advantage [B, T], 0 where mask[B, T] is 0."""
    _check_1d("adv", adv, mask.shape[0])
    if mask.dim() != 2:
        raise ValueError(f"mask: expected shape [B, T], got {tuple(mask.shape)}")
    m = mask.to(adv.device).bool()
    return torch.where(m, adv[:, None].expand_as(m), torch.zeros((), dtype=adv.dtype, device=adv.device))


# ----------------------------------------------------------------------------------------------
# group-relative estimators


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    scale_by_std: bool = True,
    std_mode: str = "group",
    eps: float = 1e-6,
) -> Tensor:
    """GRPO / Dr.GRPO advantages.

    rewards[B] float, group_ids[B] int (any ids) -> adv[B].
    adv_i = (r_i - mean_g) / (std + eps) with std = group std (std_mode="group") or the std of the
    whole batch (std_mode="global"); scale_by_std=False gives Dr.GRPO's r_i - mean_g.
    Groups with all-equal rewards (incl. size 1) get exactly 0.
    """
    # source: GRPO, DeepSeekMath arXiv 2402.03300; Dr.GRPO arXiv 2503.20783 (no std); verl core_algos
    if std_mode not in ("group", "global"):
        raise ValueError(f"std_mode: expected 'group' or 'global', got {std_mode!r}")
    rewards = _float(rewards)
    _check_1d("rewards", rewards)
    _check_1d("group_ids", group_ids, rewards.shape[0])
    inv, g = _group_index(group_ids.to(rewards.device))
    mean, std, _, constant = _group_stats(rewards, inv, g)
    adv = rewards - mean
    if scale_by_std:
        if std_mode == "global":
            std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        adv = adv / (std + eps)
    return torch.where(constant, torch.zeros_like(adv), adv)


@register_advantage("grpo")
def _grpo(rewards: Tensor, group_ids: Tensor, **kw: Any) -> Tensor:
    return group_advantages(rewards, group_ids, **kw)


@register_advantage("dr_grpo")
def _dr_grpo(rewards: Tensor, group_ids: Tensor, **kw: Any) -> Tensor:
    return group_advantages(rewards, group_ids, scale_by_std=False, **kw)


@register_advantage("rloo")
def rloo_advantages(rewards: Tensor, group_ids: Tensor, **unused: Any) -> Tensor:
    """RLOO: adv_i = r_i - mean of the other members of i's group. rewards[B], group_ids[B] -> [B].

    Equals n/(n-1) * (r_i - mean_g); a group of one gets 0.
    """
    # source: Ahmadian et al. 2024 "Back to Basics" (RLOO), arXiv 2402.14740; verl compute_rloo_outcome_advantage
    rewards = _float(rewards)
    _check_1d("rewards", rewards)
    _check_1d("group_ids", group_ids, rewards.shape[0])
    inv, g = _group_index(group_ids.to(rewards.device))
    mean, _, count, constant = _group_stats(rewards, inv, g)
    adv = (rewards - mean) * count / (count - 1).clamp(min=1)
    return torch.where(constant, torch.zeros_like(adv), adv)


def reinforce_pp_advantages(
    rewards: Tensor,
    mask: Tensor | None = None,
    group_ids: Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-6,
) -> Tensor:
    """REINFORCE++ (and its "baseline" variant when group_ids is given): batch-whitened returns.

    Sequence level: rewards[B] (mask[B] optional) -> adv[B] = whiten(r) over the batch; with
    group_ids[B]: whiten(r - group mean) (REINFORCE++-baseline).
    Token level: rewards[B, T] per-token rewards, mask[B, T] -> adv[B, T]:
      without group_ids: returns = discounted_returns(rewards, mask, gamma), whitened over valid tokens;
      with group_ids: score_i = sum of valid rewards of row i, minus its group mean, broadcast to the
      valid tokens and whitened over them. Masked tokens -> 0.
    """
    # source: REINFORCE++ arXiv 2501.03262; verl compute_reinforce_plus_plus(_baseline)_outcome_advantage
    rewards = _float(rewards)
    if rewards.dim() not in (1, 2):
        raise ValueError(f"rewards: expected shape [B] or [B, T], got {tuple(rewards.shape)}")
    m = _as_mask(mask, rewards)
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    if group_ids is not None:
        _check_1d("group_ids", group_ids, rewards.shape[0])
        score = torch.where(m, rewards, zero)
        if rewards.dim() == 2:
            score = score.sum(-1)
            row_ok = m.any(-1)
        else:
            row_ok = m
        # group mean over valid rows only: rows without valid entries are sent to their own group
        ids = torch.where(row_ok, group_ids.to(rewards.device), group_ids.min().to(rewards.device) - 1)
        inv, g = _group_index(ids)
        mean, _, _, _ = _group_stats(score, inv, g)
        x = score - mean
        x = x[:, None].expand_as(rewards) if rewards.dim() == 2 else x
    elif rewards.dim() == 2:
        x = discounted_returns(rewards, m, gamma)
    else:
        x = rewards
    return masked_whiten(x, m, eps)


@register_advantage("reinforce_pp")
def _reinforce_pp(rewards: Tensor, group_ids: Tensor, **kw: Any) -> Tensor:
    return reinforce_pp_advantages(rewards, **kw)  # batch whitening, no grouping


@register_advantage("reinforce_pp_baseline")
def _reinforce_pp_baseline(rewards: Tensor, group_ids: Tensor, **kw: Any) -> Tensor:
    return reinforce_pp_advantages(rewards, group_ids=group_ids, **kw)


# ----------------------------------------------------------------------------------------------
# time recursions (loop over T, vectorised over B)


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
    whiten: bool = False,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over valid positions only.

    rewards[B, T], values[B, T], mask[B, T] -> (advantages[B, T], returns[B, T]).
    Masked positions (e.g. observation tokens between turns) are skipped: they add no TD error and the
    bootstrap value jumps to the next valid position. V after the last valid position is 0.
    returns = advantages + values; both are 0 at masked positions. whiten=True whitens the advantages
    over valid positions (verl always does; off by default so the output is the plain estimate).
    """
    # source: Schulman et al. arXiv 1506.02438; masking as verl compute_gae_advantage_return
    rewards, values = _float(rewards), _float(values)
    if rewards.dim() != 2 or values.shape != rewards.shape:
        raise ValueError(
            f"rewards/values: expected equal shapes [B, T], got {tuple(rewards.shape)} and {tuple(values.shape)}"
        )
    m = _as_mask(mask, rewards)
    B, T = rewards.shape
    next_value = rewards.new_zeros(B)
    last = rewards.new_zeros(B)
    adv = torch.zeros_like(rewards)
    for t in reversed(range(T)):
        valid = m[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_value = torch.where(valid, values[:, t], next_value)
        last = torch.where(valid, delta + gamma * lam * last, last)
        adv[:, t] = last
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    returns = torch.where(m, adv + values, zero)
    adv = masked_whiten(adv, m, eps) if whiten else torch.where(m, adv, zero)
    return adv, returns


def discounted_returns(rewards: Tensor, mask: Tensor | None, gamma: float) -> Tensor:
    """G_k = r_k + gamma * G_{next valid k'}; rewards[B, K], mask[B, K] -> returns[B, K].

    Masked steps add no reward and no discount (they are skipped); their return is 0.
    """
    # source: Sutton & Barto 2nd ed. eq. 3.8 (discounted return); skipping masked steps mirrors `gae` above
    rewards = _float(rewards)
    if rewards.dim() != 2:
        raise ValueError(f"rewards: expected shape [B, K], got {tuple(rewards.shape)}")
    m = _as_mask(mask, rewards)
    running = rewards.new_zeros(rewards.shape[0])
    out = torch.zeros_like(rewards)
    for k in reversed(range(rewards.shape[1])):
        running = torch.where(m[:, k], rewards[:, k] + gamma * running, running)
        out[:, k] = torch.where(m[:, k], running, torch.zeros_like(running))
    return out


# ----------------------------------------------------------------------------------------------
# GiGPO (group-in-group) for multi-turn agents


def hash_anchors(observations: Sequence[Any]) -> Tensor:
    """Map observations to int ids, equal observations -> equal id (first-seen order).

    Lists/tuples/dicts/sets are compared by value (recursively frozen); other items must be hashable.
    Returns LongTensor[N].
    """

    def freeze(x: Any) -> Hashable:
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, tuple(freeze(v) for v in x))
        if isinstance(x, dict):
            return ("dict", tuple(sorted((repr(k), freeze(v)) for k, v in x.items())))
        if isinstance(x, (set, frozenset)):
            return ("set", frozenset(freeze(v) for v in x))
        return x

    table: dict[Hashable, int] = {}
    ids = []
    for i, obs in enumerate(observations):
        key = freeze(obs)
        try:
            ids.append(table.setdefault(key, len(table)))
        except TypeError:
            raise ValueError(
                f"hash_anchors: observation {i} of type {type(obs).__name__} is not hashable; "
                "pass str/bytes/tuples (e.g. the observation text)"
            ) from None
    return torch.tensor(ids, dtype=torch.long)


def gigpo_advantages(
    episode_rewards: Tensor,
    episode_group_ids: Tensor,
    step_returns: Tensor,
    step_episode_index: Tensor,
    step_anchor_ids: Tensor,
    omega: float = 1.0,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    episode_stats: str = "episode",
) -> Tensor:
    """GiGPO step advantages.

    episode_rewards[E], episode_group_ids[E] (episodes of the same task), step_returns[N] (discounted
    return from each step, e.g. `discounted_returns` flattened), step_episode_index[N] (row in
    0..E-1 of each step's episode), step_anchor_ids[N] (equal id = identical observation, see
    `hash_anchors`) -> step_adv[N]:
        A = A_episode[episode of step] + omega * A_step,
    A_episode = group_advantages(episode_rewards, episode_group_ids), A_step = group_advantages of
    step_returns within step groups keyed by (episode group, anchor id); steps whose anchor state was
    visited only once get A_step = 0.
    episode_stats: where the episode part's group mean/std come from. "episode" (the paper's eq. 3): each episode
    of a group counts once. "step" (verl-agent's default, `compute_mean_std_cross_steps=True`): every step row
    carries its episode's reward R and the statistics run over the rows, so an episode of k steps weighs k times;
    A_episode of a row = (R - row-weighted group mean) / (row std + eps). scale_by_std=False is verl-agent's
    `mode: mean_norm` (mean-centred only; its default), True its `mean_std_norm`. One difference stays: a group
    with a single row (or a single episode) gets 0 here, its raw reward in verl-agent.
    """
    # source: GiGPO arXiv 2505.10978 (episode + step relative advantages); verl-agent (langfengQ/verl-agent)
    # gigpo/core_gigpo.py episode_norm_reward / step_norm_reward, read in the fork zhengxuyu/verl-agent at 3d91c9b
    if episode_stats not in ("episode", "step"):
        raise ValueError(f"episode_stats: expected 'episode' or 'step', got {episode_stats!r}")
    _check_1d("episode_group_ids", episode_group_ids, episode_rewards.shape[0])
    n = step_returns.shape[0]
    _check_1d("step_returns", step_returns)
    _check_1d("step_episode_index", step_episode_index, n)
    _check_1d("step_anchor_ids", step_anchor_ids, n)
    device = step_returns.device
    ep_idx = step_episode_index.to(device).long()
    if n and (ep_idx.min() < 0 or ep_idx.max() >= episode_rewards.shape[0]):
        raise ValueError(
            f"step_episode_index: expected values in [0, {episode_rewards.shape[0]}), "
            f"got range [{int(ep_idx.min())}, {int(ep_idx.max())}]"
        )
    ep_rewards, ep_groups = episode_rewards.to(device), episode_group_ids.to(device)
    if episode_stats == "episode":
        ep_part = group_advantages(ep_rewards, ep_groups, scale_by_std, eps=eps)[ep_idx]
    else:  # one row per step: the episode reward repeated on each of its steps
        ep_part = group_advantages(ep_rewards[ep_idx], ep_groups[ep_idx], scale_by_std, eps=eps)
    key = torch.stack([ep_groups.long()[ep_idx], step_anchor_ids.to(device).long()], dim=1)
    _, step_group = torch.unique(key, dim=0, return_inverse=True)
    step_adv = group_advantages(step_returns, step_group, scale_by_std, eps=eps)
    return ep_part + omega * step_adv
