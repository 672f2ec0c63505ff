"""Group rollouts for flow-matching policies: G images per prompt with the whole trajectory recorded.

`sample_groups` runs the sampler and returns a `Trajectory`: the latent at every noise level, the
log-prob of every stochastic transition, the schedule, which steps were stochastic and which to train
on, and the decoded images. `step_log_prob` recomputes one transition's log-prob with the current
weights through exactly the same code path (velocity -> `sde_step_with_logprob`), which is what makes
the trainer's log-probs agree with the rollout's (`diag/logprob_drift`).

SDE window (Flow-GRPO-Fast): with `window_size > 0` only `window_size` consecutive steps, starting at a
position drawn uniformly from `window_range` (or fixed when the range has one start), are stochastic;
every other step is a deterministic Euler (ODE) step, and only the window's steps are trained on.
Without a window every step is stochastic and the first `int(num_steps * timestep_fraction)` steps are
trained on (Flow-GRPO: 0.99 of 10 steps = the first 9, i.e. all but the last). With `sde_type="cps"` the step
into sigma = 0 is never trained on (its noise std is 0: no density, and the KL would divide by 0); it is sampled
as the other steps are (deterministically, as CPS gives it), so a window of one step there trains nothing.

MixGRPO (`mmrl.diffusion.mixgrpo`): `window=(start, end)` fixes the window (its progressive schedule is computed by
the recipe from the RL step); `ode_solver="dpm2"` integrates the deterministic steps after the last SDE step (all
steps when none is stochastic) with DPM-Solver++(2M) instead of Euler (steps before the window stay Euler, as
MixGRPO's sampler); `ode_compress < 1` replaces the schedule after the window by one with that fraction of its
points (MixGRPO-Flash), so the trajectory has fewer steps than `num_steps` (`Trajectory.sigmas` holds the schedule
that was used).

Randomness comes from one `torch.Generator` (or the global RNG) and is drawn up front in a fixed
order (initial noise, window position, per-step noise), so the result does not depend on the
rollout micro-batch size.

Gradient through classifier-free guidance (`cfg_grad`, training only): with CFG the velocity is
v = v_u + w (v_c - v_u), both branches from one doubled-batch forward. "cond_only" detaches v_u, so the
update is w * dv_c only: flow_grpo's training today (scripts/train_sd3.py `compute_log_prob`,
`noise_pred_uncond = noise_pred_uncond.detach()` since commit 2d76907 of 2025-07-15, still at ac4c86e) and
the Flow-GRPO recipe's default (`rollout.cfg_grad`). "both" lets the gradient flow through v_c and v_u,
w dv_c + (1 - w) dv_u, as flow_grpo's code before that commit did; it is these functions' default because it
is exactly `model.velocity` (what the no-grad rollout calls). The forward value, hence every log-prob and
`diag/logprob_drift`, is the same in both modes; the backward still runs over the doubled batch (no memory or
time saved). Without CFG (guidance_scale <= 1, FLUX's guidance embedding) the two modes are the same.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from mmrl.diffusion.models import FlowModel, PromptEmbeds
from mmrl.diffusion.sde import StepOutput, dpm_solver_2m_step, ode_step, sde_step_with_logprob

Tensor = torch.Tensor


@dataclass
class Trajectory:
    """A batch of B = P * G rollouts (P prompts, G per prompt, samples of a prompt are adjacent).

    latents [B, T+1, C, h, w] fp32 (video families: [B, T+1, C, F, h, w]): x at sigmas[0..T] (latents[:, 0] =
    initial noise, [:, T] = final);
    log_probs [B, T]: rollout log-prob of each transition (0 on ODE steps);
    sigmas [T+1]: the schedule (sigmas[T] = 0); sde_mask [T] bool: stochastic steps;
    train_steps [K] long: step indices the trainer uses; prompt_index [B] long: row in `embeds`
    (also the group id); embeds: one row per prompt; images [B, 3, H, W] in [0, 1] (videos: [B, F, 3, H, W]; None
    when not decoded); means [B, T, C, (F,) h, w] fp32: the Gaussian mean of every stochastic transition (0 on ODE
    steps), recorded with `record_means=True` (GRPO-Guard's ratio needs the sampling policy's means), else None;
    audio [B, C, S]: the waveforms of an audio-video family at `model.audio_sample_rate`, decoded with
    `decode_audio=True` (an audio reward), else None.
    """

    latents: Tensor
    log_probs: Tensor
    sigmas: Tensor
    sde_mask: Tensor
    train_steps: Tensor
    prompt_index: Tensor
    embeds: PromptEmbeds
    images: Tensor | None = None
    means: Tensor | None = None
    audio: Tensor | None = None

    def __len__(self) -> int:
        return int(self.latents.shape[0])


def sde_window(num_steps: int, window_size: int, window_range: tuple[int, int] | None,
               generator: torch.Generator | None = None) -> tuple[int, int]:
    """[start, end) of the SDE window; start uniform in [lo, hi - window_size] (window_range = (lo, hi))."""
    lo, hi = window_range if window_range is not None else (0, num_steps)
    hi = min(hi, num_steps)
    if window_size <= 0 or window_size > hi - lo:
        raise ValueError(f"sde window: window_size={window_size} does not fit window_range=({lo}, {hi}) "
                         f"with num_steps={num_steps}")
    start = lo + int(torch.randint(0, hi - window_size - lo + 1, (1,), generator=generator).item())
    return start, start + window_size


CFG_GRAD_MODES = ("both", "cond_only")
ODE_SOLVERS = ("euler", "dpm2")


def _autocast(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast at `dtype` on `device`, or a no-op context when dtype is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def guided_velocity(model: FlowModel, latents: Tensor, sigma: Tensor | float, embeds: PromptEmbeds, *,
                    guidance_scale: float, cfg: bool | None = None, cfg_grad: str = "both") -> Tensor:
    """`model.velocity` with a choice of which CFG branches carry the gradient (see the module docstring).

    cfg_grad="both": exactly `model.velocity(...)`. "cond_only" with CFG on: the same doubled-batch forward
    ([empty prompt; prompt] rows, one transformer call, identical values) with the unconditional half detached.
    """
    if cfg_grad not in CFG_GRAD_MODES:
        raise ValueError(f"cfg_grad: expected one of {list(CFG_GRAD_MODES)}, got {cfg_grad!r}")
    if cfg is None:
        cfg = model.cfg_enabled(guidance_scale)
    if cfg_grad == "both" or not cfg:
        return model.velocity(latents, sigma, embeds, guidance_scale=guidance_scale, cfg=cfg)
    b = latents.shape[0]
    s = torch.as_tensor(sigma, dtype=torch.float32, device=model.device).expand(b)
    both = PromptEmbeds.cat([model.negative_rows(embeds), embeds])  # an edit model's negative keeps its source image
    v = model.velocity(torch.cat([latents, latents]), torch.cat([s, s]), both, guidance_scale=guidance_scale, cfg=False)
    v_uncond, v_cond = v.chunk(2)
    return model.combine_cfg(v_uncond.detach(), v_cond, guidance_scale, sigma=s)


def step_log_prob(model: FlowModel, latents: Tensor, next_latents: Tensor | None, sigma: Tensor, sigma_next: Tensor,
                  embeds: PromptEmbeds, *, guidance_scale: float, noise_level: float, sde_type: str = "sde",
                  noise: Tensor | None = None, cfg: bool | None = None, cfg_grad: str = "both") -> StepOutput:
    """One stochastic transition under the current weights: velocity -> `sde_step_with_logprob`.

    latents/next_latents [b, ...]; sigma/sigma_next scalars or [b]; embeds with b rows. With
    next_latents=None a new sample is drawn from `noise`. Used by both the rollout and the trainer.
    cfg_grad ("both" | "cond_only"): which CFG branches the gradient flows through; values are identical.
    """
    v = guided_velocity(model, latents, sigma, embeds, guidance_scale=guidance_scale, cfg=cfg, cfg_grad=cfg_grad)
    out = sde_step_with_logprob(latents, v, sigma, sigma_next, noise_level=noise_level,
                                prev_sample=next_latents, noise=noise, sde_type=sde_type)
    out.velocity = v  # (the velocity-norm diagnostic of the trainer)
    return out


@torch.no_grad()
def sample_groups(
    model: FlowModel,
    embeds: PromptEmbeds,
    group_size: int,
    *,
    num_steps: int,
    height: int,
    width: int,
    guidance_scale: float = 1.0,
    noise_level: float = 0.7,
    sde_type: str = "sde",
    window_size: int = 0,
    window_range: tuple[int, int] | None = None,
    timestep_fraction: float = 1.0,
    same_noise: bool = False,
    batch_size: int | None = None,
    generator: torch.Generator | None = None,
    decode: bool = True,
    window_generator: torch.Generator | None = None,
    on_images: Callable[[int, int, torch.Tensor], None] | None = None,
    autocast_dtype: torch.dtype | None = None,
    window: tuple[int, int] | None = None,
    ode_solver: str = "euler",
    ode_compress: float = 1.0,
    initial_noise: torch.Tensor | None = None,
    record_means: bool = False,
    decode_audio: bool = False,
) -> Trajectory:
    """Roll out `group_size` samples for each of the P prompts in `embeds` (encoded once, reused).

    noise_level = 0 gives deterministic ODE sampling (all steps Euler, no train steps) - used for eval.
    same_noise: all samples of a prompt start from the same initial noise (they differ by SDE noise); with an SDE
    window after the first step, the deterministic steps before it are computed once per prompt (the group
    branches at the window, as Flow-GRPO-Fast samples).
    batch_size: rollout micro-batch (default all B at once); does not change the result.
    window_generator: draws the SDE window position instead of `generator` (data-parallel training passes
    one seeded identically on every rank, so all ranks train on the same steps while their noise differs).
    on_images(lo, hi, images): called with each micro-batch's decoded images as soon as they exist (rows lo:hi), so
    a reward can score them while the next micro-batch is sampled; the result does not change.
    autocast_dtype: run the transformer forwards under `torch.autocast` at this dtype (a lower-precision rollout
    engine, e.g. bfloat16); the SDE math, the log-probs and the VAE decode stay in float32 / the model's dtype.
    window: [start, end) of the SDE window, given instead of drawn (MixGRPO's progressive schedule; needs
    noise_level > 0); window_size/window_range are then not used.
    ode_solver: `euler` or `dpm2` (DPM-Solver++(2M)) for the deterministic steps after the last SDE step.
    ode_compress: < 1 keeps that fraction of the schedule's points after the window (`mixgrpo.compressed_sigmas`).
    initial_noise: [P * G, ...] initial latents used instead of drawing them (e.g. different prompts rendered from
    the same noise); the generator then draws only the window and the step noise.
    record_means: also keep every stochastic step's Gaussian mean (`Trajectory.means`; memory as `latents`).
    decode_audio: also decode the sound of an audio-video family (`Trajectory.audio`, `model.decode_audio`).
    """
    if decode_audio and not model.has_audio:
        raise ValueError(f"decode_audio: the {model.family} family makes no sound (audio-video families: LTX-2)")
    if ode_solver not in ODE_SOLVERS:
        raise ValueError(f"ode_solver: expected one of {list(ODE_SOLVERS)}, got {ode_solver!r}")
    p = len(embeds)
    b = p * group_size
    device = model.device
    sigmas = model.sigmas(num_steps, height, width)
    prompt_index = torch.arange(p).repeat_interleave(group_size)

    # --- all randomness up front, in a fixed order
    if initial_noise is not None:
        want = (b, *model.initial_noise(1, height, width, torch.Generator(device=device)).shape[1:])
        if tuple(initial_noise.shape) != want:
            raise ValueError(f"initial_noise: expected shape {want}, got {tuple(initial_noise.shape)}")
        x0 = initial_noise.to(device, torch.float32)
    elif same_noise:
        x0 = model.initial_noise(p, height, width, generator)[prompt_index.to(device)]
    else:
        x0 = model.initial_noise(b, height, width, generator)
    sde_mask = torch.zeros(num_steps, dtype=torch.bool)
    if window is not None and not (noise_level > 0 and 0 <= window[0] < window[1] <= num_steps):
        raise ValueError(f"sde window {window} does not fit num_steps={num_steps} (noise_level={noise_level})")
    if noise_level > 0:
        if window_size > 0 or window is not None:
            start, end = window if window is not None else sde_window(
                num_steps, window_size, window_range, window_generator if window_generator is not None else generator)
            sde_mask[start:end] = True
            train_steps = torch.arange(start, end)
        else:
            sde_mask[:] = True
            k = int(num_steps * timestep_fraction)
            if k < 1:
                raise ValueError(f"timestep_fraction={timestep_fraction} trains on no step of {num_steps}")
            train_steps = torch.arange(k)
    else:
        train_steps = torch.zeros(0, dtype=torch.long)
    if sde_type == "cps" and len(train_steps):
        # CPS into sigma_next = 0 has std sigma_next sin(noise_level pi / 2) = 0: the step is deterministic (the
        # Euler step), its log-prob is no density and the KL's 1 / (2 std^2) explodes (a 1e-3 velocity difference
        # gave KL ~5e7); it is still sampled, but not trained on
        train_steps = train_steps[sigmas[train_steps + 1].cpu() > 0]
    sde_steps = sde_mask.nonzero().flatten().tolist()
    step_noise = torch.randn((b, len(sde_steps), *x0.shape[1:]), generator=generator, device=device) if sde_steps else None
    last_sde = sde_steps[-1] if sde_steps else -1  # steps after it are the "post-window" ODE
    if ode_compress < 1.0:  # MixGRPO-Flash: fewer points from the window's end to sigma = 0
        from mmrl.diffusion.mixgrpo import compressed_sigmas, post_window_points

        if not sde_steps:
            raise ValueError("ode_compress < 1 compresses the ODE steps after an SDE window; this rollout has none")
        tail = compressed_sigmas(float(sigmas[last_sde + 1]), post_window_points(num_steps - last_sde, ode_compress),
                                 model.sigma_shift)
        sigmas = torch.cat([sigmas[:last_sde + 1], tail])
        num_steps = len(sigmas) - 1
        sde_mask = torch.cat([sde_mask[:last_sde + 1], torch.zeros(num_steps - last_sde - 1, dtype=torch.bool)])

    latents = torch.empty((b, num_steps + 1, *x0.shape[1:]), dtype=torch.float32, device=device)
    log_probs = torch.zeros((b, num_steps), dtype=torch.float32, device=device)
    means = torch.zeros((b, num_steps, *x0.shape[1:]), dtype=torch.float32, device=device) if record_means else None
    latents[:, 0] = x0
    mb = batch_size or b
    first = sde_steps[0] if sde_steps else 0
    if same_noise and initial_noise is None and group_size > 1 and first > 0:
        # Flow-GRPO-Fast's branching: a group shares its noise, so the deterministic steps before the window are one
        # trajectory per prompt, computed once and copied to the group (G times fewer transformer rows there)
        shared = torch.empty((p, first + 1, *x0.shape[1:]), dtype=torch.float32, device=device)
        shared[:, 0] = x0[::group_size]
        for lo in range(0, p, mb):
            rows = slice(lo, min(p, lo + mb))
            emb, x = embeds.select(torch.arange(p)[rows]), shared[rows, 0]
            with _autocast(device, autocast_dtype):
                for i in range(first):
                    v = guided_velocity(model, x, sigmas[i].item(), emb, guidance_scale=guidance_scale)
                    x = ode_step(x, v, sigmas[i].item(), sigmas[i + 1].item())
                    shared[rows, i + 1] = x
        latents[:, :first + 1] = shared[prompt_index.to(device)]
    else:
        first = 0
    chunks, sounds = [], []
    for lo in range(0, b, mb):
        rows = slice(lo, min(b, lo + mb))
        emb = embeds.select(prompt_index[rows])
        x = latents[rows, first]
        prev_x0, prev_s = None, None  # the previous step's data prediction (DPM-Solver++(2M)'s history)
        with _autocast(device, autocast_dtype):  # no-op when None
            for i in range(first, num_steps):
                s, s_next = sigmas[i].item(), sigmas[i + 1].item()
                # the velocity of `step_log_prob` (guided_velocity, cfg_grad both = model.velocity): same values
                v = guided_velocity(model, x, s, emb, guidance_scale=guidance_scale)
                x_in = x
                if sde_mask[i]:
                    out = sde_step_with_logprob(x, v, s, s_next, noise_level=noise_level, sde_type=sde_type,
                                                noise=step_noise[rows, sde_steps.index(i)])
                    x, log_probs[rows, i] = out.prev_sample, out.log_prob
                    if means is not None:
                        means[rows, i] = out.mean
                elif ode_solver == "dpm2" and i > last_sde:
                    x, _ = dpm_solver_2m_step(x, v, s, s_next, prev_x0, prev_s)
                else:
                    x = ode_step(x, v, s, s_next)
                if ode_solver == "dpm2":
                    prev_x0, prev_s = x_in.float() - s * v.float(), s
                latents[rows, i + 1] = x
        if decode:  # this micro-batch's images now (the same chunks as decoding at the end would use)
            chunks.append(model.decode(latents[rows, -1], height, width))
            if on_images is not None:
                on_images(rows.start, rows.stop, chunks[-1])
        if decode_audio:
            sounds.append(model.decode_audio(latents[rows, -1], height, width))
    images = torch.cat(chunks) if decode else None
    return Trajectory(latents=latents, log_probs=log_probs, sigmas=sigmas, sde_mask=sde_mask,
                      train_steps=train_steps, prompt_index=prompt_index, embeds=embeds, images=images, means=means,
                      audio=torch.cat(sounds) if decode_audio else None)
