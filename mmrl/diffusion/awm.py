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
from mmrl.core.prompt_stats import PerPromptStatTracker
from mmrl.diffusion import config as dc
from mmrl.diffusion import old_policy
from mmrl.diffusion.diagnostics import MAX_KEYS, VelocityNormConfig, velocity_reference_terms
from mmrl.diffusion.old_policy import AWM_EMA_SCHEDULES
from mmrl.diffusion.common import noise_latents
from mmrl.distributed import DistConfig, DistContext
from mmrl.runtime import Timer, seed_everything
from mmrl.training import SKIPPED_KEY, KLConfig, UpdateConfig, UpdateGuard, clip_grads, merge_rank_lists
from mmrl.training.run import closes_runs

__all__ = ["Config", "train", "ema_decay", "EMA_SCHEDULES", "RENAMED_KEYS"]

RENAMED_KEYS = dict(dc.RENAMED_KEYS)  # the diffusion recipes' pre-issue-12 names (sample.* -> rollout.*, ...)

EMA_SCHEDULES = AWM_EMA_SCHEDULES
EmaSchedule = Literal["copy", "linear", "delayed_linear", "awm_linear"]


def ema_decay(schedule: str, n: int) -> float:
    """EMA decay of the "old" policy after `n` optimizer updates (this recipe's schedules; see old_policy)."""
    return old_policy.ema_decay(schedule, n, EMA_SCHEDULES)


# ------------------------------------------------------------------------------------------ config


@dataclass
class RolloutConfig(dc.RolloutConfig):
    guidance_scale: float = 1.0
    """CFG in rollout and training (the published AWM runs are CFG-free: 1.0)."""
    eval_guidance_scale: float = 1.0
    """Guidance for evaluation."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_size < 2:
            raise ValueError(f"rollout.group_size must be >= 2 for per-prompt advantages, got {self.group_size}")


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
class LogConfig(dc.LogConfig):
    eval_state: Literal["default", "old"] = "default"
    """Policy state evaluated: `default` (the trained weights) or `old` (the EMA policy)."""


@dataclass
class Config(RunConfig):
    algorithm: str = "awm"
    """Recipe name."""
    model: dc.ModelConfig = field(default_factory=dc.ModelConfig)
    """Model and adapters."""
    data: dc.DataConfig = field(default_factory=dc.DataConfig)
    """Prompt files."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout sampler (deterministic ODE)."""
    optim: dc.DiffusionOptimConfig = field(default_factory=dc.DiffusionOptimConfig)
    """AdamW and its learning-rate schedule (published: 3e-4, weight decay 1e-4)."""
    update: UpdateConfig = field(default_factory=UpdateConfig)
    """Inner epochs, mini-batches (published: one update per step), micro-batches, clipping."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """AWM loss, training points, KL terms and the "old" policy schedule."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rewards and advantages."""
    log: LogConfig = field(default_factory=LogConfig)
    """Samples, evaluation."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Several processes under torchrun / accelerate launch (strategy none|ddp|fsdp, backend, ...)."""


def _step_range(cfg: Config) -> tuple[int, int]:
    """[lo, hi) of the rollout schedule's step indices the noise levels come from (ValueError if empty)."""
    a = cfg.algo
    lo, hi = int(a.skip_first_step), int(cfg.rollout.num_steps * a.timestep_fraction)
    if hi <= lo:
        raise ValueError(f"algo.timestep_fraction={a.timestep_fraction} (skip_first_step={a.skip_first_step}) "
                         f"leaves no step of rollout.num_steps={cfg.rollout.num_steps} to train on")
    return lo, hi


# ------------------------------------------------------------------------------------------ training


