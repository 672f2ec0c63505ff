"""Diffusion-DPO for flow-matching models (Wallace et al. 2023, arXiv 2311.12908), offline or online.

For a pair (chosen x_w, rejected x_l) with one prompt, both images are noised at the same noise level
s and with the same noise eps (x_s = (1 - s) x0 + s eps), the policy and the reference (adapters off)
predict the velocity, and the per-sample flow-matching errors ||v - (eps - x0)||^2 enter
`core.losses.dpo_loss`: -log sigmoid(-beta/2 [(e_w - e_l)_policy - (e_w - e_l)_ref]).

One step reads top to bottom:
  offline (`dpo.mode: offline`): pairs from `data.preference_file` (`pipelines.data.load_preference_pairs`:
      prompt + chosen/rejected paths, Pick-a-Pic image_0/image_1/label_0, or scored images); each image
      is encoded with the VAE the first time it is drawn and kept in `<output_dir>/latent_cache/`,
      reused across epochs and after a resume;
  online (`dpo.mode: online`): G images per prompt from the current policy (ODE if
      `sample.noise_level` = 0, else SDE), scored by the zoo, paired within each prompt group
      (`dpo.pairing`: best_worst, or all_pairs whose reward gap exceeds `dpo.pair_margin`);
  then  loss -> accumulated gradients over the step's pairs -> one AdamW update.

    from mmrl.config import load_config
    from mmrl.diffusion.dpo import train
    summary = train(load_config("configs/diffusion/dpo_tiny_online.yaml"))

Metrics: `dpo/implicit_acc`, `dpo/reward_margin`, `dpo/kl_proxy` (mean policy-minus-reference error),
`dpo/loss`; online, `reward/mean|std` are the zoo rewards of the generated images; offline there is no
reward model, so `reward/mean|std` are the implicit reward margins of the step's pairs (the quantity
DPO raises) - evaluate with a zoo reward via `data.eval_prompts` + `reward.components`.
Several processes (`torchrun` / `accelerate launch`, `dist.strategy: ddp`), as `flow_grpo`: the batch sizes
(`data.prompts_per_step` online, `data.pairs_per_step` offline) are global and must be divisible by the number
of processes; every rank draws the same global batch and keeps its contiguous share (online: whole prompt
groups, since pairs are formed inside a group). Online, rewards are all-gathered and `build_pairs` runs on the
global batch (so `dpo.max_pairs_per_step` keeps the largest gaps of the whole batch); each rank trains the pairs
of its own groups. Each rank's loss is scaled so DDP's gradient average is the gradient of the mean over all
pairs; every rank runs the same number of micro-steps (zero-weight ones where it has fewer pairs, or none) and
gradients are all-reduced once per step. Rank 0 alone logs, samples, evaluates and writes checkpoints (any
number of ranks can resume); the offline latent cache is shared (one shard file series per rank). With one
process nothing of this changes a number.

`dist.strategy: fsdp` (LoRA or full fine-tuning, as `flow_grpo`): the transformer is sharded with FSDP2 before the optimizer is
built, `PolicyStates.refresh()` follows the shards (the reference = adapters off or a frozen init adapter), the
optimizer state and checkpoints hold full tensors (saved collectively, rank 0 writes; resumable under any
strategy), and every rank runs the same transformer forwards: equal rollouts, the same number of (padding)
micro-steps with their reference passes, and evaluation (ODE and offline implicit accuracy) on every rank.

What is simplified away versus the official train.py: the VAE posterior mean instead of a fresh
posterior sample per step (so latents can be cached); no SDXL micro-conditioning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmrl.config import RunConfig
from mmrl.core.losses import dpo_loss
from mmrl.diffusion.common import (TIMING_PREFIX, AdamWTrainConfig, make_optimizer, FullOptimizerState, LatentCache, NoSamples, TransformerEvalCounter,
                                   build_policy_states, evaluate_ode, flow_matching_mse,
                                   clip_grads, init_distributed, load_reward_fn, merge_rank_lists,
                                   noise_latents, restore_checkpoint, sample_sigmas, save_checkpoint,
                                   save_checkpoint_fsdp, score_images, summarise)
from mmrl.diffusion.flow_grpo import DataConfig, LogConfig, ModelConfig, RewardConfig
from mmrl.diffusion.models import PromptEmbeds
from mmrl.distributed import DistConfig, DistContext
from mmrl.pipelines.data import require_path
from mmrl.runtime import Timer, seed_everything
from mmrl.training import NONFINITE_KEY, UpdateGuard, check_finite_weights, finite_stats, group_keep

__all__ = ["Config", "train", "build_pairs", "PAIRINGS", "make_shapes_preference_file"]

PAIRINGS = ("best_worst", "all_pairs")

# ------------------------------------------------------------------------------------------ config


@dataclass
class DPODataConfig(DataConfig):
    preference_file: str = ""
    """Offline: .jsonl/.json/.parquet of pairs (prompt, chosen, rejected), Pick-a-Pic rows or scored images."""
    image_root: str = ""
    """Offline: folder that relative image paths are resolved against (default: the file's folder)."""
    min_score_gap: float = 0.0
    """Offline, scored-image files: pair the best and worst image of a prompt only if their scores differ by more."""
    pairs_per_step: int = 8
    """Offline: preference pairs per optimizer step."""
    cache_latents: bool = True
    """Offline: keep each image's VAE latent in <output_dir>/latent_cache/ once encoded (false = encode every step, for datasets too large to cache)."""


@dataclass
class SampleConfig:
    height: int = 512
    """Image height in pixels (offline: images are resized to it before encoding)."""
    width: int = 512
    """Image width in pixels."""
    num_steps: int = 10
    """Online: sampling steps per rollout."""
    group_size: int = 8
    """Online: images per prompt (G) that pairs are built from."""
    guidance_scale: float = 4.5
    """Online: CFG when sampling (the DPO loss itself uses the conditional velocity)."""
    noise_level: float = 0.0
    """Online: 0 = deterministic ODE sampling, > 0 = Flow-GRPO SDE with this noise level."""
    batch_size: int = 0
    """Rollout micro-batch (images per transformer call); 0 = whole batch."""
    eval_num_steps: int = 40
    """ODE steps for evaluation."""
    eval_guidance_scale: float = 4.5
    """Guidance for evaluation."""


@dataclass
class DPOConfig:
    mode: str = "offline"
    """`offline` (pairs from data.preference_file) or `online` (pairs from the policy's own scored samples)."""
    beta: float = 5000.0
    """beta_dpo of the official code (paper's beta * T * omega folded; 5000 for SD1.5/SDXL)."""
    timestep_sampling: str = "uniform"
    """How the noise level of a pair is drawn: `uniform` or `logit_normal` (then shifted by sigma_shift)."""
    sigma_shift: float = 0.0
    """Time shift applied to the drawn level (0 = the model scheduler's `shift`, 3.0 for SD3.5)."""
    logit_mean: float = 0.0
    """logit_normal: mean."""
    logit_std: float = 1.0
    """logit_normal: std."""
    pairing: str = "best_worst"
    """Online: `best_worst` (one pair per prompt) or `all_pairs` (every ordered pair above the margin)."""
    pair_margin: float = 0.0
    """Online: a pair needs reward(chosen) - reward(rejected) > margin."""
    max_pairs_per_step: int = 0
    """Online: keep at most this many pairs (largest reward gaps first); 0 = all."""


@dataclass
class DPOTrainConfig(AdamWTrainConfig):
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 1e-2
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up over this many optimizer updates (official: 500, constant after)."""
    micro_batch_size: int = 4
    """Pairs per forward/backward pass (each pair = 2 policy + 2 reference rows)."""


@dataclass
class Config(RunConfig):
    algorithm: str = "dpo"
    """Recipe name."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model and adapters ("ref" = adapters off, or a snapshot in full fine-tuning)."""
    data: DPODataConfig = field(default_factory=DPODataConfig)
    """Preference pairs (offline) or prompts (online)."""
    sample: SampleConfig = field(default_factory=SampleConfig)
    """Image size; online sampler."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """Diffusion-DPO loss and pairing."""
    train: DPOTrainConfig = field(default_factory=DPOTrainConfig)
    """Optimisation."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Zoo rewards (online: pairing; both modes: evaluation). std_mode/history/drop_zero_advantage are unused."""
    log: LogConfig = field(default_factory=LogConfig)
    """Samples, evaluation."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Several processes under torchrun / accelerate launch (strategy none|ddp|fsdp, backend, find_unused_parameters)."""


def _check(cfg: Config) -> None:
    d = cfg.dpo
    if d.mode not in ("offline", "online"):
        raise ValueError(f"dpo.mode: expected 'offline' or 'online', got {d.mode!r}")
    if d.pairing not in PAIRINGS:
        raise ValueError(f"dpo.pairing: expected one of {list(PAIRINGS)}, got {d.pairing!r}")
    if d.beta <= 0:
        raise ValueError(f"dpo.beta must be > 0, got {d.beta}")
    if d.mode == "offline" and not cfg.data.preference_file:
        raise ValueError("dpo.mode=offline needs data.preference_file (a .jsonl/.json/.parquet of preference pairs)")
    if d.mode == "online" and cfg.sample.group_size < 2:
        raise ValueError(f"dpo.mode=online needs sample.group_size >= 2 to form pairs, got {cfg.sample.group_size}")
    if cfg.train.micro_batch_size < 1 or cfg.data.pairs_per_step < 1:
        raise ValueError("train.micro_batch_size and data.pairs_per_step must be >= 1")
    # sizes that would otherwise fail deep inside a step (IndexError, empty torch.cat, negative shapes)
    s, log, online = cfg.sample, cfg.log, d.mode == "online"
    sizes = [("sample.height", s.height, 1), ("sample.width", s.width, 1),
             ("sample.eval_num_steps", s.eval_num_steps, 1),
             ("model.max_sequence_length", cfg.model.max_sequence_length, 0),
             ("model.lora_rank", cfg.model.lora_rank, 1 if cfg.model.lora else 0),
             ("log.sample_every", log.sample_every, 0), ("log.eval_every", log.eval_every, 0),
             ("log.num_sample_images", log.num_sample_images,
              1 if (online and log.sample_every) or (log.eval_every and cfg.data.eval_prompts) else 0)]
    if online:
        sizes += [("data.prompts_per_step", cfg.data.prompts_per_step, 1), ("sample.num_steps", s.num_steps, 1),
                  ("sample.batch_size", s.batch_size, 0), ("dpo.max_pairs_per_step", d.max_pairs_per_step, 0)]
    for key, value, least in sizes:
        if value < least:
            raise ValueError(f"{key}: expected >= {least}, got {value}")
    if online:
        require_path("data.train_prompts", cfg.data.train_prompts, "prompt file")
    else:
        require_path("data.preference_file", cfg.data.preference_file, "preference file")
        if cfg.data.image_root:
            require_path("data.image_root", cfg.data.image_root, "image folder", kind="dir")
    if cfg.data.eval_prompts:
        require_path("data.eval_prompts", cfg.data.eval_prompts, "prompt file")


# ------------------------------------------------------------------------------------------ pairing


def build_pairs(scores: torch.Tensor, group_ids: torch.Tensor, pairing: str = "best_worst",
                margin: float = 0.0, max_pairs: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (chosen[N], rejected[N]) of preference pairs inside each group of scores[B].

    best_worst: per group the highest and the lowest score (first index on ties), if their gap > margin.
    all_pairs:  every (i, j) of a group with scores[i] - scores[j] > margin.
    max_pairs > 0 keeps the pairs with the largest gaps (stable order otherwise: by group, then index).
    """
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing: expected one of {list(PAIRINGS)}, got {pairing!r}")
    scores = scores.detach().double().cpu()
    group_ids = group_ids.cpu()
    same = group_ids[:, None] == group_ids[None, :]
    gap = scores[:, None] - scores[None, :]
    if pairing == "all_pairs":
        ok = same & (gap > margin)
    else:
        big = torch.finfo(torch.float64).max
        g_max = torch.where(same, scores[None, :].expand_as(gap), torch.full_like(gap, -big)).max(1).values
        g_min = torch.where(same, scores[None, :].expand_as(gap), torch.full_like(gap, big)).min(1).values
        idx = torch.arange(len(scores))
        first = lambda mask: torch.where(mask & same, idx[None, :], len(scores)).min(1).values  # noqa: E731
        best, worst = first(scores[None, :] == g_max[:, None]), first(scores[None, :] == g_min[:, None])
        ok = torch.zeros_like(same)
        rep = torch.unique(first(torch.ones_like(same)))  # one row per group: its first member
        ok[best[rep], worst[rep]] = (g_max[rep] - g_min[rep]) > margin
    w, l = ok.nonzero(as_tuple=True)
    if max_pairs > 0 and len(w) > max_pairs:
        keep = torch.sort(torch.argsort(gap[w, l], descending=True, stable=True)[:max_pairs]).values
        w, l = w[keep], l[keep]
    return w, l


# ------------------------------------------------------------------------------------------ training


def train(cfg: Config) -> dict:
    from mmrl.diffusion.models import load_flow_model
    from mmrl.diffusion.sampling import sample_groups
    from mmrl.pipelines.data import PromptSampler, load_preference_pairs, load_prompts

    _check(cfg)
    s, t, d = cfg.sample, cfg.train, cfg.dpo
    online = d.mode == "online"
    ctx, run = init_distributed(cfg, {"data.prompts_per_step": cfg.data.prompts_per_step} if online
                                else {"data.pairs_per_step": cfg.data.pairs_per_step})
    eval_items = load_prompts(cfg.data.eval_prompts)[: cfg.log.eval_max_prompts] if cfg.data.eval_prompts else []
    reward_fn = load_reward_fn(cfg.reward.components, run.device) if (online or eval_items) else None
    model = load_flow_model(cfg.model.path, run.device, run.dtype, cfg.model.max_sequence_length or None)
    shift = d.sigma_shift or float(model.scheduler_config.get("shift", 1.0))

    if online:
        sampler = PromptSampler(load_prompts(cfg.data.train_prompts), seed=cfg.seed)
    else:
        pairs = load_preference_pairs(cfg.data.preference_file, cfg.data.image_root or None, cfg.data.min_score_gap)
        cache = LatentCache(run.dir / "latent_cache", s.height, s.width, enabled=cfg.data.cache_latents,
                            shard_suffix=f"_r{ctx.rank}" if ctx.enabled else "")  # no two ranks write one file
        if ctx.is_main:
            print(f"[dpo] {len(pairs)} preference pairs; {cache.loaded_from_disk} image latents already cached")
        sampler = PromptSampler(list(range(len(pairs))), seed=cfg.seed)  # the stream of pair indices

    states = build_policy_states(model, cfg.model, old=False, ref=True)
    evals = TransformerEvalCounter(model.transformer)
    # DDP keeps PolicyStates' parameter objects (the "ref" switch works); one process: unchanged
    model.transformer = ctx.wrap_model(states.model, cfg.dist.strategy,
                                       find_unused_parameters=cfg.dist.find_unused_parameters)
    fsdp = ctx.enabled and cfg.dist.strategy == "fsdp"
    if fsdp:  # fully_shard replaced every parameter by a DTensor shard: follow them before building the optimizer
        states.refresh()
    params = states.trainable_parameters()
    optimizer, lr_sched = make_optimizer(params, t)
    guard = UpdateGuard(t.max_skipped_updates, ctx, run)  # a NaN/inf loss or gradient never reaches the weights
    stateful = {"optimizer": FullOptimizerState(optimizer) if fsdp else optimizer, "lr_scheduler": lr_sched,
                "data": sampler, "transformer_evals": evals}
    start, _ = restore_checkpoint(run, states, stateful, tag="dpo", truncate=ctx.is_main)
    evals_synced = evals.count  # global count (all ranks) at the last synchronisation

    timer = Timer(sync_cuda=run.device.type == "cuda")
    bar = run.progress(t.max_steps, initial=start)
    for step in range(start + 1, t.max_steps + 1):
        metrics: dict[str, Any] = {}
        images = captions = pad = None
        if ctx.enabled:  # rank-local noise, a pure function of (seed, rank, step): nothing per rank to checkpoint
            seed_everything(ctx.rank_seed(cfg.seed, step))
        with timer("step"):
            # ---- 1. pairs: (chosen latents, rejected latents, prompt embeddings)
            if online:
                with timer("rollout"):
                    items = ctx.shard(sampler.next(cfg.data.prompts_per_step))  # whole groups per rank
                    embeds = model.encode_prompts([it.prompt for it in items])
                    with torch.no_grad():
                        traj = sample_groups(model, embeds, s.group_size, num_steps=s.num_steps, height=s.height,
                                             width=s.width, guidance_scale=s.guidance_scale,
                                             noise_level=s.noise_level, batch_size=s.batch_size or None)
                    prompts = [items[i].prompt for i in traj.prompt_index.tolist()]
                with timer("reward"):
                    scores, reward_metrics = score_images(reward_fn, traj.images, prompts,
                                                          [items[i].metadata for i in traj.prompt_index.tolist()],
                                                          on_nonfinite=cfg.reward.on_nonfinite)
                if ctx.enabled:  # equal sample counts per rank: the mean of the ranks' means is the batch mean
                    reward_metrics = {k: int(ctx.all_reduce_sum(v)) if k == NONFINITE_KEY
                                      else float(ctx.all_reduce_mean(v)) for k, v in reward_metrics.items()}
                metrics.update(reward_metrics)
                # pairs from the whole batch's rewards (group id = global prompt index: shards are contiguous);
                # each rank trains the pairs of its own groups. One process: build_pairs(scores, prompt_index)
                all_scores = ctx.all_gather_tensor(scores)
                sizes = list(ctx.last_gather_sizes)
                gids = ctx.all_gather_tensor(traj.prompt_index + ctx.rank * len(items))
                # samples with a non-finite reward (reward.on_nonfinite=drop_sample) and groups left with one
                # sample form no pair
                ok = group_keep(torch.isfinite(all_scores), gids).nonzero().flatten()
                w_all, l_all = build_pairs(all_scores[ok], gids[ok], d.pairing, d.pair_margin, d.max_pairs_per_step)
                w_all, l_all = ok[w_all], ok[l_all]
                lo = sum(sizes[:ctx.rank])
                mine = (w_all >= lo) & (w_all < lo + sizes[ctx.rank])
                w, l = w_all[mine] - lo, l_all[mine] - lo
                x_w, x_l = traj.latents[w, -1], traj.latents[l, -1]
                pair_embeds = traj.embeds.select(traj.prompt_index[w])
                pad = (traj.latents[:1, -1], traj.latents[:1, -1], traj.embeds.select(traj.prompt_index[:1]))
                metrics["dpo/pairs"] = len(w_all)
                metrics["dpo/pair_gap"] = (all_scores[w_all] - all_scores[l_all]).mean().item() if len(w_all) else 0.0
                if ctx.enabled:  # the whole batch's reward statistics (score_images gave this rank's)
                    metrics.update(finite_stats(all_scores))
                images, captions = traj.images, [f"{p[:48]} | r={v:.3g}" for p, v in zip(prompts, scores.tolist())]
            else:
                idx = ctx.shard(sampler.next(cfg.data.pairs_per_step))  # this rank's share of the global pairs
                batch = [pairs[i] for i in idx]
                with timer("encode"):
                    x_w = cache.get(model, [p.chosen for p in batch], model.device)
                    x_l = cache.get(model, [p.rejected for p in batch], model.device)
                metrics["dpo/latents_cached"] = len(cache.latents)
                unique = list(dict.fromkeys(p.prompt for p in batch))
                pair_embeds = model.encode_prompts(unique).select([unique.index(p.prompt) for p in batch])

            # ---- 2./3. DPO loss on shared (noise level, noise) per pair; one optimizer update
            with timer("train"):
                m = _dpo_update(cfg, model, states, x_w, x_l, pair_embeds, shift, optimizer, lr_sched, params, timer,
                                ctx, pad, guard=guard, step=step)
            metrics.update(m)
            metrics.update(guard.pop_metrics())
            if not online:  # no reward model offline: the implicit reward margin is what DPO raises
                metrics["reward/mean"], metrics["reward/std"] = m["dpo/reward_margin"], m.pop("dpo/reward_margin_std")

        metrics["lr"] = optimizer.param_groups[0]["lr"]
        if ctx.is_main and cfg.log.sample_every and images is not None and (
                step % cfg.log.sample_every == 0 or step == 1):
            n = min(cfg.log.num_sample_images, len(images))
            run.save_samples(step, images[:n], captions[:n])
        eval_step = cfg.log.eval_every and (step % cfg.log.eval_every == 0 or step in (1, t.max_steps))
        if (ctx.is_main or fsdp) and not online and eval_step:  # FSDP: every rank runs the forwards
            with timer("eval"):
                metrics.update(_offline_eval(cfg, model, states, pairs, cache, shift))
        if (ctx.is_main or fsdp) and eval_items and eval_step:  # FSDP: every rank runs the forwards, rank 0 writes
            with timer("eval"):
                metrics.update(evaluate_ode(model, states, "default", reward_fn, eval_items,
                                            run if ctx.is_main else NoSamples(), step,
                                            num_steps=s.eval_num_steps, guidance_scale=s.eval_guidance_scale,
                                            height=s.height, width=s.width, batch_size=max(1, t.micro_batch_size),
                                            seed=cfg.seed, num_images=cfg.log.num_sample_images))
        evals.count = evals_synced = evals_synced + int(ctx.all_reduce_sum(evals.count - evals_synced))
        metrics["cost/transformer_evals"] = evals.count
        metrics.update(timer.pop(TIMING_PREFIX))
        metrics["time/step_s"] = metrics.pop("time/step_s")
        if ctx.is_main:
            run.log(step, metrics)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.4g}", acc=f"{metrics.get('dpo/implicit_acc', 0):.2f}")
        if (t.save_every and step % t.save_every == 0) or step == t.max_steps:
            check_finite_weights(states, step, ctx, run)  # never a checkpoint with NaN/inf weights
            if fsdp:  # gathering the shards is a collective: every rank takes part, rank 0 writes
                save_checkpoint_fsdp(ctx, run, step, states, stateful)
            elif ctx.is_main:
                save_checkpoint(run, step, states, stateful)
            ctx.barrier()  # nobody reads or resumes from a half-written checkpoint
    bar.close()
    evals.remove()
    summary = summarise(run, "dpo", extra_keys=("dpo/implicit_acc",)) if ctx.is_main else {}
    ctx.barrier()
    ctx.close()
    return summary


def _pair_errors(model, states, x_w, x_l, embeds, sigma, noise) -> tuple:
    """Flow-matching errors [b] of policy (with grad) and reference (no grad) on chosen and rejected,
    both noised with the same level sigma[b] and noise[b, ...]: (pol_w, pol_l, ref_w, ref_l)."""
    x0 = torch.cat([x_w, x_l])
    eps = torch.cat([noise, noise])
    sig = torch.cat([sigma, sigma])
    xt = noise_latents(x0, sig, eps)
    emb = PromptEmbeds.cat([embeds, embeds])
    pol_w, pol_l = flow_matching_mse(model.velocity(xt, sig, emb, guidance_scale=1.0), x0, eps).chunk(2)
    with torch.no_grad(), states.use("ref"):
        ref_w, ref_l = flow_matching_mse(model.velocity(xt, sig, emb, guidance_scale=1.0), x0, eps).chunk(2)
    return pol_w, pol_l, ref_w, ref_l


def _margin(beta: float, pol_w, pol_l, ref_w, ref_l) -> torch.Tensor:
    """Per-pair implicit reward margin, the `inside` of `core.losses.dpo_loss` (for spreads and eval)."""
    return (-0.5 * beta * ((pol_w - pol_l) - (ref_w - ref_l))).detach().float().cpu()


@torch.no_grad()
def _offline_eval(cfg: Config, model, states, pairs, cache, shift, draws: int = 4) -> dict:
    """Implicit accuracy / margin on the first `log.eval_max_prompts` pairs, each at `draws` fixed
    (noise level, noise) draws from a seeded generator: the same points at every evaluation, and the
    global RNG is untouched (so evaluation does not change training)."""
    d = cfg.dpo
    batch = pairs[: cfg.log.eval_max_prompts]
    gen = torch.Generator().manual_seed(cfg.seed + 999)
    unique = list(dict.fromkeys(p.prompt for p in batch))
    embeds = model.encode_prompts(unique).select([unique.index(p.prompt) for p in batch])
    x_w = cache.get(model, [p.chosen for p in batch], model.device)
    x_l = cache.get(model, [p.rejected for p in batch], model.device)
    margins = []
    for _ in range(draws):
        for rows in torch.split(torch.arange(len(batch)), max(1, cfg.train.micro_batch_size)):
            sig = sample_sigmas(len(rows), d.timestep_sampling, shift, d.logit_mean, d.logit_std, generator=gen)
            noise = torch.randn(x_w[rows].shape, generator=gen)
            errs = _pair_errors(model, states, x_w[rows], x_l[rows], embeds.select(rows), sig.to(model.device),
                                noise.to(model.device))
            margins.append(_margin(d.beta, *errs))
    m = torch.cat(margins)
    return {"eval/dpo/implicit_acc": (m > 0).float().mean().item(), "eval/dpo/reward_margin": m.mean().item()}


def _dpo_update(cfg: Config, model, states, x_w, x_l, embeds, shift, optimizer, lr_sched, params, timer,
                ctx: DistContext | None = None, pad: tuple | None = None, guard: UpdateGuard | None = None,
                step: int = 0) -> dict:
    """Gradient accumulation over all pairs (micro-batches of train.micro_batch_size), one AdamW step.

    Several ranks: each holds its pairs of the step; its loss is weighted by `ctx.loss_scale(n_local)` so DDP's
    average is the gradient of the mean over all ranks' pairs, all ranks run the same number of micro-steps
    (zero-weight micro-batches on `pad` = (x_w[1], x_l[1], embeds[1]), or on the first pair, where a rank has
    fewer) and gradients are all-reduced once (no_sync around the others). Metrics cover all ranks' pairs."""
    ctx = ctx or DistContext()
    t, d = cfg.train, cfg.dpo
    guard = guard or UpdateGuard(t.max_skipped_updates, ctx)
    n = x_w.shape[0]
    n_total = int(ctx.all_reduce_sum(n))
    out: dict[str, float] = {"dpo/pairs_trained": n_total}
    if n_total == 0:
        return {**out, "dpo/loss": math.nan, "dpo/implicit_acc": math.nan, "dpo/reward_margin": 0.0,
                "dpo/reward_margin_std": 0.0, "dpo/kl_proxy": 0.0, "train/grad_norm": 0.0}
    micro = [rows for rows in torch.split(torch.arange(n), t.micro_batch_size) if len(rows)]
    n_micro = ctx.max_int(len(micro))  # same number of micro-steps on every rank
    scale = ctx.loss_scale(n)  # local mean -> mean over all ranks' pairs under DDP's gradient average
    if len(micro) < n_micro and n == 0 and pad is None:
        raise ValueError("_dpo_update: this rank has no pair and no padding pair (pad=(x_w, x_l, embeds))")
    pad = (x_w[:1], x_l[:1], embeds.select([0])) if n > 0 else pad
    sums: dict[str, float] = {}
    margins, losses = [], []
    for mi in range(n_micro):
        real = mi < len(micro)
        if real:
            rows = micro[mi]
            xw, xl, emb = x_w[rows], x_l[rows], embeds.select(rows)
        else:
            xw, xl, emb = pad
        b = xw.shape[0]
        sig = sample_sigmas(b, d.timestep_sampling, shift, d.logit_mean, d.logit_std).to(model.device)
        noise = torch.randn_like(xw)  # one level and one noise per pair, shared by chosen and rejected
        with ctx.no_sync(model.transformer, sync=mi == n_micro - 1), timer("forward_backward"):
            errs = _pair_errors(model, states, xw, xl, emb, sig, noise)
            loss, m = dpo_loss(*errs, d.beta)
            (loss * b / n * scale if real else loss * 0.0).backward()
        if real:
            for key, v in m.items():
                sums[key] = sums.get(key, 0.0) + v * b
            margins.append(_margin(d.beta, *errs))
            losses.append(loss.detach())
    grad_norm = clip_grads(params, t.max_grad_norm)
    if guard.step(optimizer, losses, grad_norm, step):  # NaN/inf loss or gradient: skipped
        lr_sched.step()
    optimizer.zero_grad(set_to_none=True)
    if ctx.enabled:  # sums over all ranks' pairs (a rank without pairs contributes nothing)
        sums = {k: sum(v) for k, v in merge_rank_lists(ctx, {k: [v] for k, v in sums.items()}).items()}
    mean = {k: v / n_total for k, v in sums.items()}
    all_m = ctx.all_gather_tensor(torch.cat(margins) if margins else torch.zeros(0))
    out.update({"dpo/loss": mean["dpo_loss"], "dpo/implicit_acc": mean["implicit_acc"],
                "dpo/reward_margin": mean["reward_margin"],
                "dpo/reward_margin_std": all_m.std().item() if n_total > 1 else 0.0,
                "dpo/kl_proxy": mean["kl_proxy"], "dpo/model_mse": mean["model_mse"], "dpo/ref_mse": mean["ref_mse"],
                "train/grad_norm": grad_norm})
    return out


# ------------------------------------------------------------------------------------------ demo data


def make_shapes_preference_file(out_dir: str | Path, n_pairs: int = 32, seed: int = 0, size: int = 64) -> Path:
    """A small synthetic preference set for the offline demo and tests: `out_dir/pairs.jsonl` + PNGs.

    Each row: the caption of a random one-shape scene ("a red circle on a blue background"); chosen =
    that scene; rejected = the same scene with the shape in another colour (never the background's),
    so the preferred property is "the shape has the colour the prompt names".
    """
    import json
    import random

    from mmrl.pipelines.shapes import COLORS, Shape, render_scene, sample_scene

    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n_pairs):
        scene = sample_scene(rng, n_shapes=1, size=size)
        sh = scene.shapes[0]
        wrong = rng.choice([c for c in COLORS if c not in (sh.color, scene.background)])
        bad = render_scene([Shape(sh.kind, wrong, sh.x, sh.y, sh.size)], scene.background, size)
        scene.image.save(out / "images" / f"{i:04d}_chosen.png")
        bad.save(out / "images" / f"{i:04d}_rejected.png")
        rows.append({"prompt": scene.caption, "chosen": f"images/{i:04d}_chosen.png",
                     "rejected": f"images/{i:04d}_rejected.png", "wrong_color": wrong})
    path = out / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


if __name__ == "__main__":  # python -m mmrl.diffusion.dpo make-shapes-pairs OUT_DIR [N_PAIRS]
    import sys

    if len(sys.argv) < 3 or sys.argv[1] != "make-shapes-pairs":
        raise SystemExit("usage: python -m mmrl.diffusion.dpo make-shapes-pairs OUT_DIR [N_PAIRS]")
    print(make_shapes_preference_file(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 32))
