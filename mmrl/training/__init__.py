"""The training spine every recipe shares, on top of the run layer (`mmrl.run`: run start, the run directory,
checkpoints, resume):

- `steps.StepLoop`: the step loop and step tail (per-rank seeding, timings, `perf/*`, the metrics row, the progress
  bar, the checkpoint when due, the reward-hacking stop);
- `updates.UpdateIterator`: inner epochs -> optimizer updates -> micro-steps, identical on every rank (zero-weight
  padding, no_sync, DDP loss scale, clipping, the update guard, the schedule);
- `config`: the config sections every recipe shares; `optim`: AdamW + schedule, gradient clipping; `guards`:
  non-finite rewards and updates; `judges`: held-out judges and the reward-hacking alarm; `summary`: the end-of-run
  summary; `async_rollout`: rollouts in a process of their own, at most `rollout.max_staleness` policy versions
  behind (`payloads`: its batches as plain state); `attach_flops_meter` / `perf_metrics` (`mmrl.perf`).
"""

from mmrl.perf.meter import attach_flops_meter, perf_metrics
from mmrl.training.config import (KLConfig, LoRAConfig, OptimConfig, RunningNormFields, TrackersConfig, UpdateConfig,
                                  peft_lora_config)
from mmrl.training.guards import (NONFINITE_KEY, ON_NONFINITE, SKIPPED_KEY, OnNonfinite, UpdateGuard, check_rewards,
                                  finite_stats, group_keep)
from mmrl.training.optim import build_optimizer, clip_grads, lr_factor
from mmrl.training.summary import summarise

__all__ = [
    "NONFINITE_KEY", "ON_NONFINITE", "SKIPPED_KEY", "OnNonfinite", "UpdateGuard", "check_rewards", "finite_stats",
    "group_keep", "KLConfig", "LoRAConfig", "TrackersConfig", "OptimConfig", "UpdateConfig", "RunningNormFields",
    "peft_lora_config", "build_optimizer", "clip_grads", "lr_factor", "summarise", "attach_flops_meter",
    "perf_metrics",
]