@closes_runs  # the run directory's lock released however train() ends; a failed start leaves nothing
def train(cfg: Config) -> dict:
    from mmrl.diffusion.common import (NoSamples, end_step, evaluator, grid_due, grid_prompts, load_recipe_model,
                                       sample_grid, setup_training)
    from mmrl.diffusion.conditioning import check_data, encode_items
    from mmrl.diffusion.sampling import sample_groups
    from mmrl.diffusion.diagnostics import sample_statistics
    from mmrl.diffusion.scoring import global_advantages, load_reward_fn, reward_weights, score_rollout_components
    from mmrl.pipelines.data import PromptSampler, load_prompts
    from mmrl.training import FullOptimizerState, restore_checkpoint, start_run, summarise
    from mmrl.training.judges import build_judges, stop_for_hacking

    dc.check_common(cfg)
    s, a = cfg.rollout, cfg.algo
    lo, hi = _step_range(cfg)
    ema_decay(a.ema_schedule, 0)
    cfg.update.updates_per_epoch(s.batch)  # update.mini_batch_size must divide the batch: fail before loading
    ctx, run = start_run(cfg, {"rollout.prompts_per_step": s.prompts_per_step})
    train_items = load_prompts(cfg.data.train_prompts)
    eval_items = load_prompts(cfg.data.eval_prompts)[: cfg.log.eval_max_prompts] if cfg.data.eval_prompts else []
    check_data(cfg.model.path, train_prompts=train_items, eval_prompts=eval_items)  # edit models need source images
    reward_fn = load_reward_fn(cfg.reward.components, run.device, cfg.rollout.num_frames)
    model = load_recipe_model(cfg, run.device, run.dtype)
    # "default" trains, "old" = the EMA anchor (and sampler if rollout_state: old), "ref" = adapters off
    states, evals, params, optimizer, lr_sched, guard, fsdp = setup_training(
        ctx, run, cfg, model, old=True, ref=a.kl.coef > 0 or a.velocity_norm.needs_reference())
    tracker = PerPromptStatTracker(cfg.reward.std_mode, cfg.reward.history)
    sampler = PromptSampler(train_items, seed=cfg.seed)
    counters = old_policy.UpdateCounter()
    stateful = {"optimizer": FullOptimizerState(optimizer) if fsdp else optimizer, "lr_scheduler": lr_sched,
                "tracker": tracker, "data": sampler, "counters": counters, "transformer_evals": evals}
    judges = build_judges(cfg.log, run.device, stateful, len(eval_items))  # held-out judges + the hacking alarm
    start, _ = restore_checkpoint(ctx, run, states, stateful)
    evaluate = evaluator(model, states, cfg.log.eval_state, reward_fn, eval_items, cfg, judges)
    if judges is not None and start == 0 and (ctx.is_main or fsdp):  # the judges' baseline: before any update
        evaluate(run if ctx.is_main else NoSamples(), 0)

    timer = Timer(sync_cuda=run.device.type == "cuda")
    grid = grid_prompts(cfg, eval_items, train_items)  # every sample grid: these prompts, the same noise
    if start == 0 and grid_due(cfg, 0) and (ctx.is_main or fsdp):  # FSDP: every rank runs the forwards
        sample_grid(model, states, cfg.log.eval_state, reward_fn, grid, run if ctx.is_main else NoSamples(), 0, cfg)
    bar = run.progress(cfg.train.max_steps, initial=start)
    for step in range(start + 1, cfg.train.max_steps + 1):
        metrics: dict[str, Any] = {}
        if ctx.enabled:  # rank-local noise, a pure function of (seed, rank, step)
            seed_everything(ctx.rank_seed(cfg.seed, step))
        with timer("step"):
            # ---- 1. rollout (this rank's share of the prompts), deterministic ODE
            with timer("rollout"):
                items = ctx.shard(sampler.next(s.prompts_per_step))
                embeds = encode_items(model, items, s.height, s.width)  # + source images (edit models)
                with torch.no_grad(), states.use(a.rollout_state):
                    traj = sample_groups(model, embeds, s.group_size, num_steps=s.num_steps, height=s.height,
                                         width=s.width, guidance_scale=s.guidance_scale, noise_level=0.0,
                                         batch_size=s.micro_batch_size or None)
                prompts = [items[i].prompt for i in traj.prompt_index.tolist()]
                metadata = [items[i].metadata for i in traj.prompt_index.tolist()]

            # ---- 2. rewards; per-prompt advantages over all ranks, clipped, rescaled
            with timer("reward"):
                scores, reward_metrics, comps = score_rollout_components(ctx, reward_fn, traj.images, prompts,
                                                                         metadata, cfg.reward.on_nonfinite)
            metrics.update(reward_metrics)
            metrics.update(sample_statistics(traj.images, traj.latents[:, -1]))  # diag/sample/*
            adv, keep, adv_metrics = global_advantages(ctx, tracker, prompts, scores, a.adv_clip_max,
                                                       cfg.reward.drop_zero_advantage, None, comps,
                                                       reward_weights(reward_fn), cfg.reward.aggregation)
            metrics.update(adv_metrics)
            adv = adv * (a.advantage_max / a.adv_clip_max)

            # ---- 3. training points; 4./5. AWM loss, updates; EMA of "old" (same on every rank)
            with timer("train"):
                x0 = traj.latents[:, -1]
                t_index = stratified_timestep_indices(len(traj), a.num_train_timesteps, lo, hi)
                noise = torch.randn((len(traj), a.num_train_timesteps, *x0.shape[1:]), device=x0.device)
                points = (traj.sigmas[t_index], noise)
                metrics.update(_train_on_rollout(cfg, model, states, traj, points, adv, keep, optimizer, lr_sched,
                                                 params, counters, timer, ctx, guard=guard, step=step))
                metrics.update(guard.pop_metrics())
            decay = ema_decay(a.ema_schedule, counters.updates)
            if metrics["train/updates"] or not metrics[SKIPPED_KEY]:  # all updates skipped (NaN/inf): old unchanged
                states.ema("default", "old", decay)
            metrics["policy/old_decay"] = decay

        metrics["policy/lr"] = optimizer.param_groups[0]["lr"]
        if grid_due(cfg, step) and (ctx.is_main or fsdp):
            sample_grid(model, states, cfg.log.eval_state, reward_fn, grid, run if ctx.is_main else NoSamples(), step,
                        cfg)
        eval_now = eval_items and cfg.log.eval_every and (step % cfg.log.eval_every == 0
                                                          or step in (1, cfg.train.max_steps))
        if (ctx.is_main or fsdp) and eval_now:  # FSDP: every rank runs the forwards, rank 0 writes
            with timer("eval"):
                metrics.update(evaluate(run if ctx.is_main else NoSamples(), step))
        metrics["cost/transformer_evals"] = evals.sync(ctx)
        end_step(ctx, run, step, metrics, timer, bar, states, stateful, fsdp,
                 loss=f"{metrics.get('policy/loss', 0):.3g}")
        if stop_for_hacking(ctx, run, step, judges, states, stateful, fsdp):  # log.hacking.stop
            break
    bar.close()
    evals.remove()
    summary = summarise(run, "awm") if ctx.is_main else {}
    ctx.barrier()
    ctx.close()
    return summary


