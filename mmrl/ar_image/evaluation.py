"""What a janus_grpo run shows while it trains: sample grids and a held-out evaluation.

Both sample with their own `torch.Generator` seeded from the run's seed, so every grid and every evaluation of a run
starts from the same random stream (grids of different steps show one policy changing) and the training rollouts'
stream (the global generator) is never touched: a run with grids and evaluations trains exactly as one without.
Their forwards are left out of the FLOPs meter (`not_counted`), as the diffusion recipes' grids are.

* `samples/step_<N>.png` (`log.sample_every`: at step 0, the starting policy, every N steps and at the last step):
  one image per grid prompt (the first `log.num_samples` of `data.eval_prompts`, else of the training prompts),
  captioned "reward <r> | <prompt>".
* held-out evaluation (`log.eval_every` with `data.eval_prompts`: at step 0, every N steps and at the last step):
  `log.eval_images` images of each of the first `log.eval_max_prompts` prompts; metrics `eval/reward/mean`,
  `eval/reward/std` (over all images) and `eval/reward/prompt_std` (of the per-prompt means), and
  `samples/eval_step_<N>.png` with the first image of each prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from mmrl.perf.meter import not_counted
from mmrl.training.config import TrackersConfig

__all__ = ["JanusLogConfig", "JanusMonitor"]

EVAL_SEED_OFFSET = 1_000_003  # the evaluation's stream differs from the grids' (same run seed)


@dataclass
class JanusLogConfig(TrackersConfig):
    sample_every: int = 10
    """Save samples/step_<N>.png at step 0, every this many steps and at the last step (0 = never): one image per grid
    prompt from the same random stream every time, captioned with its reward and prompt."""
    num_samples: int = 8
    """Images in each sample grid (one per prompt: the first eval prompts, else training prompts)."""
    eval_every: int = 0
    """Held-out evaluation on data.eval_prompts at step 0, every this many steps and at the end (0 = never)."""
    eval_images: int = 4
    """Images per held-out prompt."""
    eval_max_prompts: int = 64
    """At most this many held-out prompts."""

    def __post_init__(self) -> None:
        for key in ("sample_every", "eval_every"):
            if getattr(self, key) < 0:
                raise ValueError(f"log.{key}: expected >= 0, got {getattr(self, key)}")
        for key in ("num_samples", "eval_images", "eval_max_prompts"):
            if getattr(self, key) < 1:
                raise ValueError(f"log.{key}: expected >= 1, got {getattr(self, key)}")


def _due(every: int, step: int, last: int) -> bool:
    return bool(every) and (step % every == 0 or step == last)


class JanusMonitor:
    """Sample grids and held-out evaluation of one run (module docstring). `reward_fn(images, prompts, metadata)`
    is the run's reward (`mmrl.rewards.load`); `items` the loaded prompt items (`.prompt`, `.metadata`); `cot` the
    run's `SemanticCoT` (`rollout.semantic_cot`: each image after its sampled chain-of-thought, as in training)."""

    def __init__(self, policy: Any, reward_fn: Callable, log: JanusLogConfig, seed: int, last_step: int,
                 eval_items: Sequence[Any], train_items: Sequence[Any], cot: Any = None):
        self.policy, self.reward_fn, self.log, self.seed, self.last = policy, reward_fn, log, seed, last_step
        self.cot = cot
        self.eval_items = list(eval_items)[: log.eval_max_prompts]
        self.grid_items = list(eval_items or train_items)[: log.num_samples]

    def _images(self, items: Sequence[Any], n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(images [len(items) * n, 3, H, W], rewards [len(items) * n]) of `n` images per prompt, one stream."""
        gen = torch.Generator(device=next(self.policy.model.parameters()).device).manual_seed(seed)
        images, scores = [], []
        with torch.no_grad(), not_counted():
            for it in items:
                if self.cot is None:
                    tokens, _ = self.policy.sample(self.policy.image_prompt_ids(it.prompt), n, generator=gen)
                else:
                    tokens = self.cot.rollout(it.prompt, n, generator=gen).tokens
                imgs = self.policy.decode(tokens)
                meta = [it.metadata] * n if it.metadata else None
                scores.append(self.reward_fn(imgs, [it.prompt] * n, meta).scores.float().cpu())
                images.append(imgs.cpu())
        return torch.cat(images), torch.cat(scores)

    def grid_due(self, step: int) -> bool:
        return bool(self.grid_items) and _due(self.log.sample_every, step, self.last)

    def eval_due(self, step: int) -> bool:
        return bool(self.eval_items) and _due(self.log.eval_every, step, self.last)

    def grid(self, step: int, run: Any) -> None:
        """samples/step_<N>.png: one image per grid prompt, from the grids' own stream."""
        images, scores = self._images(self.grid_items, 1, self.seed)
        caps = [f"reward {s:.3g} | {it.prompt}" for s, it in zip(scores.tolist(), self.grid_items)]
        run.save_samples(step, images, caps)

    def evaluate(self, step: int, run: Any) -> dict[str, float]:
        """The held-out metrics and samples/eval_step_<N>.png (the first image of each prompt)."""
        n = self.log.eval_images
        images, scores = self._images(self.eval_items, n, self.seed + EVAL_SEED_OFFSET)
        per_prompt = scores.view(len(self.eval_items), n).mean(1)
        caps = [f"reward {float(per_prompt[i]):.3g} (mean of {n}) | {it.prompt}" for i, it in enumerate(self.eval_items)]
        run.save_samples(step, images[::n], caps, name=f"eval_step_{step:06d}.png")
        return {"eval/reward/mean": float(scores.mean()),
                "eval/reward/std": float(scores.std()) if scores.numel() > 1 else 0.0,
                "eval/reward/prompt_std": float(per_prompt.std()) if len(per_prompt) > 1 else 0.0}
