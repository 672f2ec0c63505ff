"""Flow-GRPO: online RL for flow-matching text-to-image models (Liu et al. 2025, arXiv 2505.05470).

One step reads top to bottom:
  1. rollout  - G images per prompt with an SDE sampler, recording every latent and log-prob;
  2. rewards  - a weighted sum of zoo rewards (`reward.components`), each component logged;
  3. advantages - per-prompt normalisation (`core.prompt_stats`), clipping, zero-advantage groups dropped;
  4. loss     - per trained timestep: PPO-clipped ratio of the step's Gaussian log-probs, plus
                algo.kl.coef * closed-form Gaussian KL to the reference (adapters off) (`grpo_update`);
  5. step     - gradients accumulated over timesteps and micro-batches, grad-norm clipping, AdamW,
                optional EMA of the trainable weights (the "old" state) used for evaluation.

    from mmrl.config import load_config
    from mmrl.diffusion.flow_grpo import train
    summary = train(load_config("configs/diffusion/flow_grpo_tiny.yaml", ["train.max_steps=20"]))

Several processes (`torchrun` / `accelerate launch`, `dist.strategy: ddp`): `rollout.prompts_per_step` is the
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

Rollout precision and correction: `rollout.precision: bf16` samples under torch.autocast(bfloat16) (a
faster engine on GPUs); the rollout's log-probs then differ from the fp32 trainer's by more than the 1e-4 clip range.
`algo.old_logprobs: recompute` takes pi_old from one no-grad trainer forward per (kept sample, trained step) before the
update (decoupled PPO), and `algo.rollout_correction` weights (TIS) or masks (MIS, veto) each denoising step
(`token`) or trajectory (`sequence`, `geometric`) by pi_old / pi_rollout (`grpo_update._old_policy`).

Beyond flow_grpo: `algo.ratio_norm: grpo_guard` (GRPO-Guard's ratio normalisation, `mmrl.core.grpo_guard`),
`algo.velocity_norm` (velocity-norm drift against the reference, and a penalty), `reward.aggregation` (GDPO),
`log.judges` (held-out judges and the reward-hacking alarm, `mmrl.training.judges`).

What is simplified away versus flow_grpo's scripts: the reward overlaps the rollout only with
`reward.score_while_sampling` (flow_grpo always uses its thread pool); KL as a loss only (no KL-in-reward).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal

from mmrl.config import RunConfig
from mmrl.diffusion import config as dc
from mmrl.diffusion.diagnostics import VelocityNormConfig
from mmrl.distributed import DistConfig
from mmrl.run.start import closes_runs
from mmrl.training import KLConfig, RunningNormFields, UpdateConfig
from mmrl.training.config import AsyncRolloutFields, RolloutCorrectionConfig

__all__ = ["Config", "train"]


# ------------------------------------------------------------------------------------------ config


@dataclass
class RolloutConfig(AsyncRolloutFields, dc.GroupRolloutConfig):  # + worker, max_staleness, worker_threads
    noise_level: float = 0.7
    """SDE noise level a (std_t = a * sqrt(sigma / (1 - sigma))); for cps the angle fraction."""
    sde_type: Literal["sde", "cps"] = "sde"
    """`sde` (Flow-GRPO) or `cps` (coefficients-preserving sampling)."""
    window_size: int = 0
    """Flow-GRPO-Fast: SDE only on this many consecutive steps (0 = all steps stochastic)."""
    window_range: list[int] = field(default_factory=list)
    """[lo, hi): where the window may start/end (random start each step); empty = [0, num_steps]."""
    window_schedule: Literal["random", "progressive"] = "random"
    """How the SDE window moves between steps: `random` (Flow-GRPO-Fast: a uniform start in window_range) or
    `progressive` (MixGRPO: from window_range's start, window_move_by steps later every window_move_every steps,
    back to the start after the end; `mmrl.diffusion.mixgrpo`)."""
    window_move_every: int = 25
    """progressive: RL steps the window stays at one position (MixGRPO: 25; MixGRPO-Flash: 20)."""
    window_move_by: int = 1
    """progressive: steps the window moves each time (MixGRPO: 1; 0 = a fixed window, MixGRPO-Flash*)."""
    ode_solver: Literal["euler", "dpm2"] = "euler"
    """Solver of the deterministic steps after the SDE window: `euler` or `dpm2` (DPM-Solver++(2M), MixGRPO-Flash)."""
    ode_compress: float = 1.0
    """With a window: keep this fraction of the schedule's points after it (MixGRPO-Flash: 0.4, Flash*: 0.2)."""
    timestep_fraction: float = 0.99
    """Without a window: train on the first int(num_steps * fraction) steps."""
    same_noise: bool = False
    """Same initial noise for all images of a prompt."""
    cfg_grad: Literal["both", "cond_only"] = "cond_only"
    """With CFG (guidance_scale > 1, SD3): which branches of v_u + w (v_c - v_u) the training gradient flows
    through. `cond_only` = flow_grpo's training today (scripts/train_sd3.py `compute_log_prob` detaches
    `noise_pred_uncond` since commit 2d76907, 2025-07-15; still so at ac4c86e): gradient w dv_c. `both` = its
    earlier code (no detach): w dv_c + (1 - w) dv_u. Log-probs, rollouts and logprob drift are identical in both."""
    precision: Literal["run", "bf16"] = "run"
    """`bf16`: the rollout's transformer forwards run under torch.autocast(bfloat16), a faster lower-precision
    sampler; the trainer recomputes in the run's dtype, so its log-probs differ from the rollout's (use
    `algo.old_logprobs: recompute` and `algo.rollout_correction`). `run`: the model's own dtype."""
    prompt_cache_size: int = 1024
    """Keep the text embeddings of every training prompt (CPU, LRU by prompt text) when the prompt file has at
    most this many distinct prompts: the text encoders then run once per prompt instead of every step. Larger
    prompt sets (shuffled epochs never revisit a prompt soon) and 0 encode each step's prompts. Edit models encode
    each step's rows with their source images (the cache is keyed by text only)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window_range and len(self.window_range) != 2:
            raise ValueError(f"rollout.window_range: expected [lo, hi], got {self.window_range}")
        if self.noise_level <= 0:
            raise ValueError(f"rollout.noise_level must be > 0 for training rollouts, got {self.noise_level}")
        if self.window_size < 0:
            raise ValueError(f"rollout.window_size: expected >= 0, got {self.window_size}")
        if (self.window_schedule == "progressive" or self.ode_compress != 1.0) and self.window_size < 1:
            raise ValueError(f"rollout.window_schedule={self.window_schedule} / rollout.ode_compress={self.ode_compress}"
                             f" need an SDE window: set rollout.window_size >= 1")
        if not 0 < self.ode_compress <= 1 or self.window_move_every < 1 or self.window_move_by < 0:
            raise ValueError(f"rollout.ode_compress in (0, 1], window_move_every >= 1, window_move_by >= 0 expected; "
                             f"got {self.ode_compress}, {self.window_move_every}, {self.window_move_by}")


@dataclass
class FlowGRPOUpdateConfig(UpdateConfig):
    mini_batch_size: int = 48
    """Samples per optimizer update over the nominal batch (prompts_per_step * group_size); Flow-GRPO: 2 updates
    per epoch. 0 = one update per epoch; must divide the batch."""
    micro_batch_size: int = 8
    """Samples per forward/backward pass (gradient accumulation inside one update)."""


@dataclass
class FlowGRPOKLConfig(KLConfig):
    coef: float = 0.04
    """Weight of the closed-form Gaussian KL of each SDE step to the reference (0 = no reference pass)."""


@dataclass
class RewardConfig(RunningNormFields, dc.AdvantageRewardConfig):  # + running_norm*, before the per-prompt stats
    score_while_sampling: bool = False
    """Score each rollout micro-batch (rollout.micro_batch_size) in a worker thread while the next one is sampled,
    as flow_grpo's executor does; same rewards as scoring the whole batch (per-sample rewards only)."""


