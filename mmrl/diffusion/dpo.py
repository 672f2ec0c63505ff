"""Diffusion-DPO for flow-matching models (Wallace et al. 2023, arXiv 2311.12908), offline or online.

For a pair (chosen x_w, rejected x_l) with one prompt, both images are noised at the same noise level
s and with the same noise eps (x_s = (1 - s) x0 + s eps), the policy and the reference (adapters off)
predict the velocity, and the per-sample flow-matching errors ||v - (eps - x0)||^2 enter
`core.losses.dpo_loss`: -log sigmoid(-beta/2 [(e_w - e_l)_policy - (e_w - e_l)_ref]).

One step reads top to bottom:
  offline (`algo.mode: offline`): pairs from `data.preference_file` (`pipelines.data.load_preference_pairs`:
      prompt + chosen/rejected paths, Pick-a-Pic image_0/image_1/label_0, or scored images); each image
      is encoded with the VAE the first time it is drawn and kept in `<output_dir>/latent_cache/`,
      reused across epochs and after a resume;
  online (`algo.mode: online`): G images per prompt from the current policy (ODE if
      `rollout.noise_level` = 0, else SDE), scored by the zoo, paired within each prompt group
      (`algo.pairing`: best_worst, or all_pairs whose reward gap exceeds `algo.pair_margin`; `core.pairing`);
  then  loss -> accumulated gradients over the step's pairs -> one AdamW update.

    from mmrl.config import load_config
    from mmrl.diffusion.dpo import train
    summary = train(load_config("configs/diffusion/dpo_tiny_online.yaml"))

Metrics: `policy/implicit_acc`, `policy/reward_margin`, `kl/ref_proxy` (mean policy-minus-reference error),
`policy/loss`; online, `reward/mean|std` are the zoo rewards of the generated images; offline there is no
reward model, so `reward/mean|std` are the implicit reward margins of the step's pairs (the quantity
DPO raises) - evaluate with a zoo reward via `data.eval_prompts` + `reward.components`.
Several processes (`torchrun` / `accelerate launch`, `dist.strategy: ddp`), as `flow_grpo`: the batch sizes
(`rollout.prompts_per_step` online, `data.pairs_per_step` offline) are global and must be divisible by the number
of processes; every rank draws the same global batch and keeps its contiguous share (online: whole prompt
groups, since pairs are formed inside a group). Online, rewards are all-gathered and `build_pairs` runs on the
global batch (so `algo.max_pairs_per_step` keeps the largest gaps of the whole batch); each rank trains the pairs
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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from mmrl.config import RunConfig
from mmrl.core.pairing import build_pairs
from mmrl.diffusion import config as dc
from mmrl.diffusion.diagnostics import VelocityNormConfig
from mmrl.distributed import DistConfig
from mmrl.run.start import closes_runs
from mmrl.training import OptimConfig, UpdateConfig, finite_stats, group_keep

__all__ = ["Config", "train", "make_shapes_preference_file"]


# ------------------------------------------------------------------------------------------ config


@dataclass
class DataConfig(dc.DataConfig):
    preference_file: str = ""
    """Offline: .jsonl/.json/.parquet of pairs (prompt, chosen, rejected), Pick-a-Pic rows or scored images."""
    image_root: str = ""
    """Offline: folder that relative image paths are resolved against (default: the file's folder)."""
    min_score_gap: float = 0.0
    """Offline, scored-image files: pair the best and worst image of a prompt only if their scores differ by more."""
    pairs_per_step: int = 8
    """Offline: preference pairs per optimizer step (global, over all processes)."""
    cache_latents: bool = True
    """Offline: keep each image's VAE latent in <output_dir>/latent_cache/ once encoded (false = encode every step, for datasets too large to cache)."""

    def __post_init__(self) -> None:
        if self.pairs_per_step < 1:
            raise ValueError(f"data.pairs_per_step: expected >= 1, got {self.pairs_per_step}")


@dataclass
class RolloutConfig(dc.RolloutConfig):
    """Image size (offline: images are resized to it before encoding); online: the sampler."""

    group_size: int = 8
    """Online: images per prompt (G) that pairs are built from."""
    guidance_scale: float = 4.5
    """Online: CFG when sampling (the DPO loss itself uses the conditional velocity)."""
    noise_level: float = 0.0
    """Online: 0 = deterministic ODE sampling, > 0 = Flow-GRPO SDE with this noise level."""


@dataclass
class DPOOptimConfig(OptimConfig):
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 1e-2
    """AdamW weight decay."""


@dataclass
class DPOUpdateConfig(UpdateConfig):
    micro_batch_size: int = 4
    """Pairs per forward/backward pass (each pair = 2 policy + 2 reference rows)."""


@dataclass
class AlgoConfig:
    mode: Literal["offline", "online"] = "offline"
    """`offline` (pairs from data.preference_file) or `online` (pairs from the policy's own scored samples)."""
    beta: float = 5000.0
    """beta_dpo of the official code (paper's beta * T * omega folded, times 0.5 in the loss): 5000 in its SD1.5 and
    SDXL launchers and in diffusers' SDXL DPO script."""
    timestep_sampling: Literal["uniform", "logit_normal"] = "uniform"
    """How the noise level of a pair is drawn: `uniform` or `logit_normal` (then shifted by sigma_shift)."""
    sigma_shift: float = 0.0
    """Time shift applied to the drawn level (0 = the model scheduler's `shift`, 3.0 for SD3.5)."""
    logit_mean: float = 0.0
    """logit_normal: mean."""
    logit_std: float = 1.0
    """logit_normal: std."""
    pairing: Literal["best_worst", "all_pairs"] = "best_worst"
    """Online: `best_worst` (one pair per prompt) or `all_pairs` (every ordered pair above the margin)."""
    pair_margin: float = 0.0
    """Online: a pair needs reward(chosen) - reward(rejected) > margin."""
    max_pairs_per_step: int = 0
    """Online: keep at most this many pairs (largest reward gaps first); 0 = all."""
    velocity_norm: VelocityNormConfig = field(default_factory=VelocityNormConfig)
    """||v|| / ||v_ref|| on every pair's noised images (diag/velocity_norm_ratio, always logged: DPO runs the
    reference) and a hinge penalty coef * mean max(0, ratio - 1)^2 (0 = off)."""

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"algo.beta must be > 0, got {self.beta}")
        if self.max_pairs_per_step < 0:
            raise ValueError(f"algo.max_pairs_per_step: expected >= 0, got {self.max_pairs_per_step}")


