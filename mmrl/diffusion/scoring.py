"""Rewards and advantages of a diffusion rollout batch, over one process or several.

- `load_reward_fn(components, device)` + `score_images(...)`: the zoo reward of a config and its metrics.
- `score_rollout(ctx, ...)`: `score_images` on this rank's images, metrics averaged over ranks.
- `global_advantages(ctx, tracker, ...)`: per-prompt advantages (`mmrl.core.prompt_stats`) over every rank's
  rewards, this rank's rows kept (Flow-GRPO, DiffusionNFT, AWM); with several reward components,
  `reward.aggregation` chooses sum-then-normalise or per-reward normalisation (GDPO, `mmrl.core.multi_reward`).
- `score_rollout_components(...)`: `score_rollout` plus every component's raw scores [b, K] (for that choice).
"""

from __future__ import annotations

from typing import Any

import torch

from mmrl.training import NONFINITE_KEY, finite_stats, group_keep

Tensor = torch.Tensor

__all__ = ["load_reward_fn", "score_images", "score_rollout", "reduce_reward_metrics", "score_rollout_components",
           "component_scores", "reward_weights", "global_advantages", "AsyncRewardScorer"]


def load_reward_fn(components: dict[str, Any], device: Any, num_frames: int = 1):
    """`mmrl.rewards.load(mapping)` with a clear error for an empty or unknown component, and for a component that
    cannot score what the rollout makes: images (`num_frames` 1) or videos [B, F, 3, H, W] (`num_frames` > 1)."""
    from mmrl import rewards

    if not components:
        raise ValueError(f"reward.components is empty; give name -> weight, e.g. {{jpeg_compressibility: 1.0}}; "
                         f"available: {rewards.available()}")
    for key, value in components.items():
        name = value.get("reward", key) if isinstance(value, dict) else key
        if name not in rewards.available():
            raise ValueError(f"reward.components: unknown reward '{name}'; available: {rewards.available()}")
    fn = rewards.load(dict(components), device=str(device))
    for key, kind in getattr(fn, "kinds", {}).items():
        if num_frames > 1 and kind == "image":
            raise ValueError(f"reward.components.{key} scores images, but rollout.num_frames={num_frames} makes videos;"
                             f" score them per frame: {key}: {{reward: video_frames, image_reward: {key}, "
                             f"aggregate: mean}} (or min, or frame)")
        if num_frames > 1 and kind == "latent":
            raise ValueError(f"reward.components.{key} scores an image family's latents, but rollout.num_frames="
                             f"{num_frames} makes videos; use a video reward")
        if num_frames == 1 and kind == "video":
            raise ValueError(f"reward.components.{key} scores videos, but rollout.num_frames=1 makes images "
                             f"(set rollout.num_frames to 4k+1 > 1 for a video model, or use an image reward)")
    return fn


def policy_latent_space(model_path: Any = None, model: Any = None) -> Any:
    """The `LatentSpace` (mmrl.rewards.latent) of a policy: family and VAE latent channels of the loaded FlowModel
    `model`, or of the pipeline directory `model_path` read from its model_index.json and vae/config.json without
    loading weights; None when unknown (a directory not there yet: the model load names the problem)."""
    import json
    from pathlib import Path

    from mmrl.rewards.latent import LatentSpace

    if model is not None:
        family, vae = model.family, dict(model.vae.config)
    else:
        from mmrl.diffusion.models import flow_model_class

        path = Path(model_path)
        try:
            vae = json.loads((path / "vae" / "config.json").read_text())
        except (OSError, ValueError):
            return None
        if not (path / "model_index.json").is_file():
            return None
        family = flow_model_class(path).family
    channels = vae.get("latent_channels", vae.get("z_dim"))
    return None if channels is None else LatentSpace(family, int(channels))


