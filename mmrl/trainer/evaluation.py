"""`Trainer.evaluate()`: the recipe family's held-out evaluation of the run's newest checkpoint (the base model
before any), on files the trainer wrote, returning `eval/*` metrics named as the training rows name them.

- diffusion: `mmrl.eval.run_eval` (what `mmrl eval` runs: ODE samples of every prompt, every reward component, the
  shapes check; its report and grid under `<output_dir>/eval/`): `eval/reward/mean`, `eval/reward/std`,
  `eval/reward/<component>`, `eval/shapes/<check>` (prompts of the shapes grammar only);
- vlm_grpo: the recipe's greedy evaluation (`mmrl.vlm.rollout_collect.evaluate`) of the checkpoint's policy state:
  `eval/accuracy` (and `eval/accuracy/<kind>`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmrl.config import ConfigError


def newest_checkpoint(output_dir: str | Path) -> Path | None:
    from mmrl.run.files import list_checkpoints

    found = list_checkpoints(Path(output_dir) / "checkpoints") if (Path(output_dir) / "checkpoints").is_dir() else []
    return found[-1][1] if found else None


def evaluate_diffusion(cfg: Any, prompts: str) -> dict[str, float]:
    from mmrl.eval import run_eval

    checkpoint = newest_checkpoint(cfg.output_dir)
    report = run_eval(cfg, checkpoint, prompts=prompts, batch_size=max(1, cfg.update.micro_batch_size))
    metrics = {"eval/reward/mean": report["reward"]["mean"], "eval/reward/std": report["reward"]["std"]}
    metrics.update({f"eval/reward/{c}": stats["mean"] for c, stats in report["components"].items()})
    metrics.update({f"eval/shapes/{k}": v for k, v in report["compositional"]["accuracy"].items() if v is not None})
    return metrics


def evaluate_vlm(cfg: Any, rows: str) -> dict[str, float]:
    import torch

    from mmrl.eval import resolve_checkpoint
    from mmrl.pipelines.data import load_visual_qa
    from mmrl.rewards import load as load_reward
    from mmrl.runtime import resolve_device, resolve_dtype
    from mmrl.vlm.policy import build_policy
    from mmrl.vlm.rollout_collect import evaluate, make_rollout_engine

    if cfg.algorithm != "vlm_grpo":
        raise ConfigError(f"evaluate(): {cfg.algorithm} evaluates during train() (log.eval_every); trainer.evaluate() "
                          f"covers the diffusion recipes and vlm_grpo")
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    data = cfg.data
    items = load_visual_qa(rows, image_root=data.image_root or None, template=data.template, on_error=data.on_error)
    reward_model = load_reward(cfg.reward.name, **cfg.reward.kwargs)
    states, processor = build_policy(cfg.model, resolve_device(cfg.device), resolve_dtype(cfg.dtype), keep_ref=False)
    checkpoint = newest_checkpoint(cfg.output_dir)
    if checkpoint is not None:
        adapters, _ = resolve_checkpoint(checkpoint, what="evaluate()")
        states.load(adapters)
    engine, _ = make_rollout_engine(cfg, states, processor, engine="hf")
    with torch.no_grad():
        return evaluate(engine, processor, items, reward_model, cfg)
