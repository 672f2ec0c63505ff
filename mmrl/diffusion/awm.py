"""Advantage Weighted Matching (AWM): online RL for flow-matching models with the pretraining loss
(Xue et al. 2025, arXiv 2509.25050).

Like DiffusionNFT, no SDE and no per-step likelihoods: the policy is trained on its own clean samples with the
flow-matching loss, each sample weighted by its advantage. One step reads top to bottom:
  1. rollout    - G images per prompt, deterministic ODE, from the policy state `algo.rollout_state`
                  ("default": on-policy, the published setting; "old": the EMA policy, Flow-Factory's off_policy);
  2. rewards    - zoo rewards; per-prompt advantages (`core.prompt_stats`, batch std by default as published),
                  clipped to +-`algo.adv_clip_max`, rescaled to +-`algo.advantage_max`;
  3. points     - K = `algo.num_train_timesteps` noise levels per sample, one from each of K strata of the
                  rollout schedule's first int(num_steps * `algo.timestep_fraction`) steps, fresh noise eps:
                  x_t = (1 - t) x0 + t eps, drawn once per step and kept for every epoch;
  4. loss       - log p = -w(||v - (eps - x0)||^2, t) (`algo.weighting`), r = exp(log p - log p_rollout),
                  max(-A r, -A clip(r, 1 - c, 1 + c)) (`core.awm`), + `algo.old_kl_coef` ||v - v_old||^2
                  (the EMA anchor) + `algo.kl.coef` ||v - v_ref||^2 (reference = adapters off);
  5. step       - AdamW per `update.mini_batch_size` samples, then old <- decay * old + (1 - decay) * new
                  (`algo.ema_schedule`; published: awm_linear = min(0.001 n, 0.3)).

log p_rollout: rollout_state "old" -> the "old" state's forward at the same point (it is fixed during a step);
"default" with one update per step -> the current log p, detached (r = 1, the published on-policy case);
"default" with several updates -> a no-grad pass before the first update (`diag/logprob_drift` = max
|log p - log p_rollout| over the first update, ~0: the training and scoring passes agree).

    summary = train(load_config("configs/diffusion/awm_tiny.yaml"))   # mmrl.config.load_config

Several processes (`dist.strategy: ddp | fsdp`): as `nft` (global prompts_per_step, all-gathered rewards, each
rank's loss scaled to the global mean, equal micro-step counts, one all-reduce per update, rank 0 logs/saves).

Simplified away versus scxue/advantage_weighted_matching scripts/train_sd3_awm.py: the rollout solver is Euler
ODE (the published GenEval/OCR runs use an SA-solver SDE, noise 0.4); timestep indices are drawn per sample
(published: one set per micro-batch); no separate long-horizon EMA copy for evaluation (`log.eval_state`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mmrl.config import RunConfig
from mmrl.core.awm import awm_policy_loss, matching_log_prob, stratified_timestep_indices
from mmrl.diffusion import config as dc
from mmrl.diffusion import old_policy
from mmrl.diffusion.common import noise_latents
from mmrl.diffusion.diagnostics import MAX_KEYS, VelocityNormConfig, velocity_reference_terms
from mmrl.diffusion.old_policy import AWM_EMA_SCHEDULES
from mmrl.distributed import DistConfig
from mmrl.run.start import closes_runs
from mmrl.training import KLConfig, UpdateConfig
from mmrl.training.updates import padding_rows, reduce_metrics

__all__ = ["Config", "train", "ema_decay", "EMA_SCHEDULES"]


EMA_SCHEDULES = AWM_EMA_SCHEDULES
EmaSchedule = Literal["copy", "linear", "delayed_linear", "awm_linear"]


def ema_decay(schedule: str, n: int) -> float:
    """EMA decay of the "old" policy after `n` optimizer updates (this recipe's schedules; see old_policy)."""
    return old_policy.ema_decay(schedule, n, EMA_SCHEDULES)


# ------------------------------------------------------------------------------------------ config


@dataclass
class AWMKLConfig(KLConfig):
    coef: float = 1e-4
    """Weight of the velocity-space KL ||v - v_ref||^2 to the reference (adapters off); 0 = no reference pass."""


@dataclass
class AlgoConfig:
    num_train_timesteps: int = 6
    """K: training points (noise levels) per sample and step (published: 6)."""
    timestep_fraction: float = 0.9
    """Noise levels come from the first int(rollout.num_steps * fraction) steps of the rollout schedule."""
    skip_first_step: bool = False
    """Leave out step 0 (sigma = 1, pure noise) of that range (published: true for GenEval/OCR, false PickScore)."""
    weighting: Literal["uniform", "t", "t2", "huber", "ghuber"] = "ghuber"
    """w(ell, t) in log p = -w: uniform ell | t ell | t2 t^2 ell | huber t(sqrt(ell+e)-sqrt(e)) |
    ghuber t/p((ell+e)^p-e^p)."""
    ghuber_power: float = 0.25
    """p of the ghuber weighting."""
    clip_range: float = 1.0
    """PPO clip c of the ratio r = exp(log p - log p_rollout) (published: 1; Flow-Factory suggests 1e-5 off-policy)."""
    adv_clip_max: float = 5.0
    """Advantages are clipped to [-m, m] ..."""
    advantage_max: float = 1.0
    """... then scaled by advantage_max / adv_clip_max (published: 5 and 1, i.e. A / 5)."""
    rollout_state: Literal["default", "old"] = "default"
    """Policy state that samples: `default` (on-policy, published) or `old` (the EMA policy: off-policy)."""
    old_kl_coef: float = 1.0
    """Weight of ||v - v_old||^2, the pull to the EMA "old" policy (published ema_beta: 1; 0 = no "old" pass unless
    it samples)."""
    ema_schedule: EmaSchedule = "awm_linear"
    """Decay schedule of "old": awm_linear (min(0.001 n, 0.3)) | copy | linear (min(0.001 n, 0.5)) | delayed_linear."""
    kl: AWMKLConfig = field(default_factory=AWMKLConfig)
    """`coef`: weight of ||v - v_ref||^2 to the reference (adapters off; published 1e-4 PickScore, 3e-3 GenEval/OCR);
    0 = no reference pass (`estimator`, `in_reward` are not used)."""
    velocity_norm: VelocityNormConfig = field(default_factory=VelocityNormConfig)
    """||v|| / ||v_ref|| at the training points (diag/velocity_norm_ratio, whenever the reference runs) and a hinge
    penalty coef * mean max(0, ratio - 1)^2 (0 = off); `reference_pass` runs the reference for the diagnostic."""

    def __post_init__(self) -> None:
        for key in ("ghuber_power", "adv_clip_max", "advantage_max"):
            if not getattr(self, key) > 0:
                raise ValueError(f"algo.{key}: expected > 0, got {getattr(self, key)}")
        if self.num_train_timesteps < 1:
            raise ValueError(f"algo.num_train_timesteps: expected >= 1, got {self.num_train_timesteps}")
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"algo.timestep_fraction: expected in (0, 1], got {self.timestep_fraction}")
        if self.clip_range < 0 or self.old_kl_coef < 0:
            raise ValueError(f"algo.clip_range and algo.old_kl_coef: expected >= 0, got {self.clip_range}, "
                             f"{self.old_kl_coef}")


