"""DiffusionNFT: online RL for flow-matching models on the forward process (Zheng et al. 2025, arXiv 2509.16117).

No likelihoods and no SDE: the policy is trained with a flow-matching-style loss on its own clean
samples. One step reads top to bottom:
  1. rollout    - G images per prompt from the frozen "old" policy with a deterministic ODE solver;
  2. rewards    - zoo rewards (`reward.components`); per-prompt advantages (Flow-GRPO's stat tracker);
  3. optimality - r = clip(A, -m, m) / (2m) + 1/2 in [0, 1] (`core.losses.nft_optimality_prob`);
  4. loss       - at timesteps of the sampler's schedule (a random order per sample), fresh noise:
                  x_t = (1 - t) x0 + t eps; implicit positive v+ = b v + (1 - b) v_old and negative
                  v- = (1 + b) v_old - b v (b = `nft.guidance_beta`), their adaptively weighted x0
                  losses mixed with r and 1 - r (`core.losses.nft_loss`), plus
                  `train.kl_beta` * ||v - v_ref||^2 (reference = adapters off);
  5. step       - AdamW over `train.updates_per_step` chunks, then old <- decay * old + (1 - decay) * new
                  with the published decay schedules (`nft.ema_schedule`, see `ema_decay`).

    from mmrl.config import load_config
    from mmrl.diffusion.nft import train
    summary = train(load_config("configs/diffusion/nft_tiny.yaml"))

Several processes (`torchrun` / `accelerate launch`, `dist.strategy: ddp`), as `flow_grpo`: `data.prompts_per_step`
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

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from mmrl.config import RunConfig
from mmrl.core.losses import nft_loss, nft_optimality_prob
from mmrl.diffusion.common import (TIMING_PREFIX, AdamWTrainConfig, make_optimizer, FullOptimizerState, NoSamples, TransformerEvalCounter,
                                   build_policy_states, evaluate_ode, clip_grads, init_distributed,
                                   load_reward_fn, merge_rank_lists, noise_latents, restore_checkpoint,
                                   save_checkpoint, save_checkpoint_fsdp, score_images, summarise)
from mmrl.diffusion.flow_grpo import (DataConfig, LogConfig, ModelConfig, PerPromptStatTracker, RewardConfig,
                                      global_advantages)
from mmrl.distributed import DistConfig, DistContext
from mmrl.pipelines.data import require_path
from mmrl.runtime import Timer, seed_everything
from mmrl.training import NONFINITE_KEY, SKIPPED_KEY, UpdateGuard, check_finite_weights

__all__ = ["Config", "train", "ema_decay", "EMA_SCHEDULES"]

# name -> (flat steps, rate per step, cap):  decay(n) = 0 if n < flat else min(rate * (n - flat), cap)
# source: NVlabs/DiffusionNFT scripts/train_nft_sd3.py return_decay (decay_type 0, 1, 2)
EMA_SCHEDULES: dict[str, tuple[int, float, float]] = {
    "copy": (0, 0.0, 0.0),                 # decay_type 0: old <- new after every step
    "linear": (0, 0.001, 0.5),             # decay_type 1: min(0.001 n, 0.5)            (PickScore, GenEval)
    "delayed_linear": (75, 0.0075, 0.999),  # decay_type 2: 0 for n < 75, then min(0.0075 (n - 75), 0.999)  (OCR)
}


def ema_decay(schedule: str, n: int) -> float:
    """EMA decay of the "old" policy after `n` optimizer updates in total (the official `global_step`)."""
    if schedule not in EMA_SCHEDULES:
        raise ValueError(f"nft.ema_schedule: unknown schedule {schedule!r}; valid: {sorted(EMA_SCHEDULES)}")
    flat, rate, cap = EMA_SCHEDULES[schedule]
    return 0.0 if n < flat else min(rate * (n - flat), cap)


# ------------------------------------------------------------------------------------------ config


@dataclass
class SampleConfig:
    height: int = 512
    """Image height in pixels."""
    width: int = 512
    """Image width in pixels."""
    num_steps: int = 10
    """ODE (Euler) steps of a rollout; training timesteps come from this schedule."""
    group_size: int = 24
    """Images per prompt (G)."""
    guidance_scale: float = 1.0
    """CFG in rollout and training (DiffusionNFT trains CFG-free: 1.0)."""
    batch_size: int = 0
    """Rollout micro-batch (images per transformer call); 0 = whole batch."""
    eval_num_steps: int = 40
    """ODE steps for evaluation."""
    eval_guidance_scale: float = 1.0
    """Guidance for evaluation."""


@dataclass
class NFTConfig:
    guidance_beta: float = 1.0
    """NFT's beta: v+ = beta v + (1 - beta) v_old, v- = (1 + beta) v_old - beta v (published: 1.0 PickScore, 0.1 OCR)."""
    adaptive_weighting: bool = True
    """Divide each x0 loss by sg(mean |x0_pred - x0|) per sample (the official adaptive weighting)."""
    ema_schedule: str = "linear"
    """Decay schedule of the "old" policy: copy | linear (min(0.001 n, 0.5)) | delayed_linear (0 until n = 75, then min(0.0075 (n - 75), 0.999)); n = optimizer updates so far."""
    timestep_fraction: float = 0.99
    """Train on the first int(num_steps * fraction) timesteps of the rollout schedule (each sample in its own random order)."""


