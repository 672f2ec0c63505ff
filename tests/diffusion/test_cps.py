"""CPS (`rollout.sde_type: cps`) and its step into sigma = 0: sampled, never trained on (issue 27)."""

from pathlib import Path

import torch

from mmrl.config import load_config
from mmrl.core.kl import gaussian_kl_equal_std
from mmrl.diffusion.sampling import sample_groups
from mmrl.diffusion.sde import ode_step, sde_step_with_logprob
from mmrl.testing import metrics_rows

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["a red circle on a blue background", "a green square on a white background"]


def _roll(model, **kw):
    args = dict(num_steps=4, height=64, width=64, noise_level=0.7, generator=torch.Generator().manual_seed(0),
                decode=False)
    return sample_groups(model, model.encode_prompts(PROMPTS), 2, **{**args, **kw})


def test_the_step_into_sigma_zero_is_sampled_but_not_trained(tiny_sd3):
    window = dict(window_size=2, window_range=(2, 4))  # always [2, 4): holds the last step
    cps, sde = _roll(tiny_sd3, sde_type="cps", **window), _roll(tiny_sd3, **window)
    assert cps.sigmas[-1] == 0 and cps.sde_mask.tolist() == sde.sde_mask.tolist() == [False, False, True, True]
    assert sde.train_steps.tolist() == [2, 3] and cps.train_steps.tolist() == [2]  # step 3 (into sigma 0) left out
    # CPS into sigma 0 has std 0: the sampled step is the Euler step, its log-prob 0
    assert cps.log_probs[:, 3].abs().max() == 0
    emb = cps.embeds.select(cps.prompt_index)
    with torch.no_grad():
        v = tiny_sd3.velocity(cps.latents[:, 3], cps.sigmas[3].item(), emb)
    assert torch.allclose(cps.latents[:, 4], ode_step(cps.latents[:, 3], v, cps.sigmas[3].item(), 0.0), atol=1e-6)
    # without a window: all stochastic, the last step never trained under CPS
    full = _roll(tiny_sd3, sde_type="cps", timestep_fraction=1.0)
    assert full.sde_mask.all() and full.train_steps.tolist() == [0, 1, 2]
    assert _roll(tiny_sd3, timestep_fraction=1.0).train_steps.tolist() == [0, 1, 2, 3]  # sde: unchanged


def test_why_the_kl_of_that_step_exploded():
    """The trainer's KL divides by 2 std^2 with std clamped to 1e-8: at sigma_next = 0 (CPS std 0) a 1e-3 velocity
    difference gives (0.25 * 1e-3)^2 / (2e-16) ~ 3e8; one step earlier the same difference gives ~1e-7."""
    g = torch.Generator().manual_seed(0)
    x, v, eps = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))

    def kl(sigma, sigma_next):
        ref = sde_step_with_logprob(x, v, sigma, sigma_next, noise_level=0.7, noise=eps, sde_type="cps")
        cur = sde_step_with_logprob(x, v + 1e-3, sigma, sigma_next, noise_level=0.7, sde_type="cps",
                                    prev_sample=ref.prev_sample)
        return gaussian_kl_equal_std(cur.mean, ref.mean, cur.std.flatten(1)[:, 0].clamp(min=1e-8))  # as trained

    assert (kl(0.25, 0.0) > 1e8).all()
    assert (kl(0.5, 0.25) < 1e-5).all()


def test_a_cps_window_on_the_last_step_trains_with_a_small_kl(tmp_path, tiny_sd3_path):
    """Flow-GRPO, CPS, a window that always holds the last step ([1, 3) of 3 steps), KL 0.04, two updates: the
    second update's policy differs from the reference. With that step trained (before the fix) this run logged
    kl/ref 4.4e5 and policy/grad_norm 2.6e6; it now trains step 1 only: kl/ref 0.016, grad_norm 0.084."""
    from mmrl.diffusion.flow_grpo import train

    out = tmp_path / "cps"
    train(load_config({
        "algorithm": "flow_grpo", "output_dir": str(out), "seed": 3,
        "model": {"path": str(tiny_sd3_path), "lora": {"rank": 4, "alpha": 8}},
        "data": {"train_prompts": str(REPO / "assets" / "prompts" / "shapes_train.txt")},
        "rollout": {"prompts_per_step": 2, "height": 64, "width": 64, "num_steps": 3, "group_size": 3,
                    "guidance_scale": 1.0, "sde_type": "cps", "window_size": 2, "window_range": [1, 3]},
        "train": {"max_steps": 1, "save_every": 0}, "optim": {"lr": 1e-3},
        "update": {"micro_batch_size": 4, "mini_batch_size": 3},  # 2 updates
        "algo": {"kl": {"coef": 0.04}, "ema": False},
        "reward": {"components": {"jpeg_compressibility": 1.0}}, "log": {"sample_every": 0}}))
    row = metrics_rows(out)[0]
    assert row["rollout/window_start"] == 1 and row["train/updates"] == 2 and row["diag/logprob_drift"] < 1e-4
    assert 0 < row["kl/ref"] < 1 and row["policy/grad_norm"] < 10, (row["kl/ref"], row["policy/grad_norm"])
