"""GRPO-family RL for Qwen-VL policies: rollout -> rewards -> advantages -> loss -> optimizer step.

One step: `rollout.prompts_per_step` prompts x `rollout.group_size` responses, scored by a zoo reward (+ DAPO soft
overlong punishment); optional DAPO dynamic sampling (keep groups whose rewards differ, up to `algo.max_gen_batches`
rounds); advantages from a registered estimator; the kept rows padded ONCE into a `RolloutBatch` (vlm/batch.py) that
the reference, old-log-prob and training passes share; `update.epochs` passes of the registry policy loss
(`algo.policy_loss`: ppo_clip | gspo | cpgd; KL as a loss term or reward penalty) in mini-batches with gradient
accumulation (vlm/update.py); optional reward.running_norm and algo.rollout_correction (TIS/MIS). Reference =
LoRA adapters off, or a frozen copy (`model.lora.rank: 0`).

Several processes (`torchrun ... dist.strategy=ddp|fsdp`): prompts_per_step and update.mini_batch_size stay global;
advantages use all-gathered rewards; loss weights make DDP's average the global mini-batch gradient; ranks run
equal update (FSDP: micro-batch and forward) counts with zero-weight placeholders; DAPO rounds stop on the minimum
kept count over ranks; rank 0 logs and writes checkpoints (mmrl.training's one layout). FSDP shards the decoder
layers only and turns the vision-feature cache off. Format warm start (`warm_start.steps`, shapes data): supervised
steps on answers drawn uniformly from each question's answer vocabulary (NOT the true answers; vlm/warm_start.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mmrl.config import RunConfig, TrainConfig
from mmrl.core import get_advantage_estimator, kl_estimate
from mmrl.core.correction import weighted_advantages
from mmrl.core.multi_reward import multi_reward_advantages
from mmrl.distributed import DistConfig
from mmrl.perf.meter import add_flops
from mmrl.rewards import load as load_reward
from mmrl.run.checkpoint import FullOptimizerState, restore_checkpoint
from mmrl.run.start import closes_runs, start_run
from mmrl.runtime import Timer
from mmrl.training import KLConfig, OptimConfig, UpdateGuard, attach_flops_meter, build_optimizer
from mmrl.training.async_rollout import policy_weights, rollout_process
from mmrl.training.rank_rollout import serve_rollout_rank
from mmrl.training.config import RolloutCorrectionConfig
from mmrl.training.judges import build_judges
from mmrl.training.steps import StepLoop
from mmrl.vlm.batch import RolloutBatch
from mmrl.vlm.common import VisionCache, language_block_types, vision_has_adapters, vision_tower, vision_tower_trainable
from mmrl.vlm.config import (DataConfig, LogConfig, LossAgg, ModelConfig, RewardConfig, RolloutConfig, VLMUpdateConfig,
                             WarmStartConfig)
from mmrl.vlm.families import family_of_processor
from mmrl.vlm.grpo_checks import check_config, recompute_old_logprobs
from mmrl.vlm.policy import build_policy, rl_parameters
from mmrl.vlm.rollout_collect import (build_data, evaluate, finish, make_rollout_engine, reward_components,
                                      rollout_metrics, rollout_step, save_sample_grid, shapes_warm_start_pairs)
from mmrl.vlm.rollout_worker import BUILDER
from mmrl.vlm.update import PairedForwards, PolicyGradientLoss, contiguous_minibatches, policy_update
from mmrl.vlm.warm_start import format_warm_start


@dataclass
class AlgoConfig:
    advantage: str = "grpo"
    """Advantage estimator from mmrl.core (grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, cpgd)."""
    policy_loss: str = "ppo_clip"
    """Policy loss from the mmrl.core registry: `ppo_clip` (token-level ratio), `gspo` (sequence-level ratio;
    use it with small clip ranges, e.g. clip_low 3e-4, clip_high 4e-4), `cpgd` (clipped log-ratio + policy drift,
    drift coef 0.01 / clip 0.2 as MM-EUREKA; pair it with `advantage: cpgd`) or `reinforce` (-A log p, no ratio;
    with old_logprobs=rollout and rollout_correction: verl's bypass + policy gradient, pg_is / pg_rs)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and generate more until the batch is full."""
    max_gen_batches: int = 4
    """DAPO: at most this many generation rounds per step; then train on the groups kept so far."""
    clip_low: float = 0.2
    """Clip epsilon below 1."""
    clip_high: float = 0.28
    """Clip epsilon above 1 (clip-higher; = clip_low for symmetric PPO)."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 for negative advantages (0 = off)."""
    loss_agg: LossAgg = "token-mean"
    """Loss aggregation over tokens (seq-mean-token-sum-norm divides by rollout.max_new_tokens)."""
    kl: KLConfig = field(default_factory=KLConfig)
    """KL(policy || reference): coef (0 = no reference forward), estimator (k1 | k2 | k3 | abs ...), in_reward
    (subtract coef * sum_t KL_t from each sequence reward instead of adding a loss term)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (0 = entropy is only logged)."""
    old_logprobs: Literal["auto", "recompute", "rollout"] = "auto"
    """`recompute` (a forward before updating), `rollout` (the engine's) or `auto` (recompute when more than
    one update per rollout or with vLLM)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Engine vs trainer log-probs: TIS weights, MIS / veto masks (verl). Decoupled (old log-probs recomputed):
    pi_old / pi_rollout once per batch. Bypass (old_logprobs=rollout, needs policy_loss=reinforce): pi / pi_rollout
    of the current policy in every micro-batch."""


@dataclass
class Config(RunConfig):
    algorithm: str = "vlm_grpo"
    """Recipe name."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and ground truth."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward and reward shaping."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Advantages, policy loss, KL."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    """AdamW and its learning-rate schedule."""
    update: VLMUpdateConfig = field(default_factory=VLMUpdateConfig)
    """Epochs, mini-batches (sequences per optimizer update, global; 0 = the whole batch), micro-batches, clipping."""
    warm_start: WarmStartConfig = field(default_factory=lambda: WarmStartConfig(params=["lm_head"]))
    """Optional format-only warm start (shapes data only; part of the tiny recipe)."""
    log: LogConfig = field(default_factory=LogConfig)
    """Samples and eval."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop length, checkpoints, resume."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Multi-process training under torchrun / accelerate launch (strategy none|ddp|fsdp (hf engine), backend,
    find_unused_parameters)."""



@closes_runs  # the run directory's lock released however train() ends; a failed start leaves nothing
def train(cfg: Config) -> dict:
    check_config(cfg)
    if serve_rollout_rank(cfg, BUILDER):  # rollout.worker=ranks: this rank generated the trainer rank's batches
        return {}
    rollout, algo, update = cfg.rollout, cfg.algo, cfg.update
    ctx, run = start_run(cfg, {"rollout.prompts_per_step": rollout.prompts_per_step,
                               "update.mini_batch_size": update.mini_batch_size})
    world, fsdp = ctx.world_size, ctx.enabled and cfg.dist.strategy == "fsdp"
    reward_model = load_reward(cfg.reward.name, **cfg.reward.kwargs)  # before the model: a remote reward fails fast
    estimator = get_advantage_estimator(algo.advantage)
    data, eval_items = build_data(cfg)
    with ctx.main_process_first():  # rank 0 builds the tiny demo model (model.build_tiny) before the others load it
        states, processor = build_policy(cfg.model, run.device, run.dtype, keep_ref=algo.kl.coef > 0)
    model, tok = states.model, processor.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos_id = tok.convert_tokens_to_ids(family_of_processor(processor).turn_end)
    # with a rollout process (rollout.worker=process) this engine only evaluates
    engine, syncer = make_rollout_engine(cfg, states, processor, ctx if fsdp else None,
                                         engine="hf" if rollout.worker != "inline" else None)
    recompute = recompute_old_logprobs(cfg)
    summary: dict[str, Any] = {}
    if run.find_resume() is None and cfg.warm_start.steps > 0:  # before sharding: identical on every rank
        warmup = Timer(sync_cuda=run.device.type == "cuda")
        with warmup("warmup"):
            summary["warm_start_loss"] = format_warm_start(model, states.named_trainable_parameters(), cfg.warm_start,
                                                           shapes_warm_start_pairs(cfg, processor, eos_id), pad_id)
        summary["warm_start_s"] = warmup.times["warmup"]
        if not cfg.model.lora.enabled and "ref" in states.states:  # the reference is the warm-started model
            states.copy("default", "ref")
    params = rl_parameters(states, cfg.model.freeze)  # before DDP wraps: it registers what requires grad
    # FSDP shards the decoder layers only (text-only and image forwards: same collectives); DDP: training forward
    tmodel = ctx.wrap_model(model, cfg.dist.strategy, find_unused_parameters=cfg.dist.find_unused_parameters,
                            **({"fsdp_block_types": language_block_types(model)} if fsdp else {}))
    if fsdp:
        states.refresh()  # fully_shard replaced every parameter by a DTensor shard: follow them
        params = rl_parameters(states, cfg.model.freeze)
    attach_flops_meter(model)  # perf/tflops_per_step, perf/mfu, perf/peak_memory_gib
    nominal_batch = rollout.prompts_per_step * rollout.group_size
    updates = cfg.train.max_steps * update.epochs * update.updates_per_epoch(nominal_batch)
    optimizer, lr_sched = build_optimizer(params, cfg.optim, total_steps=updates)
    stateful = {"optimizer": FullOptimizerState(optimizer) if fsdp else optimizer, "lr_scheduler": lr_sched,
                "data": data}
    reward_norm = cfg.reward.build_running_norm(stateful)  # identical on every rank: updated with global rewards
    judges = build_judges(cfg.log, run.device, stateful, len(eval_items), "data.eval_size")  # scored with accuracy
    pipe = rollout_process(cfg, ctx, run, BUILDER, stateful)  # rollout.worker=process: None inline
    start, extra = restore_checkpoint(ctx, run, states, stateful)
    summary.update(extra.get("summary", {}))  # the eval accuracy before RL, of the run's start
    last_eval = extra.get("last_eval")  # (step, greedy eval accuracy) of the newest evaluation, for the sample grids
    if pipe is not None:  # the rollout process starts from this version's weights and data position
        pipe.start(start, policy_weights(states))
    if syncer is not None:  # the engine loaded model.path: send what the warm start or a resumed checkpoint changed
        syncer.sync(full=True)
    # vision features: shared by the policy and reference passes only when no state can change the tower
    reuse = update.reuse_vision_features and not fsdp
    state_ids = {id(p) for p in states.trainable_parameters()}
    share_ref = reuse and not vision_has_adapters(model) and not any(
        id(p) in state_ids for p in vision_tower(model).parameters())
    vision_grads_need_images = fsdp and vision_tower_trainable(model)
    # the kept-sample count DAPO's rounds stop on: the minimum over ranks, so every rank runs the same rounds
    kept_count = (lambda kept: min(ctx.all_gather_object(len(kept)))) if ctx.enabled else len
    lockstep = PairedForwards(ctx, model, pad_id, enabled=fsdp)  # FSDP: pair the ranks' old/ref forwards
    bypass_correction = algo.rollout_correction if algo.rollout_correction.enabled and not recompute else None
    loss_fn = PolicyGradientLoss(algo.policy_loss, algo.clip_low, algo.clip_high, algo.dual_clip, algo.loss_agg,
                                 rollout.max_new_tokens, algo.entropy_coef, algo.kl.coef, algo.kl.estimator,
                                 algo.kl.in_reward, correction=bypass_correction)  # bypass: pi / pi_rollout
    if start == 0 and (ctx.is_main or fsdp):  # FSDP: every rank runs the eval forwards, rank 0 reports
        first = evaluate(engine, processor, eval_items, reward_model, cfg, judges, 0)  # (the judges' baseline)
        summary.update({k.replace("eval/accuracy", "eval_accuracy_first"): v for k, v in first.items()})
        last_eval = (0, first["eval/accuracy"]) if first else None
        if ctx.is_main:
            print(f"[vlm_grpo] eval accuracy before RL: {first}", flush=True)
    guard = UpdateGuard(update.max_skipped_updates, ctx, run)  # a NaN/inf loss or gradient never reaches the weights

    def evaluate_after(step: int, metrics: dict) -> None:
        """Greedy evaluation every log.eval_every steps and at the end (FSDP: every rank runs the forwards), then
        the sample grid when due (beside the newest eval accuracy)."""
        nonlocal last_eval
        if (ctx.is_main or fsdp) and ((cfg.log.eval_every and step % cfg.log.eval_every == 0)
                                      or step == cfg.train.max_steps):
            with steps.timer("eval"):
                metrics.update(evaluate(engine, processor, eval_items, reward_model, cfg, judges, step))
            if "eval/accuracy" in metrics:
                last_eval = (step, metrics["eval/accuracy"])
        if step == cfg.train.max_steps:
            summary.update({k.replace("eval/accuracy", "eval_accuracy_last"): v for k, v in metrics.items()
                            if k.startswith("eval/accuracy")})
        if ctx.is_main and cfg.log.sample_every and (step % cfg.log.sample_every == 0 or step == 1):
            save_sample_grid(run, step, latest["roll"], cfg.log.num_samples, rollout.temperature, last_eval)

    latest: dict[str, Any] = {}  # this step's rollouts, for the sample grid drawn after the evaluation

    steps = StepLoop(ctx, run, cfg, start, states=states, stateful=stateful, fsdp=fsdp, judges=judges,
                     after_step=evaluate_after,
                     checkpoint_extra=lambda: {"last_eval": last_eval, "summary": {
                         k: v for k, v in summary.items() if k.startswith("eval_accuracy_first")}},
                     postfix=lambda m: {"reward": f"{float(m['reward/mean']):.3f}",
                                        "acc": f"{float(m['reward/accuracy']):.2f}"})
    for step in steps:
        metrics, timer = steps.metrics, steps.timer
        # ---- rollout (+ DAPO dynamic sampling) and rewards; each rank generates its share of the prompts
        if pipe is None:
            roll, first_response = rollout_step(cfg, engine, processor, reward_model, data, ctx, timer,
                                                count=kept_count, check_images=vision_grads_need_images)
            async_metrics: dict[str, Any] = {}
        else:  # made by the rollout process with the weights after update step-1-max_staleness
            payload, async_metrics = pipe.next(step)
            roll, first_response = payload["roll"], payload["first"]
            add_flops(model, pipe.last_flops)
        kept, latest["roll"] = roll.results, roll
        n_kept, all_lens, rollout_stats = rollout_metrics(ctx, roll, cfg)
        metrics.update(rollout_stats)
        metrics.update(async_metrics)
        if n_kept:  # every rank takes part in the update; a rank that kept nothing with a zero-weight row
            rewards_t, rows = roll.scores, kept or first_response
            batch = RolloutBatch.build(model, [r.prompt_ids for r in rows], [r.response_ids for r in rows],
                                       [r.mm for r in rows], pad_id,
                                       rollout_logprobs=[r.response_logprobs for r in rows],
                                       weights=[1.0] * len(kept) or [0.0])
            update.set_packing(batch)  # padding-free forwards in the ref / old / training passes (or padded)
            vcache = VisionCache(model) if reuse else None  # this step's images, policy ("default") state
            # ---- reference log-probs, KL as a reward penalty
            if algo.kl.coef > 0:
                ref_cache = vcache if share_ref else (VisionCache(model) if reuse else None)
                with timer("ref"), states.use("ref"), lockstep():
                    batch.ref_logprobs = batch.logprobs(model, update.micro_batch_size, rollout.temperature,
                                                        vision_cache=ref_cache)
                if algo.kl.in_reward:
                    kl_tok = kl_estimate(batch.rollout_logprobs, batch.ref_logprobs, algo.kl.estimator)
                    seq_kl = (kl_tok * batch.response_mask).sum(-1).cpu()[:len(kept)]
                    rewards_t = rewards_t - algo.kl.coef * seq_kl
                    metrics["kl/ref"] = (float(ctx.all_reduce_sum(seq_kl.sum())) / float(all_lens.sum())
                                         if ctx.enabled else seq_kl.sum() / all_lens.sum())
            # ---- advantages (group statistics over the global batch)
            r_all, g_all = ctx.gather_group_rewards(rewards_t, roll.group_ids, scope="rank")
            if reward_norm is not None and kept:
                reward_norm.update(r_all)
                r_all = reward_norm.normalize(r_all)
                metrics.update(reward_norm.metrics())
            if cfg.reward.aggregation == "normalise_then_sum":  # GDPO: each component in its own groups
                comp, weights = reward_components(reward_model, rewards_t, roll.comps, cfg.reward.overlong_buffer > 0)
                adv_all = multi_reward_advantages(ctx.all_gather_tensor(comp), weights,
                                                  lambda r: estimator(r, g_all), cfg.reward.aggregation)
            else:
                adv_all = estimator(r_all, g_all)
            adv = ctx.local_slice(adv_all) if kept else torch.zeros(1)  # (placeholder row: 0)
            batch.advantages = adv.to(batch.device)
            # ---- old log-probs
            drift = None
            if recompute:
                with timer("old_logprob"), lockstep():
                    batch.old_logprobs = batch.logprobs(model, update.micro_batch_size, rollout.temperature,
                                                        vision_cache=vcache)
                drift = float(((batch.old_logprobs - batch.rollout_logprobs).abs() * batch.response_mask)[
                    :len(kept)].max()) if kept and batch.response_len else 0.0
            else:
                batch.old_logprobs = batch.rollout_logprobs
            if algo.rollout_correction.enabled and kept and recompute:  # sampling log-probs vs the trainer's
                is_weights, keep, correction = algo.rollout_correction.apply(batch.old_logprobs,
                                                                             batch.rollout_logprobs, batch.loss_mask)
                batch.advantages = weighted_advantages(batch.advantages, is_weights)
                batch.loss_mask = batch.loss_mask & keep
                metrics.update(correction)
            # ---- loss and optimizer steps
            n_rows = ctx.max_int(len(kept)) if ctx.enabled else len(kept)
            mini_batch = update.mini_batch_size // world or n_rows
            with timer("train"):
                res = policy_update(tmodel, batch, optimizer, params, loss_fn=loss_fn,
                                    minibatches=contiguous_minibatches(len(kept), n_rows, mini_batch),
                                    micro_batch_size=update.micro_batch_size, epochs=update.epochs,
                                    max_grad_norm=update.max_grad_norm, temperature=rollout.temperature,
                                    entropy_grad=algo.entropy_coef != 0, guard=guard, step=step,
                                    lr_scheduler=lr_sched, ctx=ctx, equal_micro_batches=fsdp, vision_cache=vcache,
                                    loss_tokens="loss_mask" if algo.loss_agg == "token-mean" else "rows")
            drift = res.drift if drift is None else drift
            metrics["diag/logprob_drift"] = max(ctx.all_gather_object(drift)) if ctx.enabled else drift
            metrics.update(res.metrics())
            metrics["policy/lr"] = lr_sched.get_last_lr()[0]
            if vcache is not None:
                metrics["rollout/vision_cache/calls"] = vcache.vision_calls
            if syncer is not None:  # the engine samples the next step with the updated weights
                metrics.update(syncer.sync())
            metrics.update(guard.pop_metrics())
            if fsdp:  # zero-weight micro-batches and 1-token dummy forwards, summed over ranks
                metrics["dist/padding_micro_batches"] = sum(ctx.all_gather_object(res.placeholders))
                metrics["dist/lockstep_dummy_forwards"] = sum(ctx.all_gather_object(lockstep.pop_dummies()))
        if pipe is not None:  # version `step`: the rollout process makes later batches with these weights
            metrics.update(pipe.push(step, policy_weights(states, only=params)))
    steps.close()
    if pipe is not None:
        pipe.close()
    if syncer is not None:
        engine.close()  # vLLM's process-global state freed: another engine can start in this process
    ctx.close()
    return finish(run, summary) if ctx.is_main else {}
