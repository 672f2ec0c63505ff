"""The distributed update iterator: inner epochs -> optimizer updates -> micro-steps, written once for every
diffusion recipe (Flow-GRPO, DiffusionNFT, AWM, DGPO, Diffusion-DPO).

    updates = UpdateIterator(ctx, keep, module=model.transformer, optimizer=..., params=..., lr_scheduler=...,
                             guard=guard, max_grad_norm=..., step=step, epochs=..., updates_per_epoch=...,
                             micro_batch_size=..., metrics=acc)
    for mb in updates:                                  # one micro-step: rows of this rank (or a padding row)
        for j in range(points):                          # the recipe's training points of those rows
            with mb.no_sync(last_point=j == points - 1):  # DDP all-reduces in the update's last backward only
                loss = ...                               # the recipe's loss
                (loss * mb.weight(points)).backward()
            if mb.real:
                acc["policy/loss"].append(loss.detach())   # what the guard checks before the update is applied
    updates.applied                                      # optimizer updates the guard let through

What it does, in this order, identically on every rank:
- per epoch: `on_epoch()` (a recipe's own per-epoch draws), then the units (kept sample indices, or DGPO's prompt
  groups) in a random order (`shuffle`), split into min(updates_per_epoch, max-over-ranks unit count) updates
  (`torch.tensor_split`, so every rank runs the same number of updates);
- per update: its rows (`rows_of(units)`), micro-steps of `micro_batch_size` units, as many on every rank as the
  rank with the most (a rank with fewer runs zero-weight micro-steps on `pad_rows`: `mb.real` False), the loss scale
  `ctx.loss_scale(scale_count(rows))` (DDP averages gradients: the scale makes the average the global mean);
- after an update's last micro-step: gradient clipping (`update.max_grad_norm`, its norm appended to
  `metrics["policy/grad_norm"]`), `guard.step` on the update's losses (`metrics["policy/loss"]` since the update
  began: a NaN/inf loss or gradient is not applied), and for an applied update `lr_scheduler.step()`,
  `on_update()` (e.g. the EMA of "old"), `counters.updates += 1`; then the gradients are cleared.
One process: `ctx` is a no-op and nothing of this changes a number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from mmrl.training.optim import clip_grads

Tensor = torch.Tensor

__all__ = ["MicroStep", "UpdateIterator", "padding_rows", "reduce_metrics"]


def reduce_metrics(ctx: Any, values: dict[str, list], max_keys: tuple[str, ...] = ()) -> dict[str, float]:
    """One value per metric of a batch's micro-step values (floats or 0-dim tensors, converted once here: no GPU
    sync per micro-step): every rank's values merged (a collective), then the max for `max_keys`, else the mean."""
    from mmrl.distributed import merge_rank_lists

    vals = merge_rank_lists(ctx, {k: [float(x) for x in v] for k, v in values.items()})
    return {k: max(v) if k in max_keys else sum(v) / len(v) for k, v in vals.items() if v}


def padding_rows(keep: Tensor) -> Tensor:
    """The rows of a padding micro-step (weight 0, results unused) on a rank with fewer kept rows: any real row."""
    return keep[:1] if len(keep) else torch.zeros(1, dtype=torch.long)


@dataclass
class MicroStep:
    """One micro-step of an update: `rows` (this rank's sample indices, or the padding rows when not `real`),
    `update_rows` (this rank's rows of the whole update), `scale` (its DDP loss scale), whether it is `last` of its
    update (the gradients are all-reduced in its final backward) and whether its update is the `first_update` of the
    step (no optimizer step has happened yet: the ratio to the rollout policy must be 1)."""

    rows: Tensor
    real: bool
    update_rows: Tensor
    scale: float
    last: bool
    first_update: bool
    index: int
    _ctx: Any
    _module: Any

    def weight(self, points: int) -> float:
        """The mean over the update's rows and `points` training points per row (0 for a padding micro-step)."""
        return len(self.rows) / len(self.update_rows) / points * self.scale if self.real else 0.0

    def no_sync(self, last_point: bool = True):
        """Around a forward AND its backward: DDP all-reduces only in the update's last backward."""
        return self._ctx.no_sync(self._module, sync=self.last and last_point)


