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
from mmrl.diffusion import config as dc
from mmrl.diffusion import old_policy
from mmrl.diffusion.common import noise_latents
from mmrl.diffusion.diagnostics import MAX_KEYS, VelocityNormConfig, velocity_reference_terms
from mmrl.diffusion.old_policy import NFT_EMA_SCHEDULES
from mmrl.distributed import DistConfig
from mmrl.run.start import closes_runs
from mmrl.training import KLConfig, UpdateConfig
from mmrl.training.updates import reduce_metrics

__all__ = ["Config", "train", "ema_decay", "EMA_SCHEDULES"]


EMA_SCHEDULES = NFT_EMA_SCHEDULES
EmaSchedule = Literal["copy", "linear", "delayed_linear"]


def ema_decay(schedule: str, n: int) -> float:
    """EMA decay of the "old" policy after `n` optimizer updates (this recipe's schedules; see old_policy)."""
    return old_policy.ema_decay(schedule, n, EMA_SCHEDULES)


# ------------------------------------------------------------------------------------------ config


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
class Config(RunConfig):
    algorithm: str = "nft"
    """Recipe name."""
    model: dc.ModelConfig = field(default_factory=dc.ModelConfig)
    """Model and adapters."""
    data: dc.DataConfig = field(default_factory=dc.DataConfig)
    """Prompt files."""
    rollout: dc.CFGFreeRolloutConfig = field(default_factory=dc.CFGFreeRolloutConfig)
    """Rollout sampler (deterministic ODE)."""
    optim: dc.DiffusionOptimConfig = field(default_factory=dc.DiffusionOptimConfig)
    """AdamW and its learning-rate schedule."""
    update: NFTUpdateConfig = field(default_factory=NFTUpdateConfig)
    """Inner epochs, mini-batches (the official gradient_step_per_epoch: 1 PickScore, 2 OCR), micro-batches, clipping."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """DiffusionNFT loss, KL and old-policy schedule."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rewards and advantages."""
    log: dc.EvalStateLogConfig = field(default_factory=dc.EvalStateLogConfig)
    """Samples, evaluation."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Several processes under torchrun / accelerate launch (strategy none|ddp|fsdp, backend, find_unused_parameters)."""


# ------------------------------------------------------------------------------------------ training


@closes_runs  # the run directory's lock released however train() ends; a failed start leaves nothing
def train(cfg: Config) -> dict:
    from mmrl.diffusion.loop import DiffusionLoop
    from mmrl.diffusion.rollout import ode_sampling
    from mmrl.training import summarise

    dc.check_common(cfg)
    rollout, algo = cfg.rollout, cfg.algo
    if int(rollout.num_steps * algo.timestep_fraction) < 1:
        raise ValueError(f"algo.timestep_fraction={algo.timestep_fraction} trains on no step of {rollout.num_steps}")
    cfg.update.updates_per_epoch(rollout.batch)  # update.mini_batch_size must divide the batch: fail before loading
    loop = DiffusionLoop(cfg)
    # "default" trains, "old" = the EMA rollout policy, "ref" = adapters off (KL)
    loop.setup(old=True, ref=algo.kl.coef > 0 or algo.velocity_norm.needs_reference(), eval_state=cfg.log.eval_state,
               counters=True)
    loop.begin(postfix=lambda m: {"loss": f"{m.get('policy/loss', 0):.3g}"})
    for step in loop:
        # ---- 1. rollout with the frozen "old" policy, deterministic ODE (this rank's share of the prompts); rewards
        roll = loop.rollout(step, ode_sampling(rollout), state="old")
        # ---- 2. per-prompt advantages over all ranks' rewards (unclipped here: nft_optimality_prob clips)
        adv, keep = loop.advantages(roll, clip=float("inf"))
        # ---- 3. optimality probability r
        r = nft_optimality_prob(adv, algo.adv_clip_max)
        # ---- 4./5. NFT loss on forward-noised clean samples; updates; EMA of "old" (same on every rank)
        with loop.timer("train"):
            loop.metrics.update(_train_on_rollout(loop.parts, step, roll.traj, r, keep))
            loop.metrics.update(loop.guard.pop_metrics())
        loop.update_old(ema_decay(algo.ema_schedule, loop.counters.updates))
    return loop.finish(lambda run: summarise(run, "nft"))


def _train_on_rollout(parts: Any, step: int, traj: Any, r: torch.Tensor, keep: torch.Tensor) -> dict:
    """Inner epochs over one rollout batch: NFT loss (+ velocity KL) at K schedule timesteps per sample, through
    the shared update iterator (`TrainingParts.updates`: epochs, updates, equal micro-step counts on every rank)."""
    cfg, ctx, model, states = parts.cfg, parts.ctx, parts.model, parts.states
    rollout, algo = cfg.rollout, cfg.algo
    acc: dict[str, list[float]] = defaultdict(list)
    if ctx.max_int(len(keep)) == 0:
        return {"train/updates": 0}
    x0_all = traj.latents[:, -1]
    k = int(rollout.num_steps * algo.timestep_fraction)
    train_sigmas = traj.sigmas[:k]
    need_ref = algo.kl.coef > 0 or algo.velocity_norm.needs_reference()
    orders: list[torch.Tensor] = []

    def timestep_orders(epoch: int) -> None:  # each sample visits the K timesteps in its own random order (official)
        orders[:] = [torch.stack([torch.randperm(k) for _ in range(len(traj))])]

    updates = parts.updates(keep, metrics=acc, step=step, on_epoch=timestep_orders)
    for mb in updates:
        rows = mb.rows
        emb = traj.embeds.select(traj.prompt_index[rows])
        x0 = x0_all[rows]
        rr = r[rows].to(x0.device)
        weight = mb.weight(k)  # mean over the update's samples and K timesteps
        for j in range(k):
            sig = train_sigmas[orders[0][rows, j]].to(x0.device)
            xt = noise_latents(x0, sig, torch.randn_like(x0))
            with mb.no_sync(last_point=j == k - 1), parts.timer("forward_backward"):  # forward AND backward
                with torch.no_grad(), states.use("old"):
                    v_old = model.velocity(xt, sig, emb, guidance_scale=rollout.guidance_scale)
                v = model.velocity(xt, sig, emb, guidance_scale=rollout.guidance_scale)
                loss, m = nft_loss(v, v_old, x0, xt, sig, rr, algo.guidance_beta,
                                   adaptive_weighting=algo.adaptive_weighting, loss_scale=algo.adv_clip_max)
                if need_ref:  # velocity KL and velocity-norm term against the reference (+ diagnostic)
                    with torch.no_grad(), states.use("ref"):
                        v_ref = model.velocity(xt, sig, emb, guidance_scale=rollout.guidance_scale)
                    term, ref_metrics = velocity_reference_terms(v, v_ref, algo.kl.coef, algo.velocity_norm.coef)
                    loss = loss + term
                    if mb.real:
                        for key, val in ref_metrics.items():
                            acc[key].append(val)
                (loss * weight).backward()
            if mb.real:
                for key in ("pos_loss", "neg_loss", "old_deviate", "nft_loss"):
                    acc[f"policy/{key}"].append(m[key])
                acc["policy/loss"].append(loss.item())
    out = reduce_metrics(ctx, acc, MAX_KEYS)  # metrics of the whole batch: every rank's micro-step values
    out["train/updates"] = updates.applied
    if ctx.enabled:
        out["policy/r_mean"] = float(ctx.all_reduce_sum(r[keep].double().sum()) / ctx.all_reduce_sum(len(keep)))
    else:
        out["policy/r_mean"] = r[keep].mean().item()
    return out
