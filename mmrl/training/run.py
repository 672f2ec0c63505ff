"""Run start for every recipe: the process group and the run directory."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any


def start_run(cfg: Any, global_sizes: dict[str, int] | None = None):
    """(DistContext, Run) for a recipe config with a `dist:` section, under torchrun / accelerate or plain python.

    Checks: several processes with `dist.strategy: none` is an error (the ranks would train apart silently); every
    global size in `global_sizes` (config key -> value) must be divisible by the number of processes. Rank 0
    creates the run directory and writes config.yaml first (the run-directory checks of `mmrl.runtime.Run` run on
    every rank); the other ranks get no progress bar and use `ctx.device` (cuda:LOCAL_RANK). One process: exactly
    `Run(cfg)`. Also tunes glibc malloc for the run (``mmrl.runtime.tune_malloc``; opt out with
    MMRL_NO_MALLOC_TUNING=1): large CPU buffers stay in the heap between calls; no number changes."""
    from mmrl.distributed import DistContext
    from mmrl.runtime import Run, tune_malloc

    tune_malloc()
    ctx = DistContext.init(cfg.dist.backend)
    try:
        if ctx.enabled and cfg.dist.strategy == "none":
            raise ValueError(f"{ctx.world_size} processes were launched but dist.strategy is 'none': add "
                             f"dist.strategy=ddp (gradients are then averaged across processes)")
        for key, n in (global_sizes or {}).items():
            if n % ctx.world_size:
                raise ValueError(f"{key}={n} (global, over all processes) must be divisible by the number of "
                                 f"processes ({ctx.world_size})")
        if not ctx.is_main:
            os.environ["MMRL_NO_PROGRESS"] = "1"
        with ctx.main_process_first():
            run = Run(cfg, write_config=ctx.is_main)
    except BaseException:
        ctx.close()
        raise
    if ctx.enabled:
        run.device = ctx.device  # cuda:LOCAL_RANK (models and rewards load there)
    return ctx, run


def merge_rank_lists(ctx: Any, lists: dict[str, list]) -> dict[str, list]:
    """{key: values of rank 0 + values of rank 1 + ...} (all-gathered; a rank may lack a key). One process:
    `lists` unchanged. A collective: every rank must call it."""
    if not ctx.enabled:
        return lists
    merged: dict[str, list] = defaultdict(list)
    for part in ctx.all_gather_object(dict(lists)):
        for k, v in part.items():
            merged[k] += list(v)
    return merged
