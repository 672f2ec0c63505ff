"""DGPO, Direct Group Preference Optimization (Luo, Hu, Tang; ICLR 2026, arXiv 2510.08425): online RL for
flow-matching models without a stochastic policy. The objective and its weights: `mmrl.core.dgpo`.

One step reads top to bottom:
  1. rollout    - G images per prompt, deterministic ODE (`rollout.ode_solver`: dpm2 = DPM-Solver++(2M), the
                  published sampler; euler), from the trained policy, or from the EMA "old" policy after
                  `algo.old_rollout_after` updates (published switch_ema_ref);
  2. rewards    - zoo rewards; per-prompt advantages (`core.prompt_stats`), clipped to +-`algo.adv_clip_max`;
  3. points     - M = `algo.num_train_timesteps` step indices of the rollout schedule drawn without replacement
                  from 0..`algo.trunc_steps` (one set per step, shared by all samples), x_t = (1 - t) x0 + t eps
                  with one noise eps per group and point (`algo.shared_noise`, published);
  4. loss       - ell = ||v_theta(x_t) - (eps - x0)||^2 per sample; group weights sigmoid(beta/G sum A (ell - ell_ref))
                  (ell_ref: the reference, adapters off, or the "old" EMA policy with `algo.ref: old`); loss
                  mean(w A ell), ell detached where the PPO-style ratio exp(ell_old - ell) left 1 +- `algo.clip_range`
                  (`algo.clip`); + `algo.kl.coef` ||v - v_ref||^2;
  5. step       - AdamW per `update.mini_batch_size` samples (whole groups); after each update
                  old <- decay * old + (1 - decay) * new, decay = min(0.001 n, 0.3) (published ema_ref).

Training velocities are conditional-only at `algo.train_guidance_scale` (published mode 1: CFG in the rollout, none
in training); the reference at `algo.ref_guidance_scale` (published kl_cfg). A micro-batch holds whole groups
(`update.micro_batch_size` a multiple of `rollout.group_size`), so the group weights need no extra pass; several
processes shard whole prompts, so a group never spans ranks (the published all-reduce of group sums is not needed).

    summary = train(load_config("configs/diffusion/dgpo_tiny.yaml"))   # mmrl.config.load_config

Simplified away versus Luo-Yihong/DGPO scripts/train_sd3_dgpo.py (commit 01ceb4b): no separate long-horizon EMA for
evaluation (`log.eval_state` picks "default" or "old"); the rollout sampler is this library's DPM-Solver++(2M) on
the family's schedule (published: diffusers' DPMSolverMultistepScheduler with Sana's scheduler config, flow_shift 3).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mmrl.config import RunConfig
from mmrl.core.dgpo import dgpo_clip_mask, dgpo_group_weights, dgpo_loss
from mmrl.diffusion import config as dc
from mmrl.diffusion import old_policy
from mmrl.diffusion.common import noise_latents
from mmrl.distributed import DistConfig
from mmrl.run.start import closes_runs
from mmrl.training import KLConfig, UpdateConfig
from mmrl.training.updates import padding_rows, reduce_metrics

__all__ = ["Config", "train"]


@dataclass
class RolloutConfig(dc.GroupRolloutConfig):
    ode_solver: Literal["euler", "dpm2"] = "dpm2"
    """Deterministic sampler of the rollout: `dpm2` (DPM-Solver++(2M), as DGPO) or `euler`."""


@dataclass
class DGPOKLConfig(KLConfig):
    coef: float = 0.02
    """Weight of ||v - v_ref||^2 to the reference (adapters off) (published SD3.5 GenEval/OCR/PickScore: 0.02)."""


@dataclass
class AlgoConfig:
    beta: float = 100.0
    """beta of the group preference (published beta_dpo: 100; 2000-5000 with `ref: old`)."""
    num_train_timesteps: int = 4
    """M: training points per sample and step (published: 4)."""
    trunc_steps: int = 6
    """Points come from the rollout schedule's step indices 0..trunc_steps (published: 6 of 10 steps, 4 for GenEval)."""
    shared_noise: bool = True
    """One noise eps per group and point (published use_shared_noise); false = per sample."""
    clip: bool = True
    """PPO-style clipping of ell against the "old" EMA policy (published clip_dsm)."""
    clip_range: float = 1e-2
    """c of the ratio exp(ell_old - ell) (published: 1e-2 for SD3.5; 1e-3 more stable, slower)."""
    adv_clip_max: float = 5.0
    """Advantages are clipped to [-m, m]."""
    ref: Literal["ref", "old"] = "ref"
    """ell_ref of the group weights: `ref` (adapters off, published default) or `old` (the EMA policy,
    use_ema_ref; with a much larger beta)."""
    train_guidance_scale: float = 1.0
    """Guidance of the trained velocity (published: conditional only)."""
    ref_guidance_scale: float = 1.0
    """Guidance of the reference velocity (published kl_cfg: 1; 4.5 for CFG-free rollouts)."""
    old_rollout_after: int = 0
    """Sample with the EMA "old" policy once this many updates are done (published switch_ema_ref: 200-500);
    0 = always the trained policy."""
    kl: DGPOKLConfig = field(default_factory=DGPOKLConfig)
    """`coef`: weight of ||v - v_ref||^2 to the reference (adapters off); 0 = no reference pass unless `ref: ref`
    (`estimator`, `in_reward` are not used)."""

    def __post_init__(self) -> None:
        if self.num_train_timesteps < 1 or self.trunc_steps < 0 or self.num_train_timesteps > self.trunc_steps + 1:
            raise ValueError(f"algo.num_train_timesteps={self.num_train_timesteps}: expected 1..trunc_steps + 1 "
                             f"(= {self.trunc_steps + 1})")
        if self.beta <= 0 or self.clip_range < 0 or self.adv_clip_max <= 0 or self.old_rollout_after < 0:
            raise ValueError(f"algo: expected beta > 0, clip_range >= 0, adv_clip_max > 0, old_rollout_after >= 0; "
                             f"got {self.beta}, {self.clip_range}, {self.adv_clip_max}, {self.old_rollout_after}")


