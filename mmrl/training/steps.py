"""The step loop and step tail of every recipe (the diffusion recipes through `mmrl.diffusion.loop`, vlm_grpo,
vlm_multiturn, prompt_rewriter):

    steps = StepLoop(ctx, run, cfg, start, states=states, stateful=stateful, fsdp=fsdp, judges=judges,
                     postfix=lambda m: {"reward": f"{m['reward/mean']:.4g}"})
    for step in steps:              # steps.metrics: this step's row; steps.timer: its timings
        ... the recipe's step: rollout, rewards, advantages, updates
    steps.close()

Around each step, on every rank: with several processes the global RNG is seeded from (seed, rank, step) first
(rank-local noise that needs nothing per rank in a checkpoint); the step body runs inside `timer("step")`; then
`after_step(step, metrics)` (a recipe family's samples and evaluation, outside the step's time), and the tail: the
timings (`time/*`, `time/step_s`), with a rollout process (`stateful["async_rollout"]`) its overlap metrics
(`async/*`, `mmrl.training.overlap`), `perf/*` (a collective), one metrics.jsonl row (rank 0), the progress bar, the
checkpoint when due (`train.save_every` or the last step; collective, rank 0 writes, `checkpoint_extra()` saved
with it), and the stops: a callback's request (`mmrl.run.trackers.stop_requested`) and the reward-hacking alarm
(`log.hacking.stop`), each writing the step's checkpoint first.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from mmrl.perf.meter import perf_metrics
from mmrl.runtime import Timer, seed_everything

__all__ = ["StepLoop", "TIMING_PREFIX"]

TIMING_PREFIX = "time/"  # metrics that legitimately differ between two identical runs


class StepLoop:
    """Iterate a run's remaining steps (module docstring). `start`: the step a restored checkpoint ended (0 for a
    fresh run); `states`: the `PolicyStates` (its model carries the FLOPs meter); `postfix(metrics)`: the progress
    bar's extra fields; `checkpoint_extra()`: recipe state saved beside the stateful objects (e.g. a task cursor)."""

    def __init__(self, ctx: Any, run: Any, cfg: Any, start: int, *, states: Any, stateful: dict, fsdp: bool,
                 judges: Any = None, postfix: Callable[[dict], dict] | None = None,
                 after_step: Callable[[int, dict], None] | None = None,
                 checkpoint_extra: Callable[[], dict] | None = None, model: Any = None):
        self.ctx, self.run, self.cfg, self.start = ctx, run, cfg, start
        self.states, self.stateful, self.fsdp, self.judges = states, stateful, fsdp, judges
        self.model = model if model is not None else states.model
        self.postfix = postfix or (lambda m: {"reward": f"{m['reward/mean']:.4g}"})
        self.after_step, self.checkpoint_extra = after_step, checkpoint_extra
        self.timer = Timer(sync_cuda=run.device.type == "cuda")
        self.bar = run.progress(cfg.train.max_steps, initial=start)
        self.metrics: dict[str, Any] = {}
        self.step = start

    def __iter__(self) -> Iterator[int]:
        ctx, cfg = self.ctx, self.cfg
        for step in range(self.start + 1, cfg.train.max_steps + 1):
            self.step, self.metrics = step, {}
            if ctx.enabled:  # rank-local noise, a pure function of (seed, rank, step): nothing per rank to checkpoint
                seed_everything(ctx.rank_seed(cfg.seed, step))
            with self.timer("step"):
                yield step
            if self.after_step is not None:
                self.after_step(step, self.metrics)
            if self.end_step(step, self.metrics):
                break

    def end_step(self, step: int, metrics: dict) -> bool:
        """The tail of a step on every rank (module docstring); True when a callback (`control.should_training_stop`)
        or the hacking alarm stops the run."""
        from mmrl.run.checkpoint import checkpoint_due
        from mmrl.run.trackers import stop_requested
        from mmrl.training.judges import stop_for_hacking

        ctx, run = self.ctx, self.run
        metrics.update(self.timer.pop(TIMING_PREFIX))
        metrics["time/step_s"] = metrics.pop("time/step_s")
        pipe = self.stateful.get("async_rollout")  # rollout.worker=process: the overlap metrics need the step's time
        if pipe is not None:
            metrics.update(pipe.step_metrics(metrics["time/step_s"]))
        metrics.update(perf_metrics(ctx, self.model, metrics["time/step_s"], run.device))  # a collective
        if ctx.is_main:
            run.log(step, metrics)
        self.bar.update(1)
        self.bar.set_postfix(**self.postfix(metrics))
        if checkpoint_due(self.cfg, step):
            self.save(step)
        if stop_requested(ctx, run):  # a callback's control.should_training_stop
            if not checkpoint_due(self.cfg, step):
                self.save(step)
            if ctx.is_main:
                print(f"[{self.cfg.algorithm}] stopping at step {step}: a callback asked to "
                      f"(control.should_training_stop); the checkpoint of this step is written", flush=True)
            return True
        return stop_for_hacking(ctx, run, step, self.judges, self.states, self.stateful, self.fsdp)

    def save(self, step: int) -> None:
        from mmrl.run.checkpoint import save_checkpoint

        extra = self.checkpoint_extra() if self.checkpoint_extra is not None else None
        save_checkpoint(self.ctx, self.run, step, self.states, self.stateful, fsdp=self.fsdp, extra=extra)

    def close(self) -> None:
        self.bar.close()
