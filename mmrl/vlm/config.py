"""Config sections of the VLM recipes, defined once: vlm_grpo's `model`, `data`, `rollout`, `reward`, `log` (the
prompt rewriter's `model` and `rollout` too), the `update` and `warm_start` sections of all three, and vlm_multiturn's
`model`, `env`, `rollout`, `reward`, `log`. A recipe module defines its `algo:` section, the sections whose defaults
it changes (a subclass with its own defaults) and `Config`; the optimizer/KL/LoRA bases come from `mmrl.training`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from mmrl.pipelines.data import GEO3K_TEMPLATE
from mmrl.training import LoRAConfig, OnNonfinite, TrackersConfig, UpdateConfig
from mmrl.training.config import AsyncRolloutFields, RunningNormFields
from mmrl.training.judges import JudgeFields

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
LM_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def at_least(section: str, obj: Any, **least: int) -> None:
    """ValueError naming `section.key` when a key of `obj` is below its least value."""
    for key, lo in least.items():
        if getattr(obj, key) < lo:
            raise ValueError(f"{section}.{key}: expected >= {lo}, got {getattr(obj, key)}")


# ============================================================================================ shared


@dataclass
class PackingFields:
    """Padding-free packing keys of a VLM recipe's `update:` section (put it first among the bases to list its keys
    after the base's)."""

    packing: bool = False
    """Padding-free forwards in the reference, old and training passes: each micro-batch's real tokens packed into
    rows of `pack_length` tokens with block-diagonal causal masks and per-sequence (M-RoPE) positions
    (RolloutBatch.pack); logits only at response tokens; equal to the padded forwards up to float order."""
    pack_length: int = 0
    """Tokens per packed row with packing (rows are filled first fit decreasing): 0 = the micro-batch's longest
    sequence (attention with a dense mask, as sdpa/eager on CPU, then costs no more than the padded batch's); a
    large value puts the whole micro-batch in one row (for a varlen attention kernel: flash-attention 2)."""

    def __post_init__(self) -> None:
        if self.pack_length < 0:
            raise ValueError(f"update.pack_length: expected >= 0 (0 = the longest sequence), got {self.pack_length}")
        post = getattr(super(), "__post_init__", None)  # the next base's checks
        if post is not None:
            post()

    def set_packing(self, batch: Any) -> Any:
        """`batch` (a `RolloutBatch`) with this section's packing settings (its forwards then run packed or
        padded)."""
        batch.packed, batch.pack_length = self.packing, self.pack_length
        return batch


@dataclass
class VLMUpdateConfig(PackingFields, UpdateConfig):
    """The `update:` section of the VLM recipes."""

    micro_batch_size: int = 16
    """Sequences (vlm_multiturn: episodes) per forward/backward (gradient accumulation inside a mini-batch)."""
    reuse_vision_features: bool = True
    """Run the vision tower once per prompt image set (episode) per step and reuse the features for all responses
    and the reference / old / training passes (exact). The training pass recomputes them with gradients when the
    vision tower is trained; a reference pass with LoRA on the vision tower gets its own cache. Off under FSDP."""


@dataclass
class WarmStartConfig:
    steps: int = 0
    """Format-only supervised steps before RL (0 = off): prompts -> random well-formed responses (not the true
    answers), so a random model learns the answer format, not the task."""
    lr: float = 1e-3
    """Warm-start learning rate."""
    batch_size: int = 32
    """Prompts per warm-start step."""
    params: list[str] = field(default_factory=list)
    """Train only parameters whose name contains one of these (empty = all trainable). Fitting random answers with
    every weight teaches the model to ignore its input; `[lm_head]` teaches just the format."""

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"warm_start.steps: expected >= 0, got {self.steps}")
        if self.steps and self.batch_size < 1:
            raise ValueError(f"warm_start.batch_size: expected >= 1, got {self.batch_size}")
        if self.steps and not self.lr > 0:
            raise ValueError(f"warm_start.lr: expected > 0, got {self.lr}")


# ============================================================================================ single-turn policies
# vlm_grpo; the prompt rewriter's `model` and `rollout`


