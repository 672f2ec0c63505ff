"""One checkpoint layout for every recipe, written and read the same way under one process, DDP and FSDP::

    checkpoints/step_N/
      adapters/      every PolicyStates state (peft + diffusers-loadable LoRA, or full weights)
      state.pt       {"stateful": {name: obj.state_dict()}, "extra": {...}, "rng": RNG states, "step": N}
      config.yaml    the resolved config this state was trained with
      MANIFEST.json  size + crc32 of every file;  COMPLETE  written last (see mmrl.runtime.Run.checkpoint)

`stateful` names the recipe's resumable objects; the usual names are "optimizer", "lr_scheduler", "data" (+ e.g.
"tracker"). Checkpoints of the VLM recipes before this layout (`policy/` + flat state.pt keys) are still read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmrl.runtime import RunError, checkpoint_step, get_rng_state, set_rng_state

# resumable objects that exist only while an option is on (`reward.running_norm`, `log.judges`): a checkpoint
# written with the option off lacks them, and a resume that turns it on starts them empty
FRESH_ON_RESUME = ("reward_norm", "judges")
# flat state.pt keys of the VLM recipes' earlier layout -> stateful names of this one
_LEGACY_STATEFUL = {"optimizer": "optimizer", "scheduler": "lr_scheduler", "data": "data"}


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


def checkpoint_due(cfg: Any, step: int) -> bool:
    """True at every `train.save_every`-th step and at the last step."""
    t = cfg.train
    return bool((t.save_every and step % t.save_every == 0) or step == t.max_steps)


def save_checkpoint(ctx: Any, run: Any, step: int, states: Any, stateful: dict[str, Any], *, fsdp: bool = False,
                    extra: dict | None = None) -> None:
    """Write checkpoints/step_<step>/ atomically. Every rank calls it: the weights are checked for NaN/inf first
    (all ranks raise together; nothing is written), FSDP gathers shards and full-tensor optimizer state on every
    rank (`fsdp=True`; wrap the optimizer in `FullOptimizerState`), and rank 0 writes; the others wait at a barrier
    until the checkpoint is complete."""
    from mmrl.training.guards import check_finite_weights

    check_finite_weights(states, step, ctx, run)
    with ctx.checkpoint(run, step) as d:
        if d is None and not fsdp:
            return
        states.save(Path(d) / "adapters" if d is not None else None)
        full = {k: v.state_dict() for k, v in stateful.items()}  # collectives under FSDP
        if d is not None:
            run.save_state(d, stateful=full, extra=dict(extra or {}), rng=get_rng_state(), step=step)


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
    if (ckpt / "adapters").is_dir() and "stateful" in state:
        saved, extra = state["stateful"], dict(state.get("extra", {}))
        weights = ckpt / "adapters"
    elif (ckpt / "policy").is_dir() and "stateful" not in state:  # the VLM recipes' earlier layout
        saved = {new: state[old] for old, new in _LEGACY_STATEFUL.items() if old in state}
        extra = {k: v for k, v in state.items() if k not in _LEGACY_STATEFUL and k not in ("rng", "step")}
        weights = ckpt / "policy"
    else:
        raise RunError(f"checkpoint {ckpt} has neither adapters/ + state.pt['stateful'] (this version's layout) nor "
                       f"policy/ (the earlier VLM layout): not a checkpoint of an mmrl recipe")
    missing = [k for k in stateful if k not in saved and k not in FRESH_ON_RESUME]
    if missing:
        raise RunError(f"checkpoint {ckpt}: state.pt lacks {missing} (has {sorted(saved)}): written by another recipe?")
    fresh = [k for k in stateful if k not in saved]
    if fresh and ctx.is_main:
        print(f"[{getattr(run.cfg, 'algorithm', 'train')}] {ckpt} holds no {fresh} (an option turned on at this "
              f"resume): {', '.join(fresh)} start(s) empty at step {step}", flush=True)
    states.load(weights)
    for k, obj in stateful.items():
        if k in saved:
            obj.load_state_dict(saved[k])
    for obj in stateful.values():  # settings from the config, whatever order the state was loaded in (LRSchedule)
        if hasattr(obj, "apply_config"):
            obj.apply_config()
    set_rng_state(state["rng"])
    if ctx.is_main:
        run.truncate_metrics(step)
        print(f"[{getattr(run.cfg, 'algorithm', 'train')}] resumed from {ckpt} (step {step})", flush=True)
    return step, extra
