"""DGPO, Direct Group Preference Optimization (Luo, Hu, Tang; ICLR 2026, arXiv 2510.08425): online RL for
flow-matching models without a stochastic policy. The objective and its weights: `mmrl.core.dgpo`.

One step reads top to bottom:
  1. rollout    - G images per prompt, deterministic ODE (`rollout.ode_solver`: dpm2 = DPM-Solver++(2M), the
                  published sampler; euler), from the trained policy, or from the EMA "old" policy after
                  `algo.old_rollout_after` updates (published switch_ema_ref);
  2. rewards    - zoo rewards; per-prompt advantages (`core.prompt_stats`), clipped to +-`algo.adv_clip_max`;
  3. points     - M = `algo.num_train_timesteps` step indices of the rollout schedule drawn without replacement
                  from 0..`algo.trunc_steps` (one set per step, shared by all samples), x_t = (1 - t) x0 + t eps
                  with one noise eps per group and point (`algo.shared_noise`, published);
  4. loss       - ell = ||v_theta(x_t) - (eps - x0)||^2 per sample; group weights sigmoid(beta/G sum A (ell - ell_ref))
                  (ell_ref: the reference, adapters off, or the "old" EMA policy with `algo.ref: old`); loss
                  mean(w A ell), ell detached where the PPO-style ratio exp(ell_old - ell) left 1 +- `algo.clip_range`
                  (`algo.clip`); + `algo.kl.coef` ||v - v_ref||^2;
  5. step       - AdamW per `update.mini_batch_size` samples (whole groups); after each update
                  old <- decay * old + (1 - decay) * new, decay = min(0.001 n, 0.3) (published ema_ref).

Training velocities are conditional-only at `algo.train_guidance_scale` (published mode 1: CFG in the rollout, none
in training); the reference at `algo.ref_guidance_scale` (published kl_cfg). A micro-batch holds whole groups
(`update.micro_batch_size` a multiple of `rollout.group_size`), so the group weights need no extra pass; several
processes shard whole prompts, so a group never spans ranks (the published all-reduce of group sums is not needed).

    summary = train(load_config("configs/diffusion/dgpo_tiny.yaml"))   # mmrl.config.load_config

Simplified away versus Luo-Yihong/DGPO scripts/train_sd3_dgpo.py (commit 01ceb4b): no separate long-horizon EMA for
evaluation (`log.eval_state` picks "default" or "old"); the rollout sampler is this library's DPM-Solver++(2M) on
the family's schedule (published: diffusers' DPMSolverMultistepScheduler with Sana's scheduler config, flow_shift 3).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mmrl.config import RunConfig
from mmrl.core.dgpo import dgpo_clip_mask, dgpo_group_weights, dgpo_loss
from mmrl.core.prompt_stats import PerPromptStatTracker
from mmrl.diffusion import config as dc
from mmrl.diffusion import old_policy
from mmrl.diffusion.awm import LogConfig  # samples, evaluation, `eval_state` (the same section as AWM's)
from mmrl.diffusion.common import noise_latents
from mmrl.distributed import DistConfig, DistContext
from mmrl.runtime import Timer, seed_everything
from mmrl.training import KLConfig, UpdateConfig, UpdateGuard, clip_grads, merge_rank_lists
from mmrl.training.run import closes_runs

__all__ = ["Config", "train", "RENAMED_KEYS"]

RENAMED_KEYS = dict(dc.RENAMED_KEYS)


@dataclass
class RolloutConfig(dc.RolloutConfig):
    ode_solver: Literal["euler", "dpm2"] = "dpm2"
    """Deterministic sampler of the rollout: `dpm2` (DPM-Solver++(2M), as DGPO) or `euler`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_size < 2:
            raise ValueError(f"rollout.group_size must be >= 2 for group preferences, got {self.group_size}")


@dataclass
class DGPOKLConfig(KLConfig):
    coef: float = 0.02
    """Weight of ||v - v_ref||^2 to the reference (adapters off) (published SD3.5 GenEval/OCR/PickScore: 0.02)."""


