"""DiffusionNFT: online RL for flow-matching models on the forward process (Zheng et al. 2025, arXiv 2509.16117).

No likelihoods and no SDE: the policy is trained with a flow-matching-style loss on its own clean
samples. One step reads top to bottom:
  1. rollout    - G images per prompt from the frozen "old" policy with a deterministic ODE solver;
  2. rewards    - zoo rewards (`reward.components`); per-prompt advantages (`core.prompt_stats`);
  3. optimality - r = clip(A, -m, m) / (2m) + 1/2 in [0, 1] (`core.losses.nft_optimality_prob`);
  4. loss       - at timesteps of the sampler's schedule (a random order per sample), fresh noise:
                  x_t = (1 - t) x0 + t eps; implicit positive v+ = b v + (1 - b) v_old and negative
                  v- = (1 + b) v_old - b v (b = `algo.guidance_beta`), their adaptively weighted x0
                  losses mixed with r and 1 - r (`core.losses.nft_loss`), plus
                  `algo.kl.coef` * ||v - v_ref||^2 (reference = adapters off);
  5. step       - AdamW per `update.mini_batch_size` samples, then old <- decay * old + (1 - decay) * new
                  with the published decay schedules (`algo.ema_schedule`, see `ema_decay`).

    from mmrl.config import load_config
    from mmrl.diffusion.nft import train
    summary = train(load_config("configs/diffusion/nft_tiny.yaml"))

Several processes (`torchrun` / `accelerate launch`, `dist.strategy: ddp`), as `flow_grpo`: `rollout.prompts_per_step`
is global and each rank rolls out its contiguous share; rewards are all-gathered so the per-prompt advantages
(and the stat tracker, identical on every rank) see the whole batch; each rank's loss is scaled so DDP's
gradient average is the global-batch gradient; all ranks run the same number of micro-steps (zero-weight ones
when a rank has fewer rows) and all-reduce once per update; the "old" EMA then stays identical everywhere;
rank 0 alone logs, samples, evaluates and writes checkpoints (resumable on any number of ranks). With one
process nothing of this changes a number.

`dist.strategy: fsdp` (LoRA or full fine-tuning, as `flow_grpo`): the transformer is sharded with FSDP2 before the optimizer is
built, `PolicyStates.refresh()` follows the shards (the "old" EMA works on local shards), the optimizer state and
checkpoints hold full tensors (saved collectively, rank 0 writes; resumable under any strategy), and every rank
runs the same transformer forwards: equal rollouts, the same number of (padding) micro-steps with their "old" and
reference passes, and evaluation on every rank.

What is simplified away versus NVlabs/DiffusionNFT's train_nft_sd3.py: the rollout
solver is Euler (the official default is DPM-Solver-2); no separate EMA copy for evaluation
(evaluation uses `log.eval_state`, "default" by default); no per-GPU batch-size search.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mmrl.config import RunConfig
from mmrl.core.losses import nft_loss, nft_optimality_prob
from mmrl.core.prompt_stats import PerPromptStatTracker
from mmrl.diffusion import config as dc
from mmrl.diffusion import old_policy
from mmrl.diffusion.diagnostics import MAX_KEYS, VelocityNormConfig, velocity_reference_terms
from mmrl.diffusion.old_policy import NFT_EMA_SCHEDULES
from mmrl.diffusion.common import noise_latents
from mmrl.distributed import DistConfig, DistContext
from mmrl.runtime import Timer, seed_everything
from mmrl.training import SKIPPED_KEY, KLConfig, UpdateConfig, UpdateGuard, clip_grads, merge_rank_lists
from mmrl.training.run import closes_runs

__all__ = ["Config", "train", "ema_decay", "EMA_SCHEDULES", "RENAMED_KEYS"]

# keys of earlier mmrl versions -> their names now (an old key in a YAML or override fails naming the new one)
RENAMED_KEYS = {
    **dc.RENAMED_KEYS,
    "nft": "algo",
    "train.num_inner_epochs": "update.epochs",
    "train.updates_per_step": "update.mini_batch_size",  # = rollout.prompts_per_step * group_size / updates
    "train.kl_beta": "algo.kl.coef",
    "train.adv_clip_max": "algo.adv_clip_max",
}

EMA_SCHEDULES = NFT_EMA_SCHEDULES
EmaSchedule = Literal["copy", "linear", "delayed_linear"]


def ema_decay(schedule: str, n: int) -> float:
    """EMA decay of the "old" policy after `n` optimizer updates (this recipe's schedules; see old_policy)."""
    return old_policy.ema_decay(schedule, n, EMA_SCHEDULES)


# ------------------------------------------------------------------------------------------ config


@dataclass
class RolloutConfig(dc.RolloutConfig):
    guidance_scale: float = 1.0
    """CFG in rollout and training (DiffusionNFT trains CFG-free: 1.0)."""
    eval_guidance_scale: float = 1.0
    """Guidance for evaluation."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_size < 2:
            raise ValueError(f"rollout.group_size must be >= 2 for per-prompt advantages, got {self.group_size}")


@dataclass
class NFTUpdateConfig(UpdateConfig):
    micro_batch_size: int = 9
    """Samples per forward/backward pass (gradient accumulation inside one update)."""


@dataclass
class NFTKLConfig(KLConfig):
    coef: float = 1e-4
    """Weight of the velocity-space KL ||v - v_ref||^2 to the reference (adapters off); 0 = no reference pass."""


@dataclass
class AlgoConfig:
    guidance_beta: float = 1.0
    """NFT's beta: v+ = beta v + (1 - beta) v_old, v- = (1 + beta) v_old - beta v (published: 1.0 PickScore, 0.1 OCR)."""
    adaptive_weighting: bool = True
    """Divide each x0 loss by sg(mean |x0_pred - x0|) per sample (the official adaptive weighting)."""
    ema_schedule: EmaSchedule = "linear"
    """Decay schedule of the "old" policy: copy | linear (min(0.001 n, 0.5)) | delayed_linear (0 until n = 75, then min(0.0075 (n - 75), 0.999)); n = optimizer updates so far."""
    timestep_fraction: float = 0.99
    """Train on the first int(num_steps * fraction) timesteps of the rollout schedule (each sample in its own random order)."""
    adv_clip_max: float = 5.0
    """Advantages clipped to [-m, m] and mapped to r in [0, 1]; also the loss scale (as the official code)."""
    kl: NFTKLConfig = field(default_factory=NFTKLConfig)
    """`coef`: weight of the velocity-space KL ||v - v_ref||^2 to the reference (adapters off); 0 = no reference
    pass (`estimator`, `in_reward` are not used)."""
    velocity_norm: VelocityNormConfig = field(default_factory=VelocityNormConfig)
    """||v|| / ||v_ref|| at the training points (diag/velocity_norm_ratio, whenever the reference runs) and a hinge
    penalty coef * mean max(0, ratio - 1)^2 (0 = off); `reference_pass` runs the reference for the diagnostic."""

    def __post_init__(self) -> None:
        if self.guidance_beta <= 0:
            raise ValueError(f"algo.guidance_beta must be > 0, got {self.guidance_beta}")


@dataclass
class RewardConfig(dc.AdvantageRewardConfig):
    drop_zero_advantage: bool = False
    """Skip samples whose advantage is exactly 0 (DiffusionNFT keeps them: r = 1/2 pulls v towards v_old)."""


@dataclass
class LogConfig(dc.LogConfig):
    eval_state: Literal["default", "old"] = "default"
    """Policy state evaluated: `default` (the trained weights) or `old` (the EMA sampling policy)."""


@dataclass
class Config(RunConfig):
    algorithm: str = "nft"
    """Recipe name."""
    model: dc.ModelConfig = field(default_factory=dc.ModelConfig)
    """Model and adapters."""
    data: dc.DataConfig = field(default_factory=dc.DataConfig)
    """Prompt files."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout sampler (deterministic ODE)."""
    optim: dc.DiffusionOptimConfig = field(default_factory=dc.DiffusionOptimConfig)
    """AdamW and its learning-rate schedule."""
    update: NFTUpdateConfig = field(default_factory=NFTUpdateConfig)
    """Inner epochs, mini-batches (the official gradient_step_per_epoch: 1 PickScore, 2 OCR), micro-batches, clipping."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """DiffusionNFT loss, KL and old-policy schedule."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rewards and advantages."""
    log: LogConfig = field(default_factory=LogConfig)
    """Samples, evaluation."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Several processes under torchrun / accelerate launch (strategy none|ddp|fsdp, backend, find_unused_parameters)."""


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
    if int(s.num_steps * a.timestep_fraction) < 1:
        raise ValueError(f"algo.timestep_fraction={a.timestep_fraction} trains on no step of {s.num_steps}")
    cfg.update.updates_per_epoch(s.batch)  # update.mini_batch_size must divide the batch: fail before loading
    ctx, run = start_run(cfg, {"rollout.prompts_per_step": s.prompts_per_step})
    train_items = load_prompts(cfg.data.train_prompts)
    eval_items = load_prompts(cfg.data.eval_prompts)[: cfg.log.eval_max_prompts] if cfg.data.eval_prompts else []
    check_data(cfg.model.path, train_prompts=train_items, eval_prompts=eval_items)  # edit models need source images
    reward_fn = load_reward_fn(cfg.reward.components, run.device, cfg.rollout.num_frames)
    model = load_recipe_model(cfg, run.device, run.dtype)
    # "default" trains, "old" = the EMA rollout policy, "ref" = adapters off (KL); DDP/FSDP; optimizer
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
        if ctx.enabled:  # rank-local noise, a pure function of (seed, rank, step): nothing per rank to checkpoint
            seed_everything(ctx.rank_seed(cfg.seed, step))
        with timer("step"):
            # ---- 1. rollout with the frozen "old" policy, deterministic ODE (this rank's share of the prompts)
            with timer("rollout"):
                items = ctx.shard(sampler.next(s.prompts_per_step))
                embeds = encode_items(model, items, s.height, s.width)  # + source images (edit models)
                with torch.no_grad(), states.use("old"):
                    traj = sample_groups(model, embeds, s.group_size, num_steps=s.num_steps, height=s.height,
                                         width=s.width, guidance_scale=s.guidance_scale, noise_level=0.0,
                                         batch_size=s.micro_batch_size or None)
                prompts = [items[i].prompt for i in traj.prompt_index.tolist()]
                metadata = [items[i].metadata for i in traj.prompt_index.tolist()]

            # ---- 2. rewards and per-prompt advantages; 3. optimality probability r
            with timer("reward"):
                scores, reward_metrics, comps = score_rollout_components(ctx, reward_fn, traj.images, prompts,
                                                                         metadata, cfg.reward.on_nonfinite)
            metrics.update(reward_metrics)  # several ranks: reward/mean and reward/std of all samples, below
            metrics.update(sample_statistics(traj.images, traj.latents[:, -1]))  # diag/sample/*
            # per-prompt advantages over all ranks' rewards (unclipped here: nft_optimality_prob clips)
            adv, keep, adv_metrics = global_advantages(ctx, tracker, prompts, scores, float("inf"),
                                                       cfg.reward.drop_zero_advantage, None, comps,
                                                       reward_weights(reward_fn), cfg.reward.aggregation)
            metrics.update(adv_metrics)
            r = nft_optimality_prob(adv, a.adv_clip_max)

            # ---- 4./5. NFT loss on forward-noised clean samples; updates; EMA of "old" (same on every rank)
            with timer("train"):
                metrics.update(_train_on_rollout(cfg, model, states, traj, r, keep, optimizer, lr_sched, params,
                                                 counters, timer, ctx, guard=guard, step=step))
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
    summary = summarise(run, "nft") if ctx.is_main else {}
    ctx.barrier()
    ctx.close()
    return summary


def _train_on_rollout(cfg: Config, model, states, traj, r, keep, optimizer, lr_sched, params, counters,
                      timer, ctx: DistContext | None = None, guard: UpdateGuard | None = None, step: int = 0) -> dict:
    """Inner epochs over one rollout batch: NFT loss (+ velocity KL) at K schedule timesteps per sample.

    Several ranks (as `grpo_update.train_on_rollout`): each holds its rows of the global batch; an update's chunk
    is the union of the ranks' local chunks, each rank's loss is weighted by `ctx.loss_scale(len(local chunk))`
    (DDP averages: the gradient is the global chunk mean), every rank runs the same number of micro-steps
    (zero-weight micro-batches on one of its rows where it has fewer or none) and gradients are all-reduced
    once per update (no_sync around every other micro-step). One process: ctx is a no-op."""
    ctx = ctx or DistContext()
    u, s, n = cfg.update, cfg.rollout, cfg.algo
    guard = guard or UpdateGuard(u.max_skipped_updates, ctx)
    updates_per_epoch = u.updates_per_epoch(s.batch)
    acc: dict[str, list[float]] = defaultdict(list)
    if ctx.max_int(len(keep)) == 0:
        return {"train/updates": 0}
    x0_all = traj.latents[:, -1]
    k = int(s.num_steps * n.timestep_fraction)
    train_sigmas = traj.sigmas[:k]
    b_all = len(traj)
    pad_rows = keep[:1] if len(keep) else torch.zeros(1, dtype=torch.long)  # any real row; weight 0
    need_ref = n.kl.coef > 0 or n.velocity_norm.needs_reference()
    updates = 0
    for _ in range(u.epochs):
        # each sample visits the K timesteps in its own random order (as the official script)
        order_t = torch.stack([torch.randperm(k) for _ in range(b_all)])
        order = keep[torch.randperm(len(keep))]
        n_updates = min(updates_per_epoch, ctx.max_int(len(order)))  # identical on every rank
        for chunk in torch.tensor_split(order, n_updates):
            micro = [m for m in torch.split(chunk, u.micro_batch_size) if len(m)]  # (an empty chunk splits into [[]])
            n_micro = ctx.max_int(len(micro))  # same number of micro-steps on every rank
            scale = ctx.loss_scale(len(chunk))  # local mean -> global mean under DDP's gradient average
            n_losses = len(acc["policy/loss"])  # this update's micro-step losses are appended after this index
            for mi in range(n_micro):
                real = mi < len(micro)
                rows = micro[mi] if real else pad_rows
                b = len(rows)
                emb = traj.embeds.select(traj.prompt_index[rows])
                x0 = x0_all[rows]
                rr = r[rows].to(x0.device)
                weight = b / len(chunk) / k * scale if real else 0.0  # mean over the chunk's samples and K timesteps
                for j in range(k):
                    last = mi == n_micro - 1 and j == k - 1  # DDP all-reduces in this backward only
                    sig = train_sigmas[order_t[rows, j]].to(x0.device)
                    xt = noise_latents(x0, sig, torch.randn_like(x0))
                    with ctx.no_sync(model.transformer, sync=last), timer("forward_backward"):  # forward AND backward
                        with torch.no_grad(), states.use("old"):
                            v_old = model.velocity(xt, sig, emb, guidance_scale=s.guidance_scale)
                        v = model.velocity(xt, sig, emb, guidance_scale=s.guidance_scale)
                        loss, m = nft_loss(v, v_old, x0, xt, sig, rr, n.guidance_beta,
                                           adaptive_weighting=n.adaptive_weighting, loss_scale=n.adv_clip_max)
                        if need_ref:  # velocity KL and velocity-norm term against the reference (+ diagnostic)
                            with torch.no_grad(), states.use("ref"):
                                v_ref = model.velocity(xt, sig, emb, guidance_scale=s.guidance_scale)
                            term, ref_metrics = velocity_reference_terms(v, v_ref, n.kl.coef, n.velocity_norm.coef)
                            loss = loss + term
                            if real:
                                for key, val in ref_metrics.items():
                                    acc[key].append(val)
                        (loss * weight).backward()
                    if real:
                        for key in ("pos_loss", "neg_loss", "old_deviate", "nft_loss"):
                            acc[f"policy/{key}"].append(m[key])
                        acc["policy/loss"].append(loss.item())
            grad_norm = clip_grads(params, u.max_grad_norm)
            acc["policy/grad_norm"].append(grad_norm)
            if guard.step(optimizer, acc["policy/loss"][n_losses:], grad_norm, step):  # NaN/inf: skipped
                lr_sched.step()
                updates += 1
                counters.updates += 1
            optimizer.zero_grad(set_to_none=True)
    vals = merge_rank_lists(ctx, acc)  # metrics of the whole batch: every rank's micro-step values
    out = {key: max(v) if key in MAX_KEYS else sum(v) / len(v) for key, v in vals.items() if v}
    out["train/updates"] = updates
    if ctx.enabled:
        out["policy/r_mean"] = float(ctx.all_reduce_sum(r[keep].double().sum()) / ctx.all_reduce_sum(len(keep)))
    else:
        out["policy/r_mean"] = r[keep].mean().item()
    return out
