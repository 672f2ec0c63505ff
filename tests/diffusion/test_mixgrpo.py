"""MixGRPO pieces: the progressive SDE window (against MixGRPO's own update rule), the compressed post-window
schedule (by hand), DPM-Solver++(2M) (against diffusers' DPMSolverMultistepScheduler and the analytic ODE of Gaussian
data), and the mixed ODE/SDE rollout of `sample_groups` (window, solver, compression, recomputed log-probs)."""

import math

import pytest
import torch

from mmrl.diffusion.mixgrpo import compressed_sigmas, post_window_points, progressive_window, window_positions
from mmrl.diffusion.sde import dpm_solver_2m_step, ode_step
from mmrl.testing import assert_close_across_paths


class MixGRPOStates:
    """MixGRPO's GRPOTrainingStates, strategy "progressive" with prog_overlap and roll_back (every published script),
    transcribed from Tencent-Hunyuan/MixGRPO@e5cdd6a fastvideo/utils/grpo_states.py as the reference."""

    def __init__(self, iters_per_group, group_size, max_timesteps, prog_overlap_step):
        self.iters, self.size, self.max, self.step = iters_per_group, group_size, max_timesteps, prog_overlap_step
        self.cur = self.it = 0

    def get_current_timesteps(self):
        return list(range(self.cur, min(self.cur + self.size, self.max)))

    def update_iteration(self):
        self.it += 1
        if self.it >= self.iters:
            self.it = 0
            self.cur += self.step
        if self.cur > self.max:
            self.cur, self.it = 0, 0


@pytest.mark.parametrize("iters,move_by", [(25, 1), (20, 1), (20, 0), (3, 2)])
def test_progressive_window_is_mixgrpos_schedule(iters, move_by):
    """25 sampling steps, window 4, max_timesteps = 25 - 2 (train_grpo_flux.py): the same window at every RL step of
    the first cycle (and forever when the cycle has no empty position); MixGRPO's window is empty for `iters` steps
    when it reaches max_timesteps with move_by 1 (ours rolls back there, so later cycles run `iters` steps ahead)."""
    ref = MixGRPOStates(iters, 4, 23, move_by)
    cycle = window_positions(0, 23, move_by) * iters
    empty = 0
    for step in range(1, 3 * cycle + 1):
        want = ref.get_current_timesteps()
        ref.update_iteration()
        start, end = progressive_window(step, 4, iters, move_by, 0, 23)
        if step <= cycle or move_by != 1:
            assert list(range(start, end)) == want, step
        empty += not want
        assert end > start  # ours is never empty
    assert empty == (2 * iters if move_by == 1 else 0)  # MixGRPO: one empty position per completed cycle


def test_progressive_window_by_hand():
    # MixGRPO: steps 1-25 -> [0, 4), 26-50 -> [1, 5), ...; the published 300 steps end at [11, 15)
    assert progressive_window(1, 4, 25, 1, 0, 23) == (0, 4) and progressive_window(25, 4, 25, 1, 0, 23) == (0, 4)
    assert progressive_window(26, 4, 25, 1, 0, 23) == (1, 5) and progressive_window(300, 4, 25, 1, 0, 23) == (11, 15)
    # near the end the window shrinks, then rolls back: positions 0..22 (23 of them)
    assert window_positions(0, 23, 1) == 23
    assert progressive_window(21 * 25 + 1, 4, 25, 1, 0, 23) == (21, 23)
    assert progressive_window(22 * 25 + 1, 4, 25, 1, 0, 23) == (22, 23)
    assert progressive_window(23 * 25 + 1, 4, 25, 1, 0, 23) == (0, 4)
    # MixGRPO-Flash*: prog_overlap_step 0, the window never moves
    assert {progressive_window(k, 4, 20, 0, 0, 23) for k in range(1, 500)} == {(0, 4)}
    # move by 3 inside [2, 8): starts 2, 5 then back to 2
    assert [progressive_window(k, 2, 1, 3, 2, 8)[0] for k in range(1, 6)] == [2, 5, 2, 5, 2]
    with pytest.raises(ValueError, match="move_every"):
        progressive_window(1, 4, 0, 1, 0, 23)
    with pytest.raises(ValueError, match="empty"):
        progressive_window(1, 4, 25, 1, 5, 5)


