"""The `vlm_multiturn` recipe: multi-turn agentic RL for VLM policies against environments (docs/multiturn.md).

Per step: roll out `rollout.prompts_per_step` tasks x `rollout.group_size` episodes (``mmrl.vlm.episodes``), drop
groups with equal returns (DAPO dynamic sampling) and assign credit per turn (``mmrl.vlm.credit``: grpo, turn_grpo,
gigpo), then update the policy on its own tokens over one padded ``RolloutBatch`` (``mmrl.vlm.update``). Run start,
optimizer, the step loop and its tail (``mmrl.training.steps.StepLoop``), checkpoints and summary: ``mmrl.run`` /
``mmrl.training``; the policy: ``mmrl.vlm.policy.build_policy``; the config sections: ``mmrl.vlm.config``.
Several processes (dist.strategy ddp | fsdp): every rank rolls out whole groups of the global batch; turn rewards,
anchors and group ids are all-gathered so advantages and DAPO's decisions use the whole batch; under FSDP rollouts,
evaluation and the reference pass run in ``LockstepForwards`` (only the decoder layers are sharded; the vision cache
is off). Simplified away: no value model, no per-token rewards.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mmrl.config import RunConfig, TrainConfig
from mmrl.distributed import DistConfig
from mmrl.perf.meter import not_counted
from mmrl.run.checkpoint import FullOptimizerState, restore_checkpoint
from mmrl.run.start import closes_runs, start_run
from mmrl.training import (NONFINITE_KEY, SKIPPED_KEY, KLConfig, OptimConfig, UpdateGuard, attach_flops_meter,
                           build_optimizer, finite_stats, summarise)
from mmrl.training.steps import StepLoop
from mmrl.vlm.common import VisionCache, vision_has_adapters, vision_tower
from mmrl.vlm.config import (EnvConfig, MultiTurnLogConfig, MultiTurnModelConfig, MultiTurnRewardConfig,
                             MultiTurnRolloutConfig, VLMUpdateConfig, WarmStartConfig, at_least)
from mmrl.vlm.credit import Advantage, collect_groups, episode_returns, token_advantages, turn_advantages
from mmrl.vlm.envs import EnvManager, make_env
from mmrl.vlm.episode_train import check_fsdp_rl_params, episode_batch, format_pairs, zero_grads
from mmrl.vlm.episodes import ChatFormat, RolloutStats, episode_metrics, rollout_episodes, samples_text
from mmrl.vlm.families import family_of_processor
from mmrl.vlm.grpo_checks import check_clip_ranges
from mmrl.vlm.policy import build_policy, rl_parameters
from mmrl.vlm.rollout import SamplingParams
from mmrl.vlm.update import PairedForwards, PolicyGradientLoss, policy_update
from mmrl.vlm.warm_start import format_warm_start


@dataclass
class MultiTurnOptimConfig(OptimConfig):
    lr: float = 1e-3


@dataclass
class AlgoConfig:
    advantage: Advantage = "gigpo"
    """Credit assignment: grpo (episode-level), turn_grpo (discounted turn returns), gigpo (episode + step)."""
    gamma: float = 0.95
    """Turn-level discount: a turn's return is r_k + gamma * r_{k+1} + ...; episode return sum_k gamma^(k-1) r_k."""
    omega: float = 1.0
    """GiGPO weight of the step-level (anchor-group) advantage."""
    scale_by_std: bool = True
    """Divide group advantages by the group std (False = Dr.GRPO-style mean-centring only; with gigpo that is
    verl-agent's `mode: mean_norm`, its default)."""
    gigpo_episode_stats: Literal["episode", "step"] = "episode"
    """GiGPO's episode-level statistics: `episode` (the paper: each episode counts once in its group's mean/std) or
    `step` (verl-agent's default: every turn row counts, so long episodes weigh more)."""
    policy_loss: Literal["ppo_clip", "gspo", "cpgd", "reinforce"] = "ppo_clip"
    """Policy loss (mmrl.core.POLICY_LOSSES), token-mean over the policy tokens of a mini-batch: ppo_clip (token
    ratios), gspo (sequence ratio; use its small clip ranges, e.g. clip_low 3e-4, clip_high 4e-4), cpgd or reinforce
    (-A log p, no ratio)."""
    clip_low: float = 0.2
    """Ratio clip below 1."""
    clip_high: float = 0.28
    """Ratio clip above 1 (DAPO clip-higher)."""
    kl: KLConfig = field(default_factory=KLConfig)
    """KL penalty to the reference policy in the loss (coef 0 = off; > 0 keeps a reference: LoRA off, or a copy of
    the starting weights); estimator k1, k2, k3 (= low_var_kl), abs. in_reward is not supported here."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus on policy tokens (0 = off); counters early collapse to one action."""
    dynamic_sampling: bool = True
    """DAPO dynamic sampling: drop groups with identical episode returns and roll out new tasks."""
    max_resample_rounds: int = 2
    """Extra rollout rounds per step to refill dropped groups (then train on what was collected)."""

    def __post_init__(self) -> None:
        at_least("algo", self, max_resample_rounds=0)
        if self.kl.in_reward:
            raise ValueError("algo.kl.in_reward: not supported by vlm_multiturn (the KL is a loss term); use false")