@dataclass
class AlgoConfig:
    beta: float = 100.0
    """beta of the group preference (published beta_dpo: 100; 2000-5000 with `ref: old`)."""
    num_train_timesteps: int = 4
    """M: training points per sample and step (published: 4)."""
    trunc_steps: int = 6
    """Points come from the rollout schedule's step indices 0..trunc_steps (published: 6 of 10 steps, 4 for GenEval)."""
    shared_noise: bool = True
    """One noise eps per group and point (published use_shared_noise); false = per sample."""
    clip: bool = True
    """PPO-style clipping of ell against the "old" EMA policy (published clip_dsm)."""
    clip_range: float = 1e-2
    """c of the ratio exp(ell_old - ell) (published: 1e-2 for SD3.5; 1e-3 more stable, slower)."""
    adv_clip_max: float = 5.0
    """Advantages are clipped to [-m, m]."""
    ref: Literal["ref", "old"] = "ref"
    """ell_ref of the group weights: `ref` (adapters off, published default) or `old` (the EMA policy,
    use_ema_ref; with a much larger beta)."""
    train_guidance_scale: float = 1.0
    """Guidance of the trained velocity (published: conditional only)."""
    ref_guidance_scale: float = 1.0
    """Guidance of the reference velocity (published kl_cfg: 1; 4.5 for CFG-free rollouts)."""
    old_rollout_after: int = 0
    """Sample with the EMA "old" policy once this many updates are done (published switch_ema_ref: 200-500);
    0 = always the trained policy."""
    kl: DGPOKLConfig = field(default_factory=DGPOKLConfig)
    """`coef`: weight of ||v - v_ref||^2 to the reference (adapters off); 0 = no reference pass unless `ref: ref`
    (`estimator`, `in_reward` are not used)."""

    def __post_init__(self) -> None:
        if self.num_train_timesteps < 1 or self.trunc_steps < 0 or self.num_train_timesteps > self.trunc_steps + 1:
            raise ValueError(f"algo.num_train_timesteps={self.num_train_timesteps}: expected 1..trunc_steps + 1 "
                             f"(= {self.trunc_steps + 1})")
        if self.beta <= 0 or self.clip_range < 0 or self.adv_clip_max <= 0 or self.old_rollout_after < 0:
            raise ValueError(f"algo: expected beta > 0, clip_range >= 0, adv_clip_max > 0, old_rollout_after >= 0; "
                             f"got {self.beta}, {self.clip_range}, {self.adv_clip_max}, {self.old_rollout_after}")


@dataclass
class RewardConfig(dc.AdvantageRewardConfig):
    drop_zero_advantage: bool = False
    """Skip samples whose advantage is exactly 0 (the published code keeps them; the KL term still applies)."""


@dataclass
class Config(RunConfig):
    algorithm: str = "dgpo"
    """Recipe name."""
    model: dc.ModelConfig = field(default_factory=dc.ModelConfig)
    """Model and adapters."""
    data: dc.DataConfig = field(default_factory=dc.DataConfig)
    """Prompt files."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout sampler (deterministic ODE)."""
    optim: dc.DiffusionOptimConfig = field(default_factory=dc.DiffusionOptimConfig)
    """AdamW and its learning-rate schedule (published: 3e-4 with LoRA)."""
    update: UpdateConfig = field(default_factory=UpdateConfig)
    """Inner epochs, mini-batches (whole groups; published: one update per step), micro-batches (whole groups)."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """DGPO objective, training points, clipping, reference."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rewards and advantages."""
    log: LogConfig = field(default_factory=LogConfig)
    """Samples, evaluation."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Several processes under torchrun / accelerate launch (strategy none|ddp|fsdp, backend, ...)."""


def _check(cfg: Config) -> None:
    s, a, u = cfg.rollout, cfg.algo, cfg.update
    if u.micro_batch_size % s.group_size or (u.mini_batch_size and u.mini_batch_size % s.group_size):
        raise ValueError(f"update.micro_batch_size={u.micro_batch_size} and update.mini_batch_size={u.mini_batch_size}"
                         f" must be multiples of rollout.group_size={s.group_size} (DGPO's weights need whole groups)")
    if a.trunc_steps >= s.num_steps:
        raise ValueError(f"algo.trunc_steps={a.trunc_steps} must be < rollout.num_steps={s.num_steps}")


# ------------------------------------------------------------------------------------------ training


