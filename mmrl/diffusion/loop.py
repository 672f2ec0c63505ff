"""The one diffusion training loop: what Flow-GRPO, DiffusionNFT, AWM, DGPO and Diffusion-DPO share, written once.
A recipe keeps its config, its loss and what truly differs (SDE or ODE rollouts, its training points) and reads
top to bottom:

    loop = DiffusionLoop(cfg)                                  # 1. run start, prompts, reward, model
    loop.setup(old=True, ref=cfg.algo.kl.coef > 0, eval_state="default", counters=True)   # 2. policy, optimizer
    loop.begin(postfix=...)                                    # 3. resume, baseline evaluation, step-0 grid
    for step in loop:                                          # 4. steps (seeded per rank, timed)
        roll = loop.rollout(step, ode_sampling(cfg.rollout), state="old")      # rollout + rewards
        adv, keep = loop.advantages(roll, clip=cfg.algo.adv_clip_max)         # per-prompt advantages
        loop.metrics.update(train_on_rollout(loop.parts, step, roll, ...))    # the recipe's loss
    return loop.finish(lambda run: summarise(run, "nft"))

1. `DiffusionLoop(cfg)`: the process group and run directory (`start_run`), training and held-out prompts (edit rows
   checked), the reward (`reward.components`) and the flow model (`model.path`), in this order.
2. `setup(...)`: policy states on the transformer ("default" trains; "old" and "ref" when asked), DDP/FSDP, the
   optimizer and schedule, the update guard, the per-prompt stat tracker, the prompt stream, the checkpointed state
   (`stateful`), the running reward norm and the judges (`log.judges`).
3. `begin(...)`: resume (`train.resume`), the judges' baseline evaluation and the step-0 sample grid.
4. The steps (`mmrl.training.steps.StepLoop`): after each step body, the diffusion tail: `policy/lr`, the sample
   grid (`log.sample_every`), the held-out evaluation (`log.eval_every`: after step 1, every N steps and at the
   end; FSDP: every rank runs the forwards, rank 0 writes), `cost/transformer_evals`, then the shared step tail
   (metrics row, `perf/*`, checkpoint, hacking stop).

Several processes: `rollout.prompts_per_step` is global, each rank rolls out its contiguous share, rewards are
all-gathered for the advantages, every rank runs the same number of updates and micro-steps
(`mmrl.training.updates.UpdateIterator`), rank 0 alone logs, samples, evaluates and writes checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from mmrl.diffusion.common import NoSamples, evaluator, grid_due, grid_prompts, sample_grid
from mmrl.training.steps import StepLoop
from mmrl.training.updates import UpdateIterator

__all__ = ["DiffusionLoop", "TrainingParts", "setup_training"]


def setup_training(ctx: Any, run: Any, cfg: Any, model: Any, *, old: bool, ref: bool):
    """(states, evals, params, optimizer, lr_sched, guard, fsdp) of a recipe, in the order every strategy needs:
    policy states on the transformer (`build_policy_states`), the transformer-evaluation counter, the DDP/FSDP
    wrapper (`dist.strategy`; FSDP: `states.refresh()` follows the new DTensor shards), then the optimizer and
    schedule over the trainable parameters (`optim`, `mmrl.training.build_optimizer`) and the `UpdateGuard`
    (`update.max_skipped_updates`: a NaN/inf loss or gradient never reaches the weights)."""
    from mmrl.diffusion.common import TransformerEvalCounter, build_policy_states
    from mmrl.training import UpdateGuard, attach_flops_meter, build_optimizer

    states = build_policy_states(model, cfg.model, old=old, ref=ref)
    if getattr(ctx, "sp", 1) > 1:  # dist.sequence_parallel: split plan attached after the LoRA layers exist
        from mmrl.distributed import sequence

        sequence.apply(states.model, ctx, model.family)
    evals = TransformerEvalCounter(model.transformer)
    # DDP keeps PolicyStates' parameter objects ("old"/"ref" switching and the EMA work); one process: unchanged
    # a family whose transformer has parameters no output depends on (Qwen-Image: its last block's text stream) needs
    # DDP to look for them, or the second backward fails
    unused = cfg.dist.find_unused_parameters or getattr(model, "has_unused_parameters", False)
    model.transformer = ctx.wrap_model(states.model, cfg.dist.strategy, find_unused_parameters=unused)
    fsdp = ctx.enabled and cfg.dist.strategy == "fsdp"
    if fsdp:  # fully_shard replaced every parameter by a DTensor shard: follow them before building the optimizer
        states.refresh()
    attach_flops_meter(states.model)  # perf/tflops_per_step, perf/mfu (the step tail)
    params = states.trainable_parameters()
    optimizer, lr_sched = build_optimizer(params, cfg.optim, total_steps=cfg.train.max_steps)
    guard = UpdateGuard(cfg.update.max_skipped_updates, ctx, run)
    return states, evals, params, optimizer, lr_sched, guard, fsdp


@dataclass
class TrainingParts:
    """What a diffusion recipe's update of one rollout batch works with: its config, the process group, the flow
    model (its `transformer` DDP/FSDP-wrapped), the policy states, the optimizer, schedule, trainable parameters,
    update guard, the step's timer and the EMA schedule's update counter (None without one)."""

    cfg: Any
    ctx: Any
    model: Any
    states: Any
    optimizer: Any
    lr_scheduler: Any
    params: Any
    guard: Any = None
    timer: Any = None
    counters: Any = None

    def __post_init__(self) -> None:  # (a test's update without a run: a fresh guard, a timer of its own)
        if self.guard is None:
            from mmrl.training import UpdateGuard

            self.guard = UpdateGuard(self.cfg.update.max_skipped_updates, self.ctx)
        if self.timer is None:
            from mmrl.runtime import Timer

            self.timer = Timer()

    def updates(self, units: Any, *, metrics: dict, step: int, **options: Any) -> UpdateIterator:
        """The micro-steps of this batch's optimizer updates (`mmrl.training.updates.UpdateIterator`) with the
        `update:` section (epochs, mini-batches over the nominal batch `rollout.batch`, micro-batches, clipping);
        `options` replace any of them or add the iterator's hooks."""
        update = self.cfg.update
        kwargs = dict(epochs=update.epochs, updates_per_epoch=update.updates_per_epoch(self.cfg.rollout.batch),
                      micro_batch_size=update.micro_batch_size, counters=self.counters)
        kwargs.update(options)
        return UpdateIterator(self.ctx, units, module=self.model.transformer, optimizer=self.optimizer,
                              params=self.params, lr_scheduler=self.lr_scheduler, guard=self.guard,
                              max_grad_norm=update.max_grad_norm, step=step, metrics=metrics, **kwargs)


