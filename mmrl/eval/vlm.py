"""`mmrl eval` of a VLM policy (vlm_grpo, vlm_multiturn): a run's checkpoint, an `mmrl export` directory or the base
model, evaluated greedily as the run evaluates itself, every answer written down.

    mmrl eval runs/vlm_grpo_tiny_shapes          # the newest checkpoint, with the run's config.yaml
    mmrl eval exports/vlm                        # an export: the config of the checkpoint it was exported from

vlm_grpo: the run's eval set (`data.eval_size` questions: the shapes world draws them with seed `seed + 7919`, geo3k
reads `data.val_path`), greedy responses (temperature 0, `rollout.max_new_tokens`, `rollout.stop`) of the transformers
engine in batches of `rollout.micro_batch_size` prompts (`--batch-size`; the run's batches give the run's responses),
scored by `reward.name` with the overlong penalty: `eval/accuracy` (+ `eval/accuracy/<kind>`) is the number the run
logs. vlm_multiturn: `env.eval_episodes` greedy episodes per task on the fixed eval seeds 10^7 + i, the `eval/*`
metrics the run logs (success rate, returns, episode shapes). A run that generated with vLLM is evaluated with the
transformers engine all the same: its accuracy can differ from the logged one where two tokens nearly tie.

Written into `<out>` (default `<run>/eval/step_N`; the base model `<output_dir>/eval/base`, an export
`<output_dir>/eval/export_<its name>`), each file atomically (a temp file renamed):
  answers.jsonl     one row per question: prompt, its images (saved as images/q<i>_<j>.png), response, parsed answer,
                    ground truth, correct (the run's accuracy term: 1 or 0), reward and every reward component;
                    vlm_multiturn: episodes.jsonl, one row per episode (task, seed, each turn's response and reward,
                    return, success, end reason);
  eval_report.json  the metrics, mean/std of the reward and of every component, the policy (checkpoint, step, sha256
                    of the weights, or the export), the generation settings and the resolved config.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from mmrl.config import to_dict
from mmrl.eval.harness import (default_out_dir, prepare_out_dir, resolve_checkpoint, reward_stats, sha256_file,
                               state_dir, write_json)
from mmrl.eval.target import EvalTarget

__all__ = ["run_vlm_eval", "load_vlm_policy", "VLM_RECIPES"]

VLM_RECIPES = ("vlm_grpo", "vlm_multiturn")


def run_vlm_eval(target: EvalTarget, *, state: str = "default", out: str | Path | None = None, max_prompts: int = 0,
                 batch_size: int = 0, overrides: tuple | list = ()) -> dict:
    """Evaluate the VLM policy `target` names (module docstring); returns the report (also written)."""
    from tqdm.auto import tqdm

    from mmrl.runtime import resolve_device, resolve_dtype
    from mmrl.vlm.rollout import make_engine

    cfg = target.cfg
    if cfg.algorithm not in VLM_RECIPES:
        raise ValueError(f"mmrl eval: VLM evaluation supports {', '.join(VLM_RECIPES)}; the config's algorithm is "
                         f"{cfg.algorithm!r}")
    if max_prompts < 0 or batch_size < 0:
        raise ValueError(f"--max-prompts and --batch-size must be >= 0, got {max_prompts}, {batch_size}")
    multiturn = cfg.algorithm == "vlm_multiturn"
    if multiturn and max_prompts:
        raise ValueError("--max-prompts: vlm_multiturn evaluates env.eval_episodes episodes per task; pass "
                         "env.eval_episodes=N instead")
    adapters, step = resolve_checkpoint(target.checkpoint) if target.checkpoint is not None else (None, None)
    if adapters is not None:
        state_dir(adapters, state)  # before the model loads: a missing state fails fast
    elif state != "default":
        raise ValueError(f"--state {state} needs a checkpoint (a run directory or checkpoints/step_N/)")
    model_dir = Path(cfg.model.path)
    if target.export is None and not (model_dir / "config.json").is_file():  # before anything is written
        raise FileNotFoundError(f"model.path: no config.json in {str(model_dir)!r}; expected the model the run was "
                                f"trained from (mmrl eval builds none: model.build_tiny does not apply)")
    if target.export is not None:
        label = f"export_{target.export.name}"
    else:
        label = "base" if adapters is None else f"step_{step}" if step is not None else "checkpoint"
    out = Path(out) if out is not None else default_out_dir(cfg, adapters, label)
    prepare_out_dir(out, "q*_*.png")

    t0 = time.perf_counter()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    device, dtype = resolve_device(cfg.device), resolve_dtype(cfg.dtype)
    if multiturn:
        from mmrl.vlm.multiturn import check_config

        check_config(cfg)  # environments resolve before the model loads
    else:
        from mmrl.rewards import load as load_reward
        from mmrl.vlm.rollout_collect import build_data

        items = build_data(cfg)[1][: max_prompts or None]
        if not items:
            raise ValueError("mmrl eval: the config has no eval set (data.eval_size is 0, or geo3k without "
                             "data.val_path); set them, e.g. data.eval_size=96")
        reward_model = load_reward(cfg.reward.name, **cfg.reward.kwargs)
    model, processor, policy = load_vlm_policy(target, adapters, step, state, device, dtype)
    batch = batch_size or cfg.rollout.micro_batch_size
    engine = make_engine("hf", model, processor, batch_size=batch)
    total = len(items) if not multiturn else len(cfg.env.tasks) * cfg.env.eval_episodes
    bar = tqdm(total=total, desc="mmrl eval", unit="episode" if multiturn else "question",
               disable=os.environ.get("MMRL_NO_PROGRESS") == "1")
    if multiturn:
        metrics, rows, stats = _episodes(cfg, engine, processor, bar)
        files = {"report": "eval_report.json", "episodes": "episodes.jsonl"}
    else:
        metrics, rows, stats = _answers(cfg, engine, processor, items, reward_model, bar, out)
        files = {"report": "eval_report.json", "answers": "answers.jsonl", "images": "images/"}
    bar.close()
    _write_jsonl(out / files["episodes" if multiturn else "answers"], rows)
    report = {
        "config_file": str(target.config_file), "overrides": list(overrides), "algorithm": cfg.algorithm,
        "model": str(cfg.model.path), "policy": policy, "num_evaluated": len(rows), "metrics": metrics,
        **({"success_rate": metrics.get("eval/success_rate")} if multiturn
           else {"accuracy": metrics["eval/accuracy"]}),
        **stats,
        "generation": {"engine": "hf", "temperature": 0.0, "max_new_tokens": cfg.rollout.max_new_tokens,
                       "batch_size": batch, "device": str(device), "dtype": cfg.dtype},
        "out_dir": str(out), "files": files, "time_s": round(time.perf_counter() - t0, 3), "config": to_dict(cfg),
    }
    write_json(out / "eval_report.json", report)
    return report


def load_vlm_policy(target: EvalTarget, adapters: Path | None, step: int | None, state: str, device: Any,
                    dtype: Any) -> tuple[Any, Any, dict]:
    """(model, processor, provenance): an export's model (merged, or its peft adapter on the base it names), the
    recipe's own policy with the checkpoint's weights loaded as a resume loads them, or the base model. Nothing is
    built: `model.path` must hold the model the run was trained from (`model.build_tiny` is not applied)."""
    from mmrl.adapters import FULL_WEIGHTS_NAME, PEFT_WEIGHTS_NAME
    from mmrl.vlm.common import load_policy
    from mmrl.vlm.policy import build_policy

    if target.export is not None:
        meta = target.export_meta or {}
        prov = {"export": str(target.export), "format": meta.get("format"), "source": meta.get("source")}
        if meta.get("format") == "transformers":
            model, processor = load_policy(target.export, device, dtype)
            return model, processor, prov
        from peft import PeftModel

        base = Path(str(meta.get("base_model", "")))
        if not (base / "config.json").is_file():
            raise FileNotFoundError(f"mmrl eval {target.export}: the peft export's base model {base} is not found "
                                    f"(mmrl_export.json base_model); the adapter needs the model it was trained on")
        model, processor = load_policy(base, device, dtype)
        return PeftModel.from_pretrained(model, str(target.export)).eval(), processor, prov
    cfg = target.cfg
    section = cfg.model.policy() if hasattr(cfg.model, "policy") else cfg.model  # vlm_multiturn's own section
    section = dataclasses.replace(section, build_tiny="")
    if adapters is None:
        model, processor = load_policy(section.path, device, dtype)
        return model, processor, {"checkpoint": None, "step": None, "mode": "base", "state": None}
    states, processor = build_policy(section, device, dtype, keep_ref=False)
    states.load(adapters)  # the "default" policy, as a resumed run reads it
    sub = state_dir(adapters, state)
    weights = next((sub / n for n in (PEFT_WEIGHTS_NAME, FULL_WEIGHTS_NAME) if (sub / n).is_file()), adapters)
    states.model.eval()
    return states.model, processor, {"checkpoint": str(adapters), "step": step, "mode": states.mode, "state": state,
                                     "weights": str(weights), "sha256": sha256_file(weights)}


def _answers(cfg: Any, engine: Any, processor: Any, items: list, reward_model: Any, bar: Any, out: Path
             ) -> tuple[dict, list[dict], dict]:
    """vlm_grpo: (the eval metrics, one row per question, reward statistics); the questions' images saved."""
    from mmrl.rewards.text import GROUND_TRUTH_KEYS
    from mmrl.vlm.rollout_collect import accuracy_metrics, greedy_answers

    got = greedy_answers(engine, processor, items, reward_model, cfg, chunk=engine.batch_size, progress=bar.update)
    metrics = accuracy_metrics(got.accuracy, items)
    comps = dict(got.components)
    if not set(comps) - {"overlong"}:  # a single reward: its own score is the component
        comps = {cfg.reward.name: got.scores - comps.get("overlong", 0.0), **comps}
    parsed = next((v for k, v in got.details.items() if k.split("/")[-1] == "extracted" and isinstance(v, list)),
                  [None] * len(items))
    key = cfg.reward.kwargs.get("answer_key")
    rows = []
    for i, (item, res) in enumerate(zip(items, got.results)):
        images = [f"images/q{i:04d}_{j}.png" for j in range(len(item.images))]
        for name, image in zip(images, item.images):
            image.save(out / name)
        truth = next((item.metadata[k] for k in ((key,) if key else GROUND_TRUTH_KEYS)
                      if item.metadata.get(k) is not None), None)
        rows.append({"index": i, "prompt": item.prompt, "images": images, "response": res.text,
                     "parsed": parsed[i], "answer": truth, "correct": float(got.accuracy[i]),
                     "reward": _num(got.scores[i]), "components": {k: _num(v[i]) for k, v in comps.items()},
                     "kind": item.metadata.get("kind"), "finish_reason": res.finish_reason})
    stats = {"reward": reward_stats(got.scores.tolist()),
             "components": {k: reward_stats(v.tolist()) for k, v in comps.items()}}
    return metrics, rows, stats