def test_compressed_schedule_by_hand():
    # shift 3: sigma = 3u / (1 + 2u); start sigma 0.75 <=> u = 0.5; 3 points u = 0.5, 0.25, 0 -> 0.75, 0.5, 0
    assert compressed_sigmas(0.75, 3, 3.0).tolist() == pytest.approx([0.75, 0.5, 0.0], abs=1e-7)
    # MixGRPO-Flash at the first window [0, 4) of 25 steps: 25 - 3 = 22 points left, x 0.4 -> 8 (Flash*: x 0.2 -> 4)
    assert post_window_points(22, 0.4) == 8 and post_window_points(22, 0.2) == 4
    assert post_window_points(3, 0.4) == 2  # MixGRPO's int(1.2) = 1 would stop before sigma = 0
    # equal to MixGRPO's construction on its own schedule: linspace(1, 0, 26) shifted, tail from index last + 1 = 4
    t = torch.linspace(1, 0, 26, dtype=torch.float64)
    sched = 3 * t / (1 + 2 * t)
    post_t = torch.linspace(float(t[4]), 0, 8, dtype=torch.float64)
    theirs = 3 * post_t / (1 + 2 * post_t)
    assert compressed_sigmas(float(sched[4]), 8, 3.0).tolist() == pytest.approx(theirs.tolist(), abs=1e-7)
    with pytest.raises(ValueError, match="ratio"):
        post_window_points(10, 0.0)


# ------------------------------------------------------------------------------------------ DPM-Solver++(2M)

MU, C = 0.7, 0.3  # data ~ N(MU, C^2) per dimension: the flow's velocity field and ODE solution are closed-form


def gaussian_velocity(x, sigma):
    """E[noise - x0 | x_sigma] for x_sigma = (1 - sigma) x0 + sigma noise, x0 ~ N(MU, C^2), noise ~ N(0, 1)."""
    var = (1 - sigma) ** 2 * C ** 2 + sigma ** 2
    x0 = MU + (1 - sigma) * C ** 2 / var * (x - (1 - sigma) * MU)
    return (x - x0) / sigma


def exact_solution(x1, sigma):
    """The probability-flow ODE from sigma = 1 maps x1 to (1 - sigma) MU + sqrt(V(sigma)) x1 (V(1) = 1)."""
    return (1 - sigma) * MU + math.sqrt((1 - sigma) ** 2 * C ** 2 + sigma ** 2) * x1


def _solve(x, sigmas, solver):
    prev_x0 = prev_s = None
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        v = gaussian_velocity(x, s)
        if solver == "euler":
            x = ode_step(x, v, s, s_next)
        else:
            x_new, x0 = dpm_solver_2m_step(x, v, s, s_next, prev_x0, prev_s)
            x, prev_x0, prev_s = x_new, x0, s
    return x


def test_dpm_solver_equals_diffusers_scheduler():
    """Step by step against diffusers' DPMSolverMultistepScheduler (dpmsolver++, order 2, midpoint, flow sigmas,
    final sigma 0): the same update from the same velocities (different code, float tolerance)."""
    from diffusers import DPMSolverMultistepScheduler

    sched = DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0,
                                        algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint",
                                        final_sigmas_type="zero", lower_order_final=True)
    sched.set_timesteps(8)
    sig = sched.sigmas.double().tolist()
    x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    ours, prev_x0, prev_s = x.clone(), None, None
    for i, t in enumerate(sched.timesteps):
        v_ref = gaussian_velocity(x, sig[i]).float()
        x = sched.step(v_ref, t, x).prev_sample
        v = gaussian_velocity(ours, sig[i]).float()
        ours, x0 = dpm_solver_2m_step(ours, v, sig[i], sig[i + 1], prev_x0, prev_s)
        prev_x0, prev_s = x0, sig[i]
        assert_close_across_paths(ours, x, rtol=1e-5, atol=1e-5)
    assert sig[-1] == 0.0


def test_dpm_solver_is_second_order_and_first_steps_are_euler():
    x1 = torch.linspace(-2.0, 2.0, 9, dtype=torch.float64)
    exact = exact_solution(x1, 0.0)

    def err(n, solver):
        t = torch.linspace(1, 0, n + 1, dtype=torch.float64)
        sig = (3 * t / (1 + 2 * t)).tolist()
        return (_solve(x1.clone(), sig, solver) - exact).abs().max().item()

    # measured: Euler 0.150, 0.079, 0.041; DPM-Solver++(2M) 0.108, 0.019, 0.0042 (16, 32, 64 steps, shift 3)
    e_euler = [err(n, "euler") for n in (16, 32, 64)]
    e_dpm = [err(n, "dpm2") for n in (16, 32, 64)]
    assert all(d < e for d, e in zip(e_dpm, e_euler)) and e_dpm[1] < e_euler[2]  # better than Euler with 2x steps
    assert e_dpm[1] / e_dpm[2] > 3.5 and 1.6 < e_euler[1] / e_euler[2] < 2.4  # ~4x per halving (order 2) vs ~2x
    # no history, or into sigma = 0: exactly the Euler step; sigma_prev = 1 drops the correction too
    x, v = torch.randn(2, 3), torch.randn(2, 3)
    assert torch.allclose(dpm_solver_2m_step(x, v, 0.6, 0.4)[0], x + (0.4 - 0.6) * v, atol=1e-6)
    assert torch.allclose(dpm_solver_2m_step(x, v, 0.6, 0.0, torch.zeros(2, 3), 0.8)[0], x - 0.6 * v, atol=1e-6)
    assert torch.allclose(dpm_solver_2m_step(x, v, 0.6, 0.4, torch.ones(2, 3), 1.0)[0], x - 0.2 * v, atol=1e-6)
    with pytest.raises(ValueError, match="sigma_next"):
        dpm_solver_2m_step(x, v, 0.4, 0.6)