@dataclass
class RewardConfig(dc.AdvantageRewardConfig):
    std_mode: Literal["group", "global"] = "global"
    """Advantage scale: `global` (std of the whole batch, the published global_std) or `group` (per prompt)."""
    drop_zero_advantage: bool = False
    """Skip samples whose advantage is exactly 0 (the published code keeps them: the KL terms still apply)."""


@dataclass
class Config(RunConfig):
    algorithm: str = "awm"
    """Recipe name."""
    model: dc.ModelConfig = field(default_factory=dc.ModelConfig)
    """Model and adapters."""
    data: dc.DataConfig = field(default_factory=dc.DataConfig)
    """Prompt files."""
    rollout: dc.CFGFreeRolloutConfig = field(default_factory=dc.CFGFreeRolloutConfig)
    """Rollout sampler (deterministic ODE)."""
    optim: dc.DiffusionOptimConfig = field(default_factory=dc.DiffusionOptimConfig)
    """AdamW and its learning-rate schedule (published: 3e-4, weight decay 1e-4)."""
    update: UpdateConfig = field(default_factory=UpdateConfig)
    """Inner epochs, mini-batches (published: one update per step), micro-batches, clipping."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """AWM loss, training points, KL terms and the "old" policy schedule."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rewards and advantages."""
    log: dc.EvalStateLogConfig = field(default_factory=dc.EvalStateLogConfig)
    """Samples, evaluation."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Several processes under torchrun / accelerate launch (strategy none|ddp|fsdp, backend, ...)."""


