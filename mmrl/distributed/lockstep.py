"""LockstepForwards: pair the forwards of ranks that run different numbers of them (FSDP2 all-gathers)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from mmrl.distributed.context import DistContext


class LockstepForwards:
    """Equal forward counts on every rank where each rank runs its own number of no-grad forwards.

    FSDP2 makes every forward of a sharded module a collective (parameter all-gathers), so ranks must run the
    same forwards in the same order. In phases where that count depends on the data (multi-turn rollouts:
    episodes end on different turns; generation chunks; reference passes over uneven shares), wrap the phase::

        with LockstepForwards(ctx, model, dummy=lambda: model(input_ids=pad_1x1)):
            ...  # any number of model(...) calls (forward pre-hook: one MAX all-reduce "still busy" vote each)
        # on exit: while another rank is still busy, run dummy forwards paired with its real ones

    Every real forward of ``module`` is preceded by a vote of 1; a rank that has finished its phase votes 0 and,
    while the vote's maximum is 1, runs ``dummy()`` (no vote) so its collectives pair with the busy rank's. When
    every rank votes 0 they all leave together. The dummy forward must run the same sharded units as a real one,
    so shard only blocks that every forward runs (e.g. the language model's decoder layers, leaving an optional
    vision tower in the root unit). One process, or a module that is not sharded: does nothing.
    """

    def __init__(self, ctx: "DistContext", module: nn.Module, dummy: Any, enabled: bool = True):
        self.ctx, self.module, self.dummy = ctx, module, dummy
        self.enabled = bool(enabled and ctx.enabled)
        self._handle = None
        self._in_dummy = False
        self.real = 0
        self.dummies = 0

    def _vote(self, busy: int) -> bool:
        t = torch.tensor([busy], dtype=torch.int32,
                         device=self.ctx.device if self.ctx.backend == "nccl" else torch.device("cpu"))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        if not self._in_dummy:
            self.real += 1
            self._vote(1)

    def __enter__(self) -> "LockstepForwards":
        if self.enabled:
            self._handle = self.module.register_forward_pre_hook(self._pre_hook)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enabled:
            return
        self._handle.remove()
        if exc_type is not None:  # the other ranks will wait in a collective; the launcher's timeout ends the job
            return
        self._in_dummy = True
        try:
            with torch.no_grad():
                while self._vote(0):
                    self.dummy()
                    self.dummies += 1
        finally:
            self._in_dummy = False
