"""Flow-GRPO: online RL for flow-matching text-to-image models (Liu et al. 2025, arXiv 2505.05470).

One step reads top to bottom:
  1. rollout  - G images per prompt with an SDE sampler, recording every latent and log-prob;
  2. rewards  - a weighted sum of zoo rewards (`reward.components`), each component logged;
  3. advantages - per-prompt normalisation (PerPromptStatTracker), clipping, zero-advantage groups dropped;
  4. loss     - per trained timestep: PPO-clipped ratio of the step's Gaussian log-probs, plus
                beta * closed-form Gaussian KL to the reference (adapters off);
  5. step     - gradients accumulated over timesteps and micro-batches, grad-norm clipping, AdamW,
                optional EMA of the trainable weights (the "old" state) used for evaluation.

    from mmrl.config import load_config
    from mmrl.diffusion.flow_grpo import train
    summary = train(load_config("configs/diffusion/flow_grpo_tiny.yaml", ["train.max_steps=20"]))

Several processes (`torchrun` / `accelerate launch`, `dist.strategy: ddp`): `data.prompts_per_step` is the
global number of prompts; each rank rolls out its contiguous share, rewards are all-gathered so the per-prompt
advantages and the stat tracker see the whole batch (identical tracker on every rank), each rank's loss is
scaled so DDP's gradient average equals the global-batch gradient, every rank runs the same number of
micro-steps (zero-weight ones when it has nothing left), and rank 0 alone logs, samples, evaluates and writes
checkpoints (which any number of ranks can resume). With one process nothing of this changes a number.

`dist.strategy: fsdp` (LoRA or full fine-tuning): the transformer is sharded with FSDP2 `fully_shard` per block
before the optimizer is built, `PolicyStates.refresh()` follows the sharded parameters (EMA on local shards; full
fine-tuning's "old"/"ref" snapshots are sharded like their parameters), every rank runs
the same transformer forwards (equal prompts per rank, zero-weight padding micro-steps, no reference-mean cache,
evaluation on every rank), and checkpoints gather full tensors (all ranks) that rank 0 writes: they resume with
any strategy and any number of processes.

What is simplified away versus flow_grpo's scripts: the rollout and reward run one
after the other (no thread pool); KL as a loss only (no KL-in-reward).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mmrl.config import RunConfig
from mmrl.core.kl import gaussian_kl_equal_std
from mmrl.core.losses import clipped_policy_loss
from mmrl.diffusion.common import (AdamWTrainConfig, FullOptimizerState, NoSamples, clip_grads, make_optimizer,
                                   save_checkpoint_fsdp)
from mmrl.distributed import DistConfig, DistContext, rank_seed
from mmrl.pipelines.data import require_path
from mmrl.runtime import Run, Timer, seed_everything
from mmrl.training import NONFINITE_KEY, OnNonfinite, UpdateGuard, check_finite_weights, finite_stats, group_keep

# ------------------------------------------------------------------------------------------ config


@dataclass
class ModelConfig:
    path: str = "assets/tiny_sd3_shapes"
    """Local diffusers pipeline directory (StableDiffusion3Pipeline or FluxPipeline, with model_index.json)."""
    max_sequence_length: int = 0
    """T5 tokens per prompt; 0 = family default (SD3: 128 as Flow-GRPO, FLUX: 512)."""
    lora: bool = True
    """Train a LoRA on the transformer (false = full fine-tuning of the transformer)."""
    lora_rank: int = 32
    """LoRA rank r."""
    lora_alpha: int = 64
    """LoRA alpha (scale = alpha / r)."""
    lora_target_modules: list[str] = field(default_factory=list)
    """Module names for LoRA; empty = the attention projections of the model family."""
    lora_init: str = "gaussian"
    """peft `init_lora_weights` (`gaussian` as Flow-GRPO, or `true` for zero-B init)."""
    init_lora_path: str = ""
    """Start from this LoRA (peft dir): it becomes the frozen reference and the initial policy."""


@dataclass
class DataConfig:
    train_prompts: str = "assets/prompts/shapes_train.txt"
    """Prompt file: .txt (one per line) or .jsonl with `prompt` (other keys = metadata for rewards)."""
    eval_prompts: str = ""
    """Held-out prompt file for periodic ODE evaluation (empty = no evaluation)."""
    prompts_per_step: int = 4
    """Distinct prompts per RL step; the batch is prompts_per_step * sample.group_size images."""


@dataclass
class SampleConfig:
    height: int = 512
    """Image height in pixels."""
    width: int = 512
    """Image width in pixels."""
    num_steps: int = 10
    """Sampling steps of a training rollout."""
    group_size: int = 24
    """Images per prompt (G)."""
    guidance_scale: float = 4.5
    """Classifier-free guidance (SD3) / guidance embedding (FLUX-dev) in rollout and training; 1 = off."""
    noise_level: float = 0.7
    """SDE noise level a (std_t = a * sqrt(sigma / (1 - sigma))); for cps the angle fraction."""
    sde_type: str = "sde"
    """`sde` (Flow-GRPO) or `cps` (coefficients-preserving sampling)."""
    window_size: int = 0
    """Flow-GRPO-Fast: SDE only on this many consecutive steps (0 = all steps stochastic)."""
    window_range: list[int] = field(default_factory=list)
    """[lo, hi): where the window may start/end (random start each step); empty = [0, num_steps]."""
    timestep_fraction: float = 0.99
    """Without a window: train on the first int(num_steps * fraction) steps."""
    same_noise: bool = False
    """Same initial noise for all images of a prompt."""
    cfg_grad: Literal["both", "cond_only"] = "both"
    """With CFG (guidance_scale > 1, SD3): which branches of v_u + w (v_c - v_u) the training gradient flows
    through. `both` = flow_grpo's training (one forward on [empty; prompt], no detach); `cond_only` detaches the
    unconditional branch (gradient w * dv_c). Log-probs, rollouts and logprob drift are identical in both."""
    batch_size: int = 0
    """Rollout micro-batch (images per transformer call); 0 = whole batch."""
    prompt_cache_size: int = 1024
    """Keep the text embeddings of every training prompt (CPU, LRU by prompt text) when the prompt file has at
    most this many distinct prompts: the text encoders then run once per prompt instead of every step. Larger
    prompt sets (shuffled epochs never revisit a prompt soon) and 0 encode each step's prompts."""
    eval_num_steps: int = 40
    """ODE steps for evaluation."""
    eval_guidance_scale: float = 4.5
    """Guidance for evaluation."""


