"""Group rollouts: recorded trajectories, SDE window, same noise, micro-batch invariance, recompute."""

import pytest
import torch

from mmrl.diffusion.sampling import sample_groups, sde_window, step_log_prob
from mmrl.diffusion.sde import ode_step
from mmrl.testing import assert_close_across_paths

PROMPTS = ["a red circle on a blue background", "a green square on a white background"]


def _roll(model, **kw):
    emb = model.encode_prompts(PROMPTS)
    args = dict(num_steps=4, height=64, width=64, guidance_scale=1.0, noise_level=0.7,
                generator=torch.Generator().manual_seed(0), decode=False)
    args.update(kw)
    return sample_groups(model, emb, 3, **args)


def test_trajectory_layout_and_timestep_fraction(tiny_sd3):
    traj = _roll(tiny_sd3, timestep_fraction=0.99)
    assert traj.latents.shape == (6, 5, 4, 16, 16)
    assert traj.log_probs.shape == (6, 4) and torch.isfinite(traj.log_probs).all()
    assert traj.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert traj.sde_mask.all() and traj.train_steps.tolist() == [0, 1, 2]  # int(4 * 0.99) = 3
    assert traj.sigmas[0] == 1.0 and traj.sigmas[-1] == 0.0 and traj.images is None


def test_recomputed_log_probs_equal_rollout(tiny_sd3):
    traj = _roll(tiny_sd3, guidance_scale=2.0)
    b = len(traj)
    for j in range(4):
        with torch.no_grad():
            out = step_log_prob(tiny_sd3, traj.latents[:, j], traj.latents[:, j + 1], traj.sigmas[j].expand(b),
                                traj.sigmas[j + 1].expand(b), traj.embeds.select(traj.prompt_index),
                                guidance_scale=2.0, noise_level=0.7)
        assert (out.log_prob - traj.log_probs[:, j]).abs().max() < 1e-5


def test_sde_window_ode_elsewhere(tiny_sd3):
    traj = _roll(tiny_sd3, num_steps=6, window_size=2, window_range=(1, 5))
    start = int(traj.sde_mask.nonzero()[0])
    assert traj.sde_mask.tolist() == [start <= i < start + 2 for i in range(6)] and 1 <= start <= 3
    assert traj.train_steps.tolist() == [start, start + 1]
    assert torch.equal(traj.log_probs[:, ~traj.sde_mask], torch.zeros(6, 4))
    # a step outside the window is exactly the Euler step of the recorded latent
    j = 0 if start > 0 else 5
    with torch.no_grad():
        v = tiny_sd3.velocity(traj.latents[:, j], traj.sigmas[j].item(), traj.embeds.select(traj.prompt_index))
    assert torch.equal(traj.latents[:, j + 1], ode_step(traj.latents[:, j], v, traj.sigmas[j].item(),
                                                        traj.sigmas[j + 1].item()))


def test_window_positions_cover_the_range():
    g = torch.Generator().manual_seed(0)
    starts = {sde_window(10, 3, (0, 5), g)[0] for _ in range(200)}
    assert starts == {0, 1, 2}
    assert sde_window(10, 3, (4, 7), g) == (4, 7)  # fixed position
    with pytest.raises(ValueError, match="does not fit"):
        sde_window(10, 4, (0, 3))


def test_same_noise_and_micro_batch_invariance(tiny_sd3):
    same = _roll(tiny_sd3, same_noise=True)
    assert torch.equal(same.latents[0, 0], same.latents[2, 0]) and not torch.equal(same.latents[0, 0], same.latents[3, 0])
    assert not torch.equal(same.latents[0, -1], same.latents[1, -1])  # SDE noise still differs
    full = _roll(tiny_sd3)
    chunked = _roll(tiny_sd3, batch_size=2)
    assert torch.allclose(full.latents, chunked.latents, atol=1e-5)
    assert torch.allclose(full.log_probs, chunked.log_probs, atol=1e-5)
    assert not torch.equal(full.latents[0, 0], full.latents[1, 0])


