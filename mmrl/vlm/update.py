"""The policy update of the VLM recipes over a :class:`~mmrl.vlm.batch.RolloutBatch`: epochs x mini-batches (one
optimizer update each) x micro-batches (gradient accumulation), loss weights that make the accumulated gradient
the gradient of the mini-batch loss, gradient clipping (``mmrl.training.clip_grads``), the ``UpdateGuard`` (a
NaN/inf loss or gradient is not applied), and the multi-process rules:

* DDP: every rank runs the same number of mini-batches; a rank with no rows left in one runs a zero-weight
  placeholder micro-batch (row 0 of its batch, weight 0) so the gradient all-reduce stays paired; gradients are
  all-reduced once per mini-batch (``ctx.no_sync`` on the other micro-batches); ``ctx.loss_scale`` weights each
  rank's loss so DDP's average is the gradient of the global mini-batch loss.
* FSDP (``equal_micro_batches``): every forward/backward is a collective, so each mini-batch runs the
  max-over-ranks number of micro-batches, the missing ones as zero-weight placeholders.

The loss is pluggable (``loss_fn(mb: MicroBatch) -> (loss, metrics)``): :class:`PolicyGradientLoss` is the
clipped policy-gradient loss of the registry (``algo.policy_loss``: ppo_clip | gspo, ``mmrl.core.get_policy_loss``)
+ entropy bonus + KL to the reference as a loss term. A multi-turn recipe gets token-level advantages and a loss
mask over its policy turns through the same batch fields.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from mmrl.core import agg_loss, get_policy_loss, kl_estimate
from mmrl.core.correction import weighted_advantages
from mmrl.training import UpdateGuard, clip_grads
from mmrl.vlm.batch import RolloutBatch

Tensor = torch.Tensor
# per-micro-batch metrics reduced with max / min (the rest: mean); `_max` / `_min` also cover the per-micro-batch
# rollout-correction metrics of the bypass mode (rollout_is_max / rollout_is_min)
_MAX_KEYS = ("_max", "drift")
_MIN_KEYS = ("_min",)


@dataclass
class MicroBatch:
    """What a loss function sees for one micro-batch.

    `batch`: the micro-batch rows (``RolloutBatch.select``; fields aligned with `logp`); `logp` float32[n, T] with
    gradients, `entropy` [n, T] (None unless the update asked for it); `mini_tokens`/`mini_rows`: loss-mask tokens /
    rows with at least one loss token in the whole mini-batch on this rank (the normalisers); `scale`: this rank's
    DDP loss scale (1 in one process, 0 for a placeholder); `placeholder`: a zero-weight micro-batch that only pairs
    collectives (its loss is multiplied by 0)."""

    batch: RolloutBatch
    logp: Tensor
    entropy: Tensor | None
    mini_tokens: float
    mini_rows: int
    scale: float
    placeholder: bool


def agg_weight(mask: Tensor, mini_mask_sum: float, mini_rows: int, mode: str) -> float:
    """Share of a mini-batch's loss that one micro-batch carries, so accumulated grads equal the full-batch loss:
    token-mean -> its tokens / the mini-batch's tokens; sequence means -> its rows / the mini-batch's rows."""
    if mode == "token-mean":
        return float(mask.sum()) / max(mini_mask_sum, 1.0)
    return float((mask.sum(-1) > 0).sum()) / max(mini_rows, 1)


@dataclass
class PolicyGradientLoss:
    """Registry policy loss (`policy_loss`: ppo_clip | gspo | ...) on ``batch.old_logprobs`` and
    ``batch.advantages`` over ``batch.loss_mask``, minus `entropy_coef` * entropy, plus `kl_coef` * KL to
    ``batch.ref_logprobs`` (when present and not `kl_in_reward`), aggregated with `loss_agg` and weighted by
    :func:`agg_weight` * scale. Metrics: policy/{loss, clipfrac, approx_kl, ratio_max, entropy}, kl/ref."""

    policy_loss: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 0.0
    loss_agg: str = "token-mean"
    norm_const: float | None = None
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    correction: Any = None
    """A `RolloutCorrectionConfig` applied in every micro-batch between the current policy's log-probs (detached)
    and ``batch.rollout_logprobs`` (verl's bypass mode with a policy-gradient loss, pg_is / pg_rs): the IS weights
    multiply the advantages, rejected / vetoed tokens leave the policy loss (their share of the normaliser stays,
    as the mask is only known in the forward). None: the batch's advantages and loss mask as they are."""

    def __post_init__(self) -> None:
        self.fn = get_policy_loss(self.policy_loss)  # unknown name -> ValueError with the valid list

    def __call__(self, mb: MicroBatch) -> tuple[Tensor, dict[str, float]]:
        b, mask = mb.batch, mb.batch.loss_mask
        adv, corr = b.advantages, {}
        if self.correction is not None and b.rollout_logprobs is not None and not mb.placeholder:
            w, keep, corr = self.correction.apply(mb.logp.detach(), b.rollout_logprobs, mask)
            # w * A on kept tokens, 0 on rejected ones (no gradient; the normaliser still counts them)
            adv = weighted_advantages(adv, (keep.float() if w is None else w * keep).to(mb.logp.dtype))
        loss, m = self.fn(mb.logp, b.old_logprobs, adv, mask, clip_low=self.clip_low, clip_high=self.clip_high,
                          dual_clip=self.dual_clip or None, agg=self.loss_agg, norm_const=self.norm_const)
        out = {"policy/loss": m["pg_loss"], "policy/clipfrac": m["clipfrac"], "policy/approx_kl": m["approx_kl"],
               "policy/ratio_max": m["ratio_max"], **corr}
        if mb.entropy is not None:
            ent_mean = agg_loss(mb.entropy, mask, self.loss_agg, self.norm_const)
            if self.entropy_coef:
                loss = loss - self.entropy_coef * ent_mean
            out["policy/entropy"] = float(ent_mean.detach())
        if b.ref_logprobs is not None and not self.kl_in_reward:
            kl = agg_loss(kl_estimate(mb.logp, b.ref_logprobs, self.kl_estimator), mask, self.loss_agg, self.norm_const)
            loss = loss + self.kl_coef * kl
            out["kl/ref"] = float(kl.detach())
        weight = 0.0 if mb.placeholder else agg_weight(mask, mb.mini_tokens, mb.mini_rows, self.loss_agg) * mb.scale
        return loss * weight, out


def contiguous_minibatches(n_local: int, n_rows: int, size: int) -> list[list[int]]:
    """Mini-batches of row indices: contiguous chunks of `size` over range(`n_rows`) (the max row count over ranks,
    so every rank runs the same number), each cut to this rank's `n_local` rows (possibly empty)."""
    size = max(1, int(size))
    return [list(range(s, min(n_local, s + size))) for s in range(0, max(n_rows, 1), size)]


@dataclass
class UpdateResult:
    """`values`: every real micro-batch's metrics (lists, this rank); `grad_norms`: one per mini-batch; `drift`: max
    |log p - old log p| over the loss-mask tokens of the first mini-batch, before any optimizer step; `applied`:
    optimizer updates the guard let through; `placeholders`: zero-weight micro-batches this rank ran."""

    values: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    grad_norms: list[float] = field(default_factory=list)
    drift: float = 0.0
    applied: int = 0
    placeholders: int = 0

    def metrics(self, ctx: Any = None) -> dict[str, float]:
        """Means (max for *_max and drift, min for *_min) of the micro-batch metrics, + policy/grad_norm; with an enabled `ctx` the lists
        of every rank are merged first (a collective)."""
        vals: dict[str, list[float]] = {k: list(v) for k, v in self.values.items()}
        if self.grad_norms:
            vals["policy/grad_norm"] = list(self.grad_norms)
        if ctx is not None and ctx.enabled:
            merged: dict[str, list[float]] = defaultdict(list)
            for part in ctx.all_gather_object(vals):
                for k, v in part.items():
                    merged[k] += v
            vals = merged
        return {k: (max(v) if k.endswith(_MAX_KEYS) else min(v) if k.endswith(_MIN_KEYS) else sum(v) / len(v))
                for k, v in vals.items() if v}


def policy_update(model: Any, batch: RolloutBatch, optimizer: Any, params: Sequence[Tensor], *,
                  loss_fn: Callable[[MicroBatch], tuple[Tensor, dict[str, float]]],
                  minibatches: Sequence[Sequence[int]], micro_batch_size: int, epochs: int = 1,
                  max_grad_norm: float = 0.0, temperature: float = 1.0, with_entropy: bool = True,
                  entropy_grad: bool = False, guard: UpdateGuard, step: int = 0, lr_scheduler: Any = None,
                  ctx: Any = None, equal_micro_batches: bool = False, vision_cache: Any = None,
                  zero_grad: Callable[[], None] | None = None, loss_tokens: str = "loss_mask") -> UpdateResult:
    """`epochs` passes over `minibatches` (row-index lists of `batch`; an empty one = a placeholder on this rank),
    one optimizer update each (``guard.step``; `lr_scheduler.step()` after an applied one).

    `model`: the module for the grad-enabled forward (DDP/FSDP-wrapped when distributed). `batch` must carry
    ``old_logprobs`` and ``advantages`` (and ``ref_logprobs`` for a KL loss term). `params`: the optimizer's
    parameters (clipped; `max_grad_norm` <= 0 = no clipping, the norm is still computed for the guard and logged
    only when clipping). `zero_grad`: how to clear gradients before each mini-batch (default
    ``optimizer.zero_grad(set_to_none=True)``). `ctx`: a ``DistContext`` (None = one process). `loss_tokens`:
    "loss_mask" -- the DDP loss scale counts loss tokens (token-mean) -- or "rows" (sequence means)."""
    enabled = ctx is not None and ctx.enabled
    zero_grad = zero_grad or (lambda: optimizer.zero_grad(set_to_none=True))
    res = UpdateResult()
    first = True
    for _ in range(epochs):
        for rows in minibatches:
            rows = list(rows)
            mini_tokens = float(batch.loss_mask[torch.tensor(rows, dtype=torch.long, device=batch.device)].sum()) \
                if rows else 0.0
            mini_rows = len(rows)
            scale = 1.0
            if enabled:  # (a rank with no rows left here runs one zero-weight micro-batch: chunks = [None])
                scale = ctx.loss_scale(mini_tokens if loss_tokens == "loss_mask" else mini_rows)
            zero_grad()
            losses = []  # this mini-batch's real micro-batch losses (the guard checks them)
            chunks: list[list[int] | None] = batch.micro_batch_rows(micro_batch_size, rows) if rows else [None]
            if equal_micro_batches and enabled:
                chunks += [None] * (ctx.max_int(len(chunks)) - len(chunks))
            for j, chunk in enumerate(chunks):
                pad = chunk is None  # a zero-weight micro-batch on row 0
                res.placeholders += pad
                sub = batch.select([0] if pad else chunk)
                with ctx.no_sync(model, sync=j == len(chunks) - 1) if enabled else _null():
                    logp, ent = sub.forward_logprobs(model, temperature, with_entropy=with_entropy,
                                                     entropy_grad=entropy_grad, vision_cache=vision_cache)
                    loss, m = loss_fn(MicroBatch(sub, logp, ent, mini_tokens, mini_rows, 0.0 if pad else scale, pad))
                    loss.backward()
                if pad:
                    continue
                losses.append(loss.detach())
                if first and sub.old_logprobs is not None:  # before the first optimizer step
                    diff = ((logp.detach() - sub.old_logprobs).abs() * sub.loss_mask)
                    res.drift = max(res.drift, float(diff.max()) if diff.numel() else 0.0)
                for k, v in m.items():
                    res.values[k].append(v)
            gn = clip_grads(params, max_grad_norm)
            if max_grad_norm > 0:
                res.grad_norms.append(gn)
            if guard.step(optimizer, losses, gn, step):
                res.applied += 1
                if lr_scheduler is not None:
                    lr_scheduler.step()
            first = False
    return res


class PairedForwards:
    """FSDP with uneven row counts (DAPO dynamic sampling, multi-turn episodes): ranks run different numbers of
    no-grad forwards in the old / reference passes, but under FSDP every forward is a collective. ``with paired():``
    runs a pass inside ``LockstepForwards`` that pairs the missing forwards with 1-token dummy forwards of `model`
    (a no-op context when not `enabled`); ``pop_dummies()`` returns (and resets) this rank's dummy count."""

    def __init__(self, ctx: Any, model: Any, pad_id: int, enabled: bool):
        self.ctx, self.model, self.enabled, self.dummies = ctx, model, enabled, 0
        self.ids = torch.full((1, 1), pad_id, dtype=torch.long, device=next(model.parameters()).device)

    def _dummy(self) -> None:
        self.dummies += 1
        self.model(input_ids=self.ids, use_cache=False)

    def __call__(self) -> Any:
        from mmrl.distributed import LockstepForwards

        return LockstepForwards(self.ctx, self.model, dummy=self._dummy, enabled=self.enabled)

    def pop_dummies(self) -> int:
        n, self.dummies = self.dummies, 0
        return n


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
