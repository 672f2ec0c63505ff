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
from mmrl.training import UpdateGuard, clip_grads, merge_rank_lists

__all__ = ["train_on_rollout", "RefMeanCache"]


def train_on_rollout(cfg, model, states, traj, adv, keep, optimizer, lr_sched, params, timer,
                      ctx: DistContext | None = None, guard: UpdateGuard | None = None, step: int = 0) -> dict:
    """Inner epochs over one rollout batch; returns averaged loss metrics and diag/logprob_drift.

    Several ranks: each holds its rows of the global batch; an update's chunk is the union of the ranks'
    local chunks, each rank's loss is weighted by `ctx.loss_scale(len(local chunk))` (DDP averages, so the
    gradient is the global chunk mean), all ranks run the same number of micro-steps (zero-weight padding
    micro-batches where a rank has fewer or no rows), and gradients are all-reduced once per update (no_sync
    around the forward and backward of every other micro-step).
    The reference forward runs when a term needs it (algo.kl.coef, algo.velocity_norm); it also gives the
    velocity-norm diagnostic. `algo.ratio_norm: grpo_guard` replaces the PPO log-ratio by GRPO-Guard's
    (`mmrl.core.grpo_guard`) against the sampling policy's step means; `algo.grpo_guard_reweight` divides each
    step's policy loss by its -dt."""
    ctx = ctx or DistContext()
    u, a_cfg, r = cfg.update, cfg.algo, cfg.rollout
    kl_coef = a_cfg.kl.coef
    vn = getattr(a_cfg, "velocity_norm", None)
    need_ref = kl_coef > 0 or (vn is not None and vn.needs_reference())
    guard_ratio = getattr(a_cfg, "ratio_norm", "none") == "grpo_guard"
    guard_reweight = guard_ratio and getattr(a_cfg, "grpo_guard_reweight", False)
    guard = guard or UpdateGuard(u.max_skipped_updates, ctx)
    step_kw = dict(guidance_scale=r.guidance_scale, noise_level=r.noise_level, sde_type=r.sde_type,
                   cfg_grad=r.cfg_grad)
    updates_per_epoch = u.updates_per_epoch(r.batch)
    acc: dict[str, list] = defaultdict(list)  # floats or 0-dim tensors (converted once, at the end: no GPU syncs)
    drift: list[torch.Tensor] = []
    steps = traj.train_steps.tolist()
    if ctx.max_int(len(keep)) == 0 or not steps:
        return {"diag/logprob_drift": 0.0, "train/updates": 0}
    # the reference is frozen: its step means are computed once per (sample, step) and reused by later epochs
    # (not under FSDP: cache hits differ between ranks with padding micro-steps, and FSDP needs equal forwards)
    fsdp = ctx.enabled and getattr(cfg, "dist", None) is not None and cfg.dist.strategy == "fsdp"
    ref_cache = RefMeanCache(traj) if need_ref and u.epochs > 1 and not fsdp else None
    pad_rows = _pad_rows(keep)
    # GRPO-Guard: the sampling policy's step means (the rollout's, or the recomputed pi_old's)
    old_means = None
    if guard_ratio:
        if a_cfg.old_logprobs == "recompute":
            old_means = torch.zeros_like(traj.latents[:, :-1])
        elif traj.means is None:
            raise ValueError("algo.ratio_norm=grpo_guard needs the rollout's step means: sample with record_means=True")
        else:
            old_means = traj.means
    # algo.old_logprobs=recompute: pi_old from the trainer before any update, corrected towards the rollout's
    old_lp, is_w, valid, corr_metrics = _old_policy(cfg, model, traj, keep, steps, step_kw, timer, ctx, pad_rows,
                                                    means_out=old_means if a_cfg.old_logprobs == "recompute" else None)
    updates = 0
    for epoch in range(u.epochs):
        order = keep[torch.randperm(len(keep))]
        n_updates = min(updates_per_epoch, ctx.max_int(len(order)))  # identical on every rank
        for k, chunk in enumerate(torch.tensor_split(order, n_updates)):
            first_update = epoch == 0 and k == 0
            n_losses = len(acc["policy/loss"])  # this update's micro-step losses are appended after this index
            micro = [m for m in torch.split(chunk, u.micro_batch_size) if len(m)]  # (an empty chunk splits into [[]])
            n_micro = ctx.max_int(len(micro))  # same number of micro-steps on every rank
            # local mean -> global mean under DDP's gradient average; with MIS/veto masks the mean is over the
            # (sample, step) pairs kept
            n_valid = len(chunk) * len(steps) if valid is None else int(valid[chunk][:, steps].sum())
            scale = ctx.loss_scale(len(chunk) if valid is None else n_valid)
            for mi in range(n_micro):
                real = mi < len(micro)
                rows = micro[mi] if real else pad_rows
                b = len(rows)
                emb = traj.embeds.select(traj.prompt_index[rows])
                a = adv[rows].to(model.device)
                weight = b / len(chunk) / len(steps) * scale if real else 0.0  # mean over the chunk and steps
                ref_means = _reference_means(model, states, traj, rows, steps, emb, step_kw, ref_cache, timer) \
                    if need_ref else {}
                for j in steps:
                    last = mi == n_micro - 1 and j == steps[-1]  # DDP all-reduces in this backward only
                    with ctx.no_sync(model.transformer, sync=last):  # wraps forward AND backward
                        old_j = traj.log_probs[rows, j] if old_lp is None else old_lp[rows, j]
                        a_j = a if is_w is None else a * is_w[rows, j]  # TIS: w * A (loss homogeneous in A)
                        mask_j = None if valid is None else valid[rows, j]
                        if mask_j is not None:  # the step's kept pairs' share of the chunk's kept pairs
                            weight = float(mask_j.sum()) / max(n_valid, 1) * scale if real else 0.0
                        with timer("forward_backward"):
                            cur = _transition(model, traj, rows, j, emb, step_kw)
                        if first_update and real:  # no optimizer step has happened yet: ratio must start at 1
                            drift.append((cur.log_prob.detach() - old_j).abs().max())
                        logp = cur.log_prob
                        if guard_ratio:  # log r := GRPO-Guard's (the clipped loss takes logp - old_j)
                            logp = old_j + grpo_guard_log_ratio(cur.log_prob, old_j, cur.mean,
                                                                old_means[rows.to(old_means.device), j], cur.step_std)
                        loss, m = clipped_policy_loss(logp, old_j, a_j, mask=mask_j,
                                                      clip_low=a_cfg.clip_range, clip_high=a_cfg.clip_range)
                        if guard_reweight:  # the policy loss only (not the KL): / -dt
                            loss = loss * grpo_guard_step_weight(traj.sigmas[j], traj.sigmas[j + 1])
                        if kl_coef > 0:
                            std = cur.std.flatten(1)[:, 0].clamp(min=1e-8)  # [b]: one per sample, any latent rank
                            kl = gaussian_kl_equal_std(cur.mean, ref_means[j][0], std)  # [b]
                            kl = kl.mean() if mask_j is None else (kl * mask_j).sum() / mask_j.sum().clamp(min=1)
                            loss = loss + kl_coef * kl
                            if real:
                                acc["kl/ref"].append(kl.detach())
                        if need_ref:  # velocity norm against the reference's: diagnostic (+ penalty with a coef)
                            term, vm = velocity_norm_term(cur.velocity, ref_means[j][1], vn.coef if vn else 0.0,
                                                          mask_j)
                            loss = loss + term
                            if real:
                                for key, val in vm.items():
                                    acc[key].append(val)
                        with timer("forward_backward"):
                            (loss * weight).backward()
                    if real:
                        acc["policy/clipfrac"].append(m["clipfrac"])
                        acc["policy/clipfrac_ratio"].append(m["clipfrac_ratio"])  # flow_grpo's |r - 1| > c
                        acc["policy/approx_kl"].append(m["approx_kl"])
                        acc["policy/ratio_max"].append(m["ratio_max"])
                        acc["policy/loss"].append(loss.detach())
            grad_norm = clip_grads(params, u.max_grad_norm)
            acc["policy/grad_norm"].append(grad_norm)
            if guard.step(optimizer, acc["policy/loss"][n_losses:], grad_norm, step):  # NaN/inf: skipped
                lr_sched.step()
                updates += 1
                if a_cfg.ema:
                    states.ema("default", "old", a_cfg.ema_decay)
            optimizer.zero_grad(set_to_none=True)
    vals = {k: [float(x) for x in v] for k, v in acc.items()}
    vals["diag/logprob_drift"] = [0.0] + [float(d) for d in drift]
    vals = merge_rank_lists(ctx, vals)  # metrics of the whole batch: every rank's micro-step values
    out = {k: max(v) if k in ("policy/ratio_max", "diag/logprob_drift", *MAX_KEYS) else sum(v) / len(v)
           for k, v in vals.items() if v}
    out["train/updates"] = updates
    out.update(corr_metrics)
    return out


def _pad_rows(keep: torch.Tensor) -> torch.Tensor:
    """The rows of a padding micro-batch (weight 0 / results unused) on a rank with fewer kept rows: any real row."""
    return keep[:1] if len(keep) else torch.zeros(1, dtype=torch.long)


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
    a = cfg.algo
    if a.old_logprobs == "rollout":
        return None, None, None, {}
    ctx = ctx or DistContext()
    old = torch.zeros_like(traj.log_probs)
    micro = [m for m in torch.split(keep, cfg.update.micro_batch_size) if len(m)]
    pad_rows = _pad_rows(keep) if pad_rows is None else pad_rows
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
    w, valid, metrics = a.rollout_correction.apply(old, traj.log_probs, mask)
    rejects = a.rollout_correction.rs_level != "none" or a.rollout_correction.veto_threshold > 0
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