class DiffusionLoop:
    """The run, model, policy and step loop of one diffusion recipe (module docstring). `online`: the recipe rolls
    out from `data.train_prompts` (offline DPO: from preference pairs, `data.pairs_per_step` of them per step)."""

    def __init__(self, cfg: Any, *, online: bool = True):
        from mmrl.diffusion.common import load_recipe_model
        from mmrl.diffusion.conditioning import check_data
        from mmrl.diffusion.scoring import load_reward_fn, policy_latent_space
        from mmrl.pipelines.data import load_prompts
        from mmrl.rewards.audio import check_audio_rewards, takes_audio
        from mmrl.rewards.latent import check_reward_latents, takes_latents
        from mmrl.run.start import start_run

        self.cfg = cfg
        sizes = ({"rollout.prompts_per_step": cfg.rollout.prompts_per_step} if online
                 else {"data.pairs_per_step": cfg.data.pairs_per_step})
        self.ctx, self.run = start_run(cfg, sizes)
        self.train_items = load_prompts(cfg.data.train_prompts) if online else []
        self.eval_items = (load_prompts(cfg.data.eval_prompts)[: cfg.log.eval_max_prompts] if cfg.data.eval_prompts
                           else [])
        check_data(cfg.model.path, train_prompts=self.train_items, eval_prompts=self.eval_items)  # edit rows' sources
        # the reward scores rollouts (online) and held-out evaluations
        self.reward_fn = (load_reward_fn(cfg.reward.components, self.run.device, cfg.rollout.num_frames)
                          if online or self.eval_items else None)
        self.model = load_recipe_model(cfg, self.run.device, self.run.dtype)
        if takes_latents(self.reward_fn):  # a latent reward against the loaded model (also one built after the config)
            check_reward_latents(self.reward_fn, policy_latent_space(model=self.model), cfg.model.path)
        if takes_audio(self.reward_fn):  # a sound reward against the loaded model (also one built after the config)
            check_audio_rewards(getattr(self.reward_fn, "components", None) or {"reward": self.reward_fn},
                                lambda: (self.model.family, self.model.has_audio), cfg.model.path)
        self.extra_evaluations: list[Callable[[], dict]] = []  # run beside the held-out evaluation (offline DPO)

    # ---------------------------------------------------------------------------------------------- setup

    def setup(self, *, old: bool, ref: bool, eval_state: str, tracker: bool = True, counters: bool = False,
              sampler: Any = None) -> None:
        """Policy states ("old" / "ref" when asked), DDP/FSDP, optimizer, guard; the per-prompt stat tracker, the
        prompt stream (`sampler`, default the training prompts), the update counter of an EMA schedule
        (`counters`); the checkpointed `stateful` objects, the running reward norm and the judges. `eval_state`: the
        policy state of evaluations and sample grids."""
        from mmrl.core.prompt_stats import PerPromptStatTracker
        from mmrl.diffusion import old_policy
        from mmrl.pipelines.data import PromptSampler
        from mmrl.run.checkpoint import FullOptimizerState
        from mmrl.training.judges import build_judges

        cfg, ctx, run = self.cfg, self.ctx, self.run
        (self.states, self.evals, self.params, self.optimizer, self.lr_sched, self.guard,
         self.fsdp) = setup_training(ctx, run, cfg, self.model, old=old, ref=ref)
        self.eval_state = eval_state
        self.tracker = PerPromptStatTracker(cfg.reward.std_mode, cfg.reward.history) if tracker else None
        self.sampler = sampler if sampler is not None else PromptSampler(self.train_items, seed=cfg.seed)
        self.counters = old_policy.UpdateCounter() if counters else None
        self.stateful = {"optimizer": FullOptimizerState(self.optimizer) if self.fsdp else self.optimizer,
                         "lr_scheduler": self.lr_sched}
        if self.tracker is not None:
            self.stateful["tracker"] = self.tracker
        self.stateful["data"] = self.sampler
        if self.counters is not None:
            self.stateful["counters"] = self.counters
        self.stateful["transformer_evals"] = self.evals
        build_norm = getattr(cfg.reward, "build_running_norm", None)
        self.reward_norm = build_norm(self.stateful) if build_norm is not None else None  # identical on every rank
        # log.judges: held-out judges + the hacking alarm (which warns when too few held-out prompts)
        self.judges = build_judges(cfg.log, run.device, self.stateful, len(self.eval_items))

    def begin(self, postfix: Callable[[dict], dict] | None = None) -> int:
        """Resume (`train.resume`), the judges' baseline evaluation (before any update) and the step-0 sample grid;
        returns the step a restored checkpoint ended (0 for a fresh run). `postfix(metrics)`: the progress bar's
        fields besides the reward."""
        from mmrl.run.checkpoint import restore_checkpoint

        cfg, ctx = self.cfg, self.ctx
        self.start, _ = restore_checkpoint(ctx, self.run, self.states, self.stateful)
        self.evaluate = evaluator(self.model, self.states, self.eval_state, self.reward_fn, self.eval_items, cfg,
                                  self.judges)
        if self.judges is not None and self.start == 0 and self._evaluates:
            self.evaluate(self._writer, 0)
        self.grid = grid_prompts(cfg, self.eval_items, self.train_items)  # every grid: these prompts, the same noise
        if self.start == 0 and grid_due(cfg, 0) and self._evaluates:
            self._sample_grid(0)
        extra = postfix or (lambda m: {})
        self.steps = StepLoop(ctx, self.run, cfg, self.start, states=self.states, stateful=self.stateful,
                              fsdp=self.fsdp, judges=self.judges, after_step=self._after_step,
                              postfix=lambda m: {"reward": f"{m['reward/mean']:.4g}", **extra(m)})
        self.parts = TrainingParts(cfg, ctx, self.model, self.states, self.optimizer, self.lr_sched, self.params,
                                   self.guard, self.steps.timer, self.counters)
        return self.start

    # ---------------------------------------------------------------------------------------------- a step

    def __iter__(self) -> Iterator[int]:
        return iter(self.steps)

    @property
    def metrics(self) -> dict:
        """This step's metrics row."""
        return self.steps.metrics

    @property
    def timer(self) -> Any:
        return self.steps.timer

    def rollout(self, step: int, sampling: dict | None = None, *, state: str | None = None, encode: Any = None,
                scorer: Any = None, pipe: Any = None, step_metrics: Callable[[Any], dict] | None = None):
        """This rank's rollout of the step and its rewards (`mmrl.diffusion.rollout.rollout_and_score` with the
        `sample_groups` settings `sampling` and the policy state `state`), or the batch a rollout process made
        (`pipe`, rollout.worker=process). Logs the batch's reward metrics (all ranks) and sample statistics."""
        from mmrl.diffusion.rollout import rollout_and_score
        from mmrl.diffusion.scoring import reduce_reward_metrics
        from mmrl.perf.meter import add_flops

        if pipe is None:
            roll = rollout_and_score(self.cfg, self.model, self.sampler, self.ctx, self.reward_fn, self.timer,
                                     sampling=sampling, states=self.states, state=state, encode=encode,
                                     scorer=scorer, step_metrics=step_metrics)
        else:  # made by the rollout process with the weights after update step-1-max_staleness
            roll, async_metrics = pipe.next(step)
            self.metrics.update(async_metrics)
            self.evals.count += roll.transformer_evals
            add_flops(self.states.model, pipe.last_flops)
        self.metrics.update(reduce_reward_metrics(self.ctx, roll.reward_metrics))
        self.metrics.update(roll.sample_metrics)  # diag/sample/* (+ the SDE window's rollout/*)
        return roll

    def advantages(self, roll: Any, clip: float, reward_norm: Any = None):
        """(advantages [b], indices of the samples to train on): per-prompt normalisation over every rank's
        rewards (`reward.aggregation`, `reward.std_mode`, `reward.history`), clipped to +-`clip`, samples of groups
        without a usable relative signal (and, with `reward.drop_zero_advantage`, zero advantages) left out."""
        from mmrl.diffusion.scoring import global_advantages, reward_weights

        adv, keep, metrics = global_advantages(self.ctx, self.tracker, roll.prompts, roll.scores, clip,
                                               self.cfg.reward.drop_zero_advantage, reward_norm, roll.components,
                                               reward_weights(self.reward_fn), self.cfg.reward.aggregation)
        self.metrics.update(metrics)
        return adv, keep

    def update_old(self, decay: float) -> None:
        """old <- decay * old + (1 - decay) * default after a step's updates, unless every update was skipped
        (NaN/inf: "old" stays as it was); logs `policy/old_decay`."""
        from mmrl.training import SKIPPED_KEY

        if self.metrics["train/updates"] or not self.metrics[SKIPPED_KEY]:
            self.states.ema("default", "old", decay)
        self.metrics["policy/old_decay"] = decay

    # ---------------------------------------------------------------------------------------------- the tail

    @property
    def _evaluates(self) -> bool:
        """Rank 0 evaluates; under FSDP or sequence parallelism every rank runs the forwards (rank 0 writes)."""
        return self.ctx.is_main or self.fsdp or getattr(self.ctx, "sp", 1) > 1

    @property
    def _writer(self) -> Any:
        return self.run if self.ctx.is_main else NoSamples()

    def _sample_grid(self, step: int) -> None:
        sample_grid(self.model, self.states, self.eval_state, self.reward_fn, self.grid, self._writer, step, self.cfg)

    def eval_due(self, step: int) -> bool:
        every = self.cfg.log.eval_every
        return bool(self._evaluates and every and (step % every == 0 or step in (1, self.cfg.train.max_steps)))

    def _after_step(self, step: int, metrics: dict) -> None:
        metrics["policy/lr"] = self.optimizer.param_groups[0]["lr"]
        if grid_due(self.cfg, step) and self._evaluates:
            self._sample_grid(step)
        if self.eval_due(step):
            with self.timer("eval"):
                for evaluate in self.extra_evaluations:
                    metrics.update(evaluate())
                if self.eval_items:
                    metrics.update(self.evaluate(self._writer, step))
        metrics["cost/transformer_evals"] = self.evals.sync(self.ctx)

    def finish(self, summarise: Callable[[Any], dict]) -> dict:
        """Close the progress bar and the evaluation counter; rank 0 returns `summarise(run)`."""
        self.steps.close()
        self.evals.remove()
        summary = summarise(self.run) if self.ctx.is_main else {}
        self.ctx.barrier()
        self.ctx.close()
        return summary