def test_same_noise_window_shares_the_ode_prefix_of_a_group(tiny_sd3, monkeypatch):
    """Flow-GRPO-Fast's branching: with one noise per prompt and the SDE window at steps 2-3, steps 0-1 run once
    per prompt (2 rows, not 6) and the trajectory equals the one computed row by row from the same noise."""
    rows = []
    velocity = tiny_sd3.transformer_velocity
    monkeypatch.setattr(tiny_sd3, "transformer_velocity", lambda x, *a, **kw: rows.append(len(x)) or velocity(x, *a, **kw))
    shared = _roll(tiny_sd3, same_noise=True, window=(2, 4))
    assert rows == [2, 2, 6, 6]  # two prefix steps on one row per prompt, then the window on the whole group
    g = torch.Generator().manual_seed(0)
    x0 = tiny_sd3.initial_noise(2, 64, 64, g).repeat_interleave(3, 0)  # what same_noise draws, then the step noise
    rows.clear()
    each = _roll(tiny_sd3, initial_noise=x0, generator=g, window=(2, 4))
    assert rows == [6, 6, 6, 6]
    assert torch.equal(shared.latents[0, 2], shared.latents[2, 2]) and not torch.equal(shared.latents[0, 3],
                                                                                       shared.latents[1, 3])
    assert_close_across_paths(shared.latents, each.latents, atol=1e-5)
    assert_close_across_paths(shared.log_probs, each.log_probs, atol=1e-5)
    assert shared.train_steps.tolist() == [2, 3] and (shared.log_probs[:, :2] == 0).all()


def test_cps_rollout(tiny_sd3):
    traj = _roll(tiny_sd3, sde_type="cps")
    assert torch.isfinite(traj.log_probs).all()
    assert traj.log_probs[:, -1].abs().max() == 0  # last step: sigma_next = 0 -> no noise under CPS


# ---------------------------------------------------------------------------------------- gradient through CFG


def _lora_sd3(path):
    """A fresh tiny SD3 with a LoRA whose A and B are both non-zero (so every LoRA tensor gets a gradient)."""
    from peft import LoraConfig

    from mmrl.adapters import PolicyStates
    from mmrl.diffusion.models import load_flow_model

    model = load_flow_model(path)
    states = PolicyStates(model.transformer, LoraConfig(r=4, lora_alpha=8, target_modules=model.lora_target_modules))
    model.transformer = states.model
    params = states.trainable_parameters()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model, params


def _hand_cfg_log_prob(model, x, x_next, s, s_next, emb, w, uncond_grad):
    """The CFG step log-prob built by hand from two separate forwards: v = v_u + w (v_c - v_u), with the
    unconditional (empty prompt) branch under no_grad unless `uncond_grad`."""
    from mmrl.diffusion.sde import sde_step_with_logprob

    with torch.enable_grad() if uncond_grad else torch.no_grad():
        v_u = model.velocity(x, s, model.negative_embeds(len(x)), guidance_scale=1.0)
    v_c = model.velocity(x, s, emb, guidance_scale=1.0)
    return sde_step_with_logprob(x, v_u + w * (v_c - v_u), s, s_next, noise_level=0.7, prev_sample=x_next).log_prob


def _cfg_transition(path, w):
    """(model, LoRA params, (x, x_next, sigma, sigma_next, embeds) of the second of 3 steps of a CFG-w rollout of 6
    images, advantages [6], that step's rollout log-probs)."""
    model, params = _lora_sd3(path)
    traj = _roll(model, guidance_scale=w, num_steps=3)
    b, j = len(traj), 1
    step = (traj.latents[:, j], traj.latents[:, j + 1], traj.sigmas[j].expand(b), traj.sigmas[j + 1].expand(b),
            traj.embeds.select(traj.prompt_index))
    return model, params, step, torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75, -0.25]), traj.log_probs[:, j]


