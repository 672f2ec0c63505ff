"""How well a rollout process overlaps with its trainer (`rollout.worker: process`): the per-step metrics of an async
run and their means in the run summary. Pure functions of measured seconds; `AsyncRollout` feeds them (one call per
step, from the step tail, when the step's wall time is known) and `overlap_summary` reads them back from the rows.

Per step (docs/async.md#metrics defines each), with W the trainer's step wall time (`time/step_s`), wait the part of
it spent waiting for the batch, push the weight push, R the rollout process's time generating and scoring the batch
and T = W - wait - push the trainer's own work:

    async/trainer_idle_frac  = wait / W
    async/rollout_idle_frac  = the rollout process's time blocked for a ticket / its wall time since its last batch
    async/rollout_s          = R
    async/trainer_s          = T
    async/ideal_speedup      = (R + T) / max(R, T)      what perfect overlap of these two sides gives over R + T
    async/achieved_speedup   = (R + T) / W              the synchronous step's time (R + T) over the measured one
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["staleness_metrics", "overlap_metrics", "overlap_summary", "ideal_speedup", "OVERLAP_KEYS"]

OVERLAP_KEYS = ("async/trainer_idle_frac", "async/rollout_idle_frac", "async/rollout_s", "async/trainer_s",
                "async/ideal_speedup", "async/achieved_speedup")


def staleness_metrics(staleness: Sequence[int], max_staleness: int) -> dict[str, float]:
    """`rollout/staleness/mean|max` over the batches a step trained on (their versions behind the trainer's) and
    `rollout/staleness/count_<s>`: how many of them are s versions behind, for s = 0..max_staleness (every row has
    the same keys)."""
    if not staleness:
        raise ValueError("staleness_metrics: no batch")
    out = {"rollout/staleness/mean": sum(staleness) / len(staleness), "rollout/staleness/max": float(max(staleness))}
    for s in range(max_staleness + 1):
        out[f"rollout/staleness/count_{s}"] = float(sum(1 for x in staleness if x == s))
    return out


def ideal_speedup(rollout_s: float, trainer_s: float) -> float:
    """(R + T) / max(R, T): the speed-up over a synchronous step of R + T seconds when the two sides overlap
    perfectly (the step then takes the longer side); between 1 and 2."""
    return (rollout_s + trainer_s) / max(rollout_s, trainer_s)


def overlap_metrics(*, step_s: float, wait_s: float, push_s: float, rollout_s: float, rollout_idle_s: float,
                    rollout_wall_s: float) -> dict[str, float]:
    """The `async/*` keys of one step (module docstring) from: the trainer's step wall time `step_s`, its wait for
    the batch `wait_s` and weight push `push_s`; the rollout process's time making the batch `rollout_s`, its time
    blocked waiting for the ticket `rollout_idle_s`, and its wall time since its previous batch `rollout_wall_s`.
    A ratio whose denominator is 0 is left out."""
    trainer_s = max(0.0, step_s - wait_s - push_s)
    out = {"async/rollout_s": rollout_s, "async/trainer_s": trainer_s}
    if step_s > 0:
        out["async/trainer_idle_frac"] = min(1.0, max(0.0, wait_s / step_s))
        out["async/achieved_speedup"] = (rollout_s + trainer_s) / step_s
    if rollout_wall_s > 0:
        out["async/rollout_idle_frac"] = min(1.0, max(0.0, rollout_idle_s / rollout_wall_s))
    if max(rollout_s, trainer_s) > 0:
        out["async/ideal_speedup"] = ideal_speedup(rollout_s, trainer_s)
    return out


def overlap_summary(rows: Sequence[dict[str, Any]], name: str | None = None, skip: int = 1) -> dict[str, float]:
    """The run summary's `async_*` entries: the mean of every `OVERLAP_KEYS` metric over the logged steps after the
    first `skip` (the first step's wait includes the rollout process's start-up), `async_staleness_mean` and
    `async_staleness_max` over every step, and `async_achieved_over_ideal` = mean achieved / mean ideal speed-up;
    {} for a run without a rollout process. `name`: print them as one line prefixed by it."""
    stale = [r for r in rows if r.get("rollout/staleness/mean") is not None]
    rows = [r for r in rows if r.get("async/ideal_speedup") is not None]
    if not rows:
        return {}
    measured = rows[skip:] or rows
    out: dict[str, float] = {}
    for key in OVERLAP_KEYS:
        vals = [r[key] for r in measured if r.get(key) is not None]
        if vals:
            out[key.replace("/", "_")] = sum(vals) / len(vals)
    if stale:
        out["async_staleness_mean"] = sum(r["rollout/staleness/mean"] for r in stale) / len(stale)
        out["async_staleness_max"] = max(r["rollout/staleness/max"] for r in stale)
    ideal, achieved = out.get("async_ideal_speedup"), out.get("async_achieved_speedup")
    if ideal and achieved is not None:
        out["async_achieved_over_ideal"] = achieved / ideal
    if name is not None and ideal and achieved is not None:
        print(f"[{name}] async overlap, steps {measured[0]['step']}-{measured[-1]['step']} (means): rollout "
              f"{out['async_rollout_s']:.3g} s, trainer {out['async_trainer_s']:.3g} s per step; ideal speed-up "
              f"{ideal:.2f}x, achieved {achieved:.2f}x ({achieved / ideal:.2f} of ideal); trainer idle "
              f"{out.get('async_trainer_idle_frac', 0.0):.0%}, rollout idle "
              f"{out.get('async_rollout_idle_frac', 0.0):.0%}", flush=True)
    return out
