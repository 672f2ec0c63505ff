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


def build_optimizer(params: Iterable[torch.Tensor], optim: OptimConfig, total_steps: int = 1):
    """(AdamW over `params`, LambdaLR with `lr_factor`). `total_steps`: scheduler steps over the whole run (only the
    decay to `optim.lr_end_factor` uses it)."""
    params = list(params)
    if not params:
        raise ValueError("build_optimizer: no trainable parameters (check model.freeze / model.lora)")
    optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                  weight_decay=optim.weight_decay)
    w, end, n = optim.warmup_steps, optim.lr_end_factor, total_steps
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_factor(i, w, end, n))
    return optimizer, sched


def clip_grads(params: Any, max_grad_norm: float) -> float:
    """Clip the gradients of `params` to `max_grad_norm` (<= 0: no clipping) and return their total 2-norm as a
    float (``mmrl.distributed.clip_grad_norm``: torch's formula, FSDP2 DTensor gradients included)."""
    from mmrl.distributed import clip_grad_norm

    return clip_grad_norm(list(params), max_grad_norm if max_grad_norm > 0 else math.inf)