@closes_runs  # the run directory's lock released however train() ends; a failed start leaves nothing
def train(cfg: Config) -> dict:
    from mmrl.diffusion.common import NoSamples, end_step, evaluator, load_recipe_model, setup_training
    from mmrl.diffusion.diagnostics import sample_statistics
    from mmrl.diffusion.sampling import sample_groups
    from mmrl.diffusion.scoring import global_advantages, load_reward_fn, reward_weights, score_rollout_components
    from mmrl.pipelines.data import PromptSampler, load_prompts
    from mmrl.training import FullOptimizerState, restore_checkpoint, start_run, summarise
    from mmrl.training.judges import build_judges, stop_for_hacking

    dc.check_common(cfg)
    _check(cfg)
    s, a = cfg.rollout, cfg.algo
    cfg.update.updates_per_epoch(s.batch)  # update.mini_batch_size must divide the batch: fail before loading
    ctx, run = start_run(cfg, {"rollout.prompts_per_step": s.prompts_per_step})
    train_items = load_prompts(cfg.data.train_prompts)
    eval_items = load_prompts(cfg.data.eval_prompts)[: cfg.log.eval_max_prompts] if cfg.data.eval_prompts else []
    reward_fn = load_reward_fn(cfg.reward.components, run.device, cfg.rollout.num_frames)
    model = load_recipe_model(cfg, run.device, run.dtype)
    # "default" trains; "old" = the EMA policy (clipping, ell_ref with ref: old, late rollouts); "ref" = adapters off
    states, evals, params, optimizer, lr_sched, guard, fsdp = setup_training(ctx, run, cfg, model, old=True,
                                                                             ref=a.kl.coef > 0 or a.ref == "ref")
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
    bar = run.progress(cfg.train.max_steps, initial=start)
    for step in range(start + 1, cfg.train.max_steps + 1):
        metrics: dict[str, Any] = {}
        if ctx.enabled:  # rank-local noise, a pure function of (seed, rank, step)
            seed_everything(ctx.rank_seed(cfg.seed, step))
        with timer("step"):
            # ---- 1. rollout (this rank's share of the prompts), deterministic ODE
            with timer("rollout"):
                items = ctx.shard(sampler.next(s.prompts_per_step))
                embeds = model.encode_prompts([it.prompt for it in items])
                rollout_state = "old" if a.old_rollout_after and counters.updates >= a.old_rollout_after else "default"
                with torch.no_grad(), states.use(rollout_state):
                    traj = sample_groups(model, embeds, s.group_size, num_steps=s.num_steps, height=s.height,
                                         width=s.width, guidance_scale=s.guidance_scale, noise_level=0.0,
                                         batch_size=s.micro_batch_size or None, ode_solver=s.ode_solver)
                prompts = [items[i].prompt for i in traj.prompt_index.tolist()]
                metadata = [items[i].metadata for i in traj.prompt_index.tolist()]

            # ---- 2. rewards; per-prompt advantages over all ranks, clipped
            with timer("reward"):
                scores, reward_metrics, comps = score_rollout_components(ctx, reward_fn, traj.images, prompts,
                                                                         metadata, cfg.reward.on_nonfinite)
            metrics.update(reward_metrics)
            metrics.update(sample_statistics(traj.images, traj.latents[:, -1]))  # diag/sample/*
            adv, keep, adv_metrics = global_advantages(ctx, tracker, prompts, scores, a.adv_clip_max,
                                                       cfg.reward.drop_zero_advantage, None, comps,
                                                       reward_weights(reward_fn), cfg.reward.aggregation)
            metrics.update(adv_metrics)

            # ---- 3. training points (shared step indices; one noise per group and point); 4./5. loss, updates
            with timer("train"):
                t_index = torch.randperm(a.trunc_steps + 1)[: a.num_train_timesteps]
                x0 = traj.latents[:, -1]
                rows = len(items) if a.shared_noise else len(traj)
                noise = torch.randn((rows, len(t_index), *x0.shape[1:]), device=x0.device)
                if a.shared_noise:
                    noise = noise[traj.prompt_index.to(x0.device)]
                metrics.update(_train_on_rollout(cfg, model, states, traj, (traj.sigmas[t_index], noise), adv, keep,
                                                 optimizer, lr_sched, params, counters, timer, ctx, guard, step))
                metrics.update(guard.pop_metrics())
            metrics["policy/old_decay"] = old_policy.ema_decay("awm_linear", max(counters.updates - 1, 0))
            metrics["rollout/from_old"] = float(rollout_state == "old")

        metrics["policy/lr"] = optimizer.param_groups[0]["lr"]
        if ctx.is_main and cfg.log.sample_every and (step % cfg.log.sample_every == 0 or step == 1):
            n = min(cfg.log.num_samples, len(prompts))
            run.save_samples(step, traj.images[:n], [f"{prompts[i][:48]} | r={scores[i]:.3g}" for i in range(n)])
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
    summary = summarise(run, "dgpo") if ctx.is_main else {}
    ctx.barrier()
    ctx.close()
    return summary