def test_cfg_grad_modes_match_hand_built_gradients(tiny_sd3_path):
    """At CFG 4.5, cfg_grad="both" (flow_grpo before 2d76907: gradient through both branches) and "cond_only"
    (flow_grpo today: unconditional branch detached) give the same log-probs as the rollout, and LoRA gradients
    equal to the hand-built two-forward computations with / without the unconditional gradient; they differ."""
    w = 4.5
    model, params, (x, x_next, s, s_next, emb), adv, rollout_logp = _cfg_transition(tiny_sd3_path, w)

    def grads(log_prob):
        return torch.cat([g.flatten() for g in torch.autograd.grad((adv * log_prob).sum(), params)])

    lp, g = {}, {}
    for mode in ("both", "cond_only"):
        lp[mode] = step_log_prob(model, x, x_next, s, s_next, emb, guidance_scale=w, noise_level=0.7,
                                 cfg_grad=mode).log_prob
        g[mode] = grads(lp[mode])
    assert torch.equal(lp["both"], lp["cond_only"])  # only the gradient path differs
    assert (lp["both"].detach() - rollout_logp).abs().max() < 1e-5  # = the rollout's (no drift)
    for mode, uncond_grad in (("both", True), ("cond_only", False)):
        ref = grads(_hand_cfg_log_prob(model, x, x_next, s, s_next, emb, w, uncond_grad))
        assert (g[mode] - ref).norm() / ref.norm() < 1e-4, mode
    rel = ((g["both"] - g["cond_only"]).norm() / g["both"].norm()).item()
    assert rel > 0.1, rel


def test_cfg_grad_branch_gradients_by_hand(tiny_sd3_path):
    """The gradient that reaches the doubled-batch transformer output [v_u rows; v_c rows], by hand: with
    v = v_u + w (v_c - v_u) and g = dL/dv (L = sum_i adv_i log p_i), "cond_only" (flow_grpo since 2d76907: v_u
    detached) gives exactly 0 on the unconditional rows and w g on the conditional ones; "both" gives (1 - w) g and
    w g. g comes from `sde_step_with_logprob` on a leaf velocity, independently of the CFG code."""
    from mmrl.diffusion.sde import sde_step_with_logprob

    w = 4.5
    model, _, (x, x_next, s, s_next, emb), adv, _ = _cfg_transition(tiny_sd3_path, w)
    b = len(x)
    seen = []

    def keep_output(module, args, out):  # the transformer's raw output, kept with its gradient
        out[0].retain_grad()
        seen.append(out[0])

    hook = model.transformer.register_forward_hook(keep_output)
    try:
        grads = {}
        for mode in ("both", "cond_only"):
            seen.clear()
            out = step_log_prob(model, x, x_next, s, s_next, emb, guidance_scale=w, noise_level=0.7, cfg_grad=mode)
            (adv * out.log_prob).sum().backward()
            (raw,) = seen  # one forward on the doubled batch
            assert raw.shape[0] == 2 * b
            grads[mode] = raw.grad.detach().clone()
            model.transformer.zero_grad(set_to_none=True)
    finally:
        hook.remove()
    with torch.no_grad():
        v = model.velocity(x, s, emb, guidance_scale=w)
    v_leaf = v.clone().requires_grad_(True)
    lp = sde_step_with_logprob(x, v_leaf, s, s_next, noise_level=0.7, prev_sample=x_next).log_prob
    (g,) = torch.autograd.grad((adv * lp).sum(), v_leaf)
    assert g.abs().max() > 0
    cond = grads["cond_only"]
    assert torch.equal(cond[:b], torch.zeros_like(cond[:b]))  # the detached branch: no gradient at all
    assert_close_across_paths(cond[b:], w * g, rtol=1e-4, atol=1e-6 * float(g.abs().max()))
    both = grads["both"]
    assert_close_across_paths(both[:b], (1 - w) * g, rtol=1e-4, atol=1e-6 * float(g.abs().max()))
    assert_close_across_paths(both[b:], w * g, rtol=1e-4, atol=1e-6 * float(g.abs().max()))


def test_cfg_grad_without_cfg_and_bad_value(tiny_sd3_path):
    model, params = _lora_sd3(tiny_sd3_path)
    emb = model.encode_prompts(PROMPTS)
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    x_next = x * 0.9
    out = {}
    for mode in ("both", "cond_only"):  # guidance 1: no CFG, the modes are the same computation
        lp = step_log_prob(model, x, x_next, 0.8, 0.6, emb, guidance_scale=1.0, noise_level=0.7, cfg_grad=mode)
        out[mode] = torch.autograd.grad(lp.log_prob.sum(), params)
    assert all(torch.equal(a, c) for a, c in zip(out["both"], out["cond_only"]))
    with pytest.raises(ValueError, match=r"cfg_grad: expected one of \['both', 'cond_only'\], got 'uncond'"):
        step_log_prob(model, x, x_next, 0.8, 0.6, emb, guidance_scale=4.5, noise_level=0.7, cfg_grad="uncond")