def _train_on_rollout(cfg: Config, model, states, traj, points, adv, keep, optimizer, lr_sched, params, counters,
                      timer, ctx: DistContext | None = None, guard: UpdateGuard | None = None, step: int = 0) -> dict:
    """Inner epochs over one rollout batch: the AWM loss (+ velocity KLs) at the K fixed points of each sample.

    points = (sigmas [b, K], noise [b, K, C, h, w]). Several ranks: as `nft._train_on_rollout` (an update's chunk is
    the union of the ranks' local chunks, loss weighted by `ctx.loss_scale`, equal micro-step counts with
    zero-weight padding, one all-reduce per update). One process: ctx is a no-op."""
    ctx = ctx or DistContext()
    u, s, a = cfg.update, cfg.rollout, cfg.algo
    guard = guard or UpdateGuard(u.max_skipped_updates, ctx)
    acc: dict[str, list[float]] = defaultdict(list)
    if ctx.max_int(len(keep)) == 0:
        return {"train/updates": 0}
    sigmas, noise = points
    x0_all, k = traj.latents[:, -1], sigmas.shape[1]
    updates_per_epoch = u.updates_per_epoch(s.batch)
    pad_rows = keep[:1] if len(keep) else torch.zeros(1, dtype=torch.long)  # any real row; weight 0

    def point(rows, j):  # (x_t, sigma, target velocity, prompt embeddings) of training point j of `rows`
        x0, eps, sig = x0_all[rows], noise[rows, j], sigmas[rows, j].to(x0_all.device)
        return noise_latents(x0, sig, eps), sig, eps - x0, traj.embeds.select(traj.prompt_index[rows])

    def log_prob(v, target, sig):
        return matching_log_prob(v, target, sig, a.weighting, a.ghuber_power)

    # log p of the sampling policy where it is neither "old" (in-loop pass) nor the first update (detached current)
    pre_pass = a.rollout_state == "default" and u.epochs * updates_per_epoch > 1
    old_lp = torch.zeros(len(traj), k, dtype=torch.float64)
    if pre_pass:
        micro = list(torch.split(keep, u.micro_batch_size))
        with torch.no_grad(), states.use("default"), timer("old_log_prob"):
            for mi in range(ctx.max_int(len(micro))):  # FSDP: every rank runs the same forwards (padding rows)
                rows = micro[mi] if mi < len(micro) else pad_rows
                for j in range(k):
                    xt, sig, target, emb = point(rows, j)
                    lp = log_prob(model.velocity(xt, sig, emb, guidance_scale=s.guidance_scale), target, sig)
                    if mi < len(micro):
                        old_lp[rows, j] = lp.cpu()
    old_pass = a.rollout_state == "old" or a.old_kl_coef > 0
    updates = 0
    for epoch in range(u.epochs):
        order = keep[torch.randperm(len(keep))]
        n_updates = min(updates_per_epoch, ctx.max_int(len(order)))  # identical on every rank
        for ui, chunk in enumerate(torch.tensor_split(order, n_updates)):
            first_update = epoch == 0 and ui == 0
            micro = [m for m in torch.split(chunk, u.micro_batch_size) if len(m)]
            n_micro = ctx.max_int(len(micro))  # same number of micro-steps on every rank
            scale = ctx.loss_scale(len(chunk))  # local mean -> global mean under DDP's gradient average
            n_losses = len(acc["policy/loss"])
            for mi in range(n_micro):
                real = mi < len(micro)
                rows = micro[mi] if real else pad_rows
                weight = len(rows) / len(chunk) / k * scale if real else 0.0  # mean over samples and points
                for j in range(k):
                    last = mi == n_micro - 1 and j == k - 1  # DDP all-reduces in this backward only
                    xt, sig, target, emb = point(rows, j)
                    with ctx.no_sync(model.transformer, sync=last), timer("forward_backward"):
                        v_old = None
                        if old_pass:
                            with torch.no_grad(), states.use("old"):
                                v_old = model.velocity(xt, sig, emb, guidance_scale=s.guidance_scale)
                        v = model.velocity(xt, sig, emb, guidance_scale=s.guidance_scale)
                        lp = log_prob(v, target, sig)
                        if a.rollout_state == "old":
                            lp_roll = log_prob(v_old, target, sig)
                        elif pre_pass:
                            lp_roll = old_lp[rows, j].to(lp.device)
                        else:  # on-policy, the only update of the step: r = 1, gradient -A d log p
                            lp_roll = lp.detach()
                        pg, m = awm_policy_loss(lp, lp_roll, adv[rows].to(lp.device), a.clip_range)
                        loss = pg
                        if v_old is not None and a.old_kl_coef > 0:
                            kl_old = (v - v_old).pow(2).mean(dim=tuple(range(1, v.dim()))).mean()
                            loss = loss + a.old_kl_coef * kl_old
                            if real:
                                acc["kl/old"].append(kl_old.item())
                        if a.kl.coef > 0 or a.velocity_norm.needs_reference():  # KL + velocity-norm terms
                            with torch.no_grad(), states.use("ref"):
                                v_ref = model.velocity(xt, sig, emb, guidance_scale=s.guidance_scale)
                            term, ref_metrics = velocity_reference_terms(v, v_ref, a.kl.coef, a.velocity_norm.coef)
                            loss = loss + term
                            if real:
                                for key, val in ref_metrics.items():
                                    acc[key].append(val)
                        (loss * weight).backward()
                    if real:
                        acc["policy/loss"].append(loss.item())
                        acc["policy/pg_loss"].append(pg.item())
                        acc["policy/log_prob"].append(lp.mean().item())
                        acc["policy/matching_loss"].append((v.detach() - target).pow(2).mean().item())
                        for key in ("policy/clipfrac", "policy/approx_kl", "policy/ratio_max"):
                            acc[key].append(m[key])
                        if pre_pass and first_update:  # same weights as the pre-pass: must agree
                            acc["diag/logprob_drift"].append((lp.detach() - lp_roll).abs().max().item())
            grad_norm = clip_grads(params, u.max_grad_norm)
            acc["policy/grad_norm"].append(grad_norm)
            if guard.step(optimizer, acc["policy/loss"][n_losses:], grad_norm, step):  # NaN/inf: skipped
                lr_sched.step()
                updates += 1
                counters.updates += 1
            optimizer.zero_grad(set_to_none=True)
    vals = merge_rank_lists(ctx, acc)  # every rank's micro-step values
    out = {key: (max(v) if key in ("policy/ratio_max", "diag/logprob_drift", *MAX_KEYS) else sum(v) / len(v))
           for key, v in vals.items() if v}
    out["train/updates"] = updates
    return out
