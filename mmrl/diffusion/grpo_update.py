"""The Flow-GRPO update on one rollout batch: PPO-clipped per-step ratios of the SDE step log-probs, plus
the closed-form Gaussian KL to the reference (adapters off), accumulated over trained timesteps and micro-batches,
one optimizer update per mini-batch (`update.mini_batch_size`), optional EMA of the trainable weights."""

from __future__ import annotations

from collections import defaultdict

import torch

from mmrl.core.grpo_guard import grpo_guard_log_ratio, grpo_guard_step_weight
from mmrl.core.kl import gaussian_kl_equal_std
from mmrl.core.losses import clipped_policy_loss
from mmrl.diffusion.diagnostics import MAX_KEYS, velocity_norm_term, velocity_norms
from mmrl.diffusion.sampling import step_log_prob
from mmrl.distributed import DistContext
from mmrl.training.updates import padding_rows, reduce_metrics

__all__ = ["train_on_rollout", "RefMeanCache"]


def train_on_rollout(parts, step: int, traj, adv, keep) -> dict:
    """Inner epochs over one rollout batch through the shared update iterator (`TrainingParts.updates`: epochs,
    updates, micro-steps, equal micro-step counts with zero-weight padding on every rank, one all-reduce per update,
    clipping and the update guard); returns averaged loss metrics and diag/logprob_drift. With `algo.ema` the "old"
    state follows every applied update.

    Per trained step j of each micro-batch: the PPO-clipped ratio of the step's Gaussian log-probs (against the
    rollout's, or pi_old recomputed by `_old_policy`), plus algo.kl.coef * the closed-form Gaussian KL to the
    reference (whose forward runs when a term needs it: algo.kl.coef, algo.velocity_norm; it also gives the
    velocity-norm diagnostic). `algo.ratio_norm: grpo_guard` replaces the PPO log-ratio by GRPO-Guard's
    (`mmrl.core.grpo_guard`) against the sampling policy's step means (`algo.grpo_guard_reweight`: each step's
    policy loss divided by its -dt). With MIS/veto masks the mean (and DDP's loss
    scale) is over the (sample, step) pairs kept."""
    cfg, ctx, model, states, timer = parts.cfg, parts.ctx, parts.model, parts.states, parts.timer
    update, algo, rollout = cfg.update, cfg.algo, cfg.rollout
    kl_coef = algo.kl.coef
    vn = getattr(algo, "velocity_norm", None)
    need_ref = kl_coef > 0 or (vn is not None and vn.needs_reference())
    guard_ratio = getattr(algo, "ratio_norm", "none") == "grpo_guard"
    guard_reweight = guard_ratio and getattr(algo, "grpo_guard_reweight", False)
    step_kw = dict(guidance_scale=rollout.guidance_scale, noise_level=rollout.noise_level, sde_type=rollout.sde_type,
                   cfg_grad=rollout.cfg_grad)
    acc: dict[str, list] = defaultdict(list)  # floats or 0-dim tensors (converted once, at the end: no GPU syncs)
    drift: list[torch.Tensor] = []
    steps = traj.train_steps.tolist()
    if ctx.max_int(len(keep)) == 0 or not steps:
        return {"diag/logprob_drift": 0.0, "train/updates": 0}
    # the reference is frozen: its step means are computed once per (sample, step) and reused by later epochs
    # (not under FSDP: cache hits differ between ranks with padding micro-steps, and FSDP needs equal forwards)
    fsdp = ctx.enabled and getattr(cfg, "dist", None) is not None and cfg.dist.strategy == "fsdp"
    ref_cache = RefMeanCache(traj) if need_ref and update.epochs > 1 and not fsdp else None
    pad_rows = padding_rows(keep)
    # GRPO-Guard: the sampling policy's step means (the rollout's, or the recomputed pi_old's)
    old_means = None
    if guard_ratio:
        if algo.old_logprobs == "recompute":
            old_means = torch.zeros_like(traj.latents[:, :-1])
        elif traj.means is None:
            raise ValueError("algo.ratio_norm=grpo_guard needs the rollout's step means: sample with record_means=True")
        else:
            old_means = traj.means
    # algo.old_logprobs=recompute: pi_old from the trainer before any update, corrected towards the rollout's
    old_lp, is_w, valid, corr_metrics = _old_policy(cfg, model, traj, keep, steps, step_kw, timer, ctx, pad_rows,
                                                    means_out=old_means if algo.old_logprobs == "recompute" else None)

    def update_old() -> None:  # the EMA of the trainable weights (the "old" state, evaluated) after every update
        states.ema("default", "old", algo.ema_decay)

    def kept_pairs(rows: torch.Tensor) -> int:  # the (sample, step) pairs MIS/veto keep: what the mean runs over
        return int(valid[rows][:, steps].sum())

    updates = parts.updates(keep, metrics=acc, step=step, pad_rows=pad_rows,
                            on_update=update_old if algo.ema else None,
                            scale_count=len if valid is None else kept_pairs)
    for mb in updates:
        rows = mb.rows
        emb = traj.embeds.select(traj.prompt_index[rows])
        adv_rows = adv[rows].to(model.device)
        weight = mb.weight(len(steps))  # mean over the update's samples and trained steps
        n_valid = None if valid is None else kept_pairs(mb.update_rows)
        ref_means = _reference_means(model, states, traj, rows, steps, emb, step_kw, ref_cache, timer) \
            if need_ref else {}
        for j in steps:
            with mb.no_sync(last_point=j == steps[-1]):  # wraps forward AND backward
                old_j = traj.log_probs[rows, j] if old_lp is None else old_lp[rows, j]
                adv_j = adv_rows if is_w is None else adv_rows * is_w[rows, j]  # TIS: w * A (loss homogeneous in A)
                mask_j = None if valid is None else valid[rows, j]
                if mask_j is not None:  # the step's kept pairs' share of the update's kept pairs
                    weight = float(mask_j.sum()) / max(n_valid, 1) * mb.scale if mb.real else 0.0
                with timer("forward_backward"):
                    cur = _transition(model, traj, rows, j, emb, step_kw)
                if mb.first_update and mb.real:  # no optimizer step has happened yet: ratio must start at 1
                    drift.append((cur.log_prob.detach() - old_j).abs().max())
                logp = cur.log_prob
                if guard_ratio:  # log r := GRPO-Guard's (the clipped loss takes logp - old_j)
                    logp = old_j + grpo_guard_log_ratio(cur.log_prob, old_j, cur.mean,
                                                        old_means[rows.to(old_means.device), j], cur.step_std)
                loss, m = clipped_policy_loss(logp, old_j, adv_j, mask=mask_j,
                                              clip_low=algo.clip_range, clip_high=algo.clip_range)
                if guard_reweight:  # the policy loss only (not the KL): / -dt
                    loss = loss * grpo_guard_step_weight(traj.sigmas[j], traj.sigmas[j + 1])
                if kl_coef > 0:
                    std = cur.std.flatten(1)[:, 0].clamp(min=1e-8)  # [b]: one per sample, any latent rank
                    kl = gaussian_kl_equal_std(cur.mean, ref_means[j][0], std)  # [b]
                    kl = kl.mean() if mask_j is None else (kl * mask_j).sum() / mask_j.sum().clamp(min=1)
                    loss = loss + kl_coef * kl
                    if mb.real:
                        acc["kl/ref"].append(kl.detach())
                if need_ref:  # velocity norm against the reference's: diagnostic (+ penalty with a coef)
                    term, vm = velocity_norm_term(cur.velocity, ref_means[j][1], vn.coef if vn else 0.0, mask_j)
                    loss = loss + term
                    if mb.real:
                        for key, val in vm.items():
                            acc[key].append(val)
                with timer("forward_backward"):
                    (loss * weight).backward()
            if mb.real:
                acc["policy/clipfrac"].append(m["clipfrac"])
                acc["policy/clipfrac_ratio"].append(m["clipfrac_ratio"])  # flow_grpo's |r - 1| > c
                acc["policy/approx_kl"].append(m["approx_kl"])
                acc["policy/ratio_max"].append(m["ratio_max"])
                acc["policy/loss"].append(loss.detach())
    acc["diag/logprob_drift"] = [0.0, *drift]
    out = reduce_metrics(ctx, acc, ("policy/ratio_max", "diag/logprob_drift", *MAX_KEYS))  # the whole batch's
    out["train/updates"] = updates.applied
    out.update(corr_metrics)
    return out


