"""Config sections the diffusion recipes share: `model` (with `model.lora`), `data`,
`rollout`, `reward`, `log`. Each recipe subclasses a section where it adds keys or changes a default; the
optimizer/update/KL sections come from `mmrl.training`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from mmrl.training import LoRAConfig, OnNonfinite, OptimConfig, TrackersConfig
from mmrl.training.judges import JudgeFields, check_judges, learned_reward_judges


# A recipe default that differs from a shared section's is a subclass with its own field default, never a
# `field(default_factory=lambda: Section(x=...))`: a YAML that gives the section (even one key of it) builds the
# annotated class, whose defaults then apply to the keys it leaves out.


@dataclass
class DiffusionOptimConfig(OptimConfig):
    lr: float = 3e-4
    """AdamW learning rate (Flow-GRPO / DiffusionNFT: 3e-4 with LoRA)."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""


@dataclass
class DiffusionLoRAConfig(LoRAConfig):
    init: str = "gaussian"
    """peft `init_lora_weights`: `gaussian` (Flow-GRPO's), `true` (B = 0: the policy starts as the base model), ..."""


@dataclass
class ModelConfig:
    path: str = "assets/tiny_sd3_shapes"
    """Local diffusers pipeline directory with model_index.json (a supported pipeline class: SD3, FLUX.1, FLUX.2,
    Z-Image, Wan, ...; `mmrl.diffusion.models.available_families()`)."""
    max_sequence_length: int = 0
    """T5 tokens per prompt; 0 = family default (SD3: 128 as Flow-GRPO, FLUX: 512)."""
    family_options: dict[str, Any] = field(default_factory=dict)
    """Settings of the model family (`FlowModel.configure` keywords; unknown ones fail naming the family), e.g.
    Wan 2.2 A14B's `guidance_scale_2` (CFG scale of the low-noise expert)."""
    lora: DiffusionLoRAConfig = field(default_factory=DiffusionLoRAConfig)
    """LoRA on the transformer (`rank: 0` = full fine-tuning; empty target_modules = the family's attention
    projections)."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass instead of keeping them (diffusers'
    `enable_gradient_checkpointing`): much less activation memory for about one more forward of compute
    (docs/scaling.md, memory at real width); the same gradients."""

    def __post_init__(self) -> None:
        if self.max_sequence_length < 0:
            raise ValueError(f"model.max_sequence_length: expected >= 0, got {self.max_sequence_length}")


@dataclass
class DataConfig:
    train_prompts: str = "assets/prompts/shapes_train.txt"
    """Prompt file: .txt (one per line) or .jsonl with `prompt` (other keys = metadata for rewards)."""
    eval_prompts: str = ""
    """Held-out prompt file for periodic ODE evaluation (empty = no evaluation)."""


@dataclass
class RolloutConfig:
    prompts_per_step: int = 4
    """Distinct prompts per RL step (global, over all processes); the batch is prompts_per_step * group_size."""
    group_size: int = 24
    """Images per prompt (G)."""
    height: int = 512
    """Image height in pixels."""
    width: int = 512
    """Image width in pixels."""
    num_frames: int = 1
    """Frames per sample: > 1 makes videos (video families only, e.g. Wan: 4k+1 frames); 1 = images."""
    num_steps: int = 10
    """Sampling steps of a training rollout."""
    guidance_scale: float = 4.5
    """Classifier-free guidance (SD3) / guidance embedding (FLUX-dev) in rollout and training; 1 = off."""
    micro_batch_size: int = 0
    """Rollout micro-batch (images per transformer call); 0 = whole batch."""
    eval_num_steps: int = 40
    """ODE steps for evaluation."""
    eval_guidance_scale: float = 4.5
    """Guidance for evaluation."""
    eval_height: int = 0
    """Evaluation image height; 0 = `height`. Train at a lower resolution than you evaluate at (fewer latent
    tokens per rollout and update) by setting height/width below eval_height/eval_width."""
    eval_width: int = 0
    """Evaluation image width; 0 = `width`."""

    def __post_init__(self) -> None:
        # sizes that would otherwise fail deep inside a step (IndexError, empty torch.cat, negative shapes)
        for key, least in (("prompts_per_step", 1), ("height", 1), ("width", 1), ("num_frames", 1), ("num_steps", 1),
                           ("eval_num_steps", 1), ("micro_batch_size", 0), ("group_size", 1), ("eval_height", 0),
                           ("eval_width", 0)):
            if getattr(self, key) < least:
                raise ValueError(f"rollout.{key}: expected >= {least}, got {getattr(self, key)}")

    @property
    def eval_hw(self) -> tuple[int, int]:
        """(height, width) of evaluation images: eval_height/eval_width, or the training size where 0."""
        return self.eval_height or self.height, self.eval_width or self.width

    @property
    def batch(self) -> int:
        """Samples per step over all processes (prompts_per_step * group_size)."""
        return self.prompts_per_step * self.group_size