@dataclass
class RewardConfig(dc.AggregationFields, dc.RewardConfig):
    """Zoo rewards and, online, how several components rank a group's images into pairs (`aggregation`)."""


@dataclass
class Config(RunConfig):
    algorithm: str = "dpo"
    """Recipe name."""
    model: dc.ModelConfig = field(default_factory=dc.ModelConfig)
    """Model and adapters ("ref" = adapters off, or a snapshot in full fine-tuning)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Preference pairs (offline) or prompts (online)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Image size; online sampler."""
    optim: DPOOptimConfig = field(default_factory=DPOOptimConfig)
    """AdamW and its learning-rate schedule (official: warmup_steps 500, constant after)."""
    update: DPOUpdateConfig = field(default_factory=DPOUpdateConfig)
    """Pairs per forward/backward pass (`micro_batch_size`; each pair = 2 policy + 2 reference rows), gradient
    clipping. One optimizer update per step over all its pairs: `epochs` must be 1 and `mini_batch_size` 0."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Diffusion-DPO loss and pairing."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Zoo rewards (online: pairing, by the weighted sum or, `aggregation: normalise_then_sum`, by GDPO's
    advantages; both modes: evaluation)."""
    log: dc.LogConfig = field(default_factory=dc.LogConfig)
    """Samples, evaluation."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Several processes under torchrun / accelerate launch (strategy none|ddp|fsdp, backend, find_unused_parameters)."""


