"""Config sections every recipe shares, so one concept has one key everywhere (`model.lora.rank`,
`optim.lr`, `update.epochs`, `algo.kl.coef`, ...). Recipes embed them with their own defaults, e.g.
``optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

KLEstimator = Literal["k1", "k2", "k3", "low_var_kl", "kl", "mse", "abs"]
TrackerName = Literal["jsonl", "tensorboard", "wandb"]


@dataclass
class TrackersConfig:
    """Experiment trackers (`mmrl.run.trackers`); every recipe's `log:` section has these keys."""

    trackers: list[TrackerName] = field(default_factory=lambda: ["jsonl"])
    """Where metrics, sample images (with prompt and reward) and the config go: jsonl (metrics.jsonl, always on),
    tensorboard (<run>/tensorboard/), wandb (<run>/wandb/)."""
    wandb_project: str = "mmrl"
    """W&B project name."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """W&B mode: offline (files for a later `wandb sync`; no network), online (needs network and a login)."""


@dataclass
class LoRAConfig:
    rank: int = 32
    """LoRA rank r; 0 = full fine-tuning (no adapters; "old"/"ref" states are parameter snapshots)."""
    alpha: int = 64
    """LoRA alpha (scale = alpha / rank)."""
    target_modules: list[str] = field(default_factory=list)
    """Module names that get adapters; empty = the model family's default."""
    init: str = "true"
    """peft `init_lora_weights`: `true` (B = 0, the policy starts as the base model), `gaussian`, `pissa`, ..."""
    init_path: str = ""
    """Start from this LoRA (a peft directory): it becomes the frozen reference and the initial policy."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"model.lora.rank: expected >= 0 (0 = full fine-tuning), got {self.rank}")
        if self.rank > 0 and self.alpha <= 0:
            raise ValueError(f"model.lora.alpha: expected > 0, got {self.alpha}")
        if self.rank == 0 and self.init_path:
            raise ValueError("model.lora.init_path needs model.lora.rank > 0 (full fine-tuning starts from the base "
                             "weights)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def peft_lora_config(lora: LoRAConfig, default_targets: Any = (), **extra: Any):
    """peft `LoraConfig` of a `model.lora` section (None when rank = 0: full fine-tuning). `default_targets`: the
    family's modules when `target_modules` is empty (a list, or a regex string as peft accepts)."""
    if not lora.enabled:
        return None
    from peft import LoraConfig

    init: Any = {"true": True, "false": False}.get(str(lora.init).lower(), lora.init)
    targets = list(lora.target_modules) or default_targets
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, init_lora_weights=init,
                      target_modules=list(targets) if not isinstance(targets, str) else targets, **extra)


@dataclass
class OptimConfig:
    lr: float = 3e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up over this many scheduler steps (0 = none)."""
    lr_end_factor: float = 1.0
    """Linear decay of the learning rate to lr * lr_end_factor at the last step (1 = constant after warm-up)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optim.lr: expected > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas: expected [beta1, beta2] in [0, 1), got {self.betas}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps: expected >= 0, got {self.warmup_steps}")
        if not 0 <= self.lr_end_factor <= 1:
            raise ValueError(f"optim.lr_end_factor: expected in [0, 1], got {self.lr_end_factor}")


