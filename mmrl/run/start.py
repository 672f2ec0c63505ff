"""Run start for every recipe: the process group and the run directory (`start_run`), and what ends it however
train() ends (`closes_runs`)."""

from __future__ import annotations

import functools
import os
from typing import Any, Callable


def start_run(cfg: Any, global_sizes: dict[str, int] | None = None):
    """(DistContext, Run) for a recipe config with a `dist:` section, under torchrun / accelerate or plain python.

    `dist.strategy: auto` becomes `ddp` when several processes were launched, `none` in one (printed by rank 0).
    Checks: several processes with `dist.strategy: none` is an error (the ranks would train apart silently); every
    global size in `global_sizes` (config key -> value) must be divisible by the number of processes. Rank 0
    takes the run directory's lock (`mmrl.run.lock`), creates it and writes config.yaml first; the other ranks then
    run the run-directory checks of `mmrl.run.Run` without writing, or, when rank 0 failed, raise its error (no
    rank is left waiting). They get no progress bar and use `ctx.device` (cuda:LOCAL_RANK). One process: exactly
    `Run(cfg)`. Also tunes glibc malloc for the run (``mmrl.runtime.tune_malloc``; opt out with
    MMRL_NO_MALLOC_TUNING=1): large CPU buffers stay in the heap between calls; no number changes."""
    from mmrl.distributed import DistContext
    from mmrl.run.directory import Run
    from mmrl.run.files import RunError
    from mmrl.runtime import tune_malloc

    tune_malloc()
    hide_hf_progress_bars()
    ctx = DistContext.init(cfg.dist.backend)
    try:
        sp = getattr(cfg.dist, "sequence_parallel", 1)
        if sp > 1:  # groups of sp processes share each forward; the recipe sees the data-parallel groups
            from mmrl.distributed.sequence import check_recipe, data_parallel_view

            check_recipe(cfg, ctx.world_size)
            ctx = data_parallel_view(ctx, sp)
        if ctx.enabled and cfg.dist.strategy == "none":
            raise ValueError(f"{ctx.processes} processes were launched but dist.strategy is 'none': use "
                             f"dist.strategy=auto or ddp (gradients are then averaged across processes)")
        if cfg.dist.strategy == "auto":  # as accelerate / TRL: several launched processes mean data parallel
            cfg.dist.strategy = ctx.resolve_strategy("auto")
            if ctx.is_main:
                n = f"{ctx.processes} processes launched" if ctx.enabled else "one process"
                print(f"[mmrl] dist.strategy: auto -> {cfg.dist.strategy} ({n})", flush=True)
        for key, n in (global_sizes or {}).items():
            if n % ctx.world_size:
                raise ValueError(f"{key}={n} (global, over all processes) must be divisible by the number of "
                                 f"processes ({ctx.world_size})" if ctx.sp == 1 else f"data-parallel groups "
                                 f"({ctx.processes} processes / dist.sequence_parallel {ctx.sp} = {ctx.world_size})")
        if not ctx.is_main:
            os.environ["MMRL_NO_PROGRESS"] = "1"
            hide_hf_progress_bars()
        failure: BaseException | None = None
        if ctx.is_main:  # rank 0 first: it takes the directory's lock, clears and checks it, writes config.yaml
            try:
                run = Run(cfg, write_config=True)
            except BaseException as exc:  # noqa: BLE001 - shared with the other ranks below, then raised
                failure = exc
        # every rank learns rank 0's outcome (a collective, so no rank waits for one that gave up)
        reason = ctx.broadcast_object(None if failure is None else str(failure)) if ctx.enabled else None
        if failure is not None:
            raise failure
        if reason is not None:
            raise RunError(f"rank 0 could not start the run: {reason}")
        if not ctx.is_main:
            run = Run(cfg, write_config=False)
    except BaseException:
        ctx.close()
        raise
    if ctx.enabled:
        run.device = ctx.device  # cuda:LOCAL_RANK (models and rewards load there)
    return ctx, run


def hide_hf_progress_bars(force: bool = False) -> None:
    """With MMRL_NO_PROGRESS=1 (or `force`) the loading bars of diffusers, transformers and huggingface_hub are off
    too. Called by `mmrl.cli.main` before any command (eval, export and reward score load models without a run),
    and by `start_run` (the Python API)."""
    if os.environ.get("MMRL_NO_PROGRESS") != "1" and not force:
        return
    import importlib

    for module in ("diffusers.utils.logging", "transformers.utils.logging"):
        try:
            importlib.import_module(module).disable_progress_bar()
        except ImportError:  # pragma: no cover - both are dependencies
            pass
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:  # pragma: no cover
        pass


# what closes_runs stops when a recipe's train() raises, besides its runs: (snapshot of what is open, closer)
_FAILURE_CLOSERS: list[tuple[Callable[[], Any], Callable[[Any], None], Any, bool]] = []


def close_on_failure(snapshot: Callable[[], Any], close: Callable[[Any], None], nothing_open: Any,
                     on_return: bool = False) -> None:
    """Register something a recipe may open that `closes_runs` must stop when train() raises (the rollout processes
    of `mmrl.training.async_rollout`): `snapshot()` is taken when train() starts, `close(snapshot)` stops what was
    opened after it; `nothing_open` stands for the snapshot when the closer was registered during the call.
    `on_return`: stop it when train() returns too (the reward servers a run started serve that run only)."""
    _FAILURE_CLOSERS.append((snapshot, close, nothing_open, on_return))


def closes_runs(train: Callable[[Any], dict]) -> Callable[[Any], dict]:
    """Decorator for a recipe's `train(cfg)`: however it ends, the runs it opened are closed (`mmrl.run.Run.close`):
    the directory lock released (on a return, an exception or Ctrl-C), and a run that failed before it wrote a
    metrics row, checkpoint or sample leaves nothing of its start behind (a bad path, a bad size, a model that
    does not load). What it registered with `close_on_failure` (rollout processes) is stopped when it raises (reward servers
    it started: however it ends)."""
    from mmrl.run.directory import close_runs, open_runs

    @functools.wraps(train)
    def wrapper(cfg: Any) -> dict:
        since = open_runs()
        opened = {id(entry): entry[0]() for entry in _FAILURE_CLOSERS}
        try:
            out = train(cfg)
        except BaseException:
            for entry in list(_FAILURE_CLOSERS):
                entry[1](opened.get(id(entry), entry[2]))
            close_runs(since, failed=True)
            raise
        for entry in list(_FAILURE_CLOSERS):
            if entry[3]:
                entry[1](opened.get(id(entry), entry[2]))
        close_runs(since)
        return out

    return wrapper
