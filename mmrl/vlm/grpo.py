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
from mmrl.run.checkpoint import FullOptimizerState, checkpoint_due, restore_checkpoint, save_checkpoint
from mmrl.run.start import closes_runs, start_run
from mmrl.runtime import Timer, seed_everything
from mmrl.training import (KLConfig, OnNonfinite, OptimConfig, UpdateGuard, attach_flops_meter, build_optimizer,
                           perf_metrics)
from mmrl.training.async_rollout import policy_weights, rollout_process
from mmrl.training.config import AsyncRolloutFields, RolloutCorrectionConfig, RunningNormFields, TrackersConfig
from mmrl.training.judges import JudgeFields, build_judges, stop_for_hacking
from mmrl.vlm.batch import RolloutBatch
from mmrl.vlm.common import VisionCache, language_block_types, vision_has_adapters, vision_tower, vision_tower_trainable
from mmrl.vlm.grpo_checks import check_config, recompute_old_logprobs
from mmrl.vlm.policy import VLMLoRAConfig, build_policy, rl_parameters
from mmrl.vlm.rollout_collect import (DataConfig, build_data, check_fsdp_images, collect_rollouts, evaluate, finish,
                                      make_rollout_engine, reward_components, rollout_metrics, save_sample_grid, score,
                                      shapes_warm_start_pairs, to_request)
