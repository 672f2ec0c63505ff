"""One diffusion rollout, in the trainer process or in a rollout process (`rollout.worker: process`,
`mmrl.training.async_rollout`), for every diffusion recipe.

`rollout_and_score(...)` is one step's rollout: this rank's share of the prompts, their embeddings (encoded once per
prompt; edit rows with their source images), G samples per prompt (`sample_groups` with the recipe's settings:
`sde_sampling` for Flow-GRPO's SDE with its window, `ode_sampling` for the deterministic ODE of DiffusionNFT, AWM,
DGPO and online DPO), their rewards (`score_images`, and each reward component's raw scores for
`reward.aggregation`; with reward.score_while_sampling the micro-batches are scored while the next is sampled) and
the samples' statistics (`diag/sample/*`). A latent reward (`mmrl.rewards.latent`) gets the final latents; when
every component scores latents the images are not decoded (`traj.images` is None, `diag/sample/*` then holds only
`latent_rms`). An audio reward (`mmrl.rewards.audio`) gets the decoded sound of an audio-video family (LTX-2), which
is decoded only then (`traj.audio`). The recipes call it through `DiffusionLoop.rollout`; the rollout
process's `FlowGRPOProducer` builds its own copy of the pipeline and policy from the run's config and calls the same
function, so both make the same batch from the same weights and random stream.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch

from mmrl.diffusion.sampling import Trajectory, sample_groups

BUILDER = "mmrl.diffusion.rollout:FlowGRPOProducer"

# the SDE-window position must be the same on every rank (same trained steps -> same micro-step count); it is
# drawn from a generator seeded by (seed, step) and this rank id, which no real process has
WINDOW_RANK = 1_000_002


@dataclass
class FlowRollout:
    """One step's rollout on this rank: the trajectories, each sample's prompt and metadata, its reward (NaN/inf
    marks a sample dropped by reward.on_nonfinite: drop_sample) and this rank's reward metrics (`score_images`)."""

    traj: Trajectory
    prompts: list[str]
    metadata: list[dict]
    scores: torch.Tensor
    reward_metrics: dict[str, float]
    components: torch.Tensor
    """Raw scores [b, K] of the reward's components (`component_scores`)."""
    sample_metrics: dict[str, float]
    """`diag/sample/*` of this rank's samples (`sample_statistics`) and the recipe's rollout metrics (Flow-GRPO:
    `rollout/num_steps` and, with an SDE window, `rollout/window_start`)."""
    transformer_evals: int = 0
    """Transformer evaluations made by a rollout process (added to the trainer's `cost/transformer_evals`)."""


def ode_sampling(rollout: Any, **extra: Any) -> dict[str, Any]:
    """`sample_groups` settings of a deterministic (ODE) rollout from a `rollout:` section; `extra` adds or
    replaces settings (DGPO's `ode_solver`, online DPO's `noise_level`)."""
    return {"num_steps": rollout.num_steps, "height": rollout.height, "width": rollout.width,
            "guidance_scale": rollout.guidance_scale, "noise_level": 0.0,
            "batch_size": rollout.micro_batch_size or None, **extra}


def sde_sampling(cfg: Any, step: int, world: int) -> dict[str, Any]:
    """`sample_groups` settings of Flow-GRPO's SDE rollout at `step` (its `rollout:` and `algo:` sections): the
    SDE (`sde_type`, `noise_level`), its window (random per step, identical on every rank; or MixGRPO's progressive
    window), the ODE solver after it, bf16 sampling and GRPO-Guard's recorded step means."""
    from mmrl.diffusion.mixgrpo import progressive_window

    rollout, algo = cfg.rollout, cfg.algo
    window = progressive_window(step, rollout.window_size, rollout.window_move_every, rollout.window_move_by,
                                *window_range(rollout)) if rollout.window_schedule == "progressive" else None
    return dict(num_steps=rollout.num_steps, height=rollout.height, width=rollout.width,
                guidance_scale=rollout.guidance_scale, noise_level=rollout.noise_level, sde_type=rollout.sde_type,
                window_size=rollout.window_size,
                window_range=tuple(rollout.window_range) if rollout.window_range else None,
                timestep_fraction=rollout.timestep_fraction, same_noise=rollout.same_noise,
                batch_size=rollout.micro_batch_size or None,
                autocast_dtype=torch.bfloat16 if rollout.precision == "bf16" else None,
                ode_solver=rollout.ode_solver, ode_compress=rollout.ode_compress,
                record_means=algo.ratio_norm == "grpo_guard" and algo.old_logprobs == "rollout",
                window_generator=window_generator(cfg, world, step), window=window)


def sde_step_metrics(rollout: Any) -> Callable[[Trajectory], dict]:
    """Flow-GRPO's rollout metrics of a trajectory: `rollout/num_steps` and, with an SDE window, its start."""

    def metrics(traj: Trajectory) -> dict:
        out = {"rollout/num_steps": len(traj.sigmas) - 1}
        if rollout.window_size:
            sde = traj.sde_mask.nonzero()  # (not train_steps: CPS leaves its last step out of those)
            out["rollout/window_start"] = int(sde[0]) if len(sde) else -1
        return out

    return metrics


def window_range(rollout: Any) -> tuple[int, int]:
    """[lo, hi) the SDE window moves in: rollout.window_range, or all steps."""
    lo, hi = rollout.window_range if rollout.window_range else (0, rollout.num_steps)
    return lo, min(hi, rollout.num_steps)


def window_generator(cfg: Any, world: int, step: int) -> torch.Generator | None:
    """Several ranks: the generator of the step's SDE-window position, identical on every rank; one rank: None."""
    from mmrl.distributed import rank_seed

    return torch.Generator().manual_seed(rank_seed(cfg.seed, WINDOW_RANK, step)) if world > 1 else None