@dataclass
class AlgoConfig:
    clip_range: float = 1e-4
    """PPO clip range on the per-step ratio."""
    adv_clip_max: float = 5.0
    """Advantages are clipped to [-adv_clip_max, adv_clip_max]."""
    kl: FlowGRPOKLConfig = field(default_factory=FlowGRPOKLConfig)
    """KL to the reference policy (adapters off): `coef` weights the closed-form Gaussian KL of each SDE step
    (0 = no reference pass); `estimator` and `in_reward` are not used by diffusion steps."""
    ema: bool = True
    """Keep an EMA of the trainable weights (the "old" state) and evaluate with it."""
    ema_decay: float = 0.9
    """EMA decay per optimizer update."""
    old_logprobs: Literal["rollout", "recompute"] = "rollout"
    """pi_old of the PPO ratio: the rollout's recorded log-probs (`rollout`, Flow-GRPO), or a no-grad forward per
    trained step with the trainer before the update (`recompute`; one extra forward per kept sample and step)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """With old_logprobs=recompute: TIS weights / MIS and veto masks between pi_old and the rollout's log-probs,
    per denoising step (`token`) or per trajectory (`sequence`, `geometric`); `rollout/correction/*` metrics."""
    ratio_norm: Literal["none", "grpo_guard"] = "none"
    """`grpo_guard`: the PPO log-ratio of each step becomes GRPO-Guard's (log r) * s + mean((mu - mu_old)^2) / (2 s)
    (s = the step's std; Flow-Factory's `grpo-guard`): no negative bias, one scale for every step. Needs
    rollout.sde_type=sde; keeps the rollout's step means (memory as the latents)."""
    grpo_guard_reweight: bool = False
    """With ratio_norm=grpo_guard: GRPO-Guard's gradient reweighting, each trained step's policy loss divided by its
    step size sigma_t - sigma_(t+1) (-dt), as verl-omni's `grpo_guard` loss; the guard's per-step gradient is
    (1 + noise_level^2 / 2) dt mean(eps dv), so the steps then weigh alike (`mmrl.core.grpo_guard`). The KL term
    is not reweighted. Off: Flow-Factory's `grpo-guard` (no reweighting)."""
    velocity_norm: VelocityNormConfig = field(default_factory=VelocityNormConfig)
    """||v_theta|| / ||v_ref|| on the trained steps (diag/velocity_norm_ratio, whenever the reference runs) and a
    hinge penalty coef * mean max(0, ratio - 1)^2 (`coef`, 0 = off); `reference_pass` runs the reference for the
    diagnostic alone."""

    def __post_init__(self) -> None:
        if self.rollout_correction.enabled and self.old_logprobs == "rollout":
            raise ValueError("algo.rollout_correction needs algo.old_logprobs=recompute: with `rollout` the PPO ratio "
                             "is already taken against the rollout's log-probs (the weights would count it twice)")


