"""Flow-GRPO's rollout step, in the trainer process or in a rollout process (`rollout.worker: process`,
`mmrl.training.async_rollout`).

`rollout_and_score(...)` is one step's rollout: this rank's share of the prompts, their embeddings (encoded once per
prompt), G SDE samples per prompt (`sample_groups`), their rewards (`score_images`, and each reward component's raw
scores for `reward.aggregation`; with reward.async_scoring the micro-batches are scored while the next is sampled)
and the samples' statistics (`diag/sample/*`). The synchronous recipe calls it in its loop; the rollout
process's `FlowGRPOProducer` builds its own copy of the pipeline and policy from the run's config and calls the same
function, so both make the same batch from the same weights and random stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmrl.diffusion.sampling import Trajectory, sample_groups

BUILDER = "mmrl.diffusion.rollout_worker:FlowGRPOProducer"

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
    """`diag/sample/*` of this rank's samples (`sample_statistics`), `rollout/num_steps` and (with an SDE window)
    `rollout/window_start`."""
    transformer_evals: int = 0
    """Transformer evaluations made by a rollout process (added to the trainer's `cost/transformer_evals`)."""


def rollout_kwargs(s: Any, a: Any) -> dict[str, Any]:
    """`sample_groups` keyword arguments of a Flow-GRPO `rollout:` and `algo:` section."""
    return dict(num_steps=s.num_steps, height=s.height, width=s.width, guidance_scale=s.guidance_scale,
                noise_level=s.noise_level, sde_type=s.sde_type, window_size=s.window_size,
                window_range=tuple(s.window_range) if s.window_range else None,
                timestep_fraction=s.timestep_fraction, same_noise=s.same_noise,
                batch_size=s.micro_batch_size or None,
                autocast_dtype=torch.bfloat16 if s.precision == "bf16" else None,
                ode_solver=s.ode_solver, ode_compress=s.ode_compress,
                record_means=a.ratio_norm == "grpo_guard" and a.old_logprobs == "rollout")


def window_range(s: Any) -> tuple[int, int]:
    """[lo, hi) the progressive window moves in: rollout.window_range, or all steps."""
    lo, hi = s.window_range if s.window_range else (0, s.num_steps)
    return lo, min(hi, s.num_steps)


def window_generator(cfg: Any, world: int, step: int) -> torch.Generator | None:
    """Several ranks: the generator of the step's SDE-window position, identical on every rank; one rank: None."""
    from mmrl.distributed import rank_seed

    return torch.Generator().manual_seed(rank_seed(cfg.seed, WINDOW_RANK, step)) if world > 1 else None


def rollout_and_score(cfg: Any, model: Any, encode: Any, sampler: Any, shards: Any, reward_fn: Any, scorer: Any,
                      timer: Any, step: int, window_gen: torch.Generator | None = None) -> FlowRollout:
    """Rollout and rewards of one step (module docstring). `shards`: a `DistContext` (its `shard` picks this rank's
    prompts); `scorer`: an `AsyncRewardScorer` or None."""
    from mmrl.diffusion.conditioning import encode_items
    from mmrl.diffusion.diagnostics import sample_statistics
    from mmrl.diffusion.mixgrpo import progressive_window
    from mmrl.diffusion.scoring import component_scores, score_images

    s = cfg.rollout
    with timer("rollout"):
        items = shards.shard(sampler.next(s.prompts_per_step))
        embeds = encode_items(model, items, s.height, s.width, encode)  # + source images (edit models)
        rows = [i for i in range(len(items)) for _ in range(s.group_size)]  # sample -> prompt (traj order)
        prompts, metadata = [items[i].prompt for i in rows], [items[i].metadata for i in rows]
        on_images = (lambda lo, hi, im: scorer.submit(im, prompts[lo:hi], metadata[lo:hi])) if scorer else None
        window = progressive_window(step, s.window_size, s.window_move_every, s.window_move_by,
                                    *window_range(s)) if s.window_schedule == "progressive" else None
        traj = sample_groups(model, embeds, s.group_size, window_generator=window_gen, on_images=on_images,
                             window=window, **rollout_kwargs(s, cfg.algo))
        step_metrics = {"rollout/num_steps": len(traj.sigmas) - 1}
        if s.window_size:
            sde = traj.sde_mask.nonzero()  # (not train_steps: CPS leaves its last step out of those)
            step_metrics["rollout/window_start"] = int(sde[0]) if len(sde) else -1
    with timer("reward"):
        out = scorer.output() if scorer else reward_fn(images=traj.images, prompts=prompts, metadata=metadata)
        scores, reward_metrics = score_images(reward_fn, traj.images, prompts, metadata,
                                              on_nonfinite=cfg.reward.on_nonfinite, out=out)
    return FlowRollout(traj, prompts, metadata, scores, reward_metrics, component_scores(reward_fn, out),
                       {**step_metrics, **sample_statistics(traj.images, traj.latents[:, -1])})


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

        s = cfg.rollout
        self.cfg, self.shards = cfg, DistContext(rank=rank, world_size=world)
        dev = torch.device(device)
        self.model = load_recipe_model(cfg, dev, resolve_dtype(cfg.dtype))
        self.states = build_policy_states(self.model, cfg.model, old=False, ref=False)
        self.evals = TransformerEvalCounter(self.model.transformer)
        self.flops_model = self.states.model  # its forwards join the trainer's perf/tflops_per_step
        items = load_prompts(cfg.data.train_prompts)
        n_distinct = len({it.prompt for it in items})
        self.encode = PromptEmbedCache(self.model, n_distinct) if 0 < n_distinct <= s.prompt_cache_size \
            else self.model.encode_prompts
        self.data = PromptSampler(items, seed=cfg.seed)
        self.reward_fn = load_reward_fn(cfg.reward.components, dev, s.num_frames)
        self.scorer = AsyncRewardScorer(self.reward_fn) if cfg.reward.async_scoring else None

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
        roll = rollout_and_score(self.cfg, self.model, self.encode, self.data, self.shards, self.reward_fn,
                                 self.scorer, timer, step, window_generator(self.cfg, self.shards.world_size, step))
        roll.transformer_evals = self.evals.count - before
        return roll, timer.pop()
