"""The training spine every recipe shares: run start, one checkpoint layout, optimizer, update guards, summary.

A recipe's `train(cfg)` reads top to bottom and calls these in order::

    ctx, run = start_run(cfg, {"rollout.prompts_per_step": cfg.rollout.prompts_per_step})
    ... load rewards, data, model; states = PolicyStates(...)
    optimizer, lr_sched = build_optimizer(params, cfg.optim, total_steps=cfg.train.max_steps)
    start, extra = restore_checkpoint(ctx, run, states, stateful)      # (0, {}) for a fresh run
    guard = UpdateGuard(cfg.update.max_skipped_updates, ctx, run)
    for step in range(start + 1, cfg.train.max_steps + 1):
        ... rollout -> check_rewards -> advantages -> losses -> backward
        grad_norm = clip_grads(params, cfg.update.max_grad_norm)
        if guard.step(optimizer, losses, grad_norm, step): lr_sched.step()
        metrics.update(perf_metrics(ctx, states.model, metrics["time/step_s"], run.device))  # every rank
        run.log(step, metrics)
        if run.should_save(step): save_checkpoint(ctx, run, step, states, stateful, fsdp=fsdp)
    return summarise(run, "recipe")

Modules: `guards` (non-finite rewards/updates/weights), `config` (the config sections every recipe shares),
`optim` (AdamW + schedule, gradient clipping), `run` (process group + run directory), `checkpoint` (save/restore
in the one layout, FSDP included; `sharded`: torch.distributed.checkpoint shards; `consolidate`: sharded -> whole),
`summary` (first-5 vs last-5 steps), `async_rollout` (rollouts in a process of their own, at most
`rollout.max_staleness` policy versions behind; `payloads`: its batches as plain state); `attach_flops_meter` /
`perf_metrics` (mmrl.perf: `perf/tflops_per_step`, MFU, peak memory).
"""

from mmrl.perf.meter import attach_flops_meter, perf_metrics
from mmrl.training.checkpoint import (FullOptimizerState, checkpoint_due, restore_checkpoint, save_checkpoint)
from mmrl.training.config import (KLConfig, LoRAConfig, OptimConfig, RunningNormFields, TrackersConfig,
                                  UpdateConfig, peft_lora_config)
from mmrl.training.guards import (NONFINITE_KEY, ON_NONFINITE, SKIPPED_KEY, NonFiniteError, OnNonfinite, UpdateGuard,
                                  check_finite_weights, check_rewards, finite_stats, group_keep, last_checkpoint)
from mmrl.training.optim import build_optimizer, clip_grads, lr_factor
from mmrl.training.run import closes_runs, merge_rank_lists, start_run
from mmrl.training.summary import summarise

__all__ = [
    "NONFINITE_KEY", "ON_NONFINITE", "SKIPPED_KEY", "NonFiniteError", "OnNonfinite", "UpdateGuard",
    "check_finite_weights", "check_rewards", "finite_stats", "group_keep", "last_checkpoint",
    "KLConfig", "LoRAConfig", "TrackersConfig", "OptimConfig", "UpdateConfig", "RunningNormFields", "peft_lora_config",
    "build_optimizer", "clip_grads", "lr_factor", "start_run", "merge_rank_lists", "closes_runs",
    "FullOptimizerState", "checkpoint_due", "restore_checkpoint", "save_checkpoint", "summarise",
    "attach_flops_meter", "perf_metrics",
]