@dataclass
class NFTTrainConfig(AdamWTrainConfig):
    micro_batch_size: int = 9
    """Images per forward/backward pass."""
    updates_per_step: int = 1
    """Optimizer updates per pass over a rollout batch (the official gradient_step_per_epoch: 1 PickScore, 2 OCR)."""
    num_inner_epochs: int = 1
    """Passes over each rollout batch."""
    adv_clip_max: float = 5.0
    """Advantages clipped to [-m, m] and mapped to r in [0, 1]; also the loss scale (as the official code)."""
    kl_beta: float = 1e-4
    """Weight of the velocity-space KL ||v - v_ref||^2 to the reference (adapters off); 0 = no reference pass."""


@dataclass
class NFTRewardConfig(RewardConfig):
    drop_zero_advantage: bool = False
    """Skip samples whose advantage is exactly 0 (DiffusionNFT keeps them: r = 1/2 pulls v towards v_old)."""


@dataclass
class NFTLogConfig(LogConfig):
    eval_state: str = "default"
    """Policy state evaluated: `default` (the trained weights) or `old` (the EMA sampling policy)."""


@dataclass
class Config(RunConfig):
    algorithm: str = "nft"
    """Recipe name."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model and adapters."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt files."""
    sample: SampleConfig = field(default_factory=SampleConfig)
    """Rollout sampler (deterministic ODE)."""
    nft: NFTConfig = field(default_factory=NFTConfig)
    """DiffusionNFT loss and old-policy schedule."""
    train: NFTTrainConfig = field(default_factory=NFTTrainConfig)
    """Optimisation."""
    reward: NFTRewardConfig = field(default_factory=NFTRewardConfig)
    """Rewards and advantages."""
    log: NFTLogConfig = field(default_factory=NFTLogConfig)
    """Samples, evaluation."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Several processes under torchrun / accelerate launch (strategy none|ddp|fsdp, backend, find_unused_parameters)."""


