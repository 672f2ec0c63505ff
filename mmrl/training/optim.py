"""The optimizer every recipe builds (AdamW + one learning-rate schedule) and gradient clipping."""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from mmrl.training.config import OptimConfig


def lr_factor(i: int, warmup_steps: int, lr_end_factor: float, total_steps: int) -> float:
    """Learning-rate multiplier after `i` scheduler steps: linear warm-up (i+1)/W over W steps, times a linear decay
    to `lr_end_factor` at `total_steps` (1 - (1 - end) * min(i, N) / N). With W = 0 and end = 1 it is exactly 1.0."""
    warm = min(1.0, (i + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    n = max(int(total_steps), 1)
    decay = 1.0 - (1.0 - lr_end_factor) * min(i, n) / n if lr_end_factor != 1.0 else 1.0
    return warm * decay


class LRSchedule(torch.optim.lr_scheduler.LambdaLR):
    """The learning-rate schedule `lr_factor` (LambdaLR) whose settings always come from the config, never from a
    checkpoint. torch restores an optimizer's `param_groups` (lr, betas, eps, weight_decay) and a scheduler's
    `base_lrs` from the state dicts, so a run resumed with `optim.lr=0.1` would go on at the saved lr; here
    loading a checkpoint keeps only what is state (AdamW's moments and step counts, the scheduler steps taken) and
    `apply_config` sets the rest from `optim` and `total_steps` (`mmrl.run.restore_checkpoint` calls it once
    both are loaded)."""

    def __init__(self, optimizer: torch.optim.Optimizer, optim: OptimConfig, total_steps: int):
        self._config = (optim, int(total_steps))
        w, end, n = optim.warmup_steps, optim.lr_end_factor, total_steps
        super().__init__(optimizer, lambda i: lr_factor(i, w, end, n))

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd.pop("_config", None)  # settings are the config's, not state
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        config = self._config
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "_config"})
        self._config = config
        self.apply_config()

    def apply_config(self) -> None:
        """Every param group's lr, betas, eps and weight_decay from the config, the base lr `optim.lr`, and the
        current lr = optim.lr * lr_factor(scheduler steps so far) under the configured warm-up and decay."""
        optim, _ = self._config
        factor = self.lr_lambdas[0](self.last_epoch)
        for group in self.optimizer.param_groups:
            group.update(lr=optim.lr * factor, initial_lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                         weight_decay=optim.weight_decay)
        self.base_lrs = [optim.lr] * len(self.optimizer.param_groups)
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]


def build_optimizer(params: Iterable[torch.Tensor], optim: OptimConfig, total_steps: int = 1):
    """(AdamW over `params`, `LRSchedule` with `lr_factor`). `total_steps`: scheduler steps over the whole run (only
    the decay to `optim.lr_end_factor` uses it)."""
    params = list(params)
    if not params:
        raise ValueError("build_optimizer: no trainable parameters (check model.freeze / model.lora)")
    optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                  weight_decay=optim.weight_decay)
    return optimizer, LRSchedule(optimizer, optim, total_steps)


def clip_grads(params: Any, max_grad_norm: float) -> float:
    """Clip the gradients of `params` to `max_grad_norm` (<= 0: no clipping) and return their total 2-norm as a
    float (``mmrl.distributed.clip_grad_norm``: torch's formula, FSDP2 DTensor gradients included)."""
    from mmrl.distributed import clip_grad_norm

    return clip_grad_norm(list(params), max_grad_norm if max_grad_norm > 0 else math.inf)