def _transition(model, traj, rows, j, emb, step_kw):
    """The recorded transition j -> j + 1 of samples `rows` under the current weights (`step_log_prob`)."""
    b = len(rows)
    return step_log_prob(model, traj.latents[rows, j], traj.latents[rows, j + 1], traj.sigmas[j].expand(b),
                         traj.sigmas[j + 1].expand(b), emb, **step_kw)


@torch.no_grad()
def _old_policy(cfg, model, traj, keep, steps, step_kw, timer, ctx: DistContext | None = None, pad_rows=None,
                means_out=None):
    """-> (old_logp [B, T] or None, IS weights [B, T] or None, kept mask [B, T] or None, metrics).

    `algo.old_logprobs: rollout` (Flow-GRPO): (None, None, None, {}) - the ratio is taken against the rollout's
    own log-probs. `recompute` (decoupled PPO, verl): one no-grad forward per (kept sample, trained step) with the
    current weights, i.e. pi_old in the trainer's precision, in micro-batches of the kept rows (samples dropped for
    a zero advantage are never trained, so their pi_old is not computed: 0 there); every rank runs the max-over-ranks
    number of micro-batches, the missing ones on `pad_rows` (results unused), so DDP/FSDP forwards pair. Then
    `algo.rollout_correction` between pi_old and the rollout's log-probs over the kept samples' trained steps
    ("token" = one denoising step, "sequence" = the product over a trajectory's trained steps): TIS weights and
    MIS / veto masks, `rollout/correction/*`. `means_out` [B, T, ...] (GRPO-Guard): filled with pi_old's step means."""
    algo = cfg.algo
    if algo.old_logprobs == "rollout":
        return None, None, None, {}
    ctx = ctx or DistContext()
    old = torch.zeros_like(traj.log_probs)
    micro = [m for m in torch.split(keep, cfg.update.micro_batch_size) if len(m)]
    pad_rows = padding_rows(keep) if pad_rows is None else pad_rows
    with timer("old_logprobs"):
        for mi in range(ctx.max_int(len(micro))):
            rows = micro[mi] if mi < len(micro) else pad_rows
            emb = traj.embeds.select(traj.prompt_index[rows])
            for j in steps:
                out = _transition(model, traj, rows, j, emb, step_kw)
                if mi < len(micro):
                    old[rows, j] = out.log_prob.float()
                    if means_out is not None:
                        means_out[rows.to(means_out.device), j] = out.mean.float()
    mask = torch.zeros(traj.log_probs.shape, dtype=torch.bool, device=old.device)
    mask[keep[:, None].to(old.device), torch.as_tensor(steps, device=old.device)[None, :]] = True
    if not bool(mask.any()):
        return old, None, None, {}
    w, valid, metrics = algo.rollout_correction.apply(old, traj.log_probs, mask)
    rejects = algo.rollout_correction.rs_level != "none" or algo.rollout_correction.veto_threshold > 0
    return old, w, valid if rejects else None, metrics


