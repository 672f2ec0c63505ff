"""GRPO-family RL for autoregressive image generation (Janus / Janus-Pro): rollout -> decoded images -> image
reward -> group advantages -> clipped token-level policy loss on the guided image-token log-probs.

One step: `rollout.prompts_per_step` prompts x `rollout.group_size` images, each image `num_image_tokens` tokens
sampled with classifier-free guidance (`mmrl.ar_image.janus.JanusPolicy.sample`, equal to transformers'
`generate(generation_mode="image", top_k=0)` for the same seed), decoded by the VQ-VAE and scored by the image
reward zoo (`reward.components`, e.g. `prompt_color`, `shapes_geneval`); advantages from the `mmrl.core` registry
(`algo.advantage`) per prompt group; old log-probs recomputed by teacher forcing before the update (the ratio of the
first update is exactly 1); the registry policy loss (`algo.policy_loss`) + KL to the reference (LoRA adapters off)
per micro-step of `mmrl.training.updates.UpdateIterator`, in `mmrl.training.steps.StepLoop`'s steps (checkpoints,
exact resume, metrics rows). The policy is LoRA on the Llama decoder and the generation head (`PolicyStates`).
`rollout.semantic_cot` makes each sample a text chain-of-thought then the image tokens (T2I-R1's BiCoT-GRPO,
`mmrl.ar_image.cot`): both parts' log-probs under one advantage per sample.
Sample grids and a held-out evaluation (`log:`, `mmrl.ar_image.evaluation`) from their own random streams.
Several processes (`torchrun ... dist.strategy=ddp`, or `auto`): every rank draws the step's global prompts and
keeps its contiguous share (`prompts_per_step` divisible by the world size), samples its groups with the per-(rank,
step) random stream of `StepLoop`, and takes its rows' advantages from the all-gathered rewards (a group never spans
ranks); DDP averages the LoRA gradients of equal shares, so an update's gradient is the global batch's; metrics are
over the whole batch; rank 0 alone draws grids, evaluates and writes checkpoints. FSDP is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from mmrl.ar_image.cot import CoTConfig
from mmrl.ar_image.janus import JANUS_IMAGE_PROMPT, check_prompt_template
from mmrl.ar_image.evaluation import JanusLogConfig, JanusMonitor
from mmrl.config import RunConfig, TrainConfig
from mmrl.distributed import DistConfig
from mmrl.run.start import closes_runs
from mmrl.training.config import KLConfig, LoRAConfig, OptimConfig, UpdateConfig

# the Llama decoder's projections and the generation head (the image-token "lm head"); the VQ-VAE and the
# understanding tower stay frozen
JANUS_LORA_TARGETS = (r".*(language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
                      r"|generation_head\.(proj_out|vision_head))")


@dataclass
class ModelConfig:
    path: str = "deepseek-ai/Janus-Pro-1B"
    """A saved JanusForConditionalGeneration directory (transformers format, with its JanusProcessor)."""
    build_tiny: Literal["", "janus"] = ""
    """`janus`: build the tiny random Janus (mmrl.tiny.build_tiny_janus) at `path` when it holds no model."""
    lora: LoRAConfig = field(default_factory=lambda: LoRAConfig(rank=32, alpha=64))
    """LoRA on the decoder and the generation head (target_modules empty = those); rank 0 = full fine-tuning."""


@dataclass
class DataConfig:
    train_prompts: str = "assets/prompts/shapes_train.txt"
    """Training prompts (.txt one per line, or .jsonl with a `prompt` key; other keys are the reward's metadata)."""
    eval_prompts: str = ""
    """Held-out prompts (same formats) for `log.eval_every` and the sample grids ("" = none: grids use training
    prompts)."""


@dataclass
class RolloutConfig:
    prompts_per_step: int = 4
    """Prompts per step."""
    group_size: int = 8
    """Images per prompt (the GRPO group)."""
    guidance_scale: float = 5.0
    """Classifier-free guidance on the image-token logits (> 1: uncond + gs (cond - uncond))."""
    temperature: float = 1.0
    """Divides the guided logits before sampling (and in the trained log-probs)."""
    prompt_template: str = JANUS_IMAGE_PROMPT
    """The text before begin-of-image, `{prompt}` the prompt: Janus' "deepseek" conversation format with an empty
    system prompt, as Janus-Pro's own image generation and T2I-R1 build it ("{prompt}" = the bare prompt, what a
    model trained on bare captions wants; not used with semantic_cot, whose `cot.image_template` says it)."""
    semantic_cot: bool = False
    """T2I-R1's semantic chain-of-thought: each sample is text (the model's lm_head continuing `cot.template`) then
    the image tokens given `cot.image_template`; GRPO on the log-probs of both (mmrl.ar_image.cot)."""
    cot: CoTConfig = field(default_factory=CoTConfig)
    """The chain-of-thought's prompt templates and text sampling (used with semantic_cot: true)."""

    def __post_init__(self) -> None:
        for key in ("prompts_per_step", "group_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"rollout.{key}: expected >= 1, got {getattr(self, key)}")
        if not self.guidance_scale > 1:
            raise ValueError(f"rollout.guidance_scale: Janus image generation needs classifier-free guidance > 1, "
                             f"got {self.guidance_scale}")
        if not self.temperature > 0:
            raise ValueError(f"rollout.temperature: expected > 0, got {self.temperature}")
        check_prompt_template(self.prompt_template)
        if not self.semantic_cot and self.cot != CoTConfig():
            raise ValueError("rollout.cot: set while rollout.semantic_cot is false; set rollout.semantic_cot: true "
                             "to use it, or drop rollout.cot")
        if self.semantic_cot and self.prompt_template != JANUS_IMAGE_PROMPT:
            raise ValueError("rollout.prompt_template: not used with rollout.semantic_cot: true (the image prompt is "
                             "rollout.cot.image_template); set that one instead, or drop rollout.prompt_template")

    @property
    def batch(self) -> int:
        return self.prompts_per_step * self.group_size


@dataclass
class RewardConfig:
    components: dict = field(default_factory=lambda: {"prompt_color": 1.0})
    """Image rewards (mmrl.rewards) name -> weight (or a mapping with `weight` and the reward's arguments)."""


@dataclass
class AlgoConfig:
    advantage: str = "grpo"
    """Advantage estimator from mmrl.core (grpo, dr_grpo, rloo, ...), per prompt group."""
    policy_loss: str = "ppo_clip"
    """Policy loss from the mmrl.core registry (ppo_clip, gspo, cpgd, reinforce)."""
    clip_low: float = 0.2
    """Clip epsilon below 1."""
    clip_high: float = 0.2
    """Clip epsilon above 1."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """Aggregation over the image tokens (every image has the same token count)."""
    kl: KLConfig = field(default_factory=KLConfig)
    """KL(policy || reference) as a loss term (coef 0 = no reference forward); the reference is the model with
    the LoRA adapters off."""


@dataclass
class Config(RunConfig):
    algorithm: str = "janus_grpo"
    """Recipe name."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Image-token generation."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Image reward."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Advantages, policy loss, KL."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    """AdamW and its learning-rate schedule."""
    update: UpdateConfig = field(default_factory=UpdateConfig)
    """Epochs, mini-batches (images per optimizer update; 0 = the whole batch), micro-batches, clipping."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop length, checkpoints, resume."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Several processes under torchrun / accelerate launch (strategy auto|none|ddp; fsdp is refused)."""
    log: JanusLogConfig = field(default_factory=JanusLogConfig)
    """Sample grids, held-out evaluation, trackers."""


def build_states(cfg: Config, device: torch.device, dtype: torch.dtype):
    """(PolicyStates over the Janus model, JanusPolicy) of the `model:` and `rollout:` sections."""
    from mmrl.adapters import PolicyStates
    from mmrl.ar_image.janus import JanusPolicy, load_janus
    from mmrl.training.config import peft_lora_config

    path = Path(cfg.model.path)
    if cfg.model.build_tiny and not (path / "config.json").is_file():
        from mmrl.tiny import build_tiny_janus

        build_tiny_janus(path, seed=0)
    model, processor = load_janus(path, device, dtype)
    model.requires_grad_(False)
    lora = peft_lora_config(cfg.model.lora, JANUS_LORA_TARGETS, lora_dropout=0.0)
    if lora is None:  # full fine-tuning: the decoder and the generation head (+ the text head that writes the CoT)
        trained = ("model.language_model.", "model.generation_head.")
        if cfg.rollout.semantic_cot:
            trained += ("lm_head.",)
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith(trained))
    states = PolicyStates(model, lora, keep_ref_copy=lora is None and cfg.algo.kl.coef > 0)
    return states, JanusPolicy(model, processor, cfg.rollout.guidance_scale, cfg.rollout.temperature,
                               cfg.rollout.prompt_template)


class _TrainForward(torch.nn.Module):
    """The training log-prob pass as one module call: DDP hooks into its wrapped module's forward, and the Janus
    passes call the model's submodules directly."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, logprobs, rows: torch.Tensor):
        return logprobs(rows)


@closes_runs  # the run directory's lock released however train() ends; a failed start leaves nothing
def train(cfg: Config) -> dict:
    from mmrl.core import get_advantage_estimator, get_policy_loss, kl_estimate
    from mmrl.core.losses import agg_loss
    from mmrl.pipelines.data import PromptSampler, load_prompts
    from mmrl.rewards import load as load_reward
    from mmrl.run.checkpoint import restore_checkpoint
    from mmrl.run.start import start_run
    from mmrl.training import UpdateGuard, attach_flops_meter, build_optimizer
    from mmrl.training.steps import StepLoop
    from mmrl.training.summary import summarise
    from mmrl.training.updates import UpdateIterator, reduce_metrics

    rollout, algo, update = cfg.rollout, cfg.algo, cfg.update
    if cfg.dist.strategy not in ("auto", "none", "ddp"):
        raise ValueError(f"dist.strategy: janus_grpo runs in one process or data parallel, expected 'auto', 'none' "
                         f"or 'ddp', got {cfg.dist.strategy!r}")
    if cfg.dist.rollout_ranks:
        raise ValueError(f"dist.rollout_ranks: janus_grpo has no rollout ranks (every rank trains), expected 0, got "
                         f"{cfg.dist.rollout_ranks}")
    ctx, run = start_run(cfg, {"rollout.prompts_per_step": rollout.prompts_per_step})
    items = load_prompts(cfg.data.train_prompts)
    eval_items = load_prompts(cfg.data.eval_prompts) if cfg.data.eval_prompts else []
    reward_fn = load_reward(dict(cfg.reward.components), device=str(run.device))
    estimator, loss_fn = get_advantage_estimator(algo.advantage), get_policy_loss(algo.policy_loss)
    with ctx.main_process_first():  # rank 0 builds the tiny model (model.build_tiny) before the others load it
        states, policy = build_states(cfg, run.device, run.dtype)
    model = states.model
    cot = None
    if rollout.semantic_cot:
        from mmrl.ar_image.cot import SemanticCoT

        cot = SemanticCoT(policy, rollout.cot)
    attach_flops_meter(model)
    params = states.trainable_parameters()
    forward = ctx.wrap_model(_TrainForward(model), cfg.dist.strategy,  # DDP: the training passes (one process: as is)
                             find_unused_parameters=cfg.dist.find_unused_parameters)
    per_epoch = update.updates_per_epoch(rollout.batch)
    optimizer, lr_sched = build_optimizer(params, cfg.optim, total_steps=cfg.train.max_steps * update.epochs * per_epoch)
    sampler = PromptSampler(items, seed=cfg.seed)
    stateful = {"optimizer": optimizer, "lr_scheduler": lr_sched, "data": sampler}
    start, _ = restore_checkpoint(ctx, run, states, stateful)
    guard = UpdateGuard(update.max_skipped_updates, ctx, run)
    monitor = JanusMonitor(policy, reward_fn, cfg.log, cfg.seed, cfg.train.max_steps, eval_items, items, cot)
    summary: dict = {}
    if start == 0 and ctx.is_main:  # the starting policy: grid at step 0, and the evaluation's baseline in the summary
        if monitor.grid_due(0):
            monitor.grid(0, run)
        if monitor.eval_due(0):
            summary["eval_reward_first"] = monitor.evaluate(0, run)["eval/reward/mean"]
            print(f"[janus_grpo] held-out reward before RL: {summary['eval_reward_first']:.4f}", flush=True)

    def after_step(step: int, m: dict) -> None:
        m["policy/lr"] = lr_sched.get_last_lr()[0]
        if not ctx.is_main:  # grids and evaluation: rank 0 alone (the others wait in end_step's collectives)
            return
        if monitor.grid_due(step):
            monitor.grid(step, run)
        if monitor.eval_due(step):
            with steps.timer("eval"):
                m.update(monitor.evaluate(step, run))
            if step == cfg.train.max_steps:
                summary["eval_reward_last"] = m["eval/reward/mean"]

    steps = StepLoop(ctx, run, cfg, start, states=states, stateful=stateful, fsdp=False, after_step=after_step)
    for step in steps:
        batch = ctx.shard(sampler.next(rollout.prompts_per_step))  # the global prompts, this rank's share
        prompts = [it.prompt for it in batch]
        with steps.timer("rollout"), torch.no_grad():
            if cot is None:
                ids = [policy.image_prompt_ids(p) for p in prompts]
                tokens = [policy.sample(x, rollout.group_size)[0] for x in ids]
            else:
                groups = [cot.rollout(p, rollout.group_size) for p in prompts]
                tokens = [g.tokens for g in groups]
            images = torch.cat([policy.decode(t) for t in tokens])
        with steps.timer("reward"):
            rep = [p for p in prompts for _ in range(rollout.group_size)]
            meta = [it.metadata for it in batch for _ in range(rollout.group_size)]
            rewards = reward_fn(images, rep, meta if any(meta) else None).scores.float().cpu()
        group = torch.arange(len(prompts)).repeat_interleave(rollout.group_size)
        # advantages of the whole batch's rewards (one process: `rewards` as they are), this rank's rows kept
        rewards_all, group_all = ctx.gather_group_rewards(rewards, group, scope="rank")
        adv_all = estimator(rewards_all, group_all)
        adv = ctx.local_slice(adv_all).to(run.device)
        tokens_all = torch.cat(tokens)
        prompt_of = group.tolist()

        def logprobs(rows: torch.Tensor, state: str | None = None):
            """(log-probs, image-token entropy, mask) of `rows` [r], in the order of `rows` (the update shuffles
            them), grouped by prompt (one forward per prompt)."""
            outs = []
            for g in sorted({prompt_of[r] for r in rows.tolist()}):
                at = (group[rows] == g).nonzero().squeeze(1)  # positions in `rows`, not row ids
                if cot is None:
                    logp, entropy = policy.guided_logprobs(ids[g], tokens_all[rows[at]])
                    outs.append((at, (logp, entropy, torch.ones_like(logp))))
                else:
                    outs.append((at, cot.logprobs(groups[g], rows[at] - g * rollout.group_size)))
            order = torch.cat([a for a, _ in outs]).argsort()
            return tuple(torch.cat([o[k] for _, o in outs])[order] for k in range(3))

        with steps.timer("old_logprobs"), torch.no_grad():
            all_rows = torch.arange(len(rep))
            old = logprobs(all_rows)[0]
            ref = None
            if algo.kl.coef > 0:
                with states.use("ref"):
                    ref = logprobs(all_rows)[0]
        acc: dict[str, list] = {"policy/loss": [], "policy/grad_norm": [], "policy/clipfrac": [],
                                "policy/entropy": [], "kl/ref": []}
        with steps.timer("update"):
            model.train()
            for mb in UpdateIterator(ctx, all_rows, module=forward, optimizer=optimizer, params=params,
                                     lr_scheduler=lr_sched, guard=guard, max_grad_norm=update.max_grad_norm,
                                     step=step, epochs=update.epochs, updates_per_epoch=per_epoch,
                                     micro_batch_size=update.micro_batch_size, metrics=acc):
                with mb.no_sync():  # around the forward too: DDP decides there whether the backward all-reduces
                    logp, entropy, mask = forward(logprobs, mb.rows)
                    a = adv[mb.rows][:, None].expand_as(logp)
                    loss, m = loss_fn(logp, old[mb.rows], a, mask, clip_low=algo.clip_low, clip_high=algo.clip_high,
                                      agg=algo.loss_agg)
                    if ref is not None:
                        kl = agg_loss(kl_estimate(logp, ref[mb.rows], algo.kl.estimator), mask, algo.loss_agg)
                        loss = loss + algo.kl.coef * kl
                        acc["kl/ref"].append(kl.detach())
                    (loss * mb.weight(1)).backward()
                if mb.real:
                    acc["policy/loss"].append(loss.detach())
                    acc["policy/clipfrac"].append(m["clipfrac"])
                    ones = torch.ones_like(entropy)  # the image tokens' (the CoT's are not measured)
                    acc["policy/entropy"].append(agg_loss(entropy.detach(), ones, algo.loss_agg))
            model.eval()
        steps.metrics.update({"reward/mean": float(rewards_all.mean()), "reward/std": float(rewards_all.std()),
                              "adv/abs_mean": float(adv_all.abs().mean()), **reduce_metrics(ctx, acc)})
        if cot is not None:  # means over equal shares: the mean of the ranks' means
            steps.metrics.update({k: float(ctx.all_reduce_mean(v)) if ctx.enabled else v
                                  for k, v in cot.metrics(groups).items()})
    steps.close()
    out = {**summarise(run, "janus_grpo"), **summary} if ctx.is_main else {}
    ctx.barrier()
    ctx.close()
    return out