from mmrl.vlm.rollout_worker import BUILDER, sampling_params
from mmrl.vlm.update import PairedForwards, PolicyGradientLoss, VLMUpdateConfig, contiguous_minibatches, policy_update
from mmrl.vlm.warm_start import WarmStartConfig, format_warm_start

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@dataclass
class ModelConfig:
    path: str = ""
    """Local checkpoint directory (transformers format: Qwen2-VL, Qwen2.5-VL, Qwen3-VL). Never a hub id."""
    build_tiny: str = ""
    """Demo only: if `path` has no checkpoint, build this tiny random model there first (qwen2_vl | qwen25_vl)."""
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
class LogConfig(JudgeFields, TrackersConfig):  # + judges, hacking (the reward-hacking alarm on the eval prompts)
    sample_every: int = 25
    """Save a grid of (image, question, response, reward) to samples/ every this many steps (0 = off)."""
    num_samples: int = 16
    """Samples per grid."""
    eval_every: int = 25
    """Greedy eval accuracy on the fixed eval prompts every this many steps (0 = only first and last)."""


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
    ro, al, up = cfg.rollout, cfg.algo, cfg.update
    ctx, run = start_run(cfg, {"rollout.prompts_per_step": ro.prompts_per_step,
                               "update.mini_batch_size": up.mini_batch_size})
    world, fsdp = ctx.world_size, ctx.enabled and cfg.dist.strategy == "fsdp"
    timer = Timer(sync_cuda=run.device.type == "cuda")
    reward_model = load_reward(cfg.reward.name, **cfg.reward.kwargs)  # before the model: a remote reward fails fast
    estimator = get_advantage_estimator(al.advantage)
    data, eval_items = build_data(cfg)
    with ctx.main_process_first():  # rank 0 builds the tiny demo model (model.build_tiny) before the others load it
        states, processor = build_policy(cfg.model, run.device, run.dtype, keep_ref=al.kl.coef > 0)
    model, tok = states.model, processor.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    # with a rollout process (rollout.worker=process) this engine only evaluates
    engine, syncer = make_rollout_engine(cfg, states, processor, ctx if fsdp else None,
                                         engine="hf" if ro.worker == "process" else None)
    sampling = sampling_params(ro)
    recompute = recompute_old_logprobs(cfg)
    summary: dict[str, Any] = {}
    if run.find_resume() is None and cfg.warm_start.steps > 0:  # before sharding: identical on every rank
        with timer("warmup"):
            summary["warm_start_loss"] = format_warm_start(model, states.named_trainable_parameters(), cfg.warm_start,
                                                           shapes_warm_start_pairs(cfg, processor, eos_id), pad_id)
        summary["warm_start_s"] = timer.times["warmup"]
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
    updates = cfg.train.max_steps * up.epochs * up.updates_per_epoch(ro.prompts_per_step * ro.group_size)
    optimizer, lr_sched = build_optimizer(params, cfg.optim, total_steps=updates)
    stateful = {"optimizer": FullOptimizerState(optimizer) if fsdp else optimizer, "lr_scheduler": lr_sched,
                "data": data}
    reward_norm = cfg.reward.build_running_norm(stateful)  # identical on every rank: updated with global rewards
    judges = build_judges(cfg.log, run.device, stateful, len(eval_items), "data.eval_size")  # scored with accuracy
    pipe = rollout_process(cfg, ctx, run, BUILDER, stateful)  # rollout.worker=process: None inline
    start, _ = restore_checkpoint(ctx, run, states, stateful)
    if pipe is not None:  # the rollout process starts from this version's weights and data position
        pipe.start(start, policy_weights(states))
    if syncer is not None:  # the engine loaded model.path: send what the warm start or a resumed checkpoint changed
        syncer.sync(full=True)
    # vision features: shared by the policy and reference passes only when no state can change the tower
    reuse = up.reuse_vision_features and not fsdp
    state_ids = {id(p) for p in states.trainable_parameters()}
    share_ref = reuse and not vision_has_adapters(model) and not any(
        id(p) in state_ids for p in vision_tower(model).parameters())
    vision_grads_need_images = fsdp and vision_tower_trainable(model)
    lockstep = PairedForwards(ctx, model, pad_id, enabled=fsdp)  # FSDP: pair the ranks' old/ref forwards
    bypass_correction = al.rollout_correction if al.rollout_correction.enabled and not recompute else None
    loss_fn = PolicyGradientLoss(al.policy_loss, al.clip_low, al.clip_high, al.dual_clip, al.loss_agg,
                                 ro.max_new_tokens, al.entropy_coef, al.kl.coef, al.kl.estimator, al.kl.in_reward,
                                 correction=bypass_correction)  # bypass: pi / pi_rollout in every micro-batch
    if start == 0 and (ctx.is_main or fsdp):  # FSDP: every rank runs the eval forwards, rank 0 reports
        first = evaluate(engine, processor, eval_items, reward_model, cfg, judges, 0)  # (the judges' baseline)
        summary.update({k.replace("eval/accuracy", "eval_accuracy_first"): v for k, v in first.items()})
        if ctx.is_main:
            print(f"[vlm_grpo] eval accuracy before RL: {first}", flush=True)
    guard = UpdateGuard(up.max_skipped_updates, ctx, run)  # a NaN/inf loss or gradient never reaches the weights
    bar = run.progress(cfg.train.max_steps, start)
    timer.pop()
    for step in range(start + 1, cfg.train.max_steps + 1):
        t_step = Timer()
        if ctx.enabled:  # rank-local sampling noise as a function of (seed, rank, step): nothing per rank to save
            seed_everything(ctx.rank_seed(cfg.seed, step))
        with t_step("step"):
            metrics: dict[str, Any] = {}
            generated: list = []  # a placeholder row for a rank that keeps nothing (several processes)

            def generate(items):
                if vision_grads_need_images:
                    check_fsdp_images(items)
                with timer("rollout"):
                    results = engine.generate([to_request(it, processor, cfg.data) for it in items], sampling)
                generated[:] = results[:1]
                return results

            def score_fn(results):
                with timer("reward"):
                    return score(reward_model, results, cfg, validate=True)

            # ---- rollout (+ DAPO dynamic sampling) and rewards; each rank generates its share of the prompts
            async_metrics: dict[str, Any] = {}
            if pipe is None:
                count = (lambda kept: min(ctx.all_gather_object(len(kept)))) if ctx.enabled else len
                roll = collect_rollouts(lambda k: ctx.shard(data.next(k * world)) if ctx.enabled else data.next(k),
                                        generate, score_fn, ro.prompts_per_step // world, ro.group_size,
                                        al.dynamic_sampling, al.max_gen_batches, count=count)
            else:  # made by the rollout process with the weights after update step-1-max_staleness
                payload, async_metrics = pipe.next(step)
                roll, generated[:] = payload["roll"], payload["first"]
                add_flops(model, pipe.last_flops)
            kept = roll.results
            n_kept, all_lens, metrics = rollout_metrics(ctx, roll, cfg)
            metrics.update(async_metrics)
            if n_kept:  # every rank takes part in the update; a rank that kept nothing with a zero-weight row
                rewards_t, rows = roll.scores, kept or generated
                batch = RolloutBatch.build(model, [r.prompt_ids for r in rows], [r.response_ids for r in rows],
                                           [r.mm for r in rows], pad_id,
                                           rollout_logprobs=[r.response_logprobs for r in rows],
                                           weights=[1.0] * len(kept) or [0.0])
                up.set_packing(batch)  # padding-free forwards in the ref / old / training passes (or padded)
                vcache = VisionCache(model) if reuse else None  # this step's images, policy ("default") state
                # ---- reference log-probs, KL as a reward penalty
                if al.kl.coef > 0:
                    ref_cache = vcache if share_ref else (VisionCache(model) if reuse else None)
                    with timer("ref"), states.use("ref"), lockstep():
                        batch.ref_logprobs = batch.logprobs(model, up.micro_batch_size, ro.temperature,
                                                            vision_cache=ref_cache)
                    if al.kl.in_reward:
                        kl_tok = kl_estimate(batch.rollout_logprobs, batch.ref_logprobs, al.kl.estimator)
                        seq_kl = (kl_tok * batch.response_mask).sum(-1).cpu()[:len(kept)]
                        rewards_t = rewards_t - al.kl.coef * seq_kl
                        metrics["kl/ref"] = (float(ctx.all_reduce_sum(seq_kl.sum())) / float(all_lens.sum())
                                             if ctx.enabled else seq_kl.sum() / all_lens.sum())
                # ---- advantages (group statistics over the global batch)
                r_all, g_all = ctx.gather_group_rewards(rewards_t, roll.group_ids, scope="rank")
                if reward_norm is not None and kept:
                    reward_norm.update(r_all)
                    r_all = reward_norm.normalize(r_all)
                    metrics.update(reward_norm.metrics())
                if cfg.reward.aggregation == "normalise_then_sum":  # GDPO: each component in its own groups
                    comp, weights = reward_components(reward_model, rewards_t, roll.comps,
                                                      cfg.reward.overlong_buffer > 0)
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
                        batch.old_logprobs = batch.logprobs(model, up.micro_batch_size, ro.temperature,
                                                            vision_cache=vcache)
                    drift = float(((batch.old_logprobs - batch.rollout_logprobs).abs() * batch.response_mask)[
                        :len(kept)].max()) if kept and batch.response_len else 0.0
                else:
                    batch.old_logprobs = batch.rollout_logprobs
                if al.rollout_correction.enabled and kept and recompute:  # sampling log-probs vs the trainer's
                    w, keep, m = al.rollout_correction.apply(batch.old_logprobs, batch.rollout_logprobs,
                                                             batch.loss_mask)
                    batch.advantages = weighted_advantages(batch.advantages, w)
                    batch.loss_mask = batch.loss_mask & keep
                    metrics.update(m)
                # ---- loss and optimizer steps
                n_rows = ctx.max_int(len(kept)) if ctx.enabled else len(kept)
                mb = up.mini_batch_size // world or n_rows
                with timer("train"):
                    res = policy_update(tmodel, batch, optimizer, params, loss_fn=loss_fn,
                                        minibatches=contiguous_minibatches(len(kept), n_rows, mb),
                                        micro_batch_size=up.micro_batch_size, epochs=up.epochs,
                                        max_grad_norm=up.max_grad_norm, temperature=ro.temperature,
                                        entropy_grad=al.entropy_coef != 0, guard=guard, step=step,
                                        lr_scheduler=lr_sched, ctx=ctx, equal_micro_batches=fsdp, vision_cache=vcache,
                                        loss_tokens="loss_mask" if al.loss_agg == "token-mean" else "rows")
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
            if ctx.is_main and cfg.log.sample_every and (step % cfg.log.sample_every == 0 or step == 1):
                save_sample_grid(run, step, roll, cfg.log.num_samples)
            if (ctx.is_main or fsdp) and ((cfg.log.eval_every and step % cfg.log.eval_every == 0)
                                          or step == cfg.train.max_steps):
                metrics.update(evaluate(engine, processor, eval_items, reward_model, cfg, judges, step))
            if step == cfg.train.max_steps:
                summary.update({k.replace("eval/accuracy", "eval_accuracy_last"): v for k, v in metrics.items()
                                if k.startswith("eval/accuracy")})
        metrics.update(timer.pop())
        metrics["time/step_s"] = t_step.times["step"]
        metrics.update(perf_metrics(ctx, model, metrics["time/step_s"], run.device))  # a collective
        if ctx.is_main:
            run.log(step, metrics)
        bar.update(1)
        bar.set_postfix(reward=f"{float(metrics['reward/mean']):.3f}", acc=f"{float(metrics['reward/accuracy']):.2f}")
        if checkpoint_due(cfg, step):  # FSDP: a collective; rank 0 writes
            save_checkpoint(ctx, run, step, states, stateful, fsdp=fsdp)
        if stop_for_hacking(ctx, run, step, judges, states, stateful, fsdp):  # log.hacking.stop
            break
    bar.close()
    if pipe is not None:
        pipe.close()
    if syncer is not None:
        engine.close()  # vLLM's process-global state freed: another engine can start in this process
    ctx.close()
    return finish(run, summary) if ctx.is_main else {}