@dataclass
class RewardConfig(dc.AdvantageRewardConfig):
    drop_zero_advantage: bool = False
    """Skip samples whose advantage is exactly 0 (the published code keeps them; the KL term still applies)."""


@dataclass
class Config(RunConfig):
    algorithm: str = "dgpo"
    """Recipe name."""
    model: dc.ModelConfig = field(default_factory=dc.ModelConfig)
    """Model and adapters."""
    data: dc.DataConfig = field(default_factory=dc.DataConfig)
    """Prompt files."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout sampler (deterministic ODE)."""
    optim: dc.DiffusionOptimConfig = field(default_factory=dc.DiffusionOptimConfig)
    """AdamW and its learning-rate schedule (published: 3e-4 with LoRA)."""
    update: UpdateConfig = field(default_factory=UpdateConfig)
    """Inner epochs, mini-batches (whole groups; published: one update per step), micro-batches (whole groups)."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """DGPO objective, training points, clipping, reference."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rewards and advantages."""
    log: dc.EvalStateLogConfig = field(default_factory=dc.EvalStateLogConfig)
    """Samples, evaluation."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Several processes under torchrun / accelerate launch (strategy none|ddp|fsdp, backend, ...)."""


def _check(cfg: Config) -> None:
    rollout, algo, update = cfg.rollout, cfg.algo, cfg.update
    group = rollout.group_size
    if update.micro_batch_size % group or (update.mini_batch_size and update.mini_batch_size % group):
        raise ValueError(f"update.micro_batch_size={update.micro_batch_size} and update.mini_batch_size="
                         f"{update.mini_batch_size} must be multiples of rollout.group_size={group} (DGPO's weights "
                         f"need whole groups)")
    if algo.trunc_steps >= rollout.num_steps:
        raise ValueError(f"algo.trunc_steps={algo.trunc_steps} must be < rollout.num_steps={rollout.num_steps}")


# ------------------------------------------------------------------------------------------ training


@closes_runs  # the run directory's lock released however train() ends; a failed start leaves nothing
def train(cfg: Config) -> dict:
    from mmrl.diffusion.loop import DiffusionLoop
    from mmrl.diffusion.rollout import ode_sampling
    from mmrl.training import summarise

    dc.check_common(cfg)
    _check(cfg)
    rollout, algo = cfg.rollout, cfg.algo
    cfg.update.updates_per_epoch(rollout.batch)  # update.mini_batch_size must divide the batch: fail before loading
    loop = DiffusionLoop(cfg)
    # "default" trains; "old" = the EMA policy (clipping, ell_ref with ref: old, late rollouts); "ref" = adapters off
    loop.setup(old=True, ref=algo.kl.coef > 0 or algo.ref == "ref", eval_state=cfg.log.eval_state, counters=True)
    loop.begin(postfix=lambda m: {"loss": f"{m.get('policy/loss', 0):.3g}"})
    for step in loop:
        # ---- 1. rollout (this rank's share of the prompts), deterministic ODE; rewards
        late = algo.old_rollout_after and loop.counters.updates >= algo.old_rollout_after
        rollout_state = "old" if late else "default"
        roll = loop.rollout(step, ode_sampling(rollout, ode_solver=rollout.ode_solver), state=rollout_state)
        # ---- 2. per-prompt advantages over all ranks, clipped
        adv, keep = loop.advantages(roll, clip=algo.adv_clip_max)
        # ---- 3. training points (shared step indices; one noise per group and point); 4./5. loss, updates
        with loop.timer("train"):
            traj = roll.traj
            t_index = torch.randperm(algo.trunc_steps + 1)[: algo.num_train_timesteps]
            x0 = traj.latents[:, -1]
            rows = len(roll.prompts) // rollout.group_size if algo.shared_noise else len(traj)
            noise = torch.randn((rows, len(t_index), *x0.shape[1:]), device=x0.device)
            if algo.shared_noise:
                noise = noise[traj.prompt_index.to(x0.device)]
            loop.metrics.update(_train_on_rollout(loop.parts, step, traj, (traj.sigmas[t_index], noise), adv, keep))
            loop.metrics.update(loop.guard.pop_metrics())
        loop.metrics["policy/old_decay"] = old_policy.ema_decay("awm_linear", max(loop.counters.updates - 1, 0))
        loop.metrics["rollout/from_old"] = float(rollout_state == "old")
    return loop.finish(lambda run: summarise(run, "dgpo"))