class AsyncRewardScorer:
    """Scores rollout micro-batches in a worker thread while the next micro-batch is sampled (as flow_grpo and
    ddpo submit the reward to an executor per sampling batch); `output()` joins the chunks, in order, into what one
    call on the whole batch returns: identical for rewards that score each sample on its own (every zoo reward;
    a composite with `normalize: batch` is refused)."""

    def __init__(self, reward_fn: Any, workers: int = 1):
        from concurrent.futures import ThreadPoolExecutor

        from mmrl.rewards.group import is_group_reward

        if getattr(reward_fn, "normalize", "none") != "none":
            raise ValueError("reward.score_while_sampling needs per-sample rewards; a composite with normalize: batch "
                             "scores the whole batch together (set reward.score_while_sampling=false)")
        if is_group_reward(reward_fn):
            raise ValueError("reward.score_while_sampling needs per-sample rewards; a group reward (group_rank, "
                             "pickscore_rank, pairwise_winrate) scores each image against its whole group, which a "
                             "rollout micro-batch can split (set reward.score_while_sampling=false)")
        self.reward_fn, self.pool, self.futures = reward_fn, ThreadPoolExecutor(max_workers=workers), []

    def submit(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> None:
        self.futures.append(self.pool.submit(self.reward_fn, images=images, prompts=prompts, metadata=metadata))

    def output(self) -> Any:
        """The chunks' RewardOutputs joined: scores and tensor details concatenated, list details extended."""
        outs, self.futures = [f.result() for f in self.futures], []
        details: dict[str, Any] = {}
        for key in outs[0].details:
            vals = [o.details[key] for o in outs]
            if all(isinstance(v, Tensor) for v in vals):
                details[key] = torch.cat([v.reshape(-1) if v.dim() == 0 else v for v in vals])
            elif all(isinstance(v, (list, tuple)) for v in vals):
                details[key] = [x for v in vals for x in v]
            else:
                details[key] = vals
        return type(outs[0])(scores=torch.cat([o.scores for o in outs]), details=details)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def score_images(reward_fn: Any, images: Tensor, prompts: list[str], metadata: list[dict],
                 prefix: str = "reward/", on_nonfinite: str = "error", out: Any = None) -> tuple[Tensor, dict[str, float]]:
    """scores[B] (float, cpu) and metrics: `<prefix>mean`, `<prefix>std` and one mean per component.

    Every score is validated (`mmrl.training.check_rewards`): a NaN/inf score raises naming the reward component
    and the prompt (`on_nonfinite="error"`), or (`"drop_sample"`) stays in `scores` as the mark of a dropped sample
    (the recipes test `torch.isfinite`) while the metrics cover the finite ones and count the others in
    `reward/nonfinite_samples`."""
    from mmrl.training import check_rewards

    out = reward_fn(images=images, prompts=prompts, metadata=metadata) if out is None else out  # (already scored)
    scores = out.scores.detach().float().cpu()
    components = list(getattr(reward_fn, "components", {}))
    keep, metrics = check_rewards(scores, out.details, on_nonfinite, reward=getattr(reward_fn, "name", "reward"),
                                  components=components, labels=[f"prompt {p!r}" for p in prompts or []])
    metrics.update(finite_stats(scores, prefix))
    for name in components:
        v = torch.as_tensor(out.details[name]).float().cpu()
        metrics[f"{prefix}{name}"] = (v[keep] if v.shape == keep.shape else v).mean().item()
    return scores, metrics


def score_rollout(ctx: Any, reward_fn: Any, images: Tensor, prompts: list[str], metadata: list[dict],
                  on_nonfinite: str = "error", out: Any = None) -> tuple[Tensor, dict[str, float]]:
    """`score_images` of this rank's samples (`out`: their RewardOutput if already scored, e.g. by
    `AsyncRewardScorer`); several ranks (equal sample counts): every metric is the mean of the ranks' means (the
    batch mean), `reward/nonfinite_samples` the sum."""
    scores, metrics = score_images(reward_fn, images, prompts, metadata, on_nonfinite=on_nonfinite, out=out)
    return scores, reduce_reward_metrics(ctx, metrics)


def reduce_reward_metrics(ctx: Any, metrics: dict[str, float]) -> dict[str, float]:
    """This rank's `score_images` metrics -> the batch's (equal sample counts per rank): every metric the mean of
    the ranks' means, `reward/nonfinite_samples` the sum. One process: unchanged."""
    if not ctx.enabled:
        return metrics
    return {k: int(ctx.all_reduce_sum(v)) if k == NONFINITE_KEY else float(ctx.all_reduce_mean(v))
            for k, v in metrics.items()}


def component_scores(reward_fn: Any, out: Any) -> Tensor:
    """Raw scores [b, K] of every component of a composite reward (columns in `reward_fn.components` order), from
    its output `out`; a single reward gives its scores as one column."""
    names = list(getattr(reward_fn, "components", {}))
    if not names:
        return out.scores.detach().float().cpu()[:, None]
    return torch.stack([torch.as_tensor(out.details[n]).detach().float().cpu().reshape(-1) for n in names], dim=1)


def reward_weights(reward_fn: Any) -> list[float]:
    """The weights of `component_scores`' columns ([1.0] for a single reward)."""
    names = list(getattr(reward_fn, "components", {}))
    return [float(reward_fn.weights[n]) for n in names] if names else [1.0]


def score_rollout_components(ctx: Any, reward_fn: Any, images: Tensor, prompts: list[str], metadata: list[dict],
                             on_nonfinite: str = "error", out: Any = None) -> tuple[Tensor, dict[str, float], Tensor]:
    """`score_rollout` plus `component_scores` of the same single scoring call: (scores[b], metrics, comps[b, K])."""
    out = reward_fn(images=images, prompts=prompts, metadata=metadata) if out is None else out
    scores, metrics = score_rollout(ctx, reward_fn, images, prompts, metadata, on_nonfinite, out=out)
    return scores, metrics, component_scores(reward_fn, out)


def global_advantages(ctx: Any, tracker: Any, prompts: list[str], scores: Tensor, adv_clip_max: float,
                      drop_zero_advantage: bool, reward_norm: Any = None, components: Tensor | None = None,
                      weights: Any = None, aggregation: str = "sum_then_normalise") -> tuple[Tensor, Tensor, dict]:
    """(advantages of this rank's samples [b], indices of the samples to train on, metrics).

    Rewards and prompts of every rank are all-gathered (rank order), the tracker (`PerPromptStatTracker`)
    normalises per prompt over that global batch (a prompt's group may even span ranks), and each rank keeps its
    own rows. Every rank updates its tracker with the same global batch, so the tracker state is identical
    everywhere (rank 0's checkpoint is everyone's). One process: exactly `tracker.update(prompts, scores)`.
    Non-finite scores mark samples dropped by `reward.on_nonfinite: drop_sample`: they are never kept, and neither
    are the samples of a prompt left with fewer than 2 finite rewards (no relative signal).
    `reward_norm` (a `RunningRewardNorm`, reward.running_norm): updated with the global batch's finite rewards, then
    the rewards are normalised before the tracker sees them (metrics `reward/running_*`; `reward/mean` stays raw).
    `aggregation="normalise_then_sum"` (GDPO): `components` [b, K] (this rank's, `component_scores`) are each
    normalised per prompt by the tracker (history 0: it keeps no state), summed with `weights` and batch-whitened
    (`mmrl.core.multi_reward`); `sum_then_normalise` (default) normalises the weighted sum `scores`."""
    all_prompts = [p for part in ctx.all_gather_object(list(prompts)) for p in part]
    all_scores = ctx.all_gather_tensor(scores)
    sizes = list(ctx.last_gather_sizes)
    if aggregation == "sum_then_normalise":
        normed = all_scores if reward_norm is None else reward_norm(all_scores)  # update, then normalise (vlm_grpo)
        adv_all = tracker.update(all_prompts, normed)
    else:
        from mmrl.core.multi_reward import multi_reward_advantages

        if components is None or reward_norm is not None or getattr(tracker, "history", None) is not None:
            raise ValueError("reward.aggregation=normalise_then_sum needs the reward components and neither "
                             "reward.running_norm nor reward.history")
        all_comps = ctx.all_gather_tensor(components)
        adv_all = multi_reward_advantages(all_comps, weights, lambda r: tracker.update(all_prompts, r), aggregation,
                                          mask=torch.isfinite(all_scores)).float()
    adv_all = adv_all.clamp(-adv_clip_max, adv_clip_max)
    adv = ctx.local_slice(adv_all, sizes)
    prompt_ids = {p: i for i, p in enumerate(dict.fromkeys(all_prompts))}
    groups = torch.tensor([prompt_ids[p] for p in all_prompts])
    usable = ctx.local_slice(group_keep(torch.isfinite(all_scores), groups), sizes)
    keep = (usable & (adv != 0) if drop_zero_advantage else usable).nonzero().flatten()
    n_keep = int(ctx.all_reduce_sum(len(keep)))
    metrics = {"train/kept_fraction": n_keep / len(adv_all), "policy/advantage_abs": adv_all.abs().mean().item()}
    if ctx.enabled:  # the whole batch's reward statistics (score_images gave this rank's)
        metrics.update(finite_stats(all_scores))
    if reward_norm is not None:
        metrics.update(reward_norm.metrics())
    return adv, keep, metrics