@dataclass
class VLMLoRAConfig(LoRAConfig):
    rank: int = 64
    """LoRA rank r on the language model; 0 = full fine-tuning (ref = a weight snapshot, +1x memory)."""
    alpha: int = 64
    """LoRA alpha (scale alpha / rank)."""
    target_modules: list[str] = field(default_factory=lambda: list(LM_TARGETS))
    """Language-model linear layers that get LoRA (matched by name under the language model only)."""


@dataclass
class ModelConfig:
    path: str = ""
    """Local checkpoint directory (transformers format: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4.1V, InternVL; the
    families of `mmrl.vlm.families`). Never a hub id."""
    build_tiny: str = ""
    """Demo only: if `path` has no checkpoint, build this tiny random model there first (qwen2_vl | qwen25_vl |
    glm4v | internvl)."""
    lora: VLMLoRAConfig = field(default_factory=VLMLoRAConfig)
    """LoRA on the language model (ref = adapters off; + the vision blocks with train_vision); rank 0 = full."""
    train_vision: bool = False
    """Also train the vision tower (LoRA on its qkv/proj/fc1/fc2/gate/up/down, or its full weights); else frozen."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% slower); for real model sizes."""
    freeze: list[str] = field(default_factory=list)
    """Exclude parameters whose name contains one of these (e.g. lm_head, embed_tokens) from the RL updates (the
    format warm start still trains them). Adam moves rarely-used vocabulary rows by ~lr per step on noise alone."""


@dataclass
class DataConfig:
    kind: Literal["shapes", "geo3k"] = "shapes"
    """`shapes` (synthetic scenes, exact answers, infinite, seeded) or `geo3k` (jsonl/parquet via load_visual_qa)."""
    path: str = ""
    """geo3k: training file (.jsonl/.json/.parquet, or a datasets save_to_disk directory) with rows `prompt` (the
    question text; `problem` is read as its alias), `images` (or `image`) and `answer`."""
    val_path: str = ""
    """geo3k: optional held-out file for greedy eval accuracy (first `eval_size` rows)."""
    image_root: str = ""
    """geo3k: folder relative image paths are resolved against (default: the file's folder)."""
    template: str = GEO3K_TEMPLATE
    """Prompt template: geo3k rows fill {prompt} (= {problem}) with their text, shapes fills {question};
    `{prompt}` alone uses the text as written (what mmrl.Trainer sets for its train_dataset)."""
    system_prompt: str = ""
    """Optional system message (empty: the chat template's default)."""
    on_error: Literal["skip", "raise"] = "skip"
    """geo3k rows with an unreadable image: `skip` (warn with the path) or `raise`."""
    limit: int = 0
    """geo3k: use at most this many rows (0 = all)."""
    qa_kinds: list[str] = field(default_factory=lambda: ["color"])
    """shapes: question kinds to draw from (color, count, shape, position)."""
    colors: list[str] = field(default_factory=lambda: ["red", "green", "blue", "yellow", "orange", "purple"])
    """shapes: shape colours."""
    backgrounds: list[str] = field(default_factory=lambda: ["white"])
    """shapes: background colours."""
    n_shapes: list[int] = field(default_factory=lambda: [1, 1])
    """shapes: inclusive [min, max] number of shapes per scene."""
    shape_size: list[float] = field(default_factory=lambda: [0.3, 0.5])
    """shapes: [min, max] shape size as a fraction of the image side."""
    image_size: int = 56
    """shapes: rendered image side in pixels (56 = 4 vision tokens for a Qwen-VL after merging)."""
    min_pixels: int = 0
    """Resize every image to at least this many pixels (qwen smart_resize; 0 = the processor's own limits)."""
    max_pixels: int = 0
    """Resize every image to at most this many pixels (0 = the processor's own limits)."""
    eval_size: int = 64
    """Fixed eval prompts (shapes: a separate seeded stream) scored greedily."""