def _check(cfg: Config) -> None:
    s, t, n = cfg.sample, cfg.train, cfg.nft
    if s.group_size < 2:
        raise ValueError(f"sample.group_size must be >= 2 for per-prompt advantages, got {s.group_size}")
    if n.guidance_beta <= 0:
        raise ValueError(f"nft.guidance_beta must be > 0, got {n.guidance_beta}")
    ema_decay(n.ema_schedule, 0)  # validates the name
    # sizes that would otherwise fail deep inside a step (IndexError, empty torch.cat, negative shapes)
    for key, value, least in (("data.prompts_per_step", cfg.data.prompts_per_step, 1), ("sample.height", s.height, 1),
                              ("sample.width", s.width, 1), ("sample.num_steps", s.num_steps, 1),
                              ("sample.eval_num_steps", s.eval_num_steps, 1), ("sample.batch_size", s.batch_size, 0),
                              ("reward.history", cfg.reward.history, 0),
                              ("model.max_sequence_length", cfg.model.max_sequence_length, 0),
                              ("model.lora_rank", cfg.model.lora_rank, 1 if cfg.model.lora else 0),
                              ("log.sample_every", cfg.log.sample_every, 0), ("log.eval_every", cfg.log.eval_every, 0),
                              ("log.num_sample_images", cfg.log.num_sample_images,
                               1 if cfg.log.sample_every or (cfg.log.eval_every and cfg.data.eval_prompts) else 0)):
        if value < least:
            raise ValueError(f"{key}: expected >= {least}, got {value}")
    require_path("data.train_prompts", cfg.data.train_prompts, "prompt file")
    if cfg.data.eval_prompts:
        require_path("data.eval_prompts", cfg.data.eval_prompts, "prompt file")
    if int(s.num_steps * n.timestep_fraction) < 1:
        raise ValueError(f"nft.timestep_fraction={n.timestep_fraction} trains on no step of {s.num_steps}")
    if t.updates_per_step < 1 or t.micro_batch_size < 1 or t.num_inner_epochs < 1:
        raise ValueError("train.updates_per_step, train.micro_batch_size and train.num_inner_epochs must be >= 1")
    if cfg.log.eval_state not in ("default", "old"):
        raise ValueError(f"log.eval_state: expected 'default' or 'old', got {cfg.log.eval_state!r}")


