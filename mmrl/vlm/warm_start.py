"""Format warm start shared by the VLM recipes: a few supervised steps on (prompt, response) pairs before RL.

The recipes draw the responses at random from what is well-formed (vlm_grpo: an answer from the question's answer
vocabulary; vlm_multiturn: ``Env.format_example``), NOT the true answers, so a randomly initialised tiny model
learns the answer format only and RL has to learn the content. Config keys: ``warm_start.{steps, lr, batch_size,
params}`` (:class:`mmrl.vlm.config.WarmStartConfig`).

Loss: token-mean negative log-likelihood (temperature `temperature`) of the response tokens of a
:class:`~mmrl.vlm.batch.RolloutBatch` built from the pairs; AdamW over the parameters whose names match
``warm_start.params`` (weight decay `weight_decay`; 0 = plain Adam).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from mmrl.core import agg_loss
from mmrl.vlm.batch import RolloutBatch
from mmrl.vlm.config import WarmStartConfig

# one warm-start batch: (prompt ids per row, response ids per row, mm dict per row)
Pairs = tuple[Sequence[Sequence[int]], Sequence[Sequence[int]], Sequence[dict]]


def warm_start_params(named: Sequence[tuple[str, torch.Tensor]], patterns: Sequence[str]) -> list[torch.Tensor]:
    """Parameters whose name contains one of `patterns` (all when empty); ValueError when none matches."""
    params = [p for n, p in named if not patterns or any(k in n for k in patterns)]
    if not params:
        raise ValueError(f"warm_start.params={list(patterns)}: no trainable parameter name contains any of them")
    return params


def format_warm_start(model: Any, named_params: Sequence[tuple[str, torch.Tensor]], cfg: WarmStartConfig,
                      next_pairs: Callable[[int], Pairs], pad_id: int, *, temperature: float = 1.0,
                      weight_decay: float = 0.0, zero_grad: Callable[[], None] | None = None) -> float:
    """`cfg.steps` supervised steps; `next_pairs(step)` returns that step's (prompt ids, response ids, mm) rows
    (responses should end with the end-of-turn token). Returns the last loss (NaN when steps = 0).

    `zero_grad` clears gradients before each step and at the end (default: the warm-start parameters only; pass the
    recipe's own when other parameters must not keep warm-start gradients, e.g. under FSDP)."""
    params = warm_start_params(named_params, cfg.params)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=weight_decay)
    zero_grad = zero_grad or (lambda: opt.zero_grad(set_to_none=True))
    loss = torch.tensor(float("nan"))
    for step in range(cfg.steps):
        prompts, responses, mm = next_pairs(step)
        batch = RolloutBatch.build(model, prompts, responses, mm, pad_id)
        logp, _ = batch.forward_logprobs(model, temperature)
        loss = -agg_loss(logp, batch.loss_mask, "token-mean")
        zero_grad()
        loss.backward()
        opt.step()
    zero_grad()
    return float(loss.detach())
