"""The Diffusion-DPO update: flow-matching errors of policy and reference on each pair's chosen and rejected image
(the same noise level and noise for both), `core.losses.dpo_loss`, gradient accumulation over the step's pairs,
one optimizer update; plus the offline implicit-accuracy evaluation."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from mmrl.core.losses import dpo_loss
from mmrl.diffusion.common import flow_matching_mse, noise_latents, sample_sigmas
from mmrl.diffusion.diagnostics import MAX_KEYS, velocity_norm_term, velocity_norms
from mmrl.diffusion.models import PromptEmbeds
from mmrl.distributed import merge_rank_lists

__all__ = ["dpo_update", "offline_eval", "pair_errors", "margin"]


def pair_errors(model, states, x_w, x_l, embeds, sigma, noise, with_velocity: bool = False) -> tuple:
    """Flow-matching errors [b] of policy (with grad) and reference (no grad) on chosen and rejected,
    both noised with the same level sigma[b] and noise[b, ...]: (pol_w, pol_l, ref_w, ref_l); with_velocity:
    also (the policy's velocity [2b, ...], the reference's velocity norms [2b]) for the velocity-norm terms."""
    x0 = torch.cat([x_w, x_l])
    eps = torch.cat([noise, noise])
    sig = torch.cat([sigma, sigma])
    xt = noise_latents(x0, sig, eps)
    emb = PromptEmbeds.cat([embeds, embeds])
    v = model.velocity(xt, sig, emb, guidance_scale=1.0)
    pol_w, pol_l = flow_matching_mse(v, x0, eps).chunk(2)
    with torch.no_grad(), states.use("ref"):
        v_ref = model.velocity(xt, sig, emb, guidance_scale=1.0)
        ref_w, ref_l = flow_matching_mse(v_ref, x0, eps).chunk(2)
    if with_velocity:
        return (pol_w, pol_l, ref_w, ref_l), (v, velocity_norms(v_ref))
    return pol_w, pol_l, ref_w, ref_l


def margin(beta: float, pol_w, pol_l, ref_w, ref_l) -> torch.Tensor:
    """Per-pair implicit reward margin, the `inside` of `core.losses.dpo_loss` (for spreads and eval)."""
    return (-0.5 * beta * ((pol_w - pol_l) - (ref_w - ref_l))).detach().float().cpu()


@torch.no_grad()
def offline_eval(cfg, model, states, pairs, cache, shift, draws: int = 4) -> dict:
    """Implicit accuracy / margin on the first `log.eval_max_prompts` pairs, each at `draws` fixed
    (noise level, noise) draws from a seeded generator: the same points at every evaluation, and the
    global RNG is untouched (so evaluation does not change training)."""
    algo = cfg.algo
    batch = pairs[: cfg.log.eval_max_prompts]
    gen = torch.Generator().manual_seed(cfg.seed + 999)
    unique = list(dict.fromkeys(p.prompt for p in batch))
    embeds = model.encode_prompts(unique).select([unique.index(p.prompt) for p in batch])
    x_w = cache.get(model, [p.chosen for p in batch], model.device)
    x_l = cache.get(model, [p.rejected for p in batch], model.device)
    margins = []
    for _ in range(draws):
        for rows in torch.split(torch.arange(len(batch)), max(1, cfg.update.micro_batch_size)):
            sig = sample_sigmas(len(rows), algo.timestep_sampling, shift, algo.logit_mean, algo.logit_std,
                                generator=gen)
            noise = torch.randn(x_w[rows].shape, generator=gen)
            errs = pair_errors(model, states, x_w[rows], x_l[rows], embeds.select(rows), sig.to(model.device),
                                noise.to(model.device))
            margins.append(margin(algo.beta, *errs))
    m = torch.cat(margins)
    return {"eval/policy/implicit_acc": (m > 0).float().mean().item(), "eval/policy/reward_margin": m.mean().item()}


def dpo_update(parts, step: int, x_w, x_l, embeds, shift: float, pad: tuple | None = None) -> dict:
    """Gradient accumulation over all pairs (micro-batches of update.micro_batch_size), one AdamW step, through the
    shared update iterator (`TrainingParts.updates`: one epoch, one update, the pairs in order).

    Several ranks: each holds its pairs of the step; its loss is weighted by `ctx.loss_scale(n_local)` so DDP's
    average is the gradient of the mean over all ranks' pairs, all ranks run the same number of micro-steps
    (zero-weight micro-batches on `pad` = (x_w[1], x_l[1], embeds[1]), or on the first pair, where a rank has
    fewer) and gradients are all-reduced once (no_sync around the others). Metrics cover all ranks' pairs."""
    cfg, ctx, model, states, timer = parts.cfg, parts.ctx, parts.model, parts.states, parts.timer
    algo = cfg.algo
    n = x_w.shape[0]
    n_total = int(ctx.all_reduce_sum(n))
    out: dict[str, float] = {"train/pairs": n_total}
    if n_total == 0:
        return {**out, "policy/loss": math.nan, "policy/implicit_acc": math.nan, "policy/reward_margin": 0.0,
                "policy/reward_margin_std": 0.0, "kl/ref_proxy": 0.0, "policy/grad_norm": 0.0}
    if n == 0 and pad is None:
        raise ValueError("dpo_update: this rank has no pair and no padding pair (pad=(x_w, x_l, embeds))")
    pad = (x_w[:1], x_l[:1], embeds.select([0])) if n > 0 else pad
    acc: dict[str, list] = defaultdict(list)  # this update's losses (the guard checks them) and its gradient norm
    sums: dict[str, float] = {}
    margins, ratio_max = [], []
    vn = getattr(algo, "velocity_norm", None)
    for mb in parts.updates(torch.arange(n), metrics=acc, step=step, epochs=1, updates_per_epoch=1, shuffle=False):
        if mb.real:
            xw, xl, emb = x_w[mb.rows], x_l[mb.rows], embeds.select(mb.rows)
        else:
            xw, xl, emb = pad
        b = xw.shape[0]
        sig = sample_sigmas(b, algo.timestep_sampling, shift, algo.logit_mean, algo.logit_std).to(model.device)
        noise = torch.randn_like(xw)  # one level and one noise per pair, shared by chosen and rejected
        with mb.no_sync(), timer("forward_backward"):
            errs, (v, ref_norm) = pair_errors(model, states, xw, xl, emb, sig, noise, with_velocity=True)
            loss, m = dpo_loss(*errs, algo.beta)
            term, vm = velocity_norm_term(v, ref_norm, vn.coef if vn is not None else 0.0)  # diagnostic (+ penalty)
            loss = loss + term
            (loss * b / n * mb.scale if mb.real else loss * 0.0).backward()
        if mb.real:
            m.update({k: val for k, val in vm.items() if k not in MAX_KEYS})
            ratio_max.append(vm["diag/velocity_norm_ratio_max"])
            for key, v in m.items():
                sums[key] = sums.get(key, 0.0) + v * b
            margins.append(margin(algo.beta, *errs))
            acc["policy/loss"].append(loss.detach())
    if ctx.enabled:  # sums over all ranks' pairs (a rank without pairs contributes nothing)
        sums = {k: sum(v) for k, v in merge_rank_lists(ctx, {k: [v] for k, v in sums.items()}).items()}
        ratio_max = merge_rank_lists(ctx, {"r": ratio_max})["r"]
    mean = {k: v / n_total for k, v in sums.items()}
    all_m = ctx.all_gather_tensor(torch.cat(margins) if margins else torch.zeros(0))
    out.update({"policy/loss": mean["dpo_loss"], "policy/implicit_acc": mean["implicit_acc"],
                "policy/reward_margin": mean["reward_margin"],
                "policy/reward_margin_std": all_m.std().item() if n_total > 1 else 0.0,
                "kl/ref_proxy": mean["kl_proxy"], "policy/model_mse": mean["model_mse"],
                "policy/ref_mse": mean["ref_mse"], "policy/grad_norm": acc["policy/grad_norm"][0]})
    out.update({k: val for k, val in mean.items() if k.startswith(("diag/", "policy/norm"))})  # velocity norm
    out["diag/velocity_norm_ratio_max"] = max(ratio_max) if ratio_max else 1.0
    return out