class _Counters:
    """Resumable integers: optimizer updates so far (the EMA schedule position)."""

    def __init__(self):
        self.updates = 0

    def state_dict(self) -> dict:
        return {"updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])


# ------------------------------------------------------------------------------------------ training


def train(cfg: Config) -> dict:
    from mmrl.diffusion.models import load_flow_model
    from mmrl.diffusion.sampling import sample_groups
    from mmrl.pipelines.data import PromptSampler, load_prompts

    _check(cfg)
    ctx, run = init_distributed(cfg, {"data.prompts_per_step": cfg.data.prompts_per_step})
    s, t = cfg.sample, cfg.train
    train_items = load_prompts(cfg.data.train_prompts)
    eval_items = load_prompts(cfg.data.eval_prompts)[: cfg.log.eval_max_prompts] if cfg.data.eval_prompts else []
    reward_fn = load_reward_fn(cfg.reward.components, run.device)
    model = load_flow_model(cfg.model.path, run.device, run.dtype, cfg.model.max_sequence_length or None)
    states = build_policy_states(model, cfg.model, old=True, ref=t.kl_beta > 0)
    evals = TransformerEvalCounter(model.transformer)
    # DDP keeps PolicyStates' parameter objects (so "old"/"ref" switching and the EMA work); one process: unchanged
    model.transformer = ctx.wrap_model(states.model, cfg.dist.strategy,
                                       find_unused_parameters=cfg.dist.find_unused_parameters)
    fsdp = ctx.enabled and cfg.dist.strategy == "fsdp"
    if fsdp:  # fully_shard replaced every parameter by a DTensor shard: follow them before building the optimizer
        states.refresh()
    params = states.trainable_parameters()
    optimizer, lr_sched = make_optimizer(params, t)
    guard = UpdateGuard(t.max_skipped_updates, ctx, run)  # a NaN/inf loss or gradient never reaches the weights
    tracker = PerPromptStatTracker(cfg.reward.std_mode, cfg.reward.history)
    sampler = PromptSampler(train_items, seed=cfg.seed)
    counters = _Counters()
    stateful = {"optimizer": FullOptimizerState(optimizer) if fsdp else optimizer, "lr_scheduler": lr_sched,
                "tracker": tracker, "data": sampler, "counters": counters, "transformer_evals": evals}
    start, _ = restore_checkpoint(run, states, stateful, tag="nft", truncate=ctx.is_main)
    evals_synced = evals.count  # global count (all ranks) at the last synchronisation

    timer = Timer(sync_cuda=run.device.type == "cuda")
    bar = run.progress(t.max_steps, initial=start)
    for step in range(start + 1, t.max_steps + 1):
        metrics: dict[str, Any] = {}
        if ctx.enabled:  # rank-local noise, a pure function of (seed, rank, step): nothing per rank to checkpoint
            seed_everything(ctx.rank_seed(cfg.seed, step))
        with timer("step"):
            # ---- 1. rollout with the frozen "old" policy, deterministic ODE (this rank's share of the prompts)
            with timer("rollout"):
                items = ctx.shard(sampler.next(cfg.data.prompts_per_step))
                embeds = model.encode_prompts([it.prompt for it in items])
                with torch.no_grad(), states.use("old"):
                    traj = sample_groups(model, embeds, s.group_size, num_steps=s.num_steps, height=s.height,
                                         width=s.width, guidance_scale=s.guidance_scale, noise_level=0.0,
                                         batch_size=s.batch_size or None)
                prompts = [items[i].prompt for i in traj.prompt_index.tolist()]
                metadata = [items[i].metadata for i in traj.prompt_index.tolist()]

            # ---- 2. rewards and per-prompt advantages; 3. optimality probability r
            with timer("reward"):
                scores, reward_metrics = score_images(reward_fn, traj.images, prompts, metadata,
                                                      on_nonfinite=cfg.reward.on_nonfinite)
            if ctx.enabled:  # equal sample counts per rank: the mean of the ranks' means is the batch mean
                reward_metrics = {k: int(ctx.all_reduce_sum(v)) if k == NONFINITE_KEY
                                  else float(ctx.all_reduce_mean(v)) for k, v in reward_metrics.items()}
            metrics.update(reward_metrics)  # several ranks: reward/mean and reward/std of all samples, below
            # per-prompt advantages over all ranks' rewards (unclipped here: nft_optimality_prob clips)
            adv, keep, adv_metrics = global_advantages(ctx, tracker, prompts, scores, math.inf,
                                                       cfg.reward.drop_zero_advantage)
            metrics.update(adv_metrics)
            r = nft_optimality_prob(adv, t.adv_clip_max)

            # ---- 4./5. NFT loss on forward-noised clean samples; updates; EMA of "old" (same on every rank)
            with timer("train"):
                metrics.update(_train_on_rollout(cfg, model, states, traj, r, keep, optimizer, lr_sched, params,
                                                 counters, timer, ctx, guard=guard, step=step))
                metrics.update(guard.pop_metrics())
            decay = ema_decay(cfg.nft.ema_schedule, counters.updates)
            if metrics["train/updates"] or not metrics[SKIPPED_KEY]:  # all updates skipped (NaN/inf): old unchanged
                states.ema("default", "old", decay)
            metrics["nft/old_decay"] = decay

        metrics["lr"] = optimizer.param_groups[0]["lr"]
        if ctx.is_main and cfg.log.sample_every and (step % cfg.log.sample_every == 0 or step == 1):
            n = min(cfg.log.num_sample_images, len(prompts))
            run.save_samples(step, traj.images[:n], [f"{prompts[i][:48]} | r={scores[i]:.3g}" for i in range(n)])
        eval_now = eval_items and cfg.log.eval_every and (step % cfg.log.eval_every == 0 or step in (1, t.max_steps))
        if (ctx.is_main or fsdp) and eval_now:  # FSDP: every rank runs the forwards, rank 0 writes
            with timer("eval"):
                metrics.update(evaluate_ode(model, states, cfg.log.eval_state, reward_fn, eval_items,
                                            run if ctx.is_main else NoSamples(), step,
                                            num_steps=s.eval_num_steps, guidance_scale=s.eval_guidance_scale,
                                            height=s.height, width=s.width, batch_size=t.micro_batch_size,
                                            seed=cfg.seed, num_images=cfg.log.num_sample_images))
        evals.count = evals_synced = evals_synced + int(ctx.all_reduce_sum(evals.count - evals_synced))
        metrics["cost/transformer_evals"] = evals.count
        metrics.update(timer.pop(TIMING_PREFIX))
        metrics["time/step_s"] = metrics.pop("time/step_s")
        if ctx.is_main:
            run.log(step, metrics)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.4g}", loss=f"{metrics.get('nft/loss', 0):.3g}")
        if (t.save_every and step % t.save_every == 0) or step == t.max_steps:
            check_finite_weights(states, step, ctx, run)  # never a checkpoint with NaN/inf weights
            if fsdp:  # gathering the shards is a collective: every rank takes part, rank 0 writes
                save_checkpoint_fsdp(ctx, run, step, states, stateful)
            elif ctx.is_main:
                save_checkpoint(run, step, states, stateful)
            ctx.barrier()  # nobody reads or resumes from a half-written checkpoint
    bar.close()
    evals.remove()
    summary = summarise(run, "nft") if ctx.is_main else {}
    ctx.barrier()
    ctx.close()
    return summary