def _step_range(cfg: Config) -> tuple[int, int]:
    """[lo, hi) of the rollout schedule's step indices the noise levels come from (ValueError if empty)."""
    algo = cfg.algo
    lo, hi = int(algo.skip_first_step), int(cfg.rollout.num_steps * algo.timestep_fraction)
    if hi <= lo:
        raise ValueError(f"algo.timestep_fraction={algo.timestep_fraction} (skip_first_step={algo.skip_first_step}) "
                         f"leaves no step of rollout.num_steps={cfg.rollout.num_steps} to train on")
    return lo, hi


# ------------------------------------------------------------------------------------------ training


@closes_runs  # the run directory's lock released however train() ends; a failed start leaves nothing
def train(cfg: Config) -> dict:
    from mmrl.diffusion.loop import DiffusionLoop
    from mmrl.diffusion.rollout import ode_sampling
    from mmrl.training import summarise

    dc.check_common(cfg)
    rollout, algo = cfg.rollout, cfg.algo
    lo, hi = _step_range(cfg)
    ema_decay(algo.ema_schedule, 0)
    cfg.update.updates_per_epoch(rollout.batch)  # update.mini_batch_size must divide the batch: fail before loading
    loop = DiffusionLoop(cfg)
    # "default" trains, "old" = the EMA anchor (and sampler if rollout_state: old), "ref" = adapters off
    loop.setup(old=True, ref=algo.kl.coef > 0 or algo.velocity_norm.needs_reference(), eval_state=cfg.log.eval_state,
               counters=True)
    loop.begin(postfix=lambda m: {"loss": f"{m.get('policy/loss', 0):.3g}"})
    for step in loop:
        # ---- 1. rollout (this rank's share of the prompts), deterministic ODE; rewards
        roll = loop.rollout(step, ode_sampling(rollout), state=algo.rollout_state)
        # ---- 2. per-prompt advantages over all ranks, clipped, rescaled
        adv, keep = loop.advantages(roll, clip=algo.adv_clip_max)
        adv = adv * (algo.advantage_max / algo.adv_clip_max)
        # ---- 3. training points; 4./5. AWM loss, updates; EMA of "old" (same on every rank)
        with loop.timer("train"):
            x0 = roll.traj.latents[:, -1]
            t_index = stratified_timestep_indices(len(roll.traj), algo.num_train_timesteps, lo, hi)
            noise = torch.randn((len(roll.traj), algo.num_train_timesteps, *x0.shape[1:]), device=x0.device)
            points = (roll.traj.sigmas[t_index], noise)
            loop.metrics.update(_train_on_rollout(loop.parts, step, roll.traj, points, adv, keep))
            loop.metrics.update(loop.guard.pop_metrics())
        loop.update_old(ema_decay(algo.ema_schedule, loop.counters.updates))
    return loop.finish(lambda run: summarise(run, "awm"))


