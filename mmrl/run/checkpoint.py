"""One checkpoint layout for every recipe, written and read the same way under one process, DDP and FSDP::

    checkpoints/step_N/
      adapters/      every PolicyStates state (peft + diffusers-loadable LoRA, or full weights)
      state.pt       {"stateful": {name: obj.state_dict()}, "extra": {...}, "rng": RNG states, "step": N}
      config.yaml    the resolved config this state was trained with
      MANIFEST.json  size + crc32 of every file;  COMPLETE  written last (see mmrl.run.Run.checkpoint)
      sharded/       sharded checkpoints only (`dist.checkpoint`, default under FSDP): optimizer state and full
                     fine-tuning weights as every rank's own shards (torch.distributed.checkpoint; mmrl.run.sharded)

Both formats resume on any number of ranks and under any strategy; the loader reads whichever it finds.

`stateful` names the recipe's resumable objects; the usual names are "optimizer", "lr_scheduler", "data" (+ e.g.
"tracker"). Checkpoints of the VLM recipes before this layout (`policy/` + flat state.pt keys) are still read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmrl.run.files import NonFiniteError, RunError, checkpoint_step, last_checkpoint
from mmrl.run.sharded import OPTIMIZER_MARK, SHARDED_DIR, load_optimizer_sharded, optimizer_sharded_state, reshard_fsdp
from mmrl.runtime import get_rng_state, set_rng_state

# resumable objects that exist only while an option is on (`reward.running_norm`, `log.judges`): a checkpoint
# written with the option off lacks them, and a resume that turns it on starts them empty
FRESH_ON_RESUME = ("reward_norm", "judges")


class FullOptimizerState:
    """An optimizer over FSDP2 DTensor parameters whose state_dict holds full (gathered, CPU) tensors -- a
    collective -- and whose load_state_dict takes full tensors (from any strategy) and keeps this rank's slice, so
    checkpoints are the same as one process writes."""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        from mmrl.distributed import full_optimizer_state_dict

        return full_optimizer_state_dict(self.optimizer)

    def load_state_dict(self, sd: dict) -> None:
        from mmrl.distributed import load_full_optimizer_state_dict

        load_full_optimizer_state_dict(self.optimizer, sd)


def _optimizer_of(obj: Any) -> Any:
    """The torch optimizer of a stateful object (an Optimizer or a FullOptimizerState), else None: its tensors go
    into a sharded checkpoint's shards, every other object's state_dict into state.pt."""
    import torch

    if isinstance(obj, FullOptimizerState):
        obj = obj.optimizer
    return obj if isinstance(obj, torch.optim.Optimizer) else None


def checkpoint_due(cfg: Any, step: int) -> bool:
    """True at every `train.save_every`-th step and at the last step."""
    t = cfg.train
    return bool((t.save_every and step % t.save_every == 0) or step == t.max_steps)


def save_checkpoint(ctx: Any, run: Any, step: int, states: Any, stateful: dict[str, Any], *, fsdp: bool = False,
                    extra: dict | None = None) -> None:
    """Write checkpoints/step_<step>/ atomically. Every rank calls it: the weights are checked for NaN/inf first
    (all ranks raise together; nothing is written). Sharded format (`dist.checkpoint`, default under FSDP with
    several ranks): every rank writes its shards of the optimizer state and of full fine-tuning weights
    (mmrl.run.sharded), rank 0 the rest. Full format: FSDP gathers shards and full-tensor optimizer state on
    every rank (`fsdp=True`; wrap the optimizer in `FullOptimizerState`) and rank 0 writes. The other ranks wait
    at a barrier until the checkpoint is complete."""

    check_finite_weights(states, step, ctx, run)
    for obj in stateful.values():  # state spread over ranks (e.g. in-flight rollouts) is collected first, on every rank
        gather = getattr(obj, "gather_for_checkpoint", None)
        if gather is not None:
            gather(ctx)
    dist_cfg = getattr(run.cfg, "dist", None)
    if dist_cfg is not None and dist_cfg.sharded_checkpoints(getattr(ctx, "processes", ctx.world_size)):
        _save_sharded(ctx, run, step, states, stateful, fsdp=fsdp, extra=extra)
        return
    with ctx.checkpoint(run, step) as d:
        if d is None and not fsdp:
            return
        states.save(Path(d) / "adapters" if d is not None else None)
        full = {k: v.state_dict() for k, v in stateful.items()}  # collectives under FSDP
        if d is not None:
            run.save_state(d, stateful=full, extra=dict(extra or {}), rng=get_rng_state(), step=step)


def _save_sharded(ctx: Any, run: Any, step: int, states: Any, stateful: dict[str, Any], *, fsdp: bool,
                  extra: dict | None) -> None:
    """The sharded format (see mmrl.run.sharded): one `dcp.save` (a collective) of this rank's optimizer and
    full fine-tuning shards into step_N/sharded/, the small rest by rank 0, all inside `Run.checkpoint`'s temp dir
    (manifest and atomic rename once every rank has written)."""
    from mmrl.adapters.files import SHARDED_KEY
    from mmrl.distributed import dcp_save

    reshard_fsdp(states.model)  # the sharded parameters, whatever forward ran last (sharded.reshard_fsdp)
    with ctx.checkpoint(run, step, all_ranks=True) as d:
        d = Path(d)
        if ctx.is_main or (fsdp and states.mode == "lora"):  # LoRA under FSDP: gathered (small), a collective
            states.save(d / "adapters" if ctx.is_main else None, sharded_dir=f"../{SHARDED_DIR}")
        tensors: dict[str, Any] = {SHARDED_KEY: states.sharded_state_dict()} if states.mode == "full" else {}
        small: dict[str, Any] = {}
        for k, obj in stateful.items():
            optimizer = _optimizer_of(obj)
            if optimizer is None:
                small[k] = obj.state_dict()
            else:
                tensors[k], small[k] = optimizer_sharded_state(optimizer, states.model)
        dcp_save(tensors, d / SHARDED_DIR)  # returns once every rank has written its shards
        if ctx.is_main:
            run.save_state(d, stateful=small, extra=dict(extra or {}), rng=get_rng_state(), step=step,
                           sharded={"world_size": getattr(ctx, "processes", ctx.world_size), "dir": SHARDED_DIR})


def restore_checkpoint(ctx: Any, run: Any, states: Any, stateful: dict[str, Any]) -> tuple[int, dict]:
    """Resume per `train.resume`: restores `states`, every `stateful` object and the RNG in place and returns
    (step, extra); (0, {}) for a fresh start. Rank 0 cuts metrics.jsonl back to the resumed step (to nothing on a
    fresh start)."""
    ckpt = run.find_resume()
    if ckpt is None:
        if ctx.is_main:
            run.truncate_metrics(0)  # a fresh run in an existing directory starts a fresh metrics.jsonl
        return 0, {}
    ckpt = Path(ckpt)
    step = checkpoint_step(ckpt)
    state = run.load_state(ckpt)
    if not ((ckpt / "adapters").is_dir() and "stateful" in state):
        raise RunError(f"checkpoint {ckpt} has no adapters/ + state.pt['stateful'] (the layout of every mmrl recipe): "
                       f"not a checkpoint of an mmrl recipe")
    saved, extra = state["stateful"], dict(state.get("extra", {}))
    weights = ckpt / "adapters"
    missing = [k for k in stateful if k not in saved and k not in FRESH_ON_RESUME]
    if missing:
        raise RunError(f"checkpoint {ckpt}: state.pt lacks {missing} (has {sorted(saved)}): written by another recipe?")
    fresh = [k for k in stateful if k not in saved]
    if fresh and ctx.is_main:
        print(f"[{getattr(run.cfg, 'algorithm', 'train')}] {ckpt} holds no {fresh} (an option turned on at this "
              f"resume): {', '.join(fresh)} start(s) empty at step {step}", flush=True)
    states.load(weights)  # sharded full fine-tuning weights: read from ckpt/sharded by every rank
    for k, obj in stateful.items():
        if k not in saved:
            continue
        if isinstance(saved[k], dict) and saved[k].get(OPTIMIZER_MARK):  # a sharded checkpoint's optimizer
            optimizer = _optimizer_of(obj)
            if optimizer is None:
                raise RunError(f"checkpoint {ckpt}: state.pt[{k!r}] is a sharded optimizer state, but this recipe's "
                               f"{k!r} is a {type(obj).__name__}")
            load_optimizer_sharded(optimizer, states.model, saved[k], ckpt / SHARDED_DIR, k)
        else:
            obj.load_state_dict(saved[k])
    for obj in stateful.values():  # settings from the config, whatever order the state was loaded in (LRSchedule)
        if hasattr(obj, "apply_config"):
            obj.apply_config()
    set_rng_state(state["rng"])
    if ctx.is_main:
        run.truncate_metrics(step)
        print(f"[{getattr(run.cfg, 'algorithm', 'train')}] resumed from {ckpt} (step {step})", flush=True)
    return step, extra


def check_finite_weights(states: Any, step: int, ctx: Any = None, run: Any = None) -> None:
    """Raise `NonFiniteError` (and write nothing) if a tensor of any policy state (`PolicyStates`) holds NaN/inf.

    Called on every rank right before a checkpoint is written: each rank checks its own tensors (its shards under
    FSDP) and the count is all-reduced, so all ranks raise together."""
    bad = states.nonfinite_tensors()
    n_bad = len(bad)
    if ctx is not None and ctx.enabled:
        n_bad = int(ctx.all_reduce_sum(float(n_bad)))
    if n_bad:
        first = bad[0] if bad else "on another rank"
        raise NonFiniteError(
            f"step {step}: {n_bad} policy tensor(s) hold NaN/inf (first: {first}); checkpoint step_{step} was not "
            f"written; last complete checkpoint: {last_checkpoint(run)}")