@dataclass
class FlowGRPOTrainConfig(AdamWTrainConfig):
    micro_batch_size: int = 8
    """Images per forward/backward pass in training."""
    updates_per_step: int = 2
    """Optimizer updates per inner epoch (the rollout batch is split into this many chunks)."""
    num_inner_epochs: int = 1
    """Passes over each rollout batch."""
    clip_range: float = 1e-4
    """PPO clip range on the per-step ratio."""
    adv_clip_max: float = 5.0
    """Advantages are clipped to [-adv_clip_max, adv_clip_max]."""
    beta: float = 0.04
    """Weight of the Gaussian KL to the reference policy (0 = no reference pass)."""
    ema: bool = True
    """Keep an EMA of the trainable weights (the "old" state) and evaluate with it."""
    ema_decay: float = 0.9
    """EMA decay per optimizer update."""


@dataclass
class RewardConfig:
    components: dict[str, Any] = field(default_factory=lambda: {"jpeg_compressibility": 1.0})
    """Zoo rewards: name -> weight, or name -> {weight: w, <load kwargs>} (mmrl.rewards.load mapping)."""
    std_mode: str = "group"
    """Advantage scale: `group` (per-prompt std) or `global` (std of the whole batch)."""
    history: int = 0
    """Per-prompt stat tracker memory: 0 = current batch only (Flow-GRPO), N = last N rewards per prompt."""
    drop_zero_advantage: bool = True
    """Skip samples whose advantage is exactly 0 (groups with identical rewards)."""
    on_nonfinite: OnNonfinite = "error"
    """A NaN/inf reward: `error` (stop, naming the reward component and the sample) or `drop_sample` (train without
    it: it leaves its prompt's group statistics, a group left with < 2 samples is not trained on; the count is
    logged as reward/nonfinite_samples)."""


