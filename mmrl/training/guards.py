"""The shared training spine: the checks every recipe runs around its algorithm so that nothing non-finite reaches
the weights, the checkpoints or metrics.jsonl.

- `check_rewards(scores, details, on_nonfinite, ...)`: per-sample reward validation. A NaN/inf score is an error
  naming the reward component and the sample (`reward.on_nonfinite: error`, the default), or the sample is dropped
  (`drop_sample`: a keep mask and the metric `reward/nonfinite_samples`).
- `group_keep(valid, group_ids, min_size)`: group-relative advantages after dropping samples: a sample is kept if it
  is valid and its group still has `min_size` valid members (a group of one carries no relative signal).
- `UpdateGuard`: wraps `optimizer.step()`. An update whose loss or gradient norm is non-finite on any rank is
  skipped on every rank (gradients zeroed; the recipe then leaves scheduler and EMA alone), counted in
  `train/skipped_updates`, and `update.max_skipped_updates` skips in a row stop the run with an error.
- `check_finite_weights(states, ...)`: before a checkpoint is written, every tensor of every policy state must be
  finite (a collective under DDP/FSDP: all ranks raise together).

All errors are `NonFiniteError` (a ValueError: the CLI prints it as one line).
"""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping, Sequence

import torch

from mmrl.run.files import NonFiniteError, last_checkpoint

Tensor = torch.Tensor

OnNonfinite = Literal["error", "drop_sample"]
ON_NONFINITE = ("error", "drop_sample")
NONFINITE_KEY = "reward/nonfinite_samples"
SKIPPED_KEY = "train/skipped_updates"

__all__ = ["OnNonfinite", "ON_NONFINITE", "NONFINITE_KEY", "SKIPPED_KEY", "check_rewards", "group_keep", "finite_stats",
           "UpdateGuard"]


# ------------------------------------------------------------------------------------------ rewards


def check_rewards(scores: Tensor, details: Mapping[str, Any] | None = None, on_nonfinite: str = "error", *,
                  reward: str = "reward", components: Sequence[str] = (), labels: Sequence[str] | None = None
                  ) -> tuple[Tensor, dict[str, float]]:
    """Validate rewards per sample: (keep[B] bool, metrics).

    `scores[B]`: the (weighted) rewards; `details`: the reward's details, where a composite keeps each component's
    raw scores under the component's name (`components` lists those names) -- they tell which component produced
    a non-finite total. `labels[B]`: how to name each sample in the error (a prompt, an episode). `keep` is True for
    finite scores. `on_nonfinite="error"` raises `NonFiniteError` at the first non-finite score; `"drop_sample"`
    returns the mask and `{"reward/nonfinite_samples": count}`."""
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"reward.on_nonfinite: expected one of {list(ON_NONFINITE)}, got {on_nonfinite!r}")
    s = scores.detach().double().cpu().reshape(-1)
    keep = torch.isfinite(s)
    n_bad = int((~keep).sum())
    if n_bad and on_nonfinite == "error":
        i = int((~keep).nonzero()[0])
        culprit = f"reward '{reward}'"
        for name in components:
            v = (details or {}).get(name)
            if v is None:
                continue
            v = torch.as_tensor(v).detach().double().cpu().reshape(-1)
            if v.numel() == s.numel() and not bool(torch.isfinite(v[i])):
                culprit = f"reward component '{name}' (of '{reward}')"
                break
        label = f" ({labels[i]})" if labels is not None and i < len(labels) else ""
        raise NonFiniteError(
            f"{culprit} returned a non-finite score ({float(s[i])}) for sample {i} of {s.numel()}{label}; "
            f"{n_bad} of {s.numel()} scores are NaN/inf. Fix the reward, or set reward.on_nonfinite=drop_sample "
            f"to train on the finite samples only")
    return keep, ({NONFINITE_KEY: n_bad} if on_nonfinite == "drop_sample" else {})


def group_keep(valid: Tensor, group_ids: Tensor, min_size: int = 2) -> Tensor:
    """bool[B]: `valid` samples whose group (equal `group_ids`) has at least `min_size` valid members.

    Dropping a sample removes it from its group's statistics; a group left with fewer than `min_size` samples
    contributes nothing (its remaining samples are not trained on either)."""
    valid = valid.bool().cpu()
    if valid.numel() == 0:
        return valid
    _, inv = torch.unique(group_ids.cpu(), return_inverse=True)
    counts = torch.zeros(int(inv.max()) + 1).index_add_(0, inv, valid.float())
    return valid & (counts[inv] >= min_size)