@dataclass
class UpdateConfig:
    epochs: int = 1
    """Passes over each rollout batch (PPO epochs / inner epochs)."""
    mini_batch_size: int = 0
    """Samples per optimizer update, counted over the nominal batch (prompts_per_step * group_size, all processes);
    the batch is split into nominal / mini_batch_size updates per epoch (it must divide the nominal batch);
    0 = one update per epoch. Dropped samples shrink the updates, never their number."""
    micro_batch_size: int = 8
    """Samples per forward/backward pass (gradient accumulation inside one update)."""
    max_grad_norm: float = 1.0
    """Clip the gradient norm to this before every update (0 = no clipping)."""
    max_skipped_updates: int = 3
    """An update whose loss or gradient norm is NaN/inf is skipped (weights, optimizer, schedule and EMA unchanged;
    counted in `train/skipped_updates`); this many skips in a row stop the run with an error (>= 1)."""

    def __post_init__(self) -> None:
        for key in ("epochs", "micro_batch_size", "max_skipped_updates"):
            if getattr(self, key) < 1:
                raise ValueError(f"update.{key}: expected >= 1, got {getattr(self, key)}")
        if self.mini_batch_size < 0:
            raise ValueError(f"update.mini_batch_size: expected >= 0 (0 = whole batch), got {self.mini_batch_size}")
        if self.max_grad_norm < 0:
            raise ValueError(f"update.max_grad_norm: expected >= 0 (0 = no clipping), got {self.max_grad_norm}")

    def updates_per_epoch(self, nominal_batch: int) -> int:
        """Optimizer updates per epoch for a nominal batch of `nominal_batch` samples (ValueError if it does not
        divide)."""
        if self.mini_batch_size == 0:
            return 1
        if nominal_batch % self.mini_batch_size:
            raise ValueError(f"update.mini_batch_size={self.mini_batch_size} must divide the rollout batch "
                             f"(prompts_per_step * group_size = {nominal_batch})")
        return nominal_batch // self.mini_batch_size


@dataclass
class KLConfig:
    coef: float = 0.0
    """Weight of the KL to the reference policy (0 = no reference pass at all)."""
    estimator: KLEstimator = "k3"
    """Per-token estimator for sampled sequences (k1, k2, k3 = low_var_kl); diffusion steps use the closed-form
    Gaussian KL and ignore it."""
    in_reward: bool = False
    """Subtract coef * KL from the reward (verl's use_kl_in_reward) instead of adding it to the loss."""

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise ValueError(f"algo.kl.coef: expected >= 0, got {self.coef}")


CorrectionLevel = Literal["none", "token", "sequence", "geometric"]


@dataclass
class RolloutCorrectionConfig:
    """Importance correction between the rollout engine's sampling log-probs and the trainer's old log-probs
    (verl's rollout_correction; `mmrl.core.correction`)."""

    is_level: CorrectionLevel = "none"
    """Truncated importance weights (TIS) per `token`, per `sequence` (product of ratios) or `geometric` (geometric
    mean); `none` = no weights."""
    is_threshold: float = 2.0
    """TIS cap C: w = min(pi_old / pi_rollout, C)."""
    rs_level: CorrectionLevel = "none"
    """Masked IS (MIS): drop tokens / sequences whose ratio is outside [rs_threshold_lower, rs_threshold]."""
    rs_threshold: float = 2.0
    """MIS upper bound."""
    rs_threshold_lower: float = 0.0
    """MIS lower bound (0 = 1 / rs_threshold)."""
    veto_threshold: float = 0.0
    """Drop a whole sequence if any token's ratio is below this (0 = off)."""

    def __post_init__(self) -> None:
        # the ranges mmrl.core.correction needs, checked when the config is read (not at the first step)
        for key in ("is_threshold", "rs_threshold"):
            value = getattr(self, key)
            if not 1.0 < value < math.inf:
                raise ValueError(f"algo.rollout_correction.{key}: expected a finite number > 1, got {value}")
        if not (self.rs_threshold_lower == 0 or 0 < self.rs_threshold_lower <= 1):
            raise ValueError(f"algo.rollout_correction.rs_threshold_lower: expected 0 (= 1 / rs_threshold) or a "
                             f"number in (0, 1], got {self.rs_threshold_lower}")
        if not 0 <= self.veto_threshold < 1:
            raise ValueError(f"algo.rollout_correction.veto_threshold: expected 0 (off) or a number in (0, 1), got "
                             f"{self.veto_threshold}")

    @property
    def enabled(self) -> bool:
        return self.is_level != "none" or self.rs_level != "none" or self.veto_threshold > 0

    def apply(self, old_logp, rollout_logp, mask):
        """`mmrl.core.correction.rollout_correction` with this section's settings; metrics renamed to
        `rollout/correction/*`. Returns (weights [B, T] or None, mask [B, T], metrics)."""
        from mmrl.core.correction import rollout_correction

        out = rollout_correction(
            old_logp, rollout_logp, mask,
            is_level=None if self.is_level == "none" else self.is_level, is_threshold=self.is_threshold,
            rs_level=None if self.rs_level == "none" else self.rs_level, rs_threshold=self.rs_threshold,
            rs_threshold_lower=self.rs_threshold_lower or None, veto_threshold=self.veto_threshold or None)
        metrics = {k.replace("rollout_corr/", "rollout/correction/"): v for k, v in out.metrics.items()}
        return out.weights, out.mask, metrics