class UpdateIterator:
    """Iterate the micro-steps of one rollout batch's updates (module docstring). `units`: kept sample indices
    (int64 [n]) or DGPO's kept prompt groups; `rows_of(units) -> rows` maps units to sample rows (default: the units
    are the rows); `scale_count(rows)`: what DDP's loss scale counts (default: the rows). After iterating:
    `applied` (optimizer updates applied), `updates` (updates run)."""

    def __init__(self, ctx: Any, units: Tensor, *, module: Any, optimizer: Any, params: Any, lr_scheduler: Any,
                 guard: Any, max_grad_norm: float, step: int, epochs: int, updates_per_epoch: int,
                 micro_batch_size: int, metrics: dict, pad_rows: Tensor | None = None, shuffle: bool = True,
                 rows_of: Callable[[Tensor], Tensor] | None = None,
                 scale_count: Callable[[Tensor], float] | None = None,
                 on_epoch: Callable[[int], None] | None = None, on_update: Callable[[], None] | None = None,
                 counters: Any = None):
        self.ctx, self.units, self.module = ctx, units, module
        self.optimizer, self.params, self.lr_scheduler, self.guard = optimizer, params, lr_scheduler, guard
        self.max_grad_norm, self.step = max_grad_norm, step
        self.epochs, self.updates_per_epoch, self.micro_batch_size = epochs, updates_per_epoch, micro_batch_size
        self.metrics, self.shuffle = metrics, shuffle
        self.rows_of = rows_of or (lambda u: u)
        self.scale_count = scale_count or len
        self.pad_rows = padding_rows(units) if pad_rows is None else pad_rows
        self.on_epoch, self.on_update, self.counters = on_epoch, on_update, counters
        self.applied = 0
        self.updates = 0

    def __iter__(self) -> Iterator[MicroStep]:
        ctx = self.ctx
        for epoch in range(self.epochs):
            if self.on_epoch is not None:
                self.on_epoch(epoch)
            order = self.units[torch.randperm(len(self.units))] if self.shuffle else self.units
            n_updates = min(self.updates_per_epoch, ctx.max_int(len(order)))  # identical on every rank
            for k, chunk in enumerate(torch.tensor_split(order, n_updates)):
                rows = self.rows_of(chunk)
                # (an empty chunk splits into [[]])
                micro = [self.rows_of(m) for m in torch.split(chunk, self.micro_batch_size) if len(m)]
                n_micro = ctx.max_int(len(micro))  # the same number of micro-steps on every rank
                scale = ctx.loss_scale(self.scale_count(rows))  # local mean -> global mean under DDP's average
                n_losses = len(self.metrics["policy/loss"])  # this update's losses are appended after this index
                for mi in range(n_micro):
                    real = mi < len(micro)
                    yield MicroStep(micro[mi] if real else self.pad_rows, real, rows, scale, mi == n_micro - 1,
                                    epoch == 0 and k == 0, mi, ctx, self.module)
                self._apply(self.metrics["policy/loss"][n_losses:])

    def _apply(self, losses: list) -> None:
        grad_norm = clip_grads(self.params, self.max_grad_norm)
        self.metrics["policy/grad_norm"].append(grad_norm)
        self.updates += 1
        if self.guard.step(self.optimizer, losses, grad_norm, self.step):  # NaN/inf: skipped
            self.lr_scheduler.step()
            if self.on_update is not None:
                self.on_update()
            self.applied += 1
            if self.counters is not None:
                self.counters.updates += 1
        self.optimizer.zero_grad(set_to_none=True)