def finite_stats(scores: Tensor, prefix: str = "reward/") -> dict[str, float]:
    """`<prefix>mean` and `<prefix>std` (unbiased) over the finite entries of `scores` (NaN if none / 0 if one)."""
    s = scores.detach().cpu().reshape(-1)
    s = s[torch.isfinite(s)]
    return {f"{prefix}mean": s.mean().item() if len(s) else math.nan,
            f"{prefix}std": s.std().item() if len(s) > 1 else 0.0}


# ------------------------------------------------------------------------------------------ optimizer steps


def _all_finite(values: Sequence[Any]) -> bool:
    vals = [torch.as_tensor(v).detach().double().cpu().reshape(-1) for v in values]
    return all(bool(torch.isfinite(v).all()) for v in vals)


class UpdateGuard:
    """Skip optimizer updates whose loss or gradient norm is NaN/inf; stop after `max_skipped` in a row.

        guard = UpdateGuard(cfg.update.max_skipped_updates, ctx, run)
        ...backward passes; grad_norm = clip_grads(params, max_norm)
        if guard.step(optimizer, losses, grad_norm, step):
            lr_scheduler.step(); states.ema(...)        # only after an applied update
        metrics.update(guard.pop_metrics())            # train/skipped_updates of this RL step

    `losses`: the update's micro-batch losses (tensors or floats); `grad_norm`: the total gradient norm (after the
    all-reduce / over FSDP shards, as `clip_grads` returns it: clipping does not make a NaN norm finite). Several
    processes: the decision is all-reduced, so every rank steps or skips together (losses are rank-local). A skip
    zeroes the gradients (`optimizer.zero_grad(set_to_none=True)`); the optimizer state is untouched. The count of
    consecutive skips is not checkpointed: it restarts at 0 on resume."""

    def __init__(self, max_skipped: int = 3, ctx: Any = None, run: Any = None):
        if int(max_skipped) < 1:
            raise ValueError(f"update.max_skipped_updates must be >= 1 (1 = stop at the first non-finite update), "
                             f"got {max_skipped}")
        self.max_skipped = int(max_skipped)
        self.ctx, self.run = ctx, run
        self.consecutive = 0  # skipped updates in a row
        self.skipped = 0  # skipped since the last pop_metrics()
        self.total_skipped = 0

    def update_ok(self, losses: Sequence[Any], grad_norm: Any) -> bool:
        """True if the loss and gradient norm are finite on every rank (a collective under several processes)."""
        bad = not (_all_finite(losses) and _all_finite([grad_norm]))
        if self.ctx is not None and self.ctx.enabled:
            bad = float(self.ctx.all_reduce_sum(1.0 if bad else 0.0)) > 0
        return not bad

    def step(self, optimizer: torch.optim.Optimizer, losses: Sequence[Any], grad_norm: Any, step: int) -> bool:
        """`optimizer.step()` if the update is finite (returns True), else zero the gradients, count the skip and
        return False; raises `NonFiniteError` when this is the `max_skipped`-th skip in a row."""
        if self.update_ok(losses, grad_norm):
            optimizer.step()
            self.consecutive = 0
            return True
        optimizer.zero_grad(set_to_none=True)
        self.consecutive += 1
        self.skipped += 1
        self.total_skipped += 1
        if self.consecutive >= self.max_skipped:
            raise NonFiniteError(
                f"{self.consecutive} consecutive updates had a non-finite loss/gradient at step {step} "
                f"(update.max_skipped_updates={self.max_skipped}); no update was applied, last complete checkpoint: "
                f"{last_checkpoint(self.run)}. Lower train.lr, check the rewards and the model's dtype")
        if self.ctx is None or self.ctx.is_main:
            print(f"[train] step {step}: skipped an update with a non-finite loss/gradient "
                  f"({self.consecutive} in a row, stop at {self.max_skipped})", flush=True)
        return False

    def pop_metrics(self) -> dict[str, float]:
        """{"train/skipped_updates": skips since the last call}."""
        out = {SKIPPED_KEY: self.skipped}
        self.skipped = 0
        return out