def _train_on_rollout(parts: Any, step: int, traj: Any, points: tuple, adv: torch.Tensor, keep: torch.Tensor) -> dict:
    """Inner epochs over one rollout batch: the AWM loss (+ velocity KLs) at the K fixed points of each sample,
    through the shared update iterator (`TrainingParts.updates`).

    points = (sigmas [b, K], noise [b, K, C, h, w])."""
    cfg, ctx, model, states = parts.cfg, parts.ctx, parts.model, parts.states
    update, rollout, algo = cfg.update, cfg.rollout, cfg.algo
    acc: dict[str, list[float]] = defaultdict(list)
    if ctx.max_int(len(keep)) == 0:
        return {"train/updates": 0}
    sigmas, noise = points
    x0_all, k = traj.latents[:, -1], sigmas.shape[1]
    pad_rows = padding_rows(keep)

    def point(rows, j):  # (x_t, sigma, target velocity, prompt embeddings) of training point j of `rows`
        x0, eps, sig = x0_all[rows], noise[rows, j], sigmas[rows, j].to(x0_all.device)
        return noise_latents(x0, sig, eps), sig, eps - x0, traj.embeds.select(traj.prompt_index[rows])

    def log_prob(v, target, sig):
        return matching_log_prob(v, target, sig, algo.weighting, algo.ghuber_power)

    def velocity(xt, sig, emb):
        return model.velocity(xt, sig, emb, guidance_scale=rollout.guidance_scale)

    # log p of the sampling policy where it is neither "old" (in-loop pass) nor the first update (detached current)
    pre_pass = algo.rollout_state == "default" and update.epochs * update.updates_per_epoch(rollout.batch) > 1
    old_lp = torch.zeros(len(traj), k, dtype=torch.float64)
    if pre_pass:
        micro = list(torch.split(keep, update.micro_batch_size))
        with torch.no_grad(), states.use("default"), parts.timer("old_log_prob"):
            for mi in range(ctx.max_int(len(micro))):  # FSDP: every rank runs the same forwards (padding rows)
                rows = micro[mi] if mi < len(micro) else pad_rows
                for j in range(k):
                    xt, sig, target, emb = point(rows, j)
                    lp = log_prob(velocity(xt, sig, emb), target, sig)
                    if mi < len(micro):
                        old_lp[rows, j] = lp.cpu()
    old_pass = algo.rollout_state == "old" or algo.old_kl_coef > 0
    updates = parts.updates(keep, metrics=acc, step=step, pad_rows=pad_rows)
    for mb in updates:
        rows = mb.rows
        weight = mb.weight(k)  # mean over samples and points
        for j in range(k):
            xt, sig, target, emb = point(rows, j)
            with mb.no_sync(last_point=j == k - 1), parts.timer("forward_backward"):
                v_old = None
                if old_pass:
                    with torch.no_grad(), states.use("old"):
                        v_old = velocity(xt, sig, emb)
                v = velocity(xt, sig, emb)
                lp = log_prob(v, target, sig)
                if algo.rollout_state == "old":
                    lp_roll = log_prob(v_old, target, sig)
                elif pre_pass:
                    lp_roll = old_lp[rows, j].to(lp.device)
                else:  # on-policy, the only update of the step: r = 1, gradient -A d log p
                    lp_roll = lp.detach()
                pg, m = awm_policy_loss(lp, lp_roll, adv[rows].to(lp.device), algo.clip_range)
                loss = pg
                if v_old is not None and algo.old_kl_coef > 0:
                    kl_old = (v - v_old).pow(2).mean(dim=tuple(range(1, v.dim()))).mean()
                    loss = loss + algo.old_kl_coef * kl_old
                    if mb.real:
                        acc["kl/old"].append(kl_old.item())
                if algo.kl.coef > 0 or algo.velocity_norm.needs_reference():  # KL + velocity-norm terms
                    with torch.no_grad(), states.use("ref"):
                        v_ref = velocity(xt, sig, emb)
                    term, ref_metrics = velocity_reference_terms(v, v_ref, algo.kl.coef, algo.velocity_norm.coef)
                    loss = loss + term
                    if mb.real:
                        for key, val in ref_metrics.items():
                            acc[key].append(val)
                (loss * weight).backward()
            if mb.real:
                acc["policy/loss"].append(loss.item())
                acc["policy/pg_loss"].append(pg.item())
                acc["policy/log_prob"].append(lp.mean().item())
                acc["policy/matching_loss"].append((v.detach() - target).pow(2).mean().item())
                for key in ("policy/clipfrac", "policy/approx_kl", "policy/ratio_max"):
                    acc[key].append(m[key])
                if pre_pass and mb.first_update:  # same weights as the pre-pass: must agree
                    acc["diag/logprob_drift"].append((lp.detach() - lp_roll).abs().max().item())
    out = reduce_metrics(ctx, acc, ("policy/ratio_max", "diag/logprob_drift", *MAX_KEYS))  # every rank's values
    out["train/updates"] = updates.applied
    return out