@dataclass
class GroupRolloutConfig(RolloutConfig):
    """The `rollout:` section of the recipes that compare samples within a prompt's group (Flow-GRPO, DiffusionNFT,
    AWM, DGPO)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_size < 2:
            raise ValueError(f"rollout.group_size must be >= 2 (advantages are relative within a prompt's group), got "
                             f"{self.group_size}")


@dataclass
class CFGFreeRolloutConfig(GroupRolloutConfig):
    """`rollout:` of the recipes that train CFG-free on their own ODE samples (DiffusionNFT, AWM)."""

    guidance_scale: float = 1.0
    """CFG in rollout and training (1.0 = off: DiffusionNFT and the published AWM runs train CFG-free)."""
    eval_guidance_scale: float = 1.0
    """Guidance for evaluation."""


@dataclass
class RewardConfig:
    MAPPING_SHORTHAND: ClassVar[dict[str, str]] = {"components": "weight"}  # `pickscore: 1.0` = {weight: 1.0}

    components: dict[str, Any] = field(default_factory=lambda: {"jpeg_compressibility": 1.0})
    """Zoo rewards: name -> weight, or name -> {weight: w, <load kwargs>} (mmrl.rewards.load mapping). Each entry is
    reachable from the command line: reward.components.pickscore.weights=/ckpt/PickScore_v1."""
    on_nonfinite: OnNonfinite = "error"
    """A NaN/inf reward: `error` (stop, naming the reward component and the sample) or `drop_sample` (train without
    it: it leaves its prompt's group statistics, a group left with < 2 samples is not trained on; the count is
    logged as reward/nonfinite_samples)."""

    def __post_init__(self) -> None:
        from mmrl.rewards.registry import check_reward_mapping

        check_reward_mapping(self.components, "reward.components")  # unknown rewards / arguments: before any load


@dataclass
class AggregationFields:
    """`reward.aggregation` of every diffusion recipe that turns rewards into advantages or pairs."""

    aggregation: Literal["sum_then_normalise", "normalise_then_sum"] = "sum_then_normalise"
    """Several reward components: `sum_then_normalise` normalises their weighted sum per prompt (GRPO);
    `normalise_then_sum` normalises each component per prompt, sums with the weights and whitens over the batch
    (GDPO, arXiv 2601.05242; needs reward.history 0 and no running_norm). One component: the same up to the batch
    whitening."""


@dataclass
class AdvantageRewardConfig(AggregationFields, RewardConfig):
    std_mode: Literal["group", "global"] = "group"
    """Advantage scale: `group` (per-prompt std) or `global` (std of the whole batch)."""
    history: int = 0
    """Per-prompt stat tracker memory: 0 = current batch only (Flow-GRPO), N = last N rewards per prompt."""
    drop_zero_advantage: bool = True
    """Skip samples whose advantage is exactly 0 (groups with identical rewards)."""

    def __post_init__(self) -> None:
        if self.history < 0:
            raise ValueError(f"reward.history: expected >= 0, got {self.history}")
        super().__post_init__()


@dataclass
class LogConfig(JudgeFields, TrackersConfig):  # + judges, hacking (log.judges: the reward-hacking alarm)
    sample_every: int = 10
    """Save samples/step_<N>.png every this many steps, at step 0 (the starting policy) and at the last step (0 =
    never): one ODE image per grid prompt (the first num_samples eval prompts, else training prompts) from the same
    noise every time, captioned with its reward and prompt, so grids of different steps compare."""
    num_samples: int = 16
    """Images in each grid (sample grids and evaluation)."""
    eval_every: int = 0
    """ODE evaluation on data.eval_prompts after step 1, every this many steps and at the end (0 = never)."""
    eval_max_prompts: int = 64
    """At most this many evaluation prompts."""

    def __post_init__(self) -> None:
        for key in ("sample_every", "eval_every", "num_samples"):
            if getattr(self, key) < 0:
                raise ValueError(f"log.{key}: expected >= 0, got {getattr(self, key)}")
        super().__post_init__()  # log.judges / log.hacking


@dataclass
class EvalStateLogConfig(LogConfig):
    """`log:` of the recipes whose "old" state is an EMA anchor that evaluation may use instead (NFT, AWM, DGPO)."""

    eval_state: Literal["default", "old"] = "default"
    """Policy state evaluated (and shown in the sample grids): `default` (the trained weights) or `old` (the EMA
    policy)."""


def check_common(cfg: Any, online: bool = True) -> None:
    """Cross-section checks of a diffusion recipe config (single sections check themselves on construction)."""
    from mmrl.pipelines.data import require_path

    log, algo = cfg.log, cfg.algo
    if getattr(algo, "adv_clip_max", 1.0) <= 0:  # mmrl.core range checks, named here before any model loads
        raise ValueError(f"algo.adv_clip_max: expected > 0, got {algo.adv_clip_max}")
    if getattr(algo, "clip_range", 0.0) < 0:
        raise ValueError(f"algo.clip_range: expected >= 0, got {algo.clip_range}")
    if log.num_samples < 1 and ((online and log.sample_every) or (log.eval_every and cfg.data.eval_prompts)):
        raise ValueError(f"log.num_samples: expected >= 1, got {log.num_samples}")
    if online:
        require_path("data.train_prompts", cfg.data.train_prompts, "prompt file", kind="data")
    if cfg.data.eval_prompts:
        require_path("data.eval_prompts", cfg.data.eval_prompts, "prompt file", kind="data")
    reward = getattr(cfg, "reward", None)
    if getattr(reward, "aggregation", "sum_then_normalise") == "normalise_then_sum" and (
            getattr(reward, "history", 0) or getattr(reward, "running_norm", False)):
        raise ValueError("reward.aggregation=normalise_then_sum normalises each reward within this step's groups: it "
                         "needs reward.history=0 and reward.running_norm=false")
    learned_reward_judges(getattr(reward, "components", None), log, bool(cfg.data.eval_prompts and log.eval_every))
    if log.judges and not (cfg.data.eval_prompts and log.eval_every):
        raise ValueError("log.judges are scored at every evaluation: set data.eval_prompts (the held-out prompts) and "
                         f"log.eval_every > 0 (got eval_prompts={cfg.data.eval_prompts!r}, "
                         f"eval_every={log.eval_every})")
    if getattr(reward, "components", None):  # a latent reward of another family / channels than model.path
        from mmrl.diffusion.scoring import policy_latent_space
        from mmrl.rewards.latent import check_latent_rewards

        check_latent_rewards(reward.components, lambda: policy_latent_space(cfg.model.path), cfg.model.path)
        from pathlib import Path

        from mmrl.diffusion.models import flow_model_class
        from mmrl.rewards.audio import check_audio_rewards

        def family_has_audio():  # a sound reward of a family without sound (read from model_index.json)
            if not (Path(cfg.model.path) / "model_index.json").is_file():
                return None  # not there yet (model.build_tiny): checked again once the model is loaded
            cls = flow_model_class(cfg.model.path)
            return cls.family, cls.has_audio

        check_audio_rewards(reward.components, family_has_audio, cfg.model.path)
    num_frames = getattr(cfg.rollout, "num_frames", 1)
    if num_frames > 1:  # an image family refuses videos here, before the image rewards would be blamed for them
        from mmrl.diffusion.models import check_num_frames

        check_num_frames(cfg.model.path, num_frames)
    check_judges(log, "video" if num_frames > 1 else "image")
