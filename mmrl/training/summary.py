"""End-of-run summary: `run.finish()` plus how the reward moved between the first and last logged steps."""

from __future__ import annotations

from typing import Any, Sequence


def summarise(run: Any, name: str, key: str = "reward/mean", extra_keys: Sequence[str] = ()) -> dict:
    """`run.finish()` plus the mean of `key` over the first 5 and last 5 logged steps (printed), the rise in units
    of the first steps' per-sample std (`key` with /mean -> /std), and first/last means of `extra_keys`.
    Rows where a value is missing or null (a non-finite metric) are skipped."""
    rows = run.read_metrics()
    vals = [r for r in rows if r.get(key) is not None]
    extra: dict[str, Any] = {}
    if vals:
        k = min(5, len(vals))
        first = sum(r[key] for r in vals[:k]) / k
        last = sum(r[key] for r in vals[-k:]) / k
        std_key = key.replace("/mean", "/std")
        first_std = sum(r.get(std_key) or 0.0 for r in vals[:k]) / k
        extra = {"reward_first5": first, "reward_last5": last, "reward_rise": last - first,
                 "reward_first_std": first_std,
                 "reward_rise_in_std": (last - first) / first_std if first_std > 0 else 0.0}
        for ek in extra_keys:
            ev = [r[ek] for r in rows if r.get(ek) is not None]
            if ev:
                extra[f"{ek}_first5"] = sum(ev[:k]) / min(k, len(ev))
                extra[f"{ek}_last5"] = sum(ev[-k:]) / min(k, len(ev))
        print(f"[{name}] {key}: first {k} steps {first:.4g} (per-sample std {first_std:.3g}) -> last {k} steps "
              f"{last:.4g}: rise {last - first:+.4g} = {extra['reward_rise_in_std']:.2f} std", flush=True)
    from mmrl.training.judges import judge_summary  # log.judges: the reward-hacking line (nothing without judges)

    extra.update(judge_summary(rows, name))
    return run.finish(extra)