def rollout_and_score(cfg: Any, model: Any, sampler: Any, shards: Any, reward_fn: Any, timer: Any, *,
                      sampling: dict[str, Any], states: Any = None, state: str | None = None, encode: Any = None,
                      scorer: Any = None, step_metrics: Callable[[Trajectory], dict] | None = None) -> FlowRollout:
    """Rollout and rewards of one step (module docstring). `shards`: a `DistContext` (its `shard` picks this rank's
    prompts); `sampling`: `sample_groups` keyword arguments (`ode_sampling` / `sde_sampling`); `state`: the policy
    state that samples (None: the active one); `encode`: the prompt encoder (a `PromptEmbedCache`; default the
    model's); `scorer`: an `AsyncRewardScorer` or None; `step_metrics(traj)`: the recipe's rollout metrics."""
    from mmrl.diffusion.conditioning import encode_items
    from mmrl.diffusion.diagnostics import sample_statistics
    from mmrl.diffusion.scoring import component_scores, score_images
    from mmrl.rewards.audio import takes_audio
    from mmrl.rewards.latent import needs_pixels, takes_latents

    rollout = cfg.rollout
    # a reward scoring latents gets the final latents; when no component needs pixels the VAE decode is skipped.
    # A reward scoring sound gets the waveforms, decoded for it only. Both are scored after sampling (the
    # micro-batch callback hands over images only)
    latent, audio, decode = takes_latents(reward_fn), takes_audio(reward_fn), needs_pixels(reward_fn)
    scorer = None if latent or audio else scorer
    if audio:
        sampling = {**sampling, "decode_audio": True}
    with timer("rollout"):
        items = shards.shard(sampler.next(rollout.prompts_per_step))
        embeds = encode_items(model, items, rollout.height, rollout.width, encode)  # + source images (edit models)
        rows = [i for i in range(len(items)) for _ in range(rollout.group_size)]  # sample -> prompt (traj order)
        prompts, metadata = [items[i].prompt for i in rows], [items[i].metadata for i in rows]
        on_images = (lambda lo, hi, im: scorer.submit(im, prompts[lo:hi], metadata[lo:hi])) if scorer else None
        with states.use(state) if state is not None else nullcontext():
            traj = sample_groups(model, embeds, rollout.group_size, on_images=on_images,
                                 **(sampling if decode else {**sampling, "decode": False}))
        extra = step_metrics(traj) if step_metrics is not None else {}
    with timer("reward"):
        kw = {"latents": traj.latents[:, -1]} if latent else {}
        if audio:
            kw.update(audio=traj.audio, sample_rate=model.audio_sample_rate)
        out = scorer.output() if scorer else reward_fn(images=traj.images, prompts=prompts, metadata=metadata, **kw)
        scores, reward_metrics = score_images(reward_fn, traj.images, prompts, metadata,
                                              on_nonfinite=cfg.reward.on_nonfinite, out=out)
    return FlowRollout(traj, prompts, metadata, scores, reward_metrics, component_scores(reward_fn, out),
                       {**extra, **sample_statistics(traj.images, traj.latents[:, -1])})


class FlowGRPOProducer:
    """Built in the rollout process as ``FlowGRPOProducer(cfg, rank, world, device)``: the pipeline, the "default"
    policy state (LoRA or full weights, replaced by every push), the prompt stream and the reward."""

    def __init__(self, cfg: Any, rank: int, world: int, device: str):
        from mmrl.diffusion.common import TransformerEvalCounter, build_policy_states, load_recipe_model
        from mmrl.diffusion.models import PromptEmbedCache
        from mmrl.diffusion.scoring import AsyncRewardScorer, load_reward_fn
        from mmrl.distributed import DistContext
        from mmrl.pipelines.data import PromptSampler, load_prompts
        from mmrl.runtime import resolve_dtype

        rollout = cfg.rollout
        self.cfg, self.shards = cfg, DistContext(rank=rank, world_size=world)
        dev = torch.device(device)
        self.model = load_recipe_model(cfg, dev, resolve_dtype(cfg.dtype))
        self.states = build_policy_states(self.model, cfg.model, old=False, ref=False)
        self.evals = TransformerEvalCounter(self.model.transformer)
        self.flops_model = self.states.model  # its forwards join the trainer's perf/tflops_per_step
        items = load_prompts(cfg.data.train_prompts)
        n_distinct = len({it.prompt for it in items})
        self.encode = PromptEmbedCache(self.model, n_distinct) if 0 < n_distinct <= rollout.prompt_cache_size \
            else self.model.encode_prompts
        self.data = PromptSampler(items, seed=cfg.seed)
        self.reward_fn = load_reward_fn(cfg.reward.components, dev, rollout.num_frames)
        self.scorer = AsyncRewardScorer(self.reward_fn) if cfg.reward.score_while_sampling else None

    def load_weights(self, tensors: dict) -> None:
        from mmrl.training.async_rollout import load_policy_weights

        load_policy_weights(self.states, tensors)

    def state_dict(self) -> dict:
        return {"data": self.data.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.data.load_state_dict(state["data"])

    def produce(self, step: int) -> tuple[FlowRollout, dict]:
        from mmrl.runtime import Timer

        timer, before = Timer(), self.evals.count
        roll = rollout_and_score(self.cfg, self.model, self.data, self.shards, self.reward_fn, timer,
                                 sampling=sde_sampling(self.cfg, step, self.shards.world_size), encode=self.encode,
                                 scorer=self.scorer, step_metrics=sde_step_metrics(self.cfg.rollout))
        roll.transformer_evals = self.evals.count - before
        return roll, timer.pop()