def _train_on_rollout(cfg: Config, model, states, traj, r, keep, optimizer, lr_sched, params, counters,
                      timer, ctx: DistContext | None = None, guard: UpdateGuard | None = None, step: int = 0) -> dict:
    """Inner epochs over one rollout batch: NFT loss (+ velocity KL) at K schedule timesteps per sample.

    Several ranks (as `flow_grpo._train_on_rollout`): each holds its rows of the global batch; an update's chunk
    is the union of the ranks' local chunks, each rank's loss is weighted by `ctx.loss_scale(len(local chunk))`
    (DDP averages: the gradient is the global chunk mean), every rank runs the same number of micro-steps
    (zero-weight micro-batches on one of its rows where it has fewer or none) and gradients are all-reduced
    once per update (no_sync around every other micro-step). One process: ctx is a no-op."""
    ctx = ctx or DistContext()
    t, s, n = cfg.train, cfg.sample, cfg.nft
    guard = guard or UpdateGuard(t.max_skipped_updates, ctx)
    acc: dict[str, list[float]] = defaultdict(list)
    if ctx.max_int(len(keep)) == 0:
        return {"train/updates": 0}
    x0_all = traj.latents[:, -1]
    k = int(s.num_steps * n.timestep_fraction)
    train_sigmas = traj.sigmas[:k]
    b_all = len(traj)
    pad_rows = keep[:1] if len(keep) else torch.zeros(1, dtype=torch.long)  # any real row; weight 0
    updates = 0
    for _ in range(t.num_inner_epochs):
        # each sample visits the K timesteps in its own random order (as the official script)
        order_t = torch.stack([torch.randperm(k) for _ in range(b_all)])
        order = keep[torch.randperm(len(keep))]
        n_updates = min(t.updates_per_step, ctx.max_int(len(order)))  # identical on every rank
        for chunk in torch.tensor_split(order, n_updates):
            micro = [m for m in torch.split(chunk, t.micro_batch_size) if len(m)]  # (an empty chunk splits into [[]])
            n_micro = ctx.max_int(len(micro))  # same number of micro-steps on every rank
            scale = ctx.loss_scale(len(chunk))  # local mean -> global mean under DDP's gradient average
            n_losses = len(acc["nft/loss"])  # this update's micro-step losses are appended after this index
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
                                           adaptive_weighting=n.adaptive_weighting, loss_scale=t.adv_clip_max)
                        if t.kl_beta > 0:
                            with torch.no_grad(), states.use("ref"):
                                v_ref = model.velocity(xt, sig, emb, guidance_scale=s.guidance_scale)
                            kl = (v - v_ref).pow(2).mean(dim=tuple(range(1, v.dim()))).mean()
                            loss = loss + t.kl_beta * kl
                            if real:
                                acc["nft/kl"].append(kl.item())
                        (loss * weight).backward()
                    if real:
                        for key in ("pos_loss", "neg_loss", "old_deviate", "nft_loss"):
                            acc[f"nft/{key}"].append(m[key])
                        acc["nft/loss"].append(loss.item())
            grad_norm = clip_grads(params, t.max_grad_norm)
            acc["train/grad_norm"].append(grad_norm)
            if guard.step(optimizer, acc["nft/loss"][n_losses:], grad_norm, step):  # NaN/inf: skipped
                lr_sched.step()
                updates += 1
                counters.updates += 1
            optimizer.zero_grad(set_to_none=True)
    vals = merge_rank_lists(ctx, acc)  # metrics of the whole batch: every rank's micro-step values
    out = {key: sum(v) / len(v) for key, v in vals.items() if v}
    out["train/updates"] = updates
    if ctx.enabled:
        out["nft/r_mean"] = float(ctx.all_reduce_sum(r[keep].double().sum()) / ctx.all_reduce_sum(len(keep)))
    else:
        out["nft/r_mean"] = r[keep].mean().item()
    return out