def _train_on_rollout(cfg: Config, model, states, traj, points, adv, keep, optimizer, lr_sched, params, counters,
                      timer, ctx: DistContext | None = None, guard: UpdateGuard | None = None, step: int = 0) -> dict:
    """Inner epochs over one rollout batch: the DGPO loss (+ velocity KL) at the M shared points of each sample.

    points = (sigmas [M], noise [B, M, C, h, w]). Updates and micro-batches are made of whole groups (prompts), so each
    micro-batch computes its own groups' weights. Several ranks: as `awm._train_on_rollout` (loss weighted by
    `ctx.loss_scale`, equal micro-step counts with zero-weight padding, one all-reduce per update)."""
    ctx = ctx or DistContext()
    u, s, a = cfg.update, cfg.rollout, cfg.algo
    guard = guard or UpdateGuard(u.max_skipped_updates, ctx)
    acc: dict[str, list[float]] = defaultdict(list)
    if ctx.max_int(len(keep)) == 0:
        return {"train/updates": 0}
    sigmas, noise = points
    x0_all, m = traj.latents[:, -1], len(sigmas)
    groups = traj.prompt_index
    kept_groups = torch.unique(groups[keep])
    updates_per_epoch = u.updates_per_epoch(s.batch)
    pad_rows = keep[:1] if len(keep) else torch.zeros(1, dtype=torch.long)  # any real row; weight 0
    ref_state = "ref" if a.ref == "ref" else "old"
    updates = 0
    for epoch in range(u.epochs):
        order = kept_groups[torch.randperm(len(kept_groups))]
        n_updates = min(updates_per_epoch, ctx.max_int(len(order)))  # identical on every rank
        for chunk_groups in torch.tensor_split(order, n_updates):
            chunk = keep[torch.isin(groups[keep], chunk_groups)]
            # micro-batches of whole groups, in the chunk's group order
            per_micro = max(1, u.micro_batch_size // s.group_size)
            micro = [keep[torch.isin(groups[keep], g)] for g in torch.split(chunk_groups, per_micro) if len(g)]
            n_micro = ctx.max_int(len(micro))  # same number of micro-steps on every rank
            scale = ctx.loss_scale(len(chunk))  # local mean -> global mean under DDP's gradient average
            n_losses = len(acc["policy/loss"])
            for mi in range(n_micro):
                real = mi < len(micro)
                rows = micro[mi] if real else pad_rows
                weight = len(rows) / max(len(chunk), 1) / m * scale if real else 0.0
                x0, emb, a_rows = x0_all[rows], traj.embeds.select(groups[rows]), adv[rows].to(x0_all.device)
                for j in range(m):
                    last = mi == n_micro - 1 and j == m - 1  # DDP all-reduces in this backward only
                    sig = sigmas[j].to(x0.device).expand(len(rows))
                    eps = noise[rows, j]
                    xt, target = noise_latents(x0, sig, eps), eps - x0
                    with ctx.no_sync(model.transformer, sync=last), timer("forward_backward"):
                        with torch.no_grad():
                            v_ref = v_old = None
                            if a.kl.coef > 0 or a.ref == "ref":
                                with states.use("ref"):
                                    v_ref = model.velocity(xt, sig, emb, guidance_scale=a.ref_guidance_scale)
                            if a.clip or a.ref == "old":
                                with states.use("old"):
                                    v_old = model.velocity(xt, sig, emb, guidance_scale=a.train_guidance_scale)
                        v = model.velocity(xt, sig, emb, guidance_scale=a.train_guidance_scale)
                        dsm = _mse(v, target)
                        ref_dsm = _mse(v_ref if ref_state == "ref" else v_old, target)
                        w = dgpo_group_weights(a_rows, dsm.detach(), ref_dsm, groups[rows].to(dsm.device), a.beta,
                                               s.group_size)
                        clipped = dgpo_clip_mask(a_rows, dsm, _mse(v_old, target), a.clip_range) if a.clip else None
                        pg = dgpo_loss(a_rows, dsm, w, clipped)
                        loss = pg
                        if a.kl.coef > 0:
                            kl = _mse(v, v_ref.detach()).mean()
                            loss = loss + a.kl.coef * kl
                            if real:
                                acc["kl/ref"].append(kl.item())
                        (loss * weight).backward()
                    if real:
                        acc["policy/loss"].append(loss.item())
                        acc["policy/dgpo_loss"].append(pg.item())
                        acc["policy/dsm_loss"].append(dsm.mean().item())
                        acc["policy/group_weight"].append(w.mean().item())
                        if clipped is not None:
                            acc["policy/clipfrac"].append(clipped.float().mean().item())
            grad_norm = clip_grads(params, u.max_grad_norm)
            acc["policy/grad_norm"].append(grad_norm)
            if guard.step(optimizer, acc["policy/loss"][n_losses:], grad_norm, step):  # NaN/inf: skipped
                lr_sched.step()
                states.ema("default", "old", old_policy.ema_decay("awm_linear", counters.updates))
                updates += 1
                counters.updates += 1
            optimizer.zero_grad(set_to_none=True)
    vals = merge_rank_lists(ctx, acc)  # every rank's micro-step values
    out = {key: sum(v) / len(v) for key, v in vals.items() if v}
    out["train/updates"] = updates
    return out


def _mse(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample mean squared error [b] over all non-batch dimensions, in float32."""
    err = (v.float() - target.float()).pow(2)
    return err.mean(dim=tuple(range(1, err.dim())))
