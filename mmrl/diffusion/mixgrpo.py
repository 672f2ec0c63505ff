"""MixGRPO's schedules (Li et al. 2025, arXiv 2507.21802): where the SDE window sits at each RL step, and the
compressed ODE schedule after it (MixGRPO-Flash). Pure functions of integers and floats; the sampler that uses them is
`sampling.sample_groups` (`window=`, `ode_solver=`, `ode_compress=`) and the recipe options live in `flow_grpo`
(`rollout.window_schedule: progressive`, `rollout.window_move_every`, `rollout.window_move_by`,
`rollout.ode_solver`, `rollout.ode_compress`).

MixGRPO samples with a mixed ODE/SDE trajectory: only the steps of a sliding window are stochastic (and trained
on); the window starts at the first (noisiest) step and moves `move_by` steps towards the data end every
`move_every` RL steps, returning to the start when it has passed the end. Outside the window the sampler is
deterministic; MixGRPO-Flash integrates the steps after the window with a second-order DPM-Solver++ on a schedule
with a fraction `ratio` of the points, so a rollout costs fewer transformer evaluations.

Source: Tencent-Hunyuan/MixGRPO at commit e5cdd6a (2025-08-08): fastvideo/utils/grpo_states.py
(GRPOTrainingStates, sample_strategy "progressive" with prog_overlap and roll_back, as every published script sets),
fastvideo/utils/sampling_utils.py (run_sample_step, dpm_apply_strategy "post"), scripts/finetune/
finetune_flux_grpo_MixGRPO*.sh (25 steps, group_size 4, iters_per_group 25 / 20, prog_overlap_step 1, or 0 for
MixGRPO-Flash*, dpm_post_compress_ratio 0.4 / 0.2, dpm_solver_order 2, midpoint, max_timesteps = steps - 2).

Two edge cases differ on purpose (both outside the published 300-step runs, whose window never passes step 14):
MixGRPO rolls back only when the window start exceeds `max_timesteps`, so at start == max_timesteps its window is
empty for `move_every` steps (no training); here the start rolls back as soon as the window would be empty. And its
post-window schedule keeps int((points left) * ratio) points, which is 1 when that product is below 2 (the sample
is then never denoised to sigma = 0); here at least 2 points (one step to sigma = 0) are kept.
"""

from __future__ import annotations

import math

import torch

__all__ = ["progressive_window", "window_positions", "compressed_sigmas", "post_window_points"]


def window_positions(lo: int, hi: int, move_by: int) -> int:
    """How many distinct window starts lo, lo + move_by, ... lie below hi (1 when the window never moves)."""
    if hi <= lo:
        raise ValueError(f"SDE window range [{lo}, {hi}) is empty")
    return 1 if move_by == 0 else math.ceil((hi - lo) / move_by)


def progressive_window(step: int, size: int, move_every: int, move_by: int, lo: int, hi: int) -> tuple[int, int]:
    """[start, end) of the SDE window at RL step `step` (1-based): start = lo + move_by * (number of completed
    `move_every`-step periods, modulo the number of positions), end = min(start + size, hi).

    MixGRPO (move_every 25, move_by 1, size 4, lo 0, hi 23 for 25 steps): steps 1-25 -> [0, 4), 26-50 -> [1, 5), ...
    A pure function of the step, so a resumed run continues the schedule exactly (nothing to checkpoint)."""
    if step < 1 or size < 1 or move_every < 1 or move_by < 0:
        raise ValueError(f"progressive_window: expected step >= 1, size >= 1, move_every >= 1, move_by >= 0; got "
                         f"step={step}, size={size}, move_every={move_every}, move_by={move_by}")
    start = lo + move_by * (((step - 1) // move_every) % window_positions(lo, hi, move_by))
    return start, min(start + size, hi)


def post_window_points(points_left: int, ratio: float) -> int:
    """Points of the compressed schedule after the window (its first point is the window's end, its last 0):
    int(points_left * ratio), at least 2. points_left = the original schedule's points after the window's last
    step (num_steps - last window index), as MixGRPO's num_post_steps."""
    if not 0 < ratio <= 1:
        raise ValueError(f"ODE compression ratio: expected in (0, 1], got {ratio}")
    return max(int(points_left * ratio), 2)


def compressed_sigmas(sigma_start: float, num_points: int, shift: float) -> torch.Tensor:
    """num_points noise levels from sigma_start down to 0, evenly spaced in the unshifted time u and mapped through
    the time shift sigma = shift u / (1 + (shift - 1) u) (the first point is sigma_start itself).

    MixGRPO-Flash: linspace(u_start, 0, n) shifted, u_start = the unshifted time of the window's end; the inverse
    of the shift gives u_start = sigma / (shift - (shift - 1) sigma) for any family's schedule."""
    if num_points < 2 or not 0 < sigma_start <= 1 or shift <= 0:
        raise ValueError(f"compressed_sigmas: expected num_points >= 2, 0 < sigma_start <= 1, shift > 0; got "
                         f"{num_points}, {sigma_start}, {shift}")
    u_start = sigma_start / (shift - (shift - 1.0) * sigma_start)
    u = torch.linspace(u_start, 0.0, num_points, dtype=torch.float64)
    sig = shift * u / (1.0 + (shift - 1.0) * u)
    sig[0] = sigma_start
    return sig.float()