@dataclass
class Config(RunConfig):
    algorithm: str = "flow_grpo"
    """Recipe name."""
    model: dc.ModelConfig = field(default_factory=dc.ModelConfig)
    """Model and adapters."""
    data: dc.DataConfig = field(default_factory=dc.DataConfig)
    """Prompt files."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout sampler (SDE)."""
    optim: dc.DiffusionOptimConfig = field(default_factory=dc.DiffusionOptimConfig)
    """AdamW and its learning-rate schedule."""
    update: FlowGRPOUpdateConfig = field(default_factory=FlowGRPOUpdateConfig)
    """Inner epochs, mini-batches (optimizer updates), micro-batches, gradient clipping."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Flow-GRPO loss: clipping, KL, EMA."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rewards and advantages."""
    log: dc.LogConfig = field(default_factory=dc.LogConfig)
    """Samples, evaluation."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Several processes under torchrun / accelerate launch (strategy none|ddp|fsdp, backend,
    find_unused_parameters)."""


# ------------------------------------------------------------------------------------------ training


@closes_runs  # the run directory's lock released however train() ends; a failed start leaves nothing
def train(cfg: Config) -> dict:
    from mmrl.diffusion.grpo_update import train_on_rollout
    from mmrl.diffusion.loop import DiffusionLoop
    from mmrl.diffusion.models import PromptEmbedCache
    from mmrl.diffusion.rollout import BUILDER, sde_sampling, sde_step_metrics, window_range
    from mmrl.diffusion.scoring import AsyncRewardScorer
    from mmrl.training.async_rollout import check_async_rollout, policy_weights, rollout_process
    from mmrl.training.rank_rollout import serve_rollout_rank

    dc.check_common(cfg)
    check_async_rollout(cfg, recomputes_old=cfg.algo.old_logprobs == "recompute")
    rollout, algo = cfg.rollout, cfg.algo
    if algo.ratio_norm == "grpo_guard" and rollout.sde_type != "sde":
        raise ValueError(f"algo.ratio_norm=grpo_guard needs rollout.sde_type=sde (Gaussian Euler-Maruyama steps), "
                         f"got {rollout.sde_type!r}")
    if algo.grpo_guard_reweight and algo.ratio_norm != "grpo_guard":
        raise ValueError(f"algo.grpo_guard_reweight balances the per-step gradients of GRPO-Guard's ratio: it needs "
                         f"algo.ratio_norm=grpo_guard, got {algo.ratio_norm!r}")
    cfg.update.updates_per_epoch(rollout.batch)  # update.mini_batch_size must divide the batch: fail before loading
    if serve_rollout_rank(cfg, BUILDER):  # rollout.worker=ranks: this rank generated the trainer rank's batches
        return {}
    loop = DiffusionLoop(cfg)
    model = loop.model
    # rewards overlap the next rollout micro-batch
    scorer = AsyncRewardScorer(loop.reward_fn) if cfg.reward.score_while_sampling else None
    idle = model.idle_experts(rollout.num_steps, rollout.height, rollout.width, window_range(rollout))
    if idle:  # e.g. Wan 2.2 A14B with the SDE window on early steps only: the low-noise expert never trains
        warnings.warn(f"{' and '.join(idle)} get(s) no gradient: no SDE step in rollout.window_range="
                      f"{list(window_range(rollout))} of {rollout.num_steps} steps runs through it (the "
                      f"experts split the steps at the checkpoint's boundary_ratio); widen the window to train it",
                      stacklevel=2)
    n_distinct = len({it.prompt for it in loop.train_items})
    encode = PromptEmbedCache(model, n_distinct) if 0 < n_distinct <= rollout.prompt_cache_size else None

    # policy states: "default" trains, "old" = EMA for eval, "ref" = adapters off (KL)
    loop.setup(old=algo.ema, ref=algo.kl.coef > 0 or algo.velocity_norm.needs_reference(),
               eval_state="old" if algo.ema else "default")
    pipe = rollout_process(cfg, loop.ctx, loop.run, BUILDER, loop.stateful)  # rollout.worker=process: None inline
    start = loop.begin(postfix=lambda m: {"drift": f"{m.get('diag/logprob_drift', 0):.1e}"})
    if pipe is not None:  # the rollout process starts from this version's weights and data position
        pipe.start(start, policy_weights(loop.states))
    for step in loop:
        # ---- 1./2. rollout: G SDE samples per prompt, prompts encoded once (this rank's share of the prompts), and
        # rewards (weighted sum; each component logged; several ranks: means over all samples)
        roll = loop.rollout(step, sde_sampling(cfg, step, loop.ctx.world_size), encode=encode, scorer=scorer,
                            pipe=pipe, step_metrics=sde_step_metrics(rollout))
        # ---- 3. advantages: per-prompt normalisation over all ranks' rewards (reward.aggregation), clipping,
        # zero advantages dropped
        adv, keep = loop.advantages(roll, clip=algo.adv_clip_max, reward_norm=loop.reward_norm)
        # ---- 4./5. loss per trained timestep, accumulated; optimizer updates (+ EMA)
        with loop.timer("train"):
            loop.metrics.update(train_on_rollout(loop.parts, step, roll.traj, adv, keep))
            loop.metrics.update(loop.guard.pop_metrics())
        if pipe is not None:  # version `step`: the rollout process makes later batches with these weights
            loop.metrics.update(pipe.push(step, policy_weights(loop.states, only=loop.params)))
    if scorer is not None:
        scorer.close()
    if pipe is not None:
        pipe.close()
    return loop.finish(_summarise)


def _summarise(run) -> dict:
    """`mmrl.training.summarise` plus the largest logprob drift of the run (must be ~0: rollout and training
    compute the same log-probs). Whether the reward rose enough is the demo's check (`mmrl demo`), not a verdict on
    every run."""
    from mmrl.training import summarise

    drift = max((r.get("diag/logprob_drift") or 0.0 for r in run.read_metrics()), default=0.0)
    summary = summarise(run, "flow_grpo")
    if "reward_rise" in summary:
        summary["max_logprob_drift"] = drift
        print(f"[flow_grpo] max logprob drift {drift:.2e} (rollout vs training log-probs; ~0 expected)", flush=True)
    return summary