# ------------------------------------------------------------------------------------------ mixed rollouts


def test_mixed_rollout_window_solver_and_compression(tiny_sd3):
    from mmrl.diffusion.sampling import sample_groups, step_log_prob

    emb = tiny_sd3.encode_prompts(["a red circle", "a blue square"])
    kw = dict(num_steps=10, height=32, width=32, guidance_scale=1.0, noise_level=0.7)

    def roll(**extra):
        return sample_groups(tiny_sd3, emb, 2, generator=torch.Generator().manual_seed(3), **kw, **extra)

    euler = roll(window=(2, 5))
    assert euler.train_steps.tolist() == [2, 3, 4] and euler.sde_mask.nonzero().flatten().tolist() == [2, 3, 4]
    assert (euler.log_probs[:, [0, 1, 5, 9]] == 0).all() and (euler.log_probs[:, 2:5] != 0).all()
    dpm = roll(window=(2, 5), ode_solver="dpm2")
    # before and inside the window: the same steps and noise; after it: DPM-Solver++(2M) moves elsewhere
    assert torch.equal(dpm.latents[:, :6], euler.latents[:, :6]) and torch.equal(dpm.log_probs, euler.log_probs)
    assert not torch.allclose(dpm.latents[:, 7], euler.latents[:, 7])
    # MixGRPO-Flash: 10 - 4 = 6 points left x 0.4 -> 2 points: one step from the window's end to sigma = 0
    flash = roll(window=(2, 5), ode_solver="dpm2", ode_compress=0.4)
    assert flash.latents.shape[1] == 7 and flash.sigmas.tolist()[:6] == euler.sigmas.tolist()[:6]
    assert flash.sigmas[-1] == 0 and len(flash.log_probs[0]) == 6 and torch.equal(flash.latents[:, :6], dpm.latents[:, :6])
    # the trainer recomputes the window's log-probs through step_log_prob: identical (drift 0)
    for j in flash.train_steps.tolist():
        out = step_log_prob(tiny_sd3, flash.latents[:, j], flash.latents[:, j + 1], flash.sigmas[j].expand(4),
                            flash.sigmas[j + 1].expand(4), emb.select(flash.prompt_index), guidance_scale=1.0,
                            noise_level=0.7)
        assert torch.equal(out.log_prob, flash.log_probs[:, j])
    # a fixed window without noise, compression without a window: errors
    with pytest.raises(ValueError, match="window"):
        sample_groups(tiny_sd3, emb, 2, **{**kw, "noise_level": 0.0}, window=(2, 5))
    with pytest.raises(ValueError, match="ode_compress"):
        sample_groups(tiny_sd3, emb, 2, **{**kw, "noise_level": 0.0}, ode_compress=0.5)
    with pytest.raises(ValueError, match="ode_solver"):
        roll(ode_solver="heun")


def test_dpm_rollout_without_window_converges_to_the_euler_limit(tiny_sd3):
    """All-ODE rollouts (noise_level 0, DGPO's sampler) on the real (tiny) transformer: with more steps the
    DPM-Solver++(2M) rollout converges to the same ODE solution as a fine Euler rollout. (On a learned tiny model
    it is not more accurate than Euler at few steps; see docs/dpo-nft.md.)"""
    from mmrl.diffusion.sampling import sample_groups

    emb = tiny_sd3.encode_prompts(["a red circle on a blue background"])

    def final(n, solver):
        return sample_groups(tiny_sd3, emb, 2, num_steps=n, height=32, width=32, guidance_scale=1.0, noise_level=0.0,
                             generator=torch.Generator().manual_seed(0), ode_solver=solver, decode=False).latents[:, -1]

    ref = final(256, "euler")
    coarse, fine = (final(8, "dpm2") - ref).abs().mean(), (final(64, "dpm2") - ref).abs().mean()
    assert fine < coarse / 3, (coarse, fine)