@dataclass
class RunningNormFields:
    """Running reward normalisation keys of a recipe's `reward:` section (LightRFT's reward_running_norm;
    `mmrl.core.running_norm`): vlm_grpo, vlm_multiturn and flow_grpo's RewardConfig inherit them. Put it first
    among the bases (``class RewardConfig(RunningNormFields, Base)``) to list its keys after the base's."""

    running_norm: bool = False
    """Divide rewards by the running std of all rewards seen (LightRFT reward_running_norm; checkpointed)."""
    running_norm_center: bool = False
    """With running_norm: also subtract the running mean."""
    running_norm_clip: float = 0.0
    """With running_norm: clamp to [-clip, clip] (0 = off)."""

    def __post_init__(self) -> None:
        if self.running_norm_clip < 0:
            raise ValueError(f"reward.running_norm_clip: expected >= 0 (0 = off), got {self.running_norm_clip}")
        post = getattr(super(), "__post_init__", None)  # the next base's checks (e.g. reward.history)
        if post is not None:
            post()

    def build_running_norm(self, stateful: dict[str, Any] | None = None):
        """The `RunningRewardNorm` of these settings, or None when running_norm is off; with `stateful` (the
        recipe's checkpointed objects) it is registered there as "reward_norm", so checkpoints carry its state.
        The recipe must update it with the gathered global rewards (identical on every rank), then normalise."""
        if not self.running_norm:
            return None
        from mmrl.core.running_norm import RunningRewardNorm

        norm = RunningRewardNorm(self.running_norm_center, self.running_norm_clip or None)
        if stateful is not None:
            stateful["reward_norm"] = norm
        return norm


RolloutWorker = Literal["inline", "process", "ranks"]


@dataclass
class AsyncRolloutFields:
    """Where rollouts run and how far they may run ahead of the trainer (`mmrl.training.async_rollout`): vlm_grpo's
    and flow_grpo's `rollout:` sections inherit them. Put it first among the bases (``class RolloutConfig(
    AsyncRolloutFields, Base)``) to list its keys after the base's."""

    worker: RolloutWorker = "inline"
    """`inline`: rollouts run in the trainer process between updates (the synchronous loop). `process`: a rollout
    process per trainer process, with its own copy of the policy, generates (and scores) batches ahead of the
    trainer; the trainer pushes its weights to it after every update. `ranks`: the same, on the rollout ranks of
    the torchrun world (`dist.rollout_ranks`), weights and batches over torch.distributed."""
    max_staleness: int = 0
    """With worker=process or ranks: how many policy versions the batch of a step may lag behind the trainer. 0 = the batch
    of step s is generated with the weights after update s-1 (the synchronous run, equal metrics); k = with the
    weights after update s-1-k, generated while the trainer runs updates s-k..s-1."""
    worker_threads: int = 0
    """torch intra-op threads of the rollout process (0 = the run's num_threads, else the trainer's thread count)."""

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness: expected >= 0 (0 = synchronous), got {self.max_staleness}")
        if self.worker_threads < 0:
            raise ValueError(f"rollout.worker_threads: expected >= 0 (0 = the run's num_threads), got "
                             f"{self.worker_threads}")
        if self.max_staleness > 0 and self.worker == "inline":
            raise ValueError(f"rollout.max_staleness={self.max_staleness} needs rollout.worker=process or ranks "
                             f"(rollouts in their own process or rank); inline rollouts always use the newest weights")
        post = getattr(super(), "__post_init__", None)  # the next base's checks
        if post is not None:
            post()