@dataclass
class Config(RunConfig):
    algorithm: str = "vlm_multiturn"
    """Recipe name."""
    model: MultiTurnModelConfig = field(default_factory=MultiTurnModelConfig)
    """Policy model."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Environments."""
    rollout: MultiTurnRolloutConfig = field(default_factory=MultiTurnRolloutConfig)
    """Multi-turn rollout."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Credit assignment and loss."""
    reward: MultiTurnRewardConfig = field(default_factory=MultiTurnRewardConfig)
    """Checks on the environments' turn rewards and their running normalisation."""
    optim: MultiTurnOptimConfig = field(default_factory=MultiTurnOptimConfig)
    """AdamW and the learning-rate schedule (lr_end_factor: linear decay over train.max_steps)."""
    update: VLMUpdateConfig = field(default_factory=VLMUpdateConfig)
    """Policy updates per step (epochs, mini-batches of episodes, micro-batches, clipping)."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Format-only supervised warm start before RL."""
    log: MultiTurnLogConfig = field(default_factory=MultiTurnLogConfig)
    """Evaluation and sample cadence."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop (steps, checkpoints, resume)."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Multi-process training under torchrun / accelerate launch (strategy none|ddp|fsdp (LoRA), backend,
    find_unused_parameters)."""


def check_config(cfg: Config) -> None:
    """Checks across sections (each section checks its own values when loaded); imports `env.modules`."""
    import importlib

    rollout = cfg.rollout
    for module in cfg.env.modules:  # custom environments register themselves on import
        importlib.import_module(module)
    if not cfg.env.tasks:
        raise ValueError("env.tasks: expected at least one environment name, got none")
    check_clip_ranges(cfg.algo.clip_low, cfg.algo.clip_high)
    for name in cfg.env.tasks:
        try:
            make_env(name, **(cfg.env.tasks[name] or {}))  # unknown names / bad kwargs fail here, with the valid names
        except TypeError as exc:  # an argument the environment does not take (YAML or env.tasks.<name>.<arg>=...)
            raise ValueError(f"env.tasks.{name}: {exc}") from None
    if rollout.group_size < 2 and cfg.algo.advantage != "turn_grpo":
        raise ValueError(f"rollout.group_size: group advantages need >= 2 episodes per task, got {rollout.group_size}")
    if cfg.model.lora.init_path:
        raise ValueError("model.lora.init_path: not supported by vlm_multiturn (it starts from model.path); use ''")
    cfg.update.updates_per_epoch(rollout.prompts_per_step * rollout.group_size)  # must divide the batch
    if rollout.engine == "vllm":
        if cfg.dist.strategy == "fsdp":
            raise ValueError("dist.strategy=fsdp: vlm_multiturn supports FSDP with rollout.engine=hf only")
        from mmrl.vlm.vllm_engine import check_vllm_rollout

        check_vllm_rollout(rollout)


def eval_episodes(cfg: Config, engine: Any, fmt: ChatFormat, manager: EnvManager,
                  lockstep: PairedForwards | None = None) -> list:
    """Greedy episodes on fixed seeds (10^7 + i, never used for training), `env.eval_episodes` per task; under FSDP
    every rank runs them (`lockstep`)."""
    specs = []
    for t, name in enumerate(cfg.env.tasks):
        specs += [{"task": name, "seed": 10**7 + i, "group": t, "env_kwargs": cfg.env.tasks[name]}
                  for i in range(cfg.env.eval_episodes)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens)
    with lockstep() if lockstep is not None else contextlib.nullcontext():
        return rollout_episodes(engine, fmt, manager, specs, greedy, cfg.rollout.max_turns, cfg.rollout.max_seq_len)