def _train_on_rollout(parts: Any, step: int, traj: Any, points: tuple, adv: torch.Tensor, keep: torch.Tensor) -> dict:
    """Inner epochs over one rollout batch: the DGPO loss (+ velocity KL) at the M shared points of each sample,
    through the shared update iterator (`TrainingParts.updates`) over whole prompt groups: updates and micro-batches
    are made of whole groups, so each micro-batch computes its own groups' weights; the EMA of "old" follows every
    applied update.

    points = (sigmas [M], noise [B, M, C, h, w])."""
    cfg, ctx, model, states = parts.cfg, parts.ctx, parts.model, parts.states
    rollout, algo = cfg.rollout, cfg.algo
    acc: dict[str, list[float]] = defaultdict(list)
    if ctx.max_int(len(keep)) == 0:
        return {"train/updates": 0}
    sigmas, noise = points
    x0_all, m = traj.latents[:, -1], len(sigmas)
    groups = traj.prompt_index
    ref_state = "ref" if algo.ref == "ref" else "old"

    def update_old() -> None:  # after every applied update
        states.ema("default", "old", old_policy.ema_decay("awm_linear", parts.counters.updates))

    updates = parts.updates(torch.unique(groups[keep]), metrics=acc, step=step, pad_rows=padding_rows(keep),
                           rows_of=lambda units: keep[torch.isin(groups[keep], units)],
                           micro_batch_size=max(1, cfg.update.micro_batch_size // rollout.group_size),
                           on_update=update_old)
    for mb in updates:
        rows = mb.rows
        weight = mb.weight(m)
        x0, emb, a_rows = x0_all[rows], traj.embeds.select(groups[rows]), adv[rows].to(x0_all.device)
        for j in range(m):
            sig = sigmas[j].to(x0.device).expand(len(rows))
            eps = noise[rows, j]
            xt, target = noise_latents(x0, sig, eps), eps - x0
            with mb.no_sync(last_point=j == m - 1), parts.timer("forward_backward"):
                with torch.no_grad():
                    v_ref = v_old = None
                    if algo.kl.coef > 0 or algo.ref == "ref":
                        with states.use("ref"):
                            v_ref = model.velocity(xt, sig, emb, guidance_scale=algo.ref_guidance_scale)
                    if algo.clip or algo.ref == "old":
                        with states.use("old"):
                            v_old = model.velocity(xt, sig, emb, guidance_scale=algo.train_guidance_scale)
                v = model.velocity(xt, sig, emb, guidance_scale=algo.train_guidance_scale)
                dsm = _mse(v, target)
                ref_dsm = _mse(v_ref if ref_state == "ref" else v_old, target)
                w = dgpo_group_weights(a_rows, dsm.detach(), ref_dsm, groups[rows].to(dsm.device), algo.beta,
                                       rollout.group_size)
                clipped = dgpo_clip_mask(a_rows, dsm, _mse(v_old, target), algo.clip_range) if algo.clip else None
                pg = dgpo_loss(a_rows, dsm, w, clipped)
                loss = pg
                if algo.kl.coef > 0:
                    kl = _mse(v, v_ref.detach()).mean()
                    loss = loss + algo.kl.coef * kl
                    if mb.real:
                        acc["kl/ref"].append(kl.item())
                (loss * weight).backward()
            if mb.real:
                acc["policy/loss"].append(loss.item())
                acc["policy/dgpo_loss"].append(pg.item())
                acc["policy/dsm_loss"].append(dsm.mean().item())
                acc["policy/group_weight"].append(w.mean().item())
                if clipped is not None:
                    acc["policy/clipfrac"].append(clipped.float().mean().item())
    out = reduce_metrics(ctx, acc)  # every rank's micro-step values
    out["train/updates"] = updates.applied
    return out


def _mse(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample mean squared error [b] over all non-batch dimensions, in float32."""
    err = (v.float() - target.float()).pow(2)
    return err.mean(dim=tuple(range(1, err.dim())))