def _episodes(cfg: Any, engine: Any, processor: Any, bar: Any) -> tuple[dict, list[dict], dict]:
    """vlm_multiturn: (the eval/* metrics, one row per episode, return statistics)."""
    from mmrl.vlm.credit import episode_returns
    from mmrl.vlm.envs import EnvManager
    from mmrl.vlm.episodes import ChatFormat, episode_metrics
    from mmrl.vlm.multiturn import eval_episodes

    manager = EnvManager(cfg.env.max_workers, cfg.env.backend, modules=cfg.env.modules)
    try:
        episodes = eval_episodes(cfg, engine, ChatFormat(processor, cfg.rollout.system_prompt or None), manager)
    finally:
        manager.close()
    bar.update(len(episodes))
    returns = episode_returns(episodes, cfg.algo.gamma)
    rows = [{"index": i, "task": ep.task, "seed": ep.seed, "return": _num(returns[i]), "success": bool(ep.success),
             "end_reason": ep.end_reason, "error": ep.error,
             "turns": [{"response": t.text, "reward": t.reward, "finish_reason": t.finish_reason} for t in ep.turns]}
            for i, ep in enumerate(episodes)]
    return episode_metrics(episodes, returns, prefix="eval/"), rows, {"return": reward_stats(returns.tolist())}


def _num(v: Any) -> float | None:
    v = float(v)
    return v if v == v and abs(v) != float("inf") else None


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    os.replace(tmp, path)