@torch.no_grad()
def _reference_means(model, states, traj, rows, steps, emb, step_kw, ref_cache, timer) -> dict[int, tuple]:
    """Step means and velocity norms of the reference policy for one micro-batch at every trained step:
    {j: (mean [b, C, (F,) h, w], ||v_ref|| [b])}.

    All of a micro-batch's reference forwards run under ONE switch to the reference state (switching peft
    adapters walks every LoRA layer), before the policy's forward/backward passes; with `ref_cache` (several
    inner epochs) steps computed in an earlier epoch are looked up instead."""
    out, todo = {}, []
    for j in steps:
        cached = ref_cache.get(rows, j) if ref_cache is not None else None
        if cached is None:
            todo.append(j)
        else:
            out[j] = cached
    if todo:
        with states.use("ref"), timer("forward_backward"):
            for j in todo:
                step = _transition(model, traj, rows, j, emb, step_kw)
                out[j] = (step.mean, velocity_norms(step.velocity))
                if ref_cache is not None:
                    ref_cache.put(rows, j, *out[j])
    return out


class RefMeanCache:
    """Reference-policy step means [B, K, C, (F,) h, w] and velocity norms [B, K] of one rollout batch (K = trained
    steps), filled on first use. The reference (adapters off, or a frozen snapshot) does not change during a step's
    inner epochs, so epochs after the first skip the reference forward entirely."""

    def __init__(self, traj):
        self.index = {j: k for k, j in enumerate(traj.train_steps.tolist())}
        shape = (traj.latents.shape[0], len(self.index), *traj.latents.shape[2:])
        self.means = torch.empty(shape, dtype=torch.float32, device=traj.latents.device)
        self.norms = torch.empty(shape[:2], dtype=torch.float32, device=traj.latents.device)
        self.filled = torch.zeros(shape[:2], dtype=torch.bool)

    def get(self, rows: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        k, r = self.index[j], rows.to(self.means.device)
        return (self.means[r, k], self.norms[r, k]) if bool(self.filled[rows, k].all()) else None

    def put(self, rows: torch.Tensor, j: int, mean: torch.Tensor, norm: torch.Tensor) -> None:
        k, r = self.index[j], rows.to(self.means.device)
        self.means[r, k] = mean.detach().float()
        self.norms[r, k] = norm.detach().float()
        self.filled[rows, k] = True