@dataclass
class LogConfig:
    sample_every: int = 10
    """Save a grid of rollout images (with prompt and reward) every this many steps (0 = never)."""
    num_sample_images: int = 16
    """Images in each grid."""
    eval_every: int = 0
    """ODE evaluation on data.eval_prompts every this many steps and at the end (0 = never)."""
    eval_max_prompts: int = 64
    """At most this many evaluation prompts."""


@dataclass
class Config(RunConfig):
    algorithm: str = "flow_grpo"
    """Recipe name."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model and adapters."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt files."""
    sample: SampleConfig = field(default_factory=SampleConfig)
    """Rollout sampler."""
    train: FlowGRPOTrainConfig = field(default_factory=FlowGRPOTrainConfig)
    """Optimisation."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rewards and advantages."""
    log: LogConfig = field(default_factory=LogConfig)
    """Samples, evaluation."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Several processes under torchrun / accelerate launch (strategy none|ddp|fsdp, backend,
    find_unused_parameters)."""


# ------------------------------------------------------------------------------------------ advantages


class PerPromptStatTracker:
    """Advantages (r - mean_p) / (std + eps) with per-prompt statistics, as Flow-GRPO / DDPO.

    std: population std of the prompt's rewards (std_mode="group") or of the whole batch ("global").
    history=0 uses the current batch only (Flow-GRPO clears its tracker each epoch); history=N keeps
    the last N rewards of each prompt (DDPO's buffer). A prompt whose rewards are all equal gets 0.
    Non-finite rewards (samples dropped by `reward.on_nonfinite: drop_sample`) get 0 and stay out of every
    statistic and buffer.
    """

    # source: flow_grpo/stat_tracking.py (np.std + 1e-4); ddpo-pytorch stat_tracking.py (buffer)
    def __init__(self, std_mode: str = "group", history: int = 0, eps: float = 1e-4):
        if std_mode not in ("group", "global"):
            raise ValueError(f"reward.std_mode: expected 'group' or 'global', got {std_mode!r}")
        self.std_mode, self.history, self.eps = std_mode, int(history), eps
        self.buffers: dict[str, list[float]] = {}

    def update(self, prompts: list[str], rewards: torch.Tensor) -> torch.Tensor:
        r = rewards.detach().double().cpu()
        adv = torch.zeros_like(r)
        ok = torch.isfinite(r)
        global_std = r[ok].std(unbiased=False) + self.eps
        for p in dict.fromkeys(prompts):
            rows = torch.tensor([i for i, q in enumerate(prompts) if q == p and ok[i]], dtype=torch.long)
            if len(rows) == 0:
                continue
            vals = torch.cat([torch.tensor(self.buffers.get(p, []), dtype=torch.float64), r[rows]])
            if vals.max() > vals.min():
                std = global_std if self.std_mode == "global" else vals.std(unbiased=False) + self.eps
                adv[rows] = (r[rows] - vals.mean()) / std
            if self.history > 0:
                self.buffers[p] = vals[-self.history:].tolist()
        return adv.float()

    def state_dict(self) -> dict:
        return {"buffers": {k: list(v) for k, v in self.buffers.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.buffers = {k: list(v) for k, v in state["buffers"].items()}


# ------------------------------------------------------------------------------------------ setup


def _check(cfg: Config) -> None:
    s, t = cfg.sample, cfg.train
    if s.sde_type not in ("sde", "cps"):
        raise ValueError(f"sample.sde_type: expected 'sde' or 'cps', got {s.sde_type!r}")
    if s.group_size < 2:
        raise ValueError(f"sample.group_size must be >= 2 for group-relative advantages, got {s.group_size}")
    if s.window_range and len(s.window_range) != 2:
        raise ValueError(f"sample.window_range: expected [lo, hi], got {s.window_range}")
    if s.noise_level <= 0:
        raise ValueError(f"sample.noise_level must be > 0 for training rollouts, got {s.noise_level}")
    if t.updates_per_step < 1 or t.micro_batch_size < 1 or t.num_inner_epochs < 1:
        raise ValueError("train.updates_per_step, train.micro_batch_size and train.num_inner_epochs must be >= 1")
    # sizes that would otherwise fail deep inside a step (IndexError, empty torch.cat, negative shapes)
    for key, value, least in (("data.prompts_per_step", cfg.data.prompts_per_step, 1), ("sample.height", s.height, 1),
                              ("sample.width", s.width, 1), ("sample.num_steps", s.num_steps, 1),
                              ("sample.eval_num_steps", s.eval_num_steps, 1), ("sample.batch_size", s.batch_size, 0),
                              ("sample.window_size", s.window_size, 0), ("reward.history", cfg.reward.history, 0),
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


# ------------------------------------------------------------------------------------------ training


# the SDE-window position must be the same on every rank (same trained steps -> same micro-step count); it is
# drawn from a generator seeded by (seed, step) and this rank id, which no real process has
_WINDOW_RANK = 1_000_002


def train(cfg: Config) -> dict:
    from mmrl.diffusion.common import (TransformerEvalCounter, build_policy_states, evaluate_ode, init_distributed,
                                       load_reward_fn, restore_checkpoint, save_checkpoint, score_images)
    from mmrl.diffusion.models import PromptEmbedCache, load_flow_model
    from mmrl.diffusion.sampling import sample_groups
    from mmrl.pipelines.data import PromptSampler, load_prompts

    _check(cfg)
    ctx, run = init_distributed(cfg, {"data.prompts_per_step": cfg.data.prompts_per_step})
    s, t = cfg.sample, cfg.train
    train_items = load_prompts(cfg.data.train_prompts)
    eval_items = load_prompts(cfg.data.eval_prompts)[: cfg.log.eval_max_prompts] if cfg.data.eval_prompts else []
    reward_fn = load_reward_fn(cfg.reward.components, run.device)
    model = load_flow_model(cfg.model.path, run.device, run.dtype, cfg.model.max_sequence_length or None)
    n_distinct = len({it.prompt for it in train_items})
    encode = PromptEmbedCache(model, n_distinct) if 0 < n_distinct <= s.prompt_cache_size else model.encode_prompts

    # policy states: "default" trains, "old" = EMA for eval, "ref" = adapters off (KL)
    states = build_policy_states(model, cfg.model, old=t.ema, ref=t.beta > 0)
    evals = TransformerEvalCounter(model.transformer)
    # DDP keeps PolicyStates' parameter objects; one process: unchanged
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
    stateful = {"optimizer": FullOptimizerState(optimizer) if fsdp else optimizer, "lr_scheduler": lr_sched,
                "tracker": tracker, "data": sampler,
                "transformer_evals": evals}
    start, _ = restore_checkpoint(run, states, stateful, tag="flow_grpo", truncate=ctx.is_main)
    evals_synced = evals.count  # global count (all ranks) at the last synchronisation

    rollout_kw = dict(num_steps=s.num_steps, height=s.height, width=s.width, guidance_scale=s.guidance_scale,
                      noise_level=s.noise_level, sde_type=s.sde_type, window_size=s.window_size,
                      window_range=tuple(s.window_range) if s.window_range else None,
                      timestep_fraction=s.timestep_fraction, same_noise=s.same_noise, batch_size=s.batch_size or None)
    timer = Timer(sync_cuda=run.device.type == "cuda")
    bar = run.progress(t.max_steps, initial=start)
    for step in range(start + 1, t.max_steps + 1):
        metrics: dict[str, Any] = {}
        window_gen = None
        if ctx.enabled:  # rank-local noise, a pure function of (seed, rank, step): nothing per rank to checkpoint
            seed_everything(ctx.rank_seed(cfg.seed, step))
            window_gen = torch.Generator().manual_seed(rank_seed(cfg.seed, _WINDOW_RANK, step))
        with timer("step"):
            # ---- 1. rollout: G samples per prompt, prompts encoded once (this rank's share of the prompts)
            with timer("rollout"):
                items = ctx.shard(sampler.next(cfg.data.prompts_per_step))
                embeds = encode([it.prompt for it in items])
                traj = sample_groups(model, embeds, s.group_size, window_generator=window_gen, **rollout_kw)
                prompts = [items[i].prompt for i in traj.prompt_index.tolist()]
                metadata = [items[i].metadata for i in traj.prompt_index.tolist()]

            # ---- 2. rewards (weighted sum; each component logged)
            with timer("reward"):
                scores, reward_metrics = score_images(reward_fn, traj.images, prompts, metadata,
                                                      on_nonfinite=cfg.reward.on_nonfinite)
            if ctx.enabled:  # equal sample counts per rank: the mean of the ranks' means is the batch mean
                reward_metrics = {k: int(ctx.all_reduce_sum(v)) if k == NONFINITE_KEY
                                  else float(ctx.all_reduce_mean(v)) for k, v in reward_metrics.items()}
            metrics.update(reward_metrics)  # reward/mean and reward/std: from all samples, below

            # ---- 3. advantages: per-prompt normalisation over all ranks' rewards, clipping, drop zero advantages
            adv, keep, adv_metrics = global_advantages(ctx, tracker, prompts, scores, t.adv_clip_max,
                                                       cfg.reward.drop_zero_advantage)
            metrics.update(adv_metrics)

            # ---- 4./5. loss per trained timestep, accumulated; optimizer updates (+ EMA)
            with timer("train"):
                metrics.update(_train_on_rollout(cfg, model, states, traj, adv, keep, optimizer, lr_sched, params,
                                                 timer, ctx, guard=guard, step=step))
                metrics.update(guard.pop_metrics())

        # ---- logging, samples, evaluation, checkpoints (rank 0)
        metrics["lr"] = optimizer.param_groups[0]["lr"]
        evals.count = evals_synced = evals_synced + int(ctx.all_reduce_sum(evals.count - evals_synced))
        metrics["cost/transformer_evals"] = evals.count
        if ctx.is_main and cfg.log.sample_every and (step % cfg.log.sample_every == 0 or step == 1):
            n = min(cfg.log.num_sample_images, len(prompts))
            run.save_samples(step, traj.images[:n], [f"r={scores[i]:.3g} {prompts[i]}" for i in range(n)])
        eval_now = eval_items and cfg.log.eval_every and (step % cfg.log.eval_every == 0 or step == t.max_steps)
        if (ctx.is_main or fsdp) and eval_now:  # FSDP: every rank runs the forwards, rank 0 writes
            with timer("eval"):
                metrics.update(evaluate_ode(
                    model, states, "old" if t.ema else "default", reward_fn, eval_items,
                    run if ctx.is_main else NoSamples(), step,
                    num_steps=s.eval_num_steps, guidance_scale=s.eval_guidance_scale, height=s.height,
                    width=s.width, batch_size=t.micro_batch_size, seed=cfg.seed, num_images=cfg.log.num_sample_images))
        metrics.update(timer.pop())
        metrics["time/step_s"] = metrics.pop("time/step_s")
        if ctx.is_main:
            run.log(step, metrics)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.4g}", drift=f"{metrics.get('diag/logprob_drift', 0):.1e}")
        if (t.save_every and step % t.save_every == 0) or step == t.max_steps:
            check_finite_weights(states, step, ctx, run)  # never a checkpoint with NaN/inf weights
            if fsdp:  # gathering the shards is a collective: every rank takes part, rank 0 writes
                save_checkpoint_fsdp(ctx, run, step, states, stateful)
            elif ctx.is_main:
                save_checkpoint(run, step, states, stateful)
            ctx.barrier()  # nobody reads or resumes from a half-written checkpoint
    bar.close()
    summary = _summarise(run) if ctx.is_main else {}
    ctx.barrier()
    ctx.close()
    return summary


def global_advantages(ctx: DistContext, tracker: PerPromptStatTracker, prompts: list[str], scores: torch.Tensor,
                      adv_clip_max: float, drop_zero_advantage: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(advantages of this rank's samples [b], indices of the samples to train on, metrics).

    Rewards and prompts of every rank are all-gathered (rank order), the tracker normalises per prompt over
    that global batch (a prompt's group may even span ranks), and each rank keeps its own rows. Every rank
    updates its tracker with the same global batch, so the tracker state is identical everywhere (rank 0's
    checkpoint is everyone's). One process: exactly `tracker.update(prompts, scores)`.
    Non-finite scores mark samples dropped by `reward.on_nonfinite: drop_sample`: they are never kept, and neither
    are the samples of a prompt left with fewer than 2 finite rewards (no relative signal)."""
    all_prompts = [p for part in ctx.all_gather_object(list(prompts)) for p in part]
    all_scores = ctx.all_gather_tensor(scores)
    sizes = list(ctx.last_gather_sizes)
    adv_all = tracker.update(all_prompts, all_scores).clamp(-adv_clip_max, adv_clip_max)
    adv = ctx.local_slice(adv_all, sizes)
    prompt_ids = {p: i for i, p in enumerate(dict.fromkeys(all_prompts))}
    usable = ctx.local_slice(group_keep(torch.isfinite(all_scores), torch.tensor([prompt_ids[p] for p in all_prompts])),
                             sizes)
    keep = (usable & (adv != 0) if drop_zero_advantage else usable).nonzero().flatten()
    n_keep = int(ctx.all_reduce_sum(len(keep)))
    metrics = {"train/kept_fraction": n_keep / len(adv_all), "train/advantage_abs": adv_all.abs().mean().item()}
    if ctx.enabled:  # the whole batch's reward statistics (score_images gave this rank's)
        metrics.update(finite_stats(all_scores))
    return adv, keep, metrics


def _train_on_rollout(cfg, model, states, traj, adv, keep, optimizer, lr_sched, params, timer,
                      ctx: DistContext | None = None, guard: UpdateGuard | None = None, step: int = 0) -> dict:
    """Inner epochs over one rollout batch; returns averaged loss metrics and diag/logprob_drift.

    Several ranks: each holds its rows of the global batch; an update's chunk is the union of the ranks'
    local chunks, each rank's loss is weighted by `ctx.loss_scale(len(local chunk))` (DDP averages, so the
    gradient is the global chunk mean), all ranks run the same number of micro-steps (zero-weight padding
    micro-batches where a rank has fewer or no rows), and gradients are all-reduced once per update (no_sync
    around the forward and backward of every other micro-step)."""
    from mmrl.diffusion.common import merge_rank_lists
    from mmrl.diffusion.sampling import step_log_prob

    ctx = ctx or DistContext()
    t = cfg.train
    guard = guard or UpdateGuard(t.max_skipped_updates, ctx)
    step_kw = dict(guidance_scale=cfg.sample.guidance_scale, noise_level=cfg.sample.noise_level,
                   sde_type=cfg.sample.sde_type, cfg_grad=cfg.sample.cfg_grad)
    acc: dict[str, list] = defaultdict(list)  # floats or 0-dim tensors (converted once, at the end: no GPU syncs)
    drift: list[torch.Tensor] = []
    steps = traj.train_steps.tolist()
    if ctx.max_int(len(keep)) == 0 or not steps:
        return {"diag/logprob_drift": 0.0, "train/updates": 0}
    # the reference is frozen: its step means are computed once per (sample, step) and reused by later epochs
    # (not under FSDP: cache hits differ between ranks with padding micro-steps, and FSDP needs equal forwards)
    fsdp = ctx.enabled and getattr(cfg, "dist", None) is not None and cfg.dist.strategy == "fsdp"
    ref_cache = RefMeanCache(traj) if t.beta > 0 and t.num_inner_epochs > 1 and not fsdp else None
    pad_rows = keep[:1] if len(keep) else torch.zeros(1, dtype=torch.long)  # any real row; weight 0
    updates = 0
    for epoch in range(t.num_inner_epochs):
        order = keep[torch.randperm(len(keep))]
        n_updates = min(t.updates_per_step, ctx.max_int(len(order)))  # identical on every rank
        for u, chunk in enumerate(torch.tensor_split(order, n_updates)):
            first_update = epoch == 0 and u == 0
            n_losses = len(acc["train/loss"])  # this update's micro-step losses are appended after this index
            micro = [m for m in torch.split(chunk, t.micro_batch_size) if len(m)]  # (an empty chunk splits into [[]])
            n_micro = ctx.max_int(len(micro))  # same number of micro-steps on every rank
            scale = ctx.loss_scale(len(chunk))  # local mean -> global mean under DDP's gradient average
            for mi in range(n_micro):
                real = mi < len(micro)
                rows = micro[mi] if real else pad_rows
                b = len(rows)
                emb = traj.embeds.select(traj.prompt_index[rows])
                a = adv[rows].to(model.device)
                weight = b / len(chunk) / len(steps) * scale if real else 0.0  # mean over the chunk and steps
                ref_means = _reference_means(model, states, traj, rows, steps, emb, step_kw, ref_cache, timer) \
                    if t.beta > 0 else {}
                for j in steps:
                    last = mi == n_micro - 1 and j == steps[-1]  # DDP all-reduces in this backward only
                    with ctx.no_sync(model.transformer, sync=last):  # wraps forward AND backward
                        x, x_next = traj.latents[rows, j], traj.latents[rows, j + 1]
                        sig, sig_next = traj.sigmas[j].expand(b), traj.sigmas[j + 1].expand(b)
                        old_lp = traj.log_probs[rows, j]
                        with timer("forward_backward"):
                            cur = step_log_prob(model, x, x_next, sig, sig_next, emb, **step_kw)
                        if first_update and real:  # no optimizer step has happened yet: must equal the rollout
                            drift.append((cur.log_prob.detach() - old_lp).abs().max())
                        loss, m = clipped_policy_loss(cur.log_prob, old_lp, a, clip_low=t.clip_range,
                                                      clip_high=t.clip_range)
                        if t.beta > 0:
                            std = cur.std[:, 0, 0, 0].clamp(min=1e-8)
                            kl = gaussian_kl_equal_std(cur.mean, ref_means[j], std).mean()
                            loss = loss + t.beta * kl
                            if real:
                                acc["policy/kl"].append(kl.detach())
                        with timer("forward_backward"):
                            (loss * weight).backward()
                    if real:
                        acc["policy/clipfrac"].append(m["clipfrac"])
                        acc["policy/approx_kl"].append(m["approx_kl"])
                        acc["policy/ratio_max"].append(m["ratio_max"])
                        acc["train/loss"].append(loss.detach())
            grad_norm = clip_grads(params, t.max_grad_norm)
            acc["train/grad_norm"].append(grad_norm)
            if guard.step(optimizer, acc["train/loss"][n_losses:], grad_norm, step):  # NaN/inf: skipped
                lr_sched.step()
                updates += 1
                if t.ema:
                    states.ema("default", "old", t.ema_decay)
            optimizer.zero_grad(set_to_none=True)
    vals = {k: [float(x) for x in v] for k, v in acc.items()}
    vals["diag/logprob_drift"] = [0.0] + [float(d) for d in drift]
    vals = merge_rank_lists(ctx, vals)  # metrics of the whole batch: every rank's micro-step values
    out = {k: max(v) if k in ("policy/ratio_max", "diag/logprob_drift") else sum(v) / len(v)
           for k, v in vals.items() if v}
    out["train/updates"] = updates
    return out


@torch.no_grad()
def _reference_means(model, states, traj, rows, steps, emb, step_kw, ref_cache, timer) -> dict[int, torch.Tensor]:
    """Step means of the reference policy for one micro-batch at every trained step: {j: mean [b, C, h, w]}.

    All of a micro-batch's reference forwards run under ONE switch to the reference state (switching peft
    adapters walks every LoRA layer), before the policy's forward/backward passes; with `ref_cache` (several
    inner epochs) steps computed in an earlier epoch are looked up instead."""
    from mmrl.diffusion.sampling import step_log_prob

    b = len(rows)
    out, todo = {}, []
    for j in steps:
        cached = ref_cache.get(rows, j) if ref_cache is not None else None
        if cached is None:
            todo.append(j)
        else:
            out[j] = cached
    if todo:
        with states.use("ref"), timer("forward_backward"):
            for j in todo:
                out[j] = step_log_prob(model, traj.latents[rows, j], traj.latents[rows, j + 1],
                                       traj.sigmas[j].expand(b), traj.sigmas[j + 1].expand(b), emb, **step_kw).mean
                if ref_cache is not None:
                    ref_cache.put(rows, j, out[j])
    return out


class RefMeanCache:
    """Reference-policy step means [B, K, C, h, w] of one rollout batch (K = trained steps), filled on first
    use. The reference (adapters off, or a frozen snapshot) does not change during a step's inner epochs, so
    epochs after the first skip the reference forward entirely."""

    def __init__(self, traj):
        self.index = {j: k for k, j in enumerate(traj.train_steps.tolist())}
        shape = (traj.latents.shape[0], len(self.index), *traj.latents.shape[2:])
        self.means = torch.empty(shape, dtype=torch.float32, device=traj.latents.device)
        self.filled = torch.zeros(shape[:2], dtype=torch.bool)

    def get(self, rows: torch.Tensor, j: int) -> torch.Tensor | None:
        k = self.index[j]
        return self.means[rows.to(self.means.device), k] if bool(self.filled[rows, k].all()) else None

    def put(self, rows: torch.Tensor, j: int, mean: torch.Tensor) -> None:
        k = self.index[j]
        self.means[rows.to(self.means.device), k] = mean.detach().float()
        self.filled[rows, k] = True


def _summarise(run: Run) -> dict:
    """run.finish() plus the reward-rise check: mean of the last 5 steps vs the first 5 steps (steps without a
    finite reward, e.g. every sample dropped as non-finite, are logged as null and left out)."""
    rows = [r for r in run.read_metrics() if r.get("reward/mean") is not None]
    extra: dict[str, Any] = {}
    if rows:
        k = min(5, len(rows))
        first = [r["reward/mean"] for r in rows[:k]]
        last = [r["reward/mean"] for r in rows[-k:]]
        first_std = sum(r.get("reward/std") or 0.0 for r in rows[:k]) / k
        rise = sum(last) / k - sum(first) / k
        extra = {"reward_rise": rise, "reward_first_std": first_std,
                 "reward_rise_in_std": rise / first_std if first_std > 0 else (math.inf if rise > 0 else 0.0),
                 "reward_rose": rise > 2 * first_std,
                 "max_logprob_drift": max(r.get("diag/logprob_drift") or 0.0 for r in rows)}
        print(f"[flow_grpo] reward first {k} steps {sum(first) / k:.4g} (per-image std {first_std:.3g}) -> "
              f"last {k} steps {sum(last) / k:.4g}: rise {rise:+.4g} = {extra['reward_rise_in_std']:.2f} std "
              f"({'PASS' if extra['reward_rose'] else 'no clear rise'}: needs > 2 std); "
              f"max logprob drift {extra['max_logprob_drift']:.2e}")
    return run.finish(extra)