def _check(cfg: Config) -> None:
    """Checks across sections (each section checks its own keys when built)."""
    from mmrl.pipelines.data import require_path

    online = cfg.algo.mode == "online"
    if cfg.update.epochs != 1 or cfg.update.mini_batch_size != 0:
        raise ValueError(f"dpo makes one optimizer update per step over all its pairs: update.epochs must be 1 and "
                         f"update.mini_batch_size 0, got {cfg.update.epochs} and {cfg.update.mini_batch_size}")
    if not online and not cfg.data.preference_file:
        raise ValueError("algo.mode=offline needs data.preference_file (a .jsonl/.json/.parquet of preference pairs)")
    if not online and cfg.rollout.num_frames > 1:
        raise ValueError(f"algo.mode=offline trains on image preference pairs; rollout.num_frames="
                         f"{cfg.rollout.num_frames} (videos) works with algo.mode=online")
    if online and cfg.rollout.group_size < 2:
        raise ValueError(f"algo.mode=online needs rollout.group_size >= 2 to form pairs, got {cfg.rollout.group_size}")
    dc.check_common(cfg, online=online)
    if not online:
        from mmrl.diffusion.models import flow_model_class

        require_path("data.preference_file", cfg.data.preference_file, "preference file")
        if cfg.data.image_root:
            require_path("data.image_root", cfg.data.image_root, "image folder", kind="dir")
        if flow_model_class(cfg.model.path).needs_source_image:
            raise ValueError(f"algo.mode=offline: preference pairs carry no source images, so the edit model at "
                             f"model.path={cfg.model.path} cannot be trained offline; use algo.mode=online with "
                             f"edit rows")


# ------------------------------------------------------------------------------------------ training