def evaluate(cfg: Config, engine: Any, fmt: ChatFormat, manager: EnvManager,
             lockstep: PairedForwards) -> dict[str, float]:
    """The eval/* metrics (success rate, returns, episode shapes) of `eval_episodes`."""
    episodes = eval_episodes(cfg, engine, fmt, manager, lockstep)
    return episode_metrics(episodes, episode_returns(episodes, cfg.algo.gamma), prefix="eval/")


@closes_runs  # the run directory's lock released however train() ends; a failed start leaves nothing
def train(cfg: Config) -> dict:
    from mmrl.vlm.rollout import HFRolloutEngine

    check_config(cfg)
    rollout, update, algo = cfg.rollout, cfg.update, cfg.algo
    ctx, run = start_run(cfg, {"rollout.prompts_per_step": rollout.prompts_per_step})
    rank, fsdp = ctx.rank, ctx.enabled and cfg.dist.strategy == "fsdp"
    manager = engine = None
    try:
        use_ref = algo.kl.coef > 0
        with ctx.main_process_first():  # rank 0 builds the tiny demo model (model.build_tiny) before the others load it
            states, processor = build_policy(cfg.model.policy(), run.device, run.dtype, keep_ref=use_ref,
                                             tiny_seed=cfg.seed)
        tok = getattr(processor, "tokenizer", processor)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        eos_id = tok.convert_tokens_to_ids(family_of_processor(processor).turn_end)
        if fsdp:  # shard the decoder layers (the vision tower stays in the root unit: text-only and image forwards
            # then run the same collectives), follow the shards, and build the optimizer from them (below)
            from mmrl.vlm.common import language_block_types

            ctx.wrap_model(states.model, "fsdp", fsdp_block_types=language_block_types(states.model))
            states.refresh()
        model = states.model
        attach_flops_meter(model)  # perf/tflops_per_step, perf/mfu, perf/peak_memory_gib
        params = states.named_trainable_parameters()  # the format warm start trains these (frozen ones included)
        rl_params = rl_parameters(states, cfg.model.freeze, freeze_now=False)
        if fsdp:
            check_fsdp_rl_params(model, rl_params)
        opt, sched = build_optimizer(rl_params, cfg.optim, total_steps=cfg.train.max_steps)
        fmt = ChatFormat(processor, rollout.system_prompt or None)
        syncer = None
        if rollout.engine == "vllm":  # token-in/token-out on the trajectory ids; weights pushed after every update
            from mmrl.vlm.vllm_engine import make_vllm_rollout

            engine, syncer = make_vllm_rollout(cfg.model.path, states, processor, rollout.vllm_kwargs, cfg.seed,
                                               max_model_len=rollout.max_seq_len,
                                               limit_mm_per_prompt={"image": max(rollout.max_turns, 1)})
        else:
            engine = HFRolloutEngine(model, processor, batch_size=rollout.micro_batch_size)
        manager = EnvManager(cfg.env.max_workers, cfg.env.backend, modules=cfg.env.modules)
        drop_grads = lambda: zero_grads(model, states.trainable_parameters())  # noqa: E731 (frozen ones too)

        lockstep = PairedForwards(ctx, model, pad_id, enabled=fsdp)  # FSDP: pair the ranks' unequal forwards
        stateful = {"optimizer": FullOptimizerState(opt) if fsdp else opt, "lr_scheduler": sched}
        reward_norm = cfg.reward.build_running_norm(stateful)  # updated with the global batch: same on every rank
        start_step, extra = restore_checkpoint(ctx, run, states, stateful)
        task_cursor = int(extra.get("task_cursor", 0))  # global: a run resumes on any number of processes
        summary_extra = dict(extra.get("summary", {}))
        if not start_step:
            if cfg.warm_start.steps > 0:  # identical on every rank (same seeded draws; FSDP: equal forwards)
                model.train(False)
                pairs = format_pairs(cfg.env.tasks, fmt, eos_id, cfg.warm_start.batch_size, cfg.seed)
                summary_extra["warm_start_loss"] = format_warm_start(
                    model, params, cfg.warm_start, pairs, pad_id, temperature=rollout.temperature or 1.0,
                    weight_decay=0.01, zero_grad=drop_grads)  # (torch's AdamW default, as before)
        if syncer is not None:  # the engine loaded model.path: send what the warm start or a resumed checkpoint changed
            syncer.sync(full=True)
        if not start_step and (ctx.is_main or fsdp):
            summary_extra["eval_before"] = before = evaluate(cfg, engine, fmt, manager, lockstep)
            if ctx.is_main:
                run.log(0, before)

        # only the optimizer's parameters get gradients from here on (DDP registers those that require grad now;
        # a frozen vision tower lets the training pass reuse cached image features)
        rl_parameters(states, cfg.model.freeze)
        # FSDP: already sharded. The vision cache calls the tower outside the root forward: off under FSDP
        tmodel = model if fsdp else ctx.wrap_model(model, cfg.dist.strategy,
                                                   find_unused_parameters=cfg.dist.find_unused_parameters)
        reuse = update.reuse_vision_features and not fsdp
        state_ids = {id(p) for p in states.trainable_parameters()}
        share_ref = reuse and not vision_has_adapters(model) and not any(
            id(p) in state_ids for p in vision_tower(model).parameters())
        sampling = SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                                  max_new_tokens=rollout.max_new_tokens)
        guard = UpdateGuard(update.max_skipped_updates, ctx, run)  # a NaN/inf loss or gradient is never applied
        mini_batches = update.updates_per_epoch(rollout.prompts_per_step * rollout.group_size)
        temperature = rollout.temperature or 1.0
        loss_fn = PolicyGradientLoss(algo.policy_loss, algo.clip_low, algo.clip_high, entropy_coef=algo.entropy_coef,
                                     kl_coef=algo.kl.coef, kl_estimator=algo.kl.estimator)

        def evaluate_after(step: int, metrics: dict) -> None:
            """Greedy evaluation every log.eval_every steps and at the end (FSDP: every rank runs it, rank 0 logs;
            the other ranks wait at the step tail's collective). Not training work: not in perf/tflops_per_step."""
            if not (ctx.is_main or fsdp):
                return
            every = cfg.log.eval_every
            with not_counted(), steps.timer("eval"):
                if every and step % every == 0 and step != cfg.train.max_steps:
                    metrics.update(evaluate(cfg, engine, fmt, manager, lockstep))
                if step == cfg.train.max_steps:
                    summary_extra["eval_after"] = after = evaluate(cfg, engine, fmt, manager, lockstep)
                    metrics.update(after)

        steps = StepLoop(ctx, run, cfg, start_step, states=states, stateful=stateful, fsdp=fsdp,
                         after_step=evaluate_after,
                         checkpoint_extra=lambda: {"task_cursor": task_cursor, "summary": summary_extra},
                         postfix=lambda m: {"success": f"{m['reward/success_rate']:.2f}",
                                            "R": f"{m['reward/mean']:.2f}"})
        for step in steps:
            metrics, timer, stats = steps.metrics, steps.timer, RolloutStats()
            lockstep.dummies = 0
            model.eval()

            def rollout_round(specs: list[dict], round_: int) -> list:
                seeded = dataclasses.replace(sampling, seed=cfg.seed * 7919 + step * 101 + round_ + rank * 1_000_003)
                with lockstep():
                    return rollout_episodes(engine, fmt, manager, specs, seeded, rollout.max_turns,
                                            rollout.max_seq_len, rollout.episode_scheduling, stats)

            # ---- rollout + DAPO dynamic sampling (decided on every rank's episodes)
            got = collect_groups(ctx, rollout_round, cfg.env.tasks, task_cursor, rollout.prompts_per_step,
                                 rollout.group_size, algo.gamma, algo.dynamic_sampling, algo.max_resample_rounds,
                                 cfg.reward.on_nonfinite)
            task_cursor = got.task_cursor
            returns = episode_returns(got.all, algo.gamma)
            metrics.update(episode_metrics(got.all, returns))  # everything sampled (all ranks), before filtering
            if cfg.reward.on_nonfinite == "drop_sample":
                metrics[NONFINITE_KEY] = got.nonfinite  # episodes dropped for a NaN/inf turn reward
                if got.nonfinite:  # returns of the episodes kept
                    metrics.update(finite_stats(returns))
            metrics.update({"rollout/dynamic/rounds": got.rounds, "rollout/dynamic/kept_groups": len(got.kept),
                            "rollout/dynamic/episodes_sampled": len(got.all)})
            train_eps, glob_train, lo = got.train_rows(rank)
            # ---- advantages (statistics and GiGPO anchor groups over the global batch), this rank's rows
            with timer("advantages"):
                turn_adv = turn_advantages(glob_train, algo.advantage, algo.gamma, algo.omega, algo.scale_by_std,
                                           reward_norm, episode_stats=algo.gigpo_episode_stats) \
                    if glob_train else torch.zeros(0, 1)
                metrics.update(reward_norm.metrics() if reward_norm is not None and glob_train else {})
                adv = token_advantages(train_eps, turn_adv[lo:lo + len(train_eps)])
                vcache = VisionCache(model) if reuse and train_eps else None  # this step's images, "default" state
                # nothing kept here but elsewhere: a placeholder row (weight 0) keeps the collectives paired
                batch = episode_batch(model, train_eps, pad_id, adv, placeholder_from=got.local if glob_train else None)
                if batch is not None:
                    update.set_packing(batch)  # padding-free forwards (update.packing) or padded
                if syncer is not None and train_eps:  # vLLM's log-probs are raw (T=1): the trainer's forward instead
                    rollout_lp = batch.old_logprobs
                    batch.old_logprobs = batch.logprobs(model, update.micro_batch_size, temperature,
                                                        vision_cache=vcache)
                    rollout_drift = float(((batch.old_logprobs - rollout_lp).abs() * batch.loss_mask).max())
                if use_ref and (train_eps or fsdp):
                    ref_cache = vcache if share_ref else (VisionCache(model) if reuse else None)
                    with states.use("ref"), lockstep():
                        if train_eps:
                            batch.ref_logprobs = batch.logprobs(model, update.micro_batch_size, temperature,
                                                                vision_cache=ref_cache)
            # ---- policy update: the same number of mini-batches on every rank (an empty one = a placeholder)
            with timer("train"):
                n_mb = max(1, min(mini_batches, ctx.max_int(len(train_eps)) if ctx.enabled else len(train_eps)))
                minibatches = [list(range(len(train_eps)))[i::n_mb] for i in range(n_mb)]
                res = policy_update(tmodel, batch, opt, opt.param_groups[0]["params"], loss_fn=loss_fn,
                                    minibatches=minibatches, micro_batch_size=update.micro_batch_size,
                                    epochs=update.epochs if glob_train else 0, max_grad_norm=update.max_grad_norm,
                                    temperature=temperature, with_entropy=algo.entropy_coef > 0,
                                    entropy_grad=algo.entropy_coef > 0, guard=guard, step=step, ctx=ctx,
                                    equal_micro_batches=fsdp, vision_cache=vcache, zero_grad=drop_grads)
            metrics.update(res.metrics(ctx))
            drift = res.drift if syncer is None or not train_eps else rollout_drift  # vLLM: rollout vs trainer
            if ctx.enabled:  # mini-batches where a rank had no episode (it ran a zero-weight one), summed over ranks
                n_empty = (update.epochs if glob_train else 0) * sum(not mb for mb in minibatches)
                metrics["dist/placeholder_minibatches"] = sum(ctx.all_gather_object(n_empty))
            if fsdp:  # forwards a rank ran only to pair another rank's rollout / reference forwards, summed over ranks
                metrics["dist/lockstep_dummy_forwards"] = sum(ctx.all_gather_object(lockstep.dummies))
                drift = max(ctx.all_gather_object(drift))
            metrics["policy/lr"] = opt.param_groups[0]["lr"]
            metrics.update(guard.pop_metrics())
            if res.applied or not metrics[SKIPPED_KEY]:  # every update of the step skipped (NaN/inf): schedule kept
                sched.step()
            metrics["diag/logprob_drift"] = drift
            if vcache is not None and vcache.vision_calls:
                metrics["rollout/vision_cache/calls"] = vcache.vision_calls
            if syncer is not None:  # the engine samples the next step with the updated weights
                metrics.update(syncer.sync())
            metrics.update({"time/generation_s": stats.generation_s, "time/environment_s": stats.environment_s,
                            "time/preprocessing_s": stats.preprocessing_s})
            metrics["rollout/episode/env_errors_total"] = len(manager.errors)
            if ctx.is_main and (step == 1 or (cfg.log.sample_every and step % cfg.log.sample_every == 0)):
                (run.samples_dir / f"step_{step:06d}.txt").write_text(samples_text(got.local))
        steps.close()
    finally:
        if manager is not None:
            manager.close()
        if engine is not None and hasattr(engine, "close"):
            engine.close()  # a vLLM engine: its process-global state freed for the next one in this process
        ctx.close()
    if not ctx.is_main:
        return {}
    return {**summarise(run, "vlm_multiturn", extra_keys=("reward/success_rate",)), **summary_extra}