@dataclass
class RolloutConfig(AsyncRolloutFields):  # + worker, max_staleness, worker_threads (a rollout process)
    engine: Literal["hf", "vllm"] = "hf"
    """`hf` (transformers sampling loop) or `vllm` (needs vLLM: the [vllm] extra on a GPU, or vLLM's CPU build)."""
    prompts_per_step: int = 8
    """Prompts (groups) per RL step, over all processes."""
    group_size: int = 8
    """Responses per prompt; >= 2 for the group-relative estimators (grpo, dr_grpo, rloo, reinforce_pp_baseline)
    and dynamic sampling; reinforce_pp (batch-whitened) also trains with 1."""
    temperature: float = 1.0
    """Sampling temperature (log-probs use the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = -1
    """Top-k filter (<= 0 = off)."""
    max_new_tokens: int = 16
    """Maximum response length in tokens."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (the response is cut after the token completing one; finish_reason 'stop')."""
    micro_batch_size: int = 64
    """Max sequences decoded together by the HF engine."""
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra vllm.LLM(...) arguments (gpu_memory_utilization, max_model_len, ...; dtype defaults to the policy's)."""


@dataclass
class RewardConfig(RunningNormFields):  # + running_norm, running_norm_center, running_norm_clip
    name: str = "exact_match"
    """Reward from the zoo (mmrl.rewards.available()); scored on the response text with metadata['answer']."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for mmrl.rewards.load(name, **kwargs); each is reachable from the command line
    (reward.kwargs.answer_key=solution)."""
    accuracy_key: str = ""
    """details key with 0/1 accuracy (e.g. `accuracy` for geo3k); empty: accuracy = score > 0.5."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: penalise responses longer than max_new_tokens - this (0 = off)."""
    overlong_penalty: float = 1.0
    """Penalty at max_new_tokens (linear ramp over the buffer)."""
    on_nonfinite: OnNonfinite = "error"
    """A NaN/inf reward: `error` (stop, naming the reward component and the response) or `drop_sample` (train
    without it; a group left with < 2 responses is not trained on; counted as reward/nonfinite_samples)."""
    aggregation: Literal["sum_then_normalise", "normalise_then_sum"] = "sum_then_normalise"
    """Several reward components (a `composite` reward; the overlong penalty counts as one): `sum_then_normalise`
    runs algo.advantage on their weighted sum; `normalise_then_sum` runs it on each component, sums with the weights
    and whitens over the batch (GDPO, arXiv 2601.05242; not with algo.kl.in_reward or running_norm)."""

    def __post_init__(self) -> None:
        from mmrl.rewards.registry import check_reward_arguments, check_reward_mapping, reward_arguments

        super().__post_init__()
        try:
            reward_arguments(self.name)
        except ValueError as exc:
            raise ValueError(f"reward.name: {exc}") from None
        check_reward_arguments(self.name, self.kwargs, "reward.kwargs")  # before any model loads
        if self.name == "composite":  # its components, their weights and arguments
            check_reward_mapping(self.kwargs, "reward.kwargs")


@dataclass
class LogConfig(JudgeFields, TrackersConfig):  # + judges, hacking (the reward-hacking alarm on the eval prompts)
    sample_every: int = 25
    """Save a grid of samples (vlm_grpo: image, question, response, reward) to samples/ at step 1 and every this
    many steps (0 = off)."""
    num_samples: int = 16
    """Samples per grid."""
    eval_every: int = 25
    """Greedy evaluation on the fixed eval prompts before training, every this many steps and at the end (0 = only
    before and at the end)."""


# ============================================================================================ multi-turn episodes
# vlm_multiturn


@dataclass
class MultiTurnLoRAConfig(LoRAConfig):  # this recipe's defaults (a subclass: a partial YAML section keeps them)
    rank: int = 0
    alpha: int = 32
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class MultiTurnModelConfig:
    path: str = "runs/tiny_qwen2_vl"
    """Local checkpoint directory of a Qwen2/2.5/3-VL model (never a hub id)."""
    build_tiny: bool = False
    """If `path` holds no checkpoint, build the tiny random Qwen2-VL there first (CPU demo and tests)."""
    lora: MultiTurnLoRAConfig = field(default_factory=MultiTurnLoRAConfig)
    """LoRA adapter of the policy (rank 0 = full fine-tuning; language model attention by default)."""
    freeze: list[str] = field(default_factory=list)
    """RL updates skip parameters whose name contains one of these (e.g. lm_head, embed_tokens); the format warm
    start still trains them. Adam moves every vocabulary row by ~lr per step even on noise, which slowly lifts
    garbage tokens; freezing the output layer during RL prevents that."""

    def policy(self) -> ModelConfig:
        """This section as the `model:` section `mmrl.vlm.policy.build_policy` reads: the tiny model is the
        Qwen2-VL one; full fine-tuning trains every weight, the vision tower included (`freeze` keeps it out of
        RL); LoRA adapts the language model only."""
        return ModelConfig(path=self.path, build_tiny="qwen2_vl" if self.build_tiny else "", lora=self.lora,
                           train_vision=not self.lora.enabled, freeze=list(self.freeze))


@dataclass
class EnvConfig:
    tasks: dict[str, dict] = field(default_factory=lambda: {"grid_puzzle": {}})
    """Environment name -> constructor keyword arguments; groups cycle through the tasks in this order."""
    modules: list[str] = field(default_factory=list)
    """Python modules to import first (they register custom environments with `register_env`)."""
    backend: Literal["thread", "process"] = "thread"
    """EnvManager backend: `thread` or `process`."""
    max_workers: int = 4
    """Threads / worker processes stepping environments concurrently."""
    eval_episodes: int = 32
    """Episodes per task in each greedy evaluation (fixed seeds, disjoint from training seeds)."""

    def __post_init__(self) -> None:
        at_least("env", self, max_workers=1, eval_episodes=0)


@dataclass
class MultiTurnRolloutConfig:
    prompts_per_step: int = 8
    """Tasks (episode groups) per RL step (global over all processes)."""
    group_size: int = 8
    """Episodes per task (same seed, so the same start state)."""
    max_turns: int = 6
    """Turn limit per episode (the environment's own max_turns also applies)."""
    max_new_tokens: int = 8
    """Token limit of one response."""
    max_seq_len: int = 1024
    """Token limit of a whole trajectory; observations that do not fit are cut, then the episode ends."""
    temperature: float = 1.0
    """Sampling temperature (log-probs for the ratio use the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = -1
    """Top-k sampling (<= 0 = off)."""
    episode_scheduling: Literal["lockstep", "independent"] = "lockstep"
    """`lockstep`: every turn generates for all live episodes, then steps their environments together.
    `independent`: episodes advance on their own (whichever are ready are generated together, each environment
    step is submitted as soon as its response exists), so slow environments do not hold up the others."""
    system_prompt: str = ""
    """Optional system message for every episode ('' = the chat template's default)."""
    micro_batch_size: int = 64
    """Max sequences the HF engine decodes together."""
    engine: Literal["hf", "vllm"] = "hf"
    """`hf` (transformers sampling loop) or `vllm` (token-in/token-out prompts; old log-probs are then recomputed)."""
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra vllm.LLM(...) arguments (defaults: dtype of the policy, max_model_len = max_seq_len, seed)."""

    def __post_init__(self) -> None:
        at_least("rollout", self, prompts_per_step=1, group_size=1, micro_batch_size=1, max_turns=1, max_new_tokens=1,
                 max_seq_len=self.max_new_tokens + 1, temperature=0)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p: expected 0 < top_p <= 1, got {self.top_p}")


@dataclass
class MultiTurnRewardConfig(RunningNormFields):  # running_norm*: on the turn rewards of the global training episodes
    on_nonfinite: OnNonfinite = "error"
    """A NaN/inf turn reward from an environment: `error` (stop, naming the environment, episode and turn) or
    `drop_sample` (train without that episode: it leaves its group's statistics, a group left with < 2 episodes is
    not trained on; the count of dropped episodes is logged as reward/nonfinite_samples)."""


@dataclass
class MultiTurnLogConfig(TrackersConfig):
    eval_every: int = 0
    """Greedy evaluation every this many steps (0 = only before and after training)."""
    sample_every: int = 10
    """Write a few trajectories to samples/step_N.txt at step 1 and every this many steps (0 = step 1 only)."""

    def __post_init__(self) -> None:
        at_least("log", self, eval_every=0, sample_every=0)