@closes_runs  # the run directory's lock released however train() ends; a failed start leaves nothing
def train(cfg: Config) -> dict:
    from mmrl.core.multi_reward import multi_reward_advantages
    from mmrl.core.prompt_stats import group_normalize
    from mmrl.diffusion.common import LatentCache
    from mmrl.diffusion.dpo_update import dpo_update, offline_eval
    from mmrl.diffusion.loop import DiffusionLoop
    from mmrl.diffusion.rollout import ode_sampling
    from mmrl.diffusion.scoring import reward_weights
    from mmrl.pipelines.data import PromptItem, PromptSampler, load_preference_pairs
    from mmrl.training import summarise

    _check(cfg)
    rollout, algo = cfg.rollout, cfg.algo
    online = algo.mode == "online"
    loop = DiffusionLoop(cfg, online=online)
    ctx, model = loop.ctx, loop.model
    shift = algo.sigma_shift or model.sigma_shift
    if online:
        sampler = PromptSampler(loop.train_items, seed=cfg.seed)
    else:
        pairs = load_preference_pairs(cfg.data.preference_file, cfg.data.image_root or None, cfg.data.min_score_gap)
        cache = LatentCache(loop.run.dir / "latent_cache", rollout.height, rollout.width,
                            enabled=cfg.data.cache_latents,
                            shard_suffix=f"_r{ctx.rank}" if ctx.enabled else "")  # no two ranks write one file
        if ctx.is_main:
            print(f"[dpo] {len(pairs)} preference pairs; {cache.loaded_from_disk} image latents already cached")
        sampler = PromptSampler(list(range(len(pairs))), seed=cfg.seed)  # the stream of pair indices
        loop.train_items = [PromptItem(p) for p in dict.fromkeys(pair.prompt for pair in pairs)]  # sample grids

    # "default" trains, "ref" = adapters off (or a snapshot in full fine-tuning)
    loop.setup(old=False, ref=True, eval_state="default", tracker=False, sampler=sampler)
    if not online:  # the implicit accuracy on held-out pairs, beside the held-out reward
        loop.extra_evaluations.append(lambda: offline_eval(cfg, model, loop.states, pairs, cache, shift))
    loop.begin(postfix=lambda m: {"acc": f"{m.get('policy/implicit_acc', 0):.2f}"})
    for step in loop:
        pad = None
        # ---- 1. pairs: (chosen latents, rejected latents, prompt embeddings)
        if online:
            roll = loop.rollout(step, ode_sampling(rollout, noise_level=rollout.noise_level))  # + rewards
            traj, group_size = roll.traj, rollout.group_size
            # pairs from the whole batch's rewards (group id = global prompt index: shards are contiguous);
            # each rank trains the pairs of its own groups. One process: build_pairs(scores, prompt_index)
            all_scores = ctx.all_gather_tensor(roll.scores)
            sizes = list(ctx.last_gather_sizes)
            gids = ctx.all_gather_tensor(traj.prompt_index + ctx.rank * (len(roll.prompts) // group_size))
            # samples with a non-finite reward (reward.on_nonfinite=drop_sample) and groups left with one
            # sample form no pair
            ok = group_keep(torch.isfinite(all_scores), gids).nonzero().flatten()
            rank_by = all_scores  # reward.aggregation=normalise_then_sum: pair by GDPO's advantages
            if cfg.reward.aggregation == "normalise_then_sum":
                rank_by = multi_reward_advantages(ctx.all_gather_tensor(roll.components),
                                                  reward_weights(loop.reward_fn),
                                                  lambda r: group_normalize(r, gids), cfg.reward.aggregation,
                                                  mask=torch.isfinite(all_scores)).float()
            w_all, l_all = build_pairs(rank_by[ok], gids[ok], algo.pairing, algo.pair_margin,
                                       algo.max_pairs_per_step)
            w_all, l_all = ok[w_all], ok[l_all]
            lo = sum(sizes[:ctx.rank])
            mine = (w_all >= lo) & (w_all < lo + sizes[ctx.rank])
            w, l = w_all[mine] - lo, l_all[mine] - lo
            x_w, x_l = traj.latents[w, -1], traj.latents[l, -1]
            pair_embeds = traj.embeds.select(traj.prompt_index[w])
            pad = (traj.latents[:1, -1], traj.latents[:1, -1], traj.embeds.select(traj.prompt_index[:1]))
            loop.metrics["rollout/pairs"] = len(w_all)
            loop.metrics["rollout/pair_gap"] = ((all_scores[w_all] - all_scores[l_all]).mean().item()
                                                if len(w_all) else 0.0)
            if ctx.enabled:  # the whole batch's reward statistics (score_images gave this rank's)
                loop.metrics.update(finite_stats(all_scores))
        else:
            idx = ctx.shard(sampler.next(cfg.data.pairs_per_step))  # this rank's share of the global pairs
            batch = [pairs[i] for i in idx]
            with loop.timer("encode"):
                x_w = cache.get(model, [p.chosen for p in batch], model.device)
                x_l = cache.get(model, [p.rejected for p in batch], model.device)
            loop.metrics["diag/latents_cached"] = len(cache.latents)
            unique = list(dict.fromkeys(p.prompt for p in batch))
            pair_embeds = model.encode_prompts(unique).select([unique.index(p.prompt) for p in batch])

        # ---- 2./3. DPO loss on shared (noise level, noise) per pair; one optimizer update
        with loop.timer("train"):
            m = dpo_update(loop.parts, step, x_w, x_l, pair_embeds, shift, pad)
        loop.metrics.update(m)
        loop.metrics.update(loop.guard.pop_metrics())
        if not online:  # no reward model offline: the implicit reward margin is what DPO raises
            loop.metrics["reward/mean"] = m["policy/reward_margin"]
            loop.metrics["reward/std"] = m["policy/reward_margin_std"]
    return loop.finish(lambda run: summarise(run, "dpo", extra_keys=("policy/implicit_acc",)))


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
