"""vlm_grpo's start-up checks: names and numbers that would otherwise fail only mid-run (choices typed with
`Literal` are already checked when the config loads)."""

from __future__ import annotations

from typing import Any

import torch

from mmrl.core import get_advantage_estimator, get_policy_loss, kl_estimate
from mmrl.pipelines.data import require_path
from mmrl.pipelines.shapes_qa import ShapesQA
from mmrl.training.async_rollout import check_async_rollout
from mmrl.training.judges import check_judges


def check_config(cfg: Any) -> None:
    """Fail before loading any model (one line naming the key, expected vs got)."""
    algo, rollout, update, data, log = cfg.algo, cfg.rollout, cfg.update, cfg.data, cfg.log
    kl_estimate(torch.zeros(1), torch.zeros(1), algo.kl.estimator)  # unknown names raise with the valid list
    get_advantage_estimator(algo.advantage)
    get_policy_loss(algo.policy_loss)
    nominal = rollout.prompts_per_step * rollout.group_size
    check_async_rollout(cfg, recomputes_old=recompute_old_logprobs(cfg))
    if cfg.reward.aggregation == "normalise_then_sum" and (algo.kl.in_reward or cfg.reward.running_norm):
        raise ValueError("reward.aggregation=normalise_then_sum normalises each reward component in its groups: it "
                         "cannot take algo.kl.in_reward or reward.running_norm (they change the summed reward only)")
    if log.judges and (not data.eval_size or (data.kind == "geo3k" and not data.val_path)):
        raise ValueError("log.judges are scored on the eval prompts: set data.eval_size > 0 (and data.val_path for "
                         f"geo3k), got eval_size={data.eval_size}, val_path={data.val_path!r}")
    check_judges(log, "text")  # they score the policy's responses
    if cfg.dist.strategy == "fsdp" and rollout.engine != "hf":
        raise ValueError("dist.strategy=fsdp: vlm_grpo supports FSDP with rollout.engine=hf only")
    if cfg.model.lora.init_path:
        raise ValueError("model.lora.init_path: vlm_grpo starts LoRA from scratch (leave it empty)")
    if algo.rollout_correction.enabled and not recompute_old_logprobs(cfg) and algo.policy_loss != "reinforce":
        raise ValueError(f"algo.rollout_correction with the rollout's log-probs as pi_old (algo.old_logprobs="
                         f"{algo.old_logprobs}: bypass) and algo.policy_loss={algo.policy_loss}: the ratio pi / "
                         f"pi_rollout already is the importance weight, so the correction would do nothing; use "
                         f"algo.old_logprobs=recompute (decoupled) or algo.policy_loss=reinforce (bypass + policy "
                         f"gradient: weights and masks from the current policy, verl's pg_is / pg_rs)")
    if algo.old_logprobs == "rollout" and (update.epochs > 1 or update.mini_batch_size not in (0, nominal)):
        raise ValueError("algo.old_logprobs=rollout needs exactly one update per rollout (update.epochs=1, "
                         "update.mini_batch_size=0)")
    for key, value, least in (("rollout.prompts_per_step", rollout.prompts_per_step, 1),
                              ("rollout.group_size", rollout.group_size, 1),
                              ("rollout.max_new_tokens", rollout.max_new_tokens, 1),
                              ("rollout.micro_batch_size", rollout.micro_batch_size, 1),
                              ("rollout.temperature", rollout.temperature, 0),
                              ("algo.max_gen_batches", algo.max_gen_batches, 1),
                              ("reward.overlong_buffer", cfg.reward.overlong_buffer, 0),
                              ("data.eval_size", data.eval_size, 0), ("data.limit", data.limit, 0),
                              ("data.min_pixels", data.min_pixels, 0), ("data.max_pixels", data.max_pixels, 0),
                              # render_scene's least image side
                              ("data.image_size", data.image_size, 4 if data.kind == "shapes" else 0),
                              ("log.sample_every", log.sample_every, 0), ("log.eval_every", log.eval_every, 0),
                              ("log.num_samples", log.num_samples, 1 if log.sample_every else 0)):
        if value < least:
            raise ValueError(f"{key}: expected >= {least}, got {value}")
    check_clip_ranges(algo.clip_low, algo.clip_high, algo.dual_clip)
    update.updates_per_epoch(nominal)  # mini_batch_size must divide the nominal batch
    if not 0 < rollout.top_p <= 1:
        raise ValueError(f"rollout.top_p: expected 0 < top_p <= 1, got {rollout.top_p}")
    if rollout.group_size < 2 and algo.dynamic_sampling:
        raise ValueError(f"rollout.group_size={rollout.group_size}: algo.dynamic_sampling keeps only groups whose "
                         f"rewards differ, which needs rollout.group_size >= 2")
    if rollout.group_size < 2 and needs_groups(algo.advantage):
        raise ValueError(f"rollout.group_size={rollout.group_size}: algo.advantage={algo.advantage} compares the "
                         f"responses to one prompt, so a group of one gets advantage 0 and nothing would train; use "
                         f"rollout.group_size >= 2 (or algo.advantage=reinforce_pp, which normalises over the batch)")
    if nominal < 2:
        raise ValueError(f"rollout.prompts_per_step * rollout.group_size = {nominal}: one response per step has "
                         f"advantage 0 under every estimator; use at least 2")
    if rollout.engine == "vllm":
        from mmrl.vlm.vllm_engine import check_vllm_rollout

        check_vllm_rollout(rollout)  # installed, importable, built for a device this machine has; temperature <= 2
    if cfg.warm_start.steps and data.kind != "shapes":
        raise ValueError("warm_start.steps > 0 needs data.kind=shapes (answer vocabularies are known there only)")
    try:
        data.template.format(prompt="", problem="", question="")
    except (KeyError, IndexError) as exc:
        raise ValueError(f"data.template: unknown placeholder {exc} in {data.template!r} (known: {{prompt}}, "
                         f"{{problem}}, {{question}})") from None
    except ValueError as exc:  # e.g. an unmatched brace
        raise ValueError(f"data.template: {data.template!r} is not a format string ({exc})") from None
    if data.kind == "shapes":
        for key in ("n_shapes", "shape_size"):
            if len(getattr(data, key)) != 2:
                raise ValueError(f"data.{key}: expected [min, max], got {getattr(data, key)}")
        ShapesQA(data, cfg.seed).item(0)  # a dry draw: bad colours, counts, sizes fail now, not after the model load
    else:  # geo3k
        if not data.path:
            raise ValueError("data.path: geo3k data needs a .jsonl/.json/.parquet file or a save_to_disk directory")
        require_path("data.path", data.path, "data file", kind="data")
        if data.val_path:
            require_path("data.val_path", data.val_path, "data file", kind="data")
        if data.image_root:
            require_path("data.image_root", data.image_root, "image folder", kind="dir")


def needs_groups(advantage: str) -> bool:
    """True when the estimator gives every group of one sample advantage 0 (grpo, dr_grpo, rloo,
    reinforce_pp_baseline: all relative to the group); reinforce_pp whitens over the whole batch and does not.
    Asked of the estimator itself, so registered custom estimators are judged the same way."""
    adv = get_advantage_estimator(advantage)(torch.tensor([0.0, 1.0]), torch.tensor([0, 1]))
    return not bool(adv.abs().sum() > 0)


def recompute_old_logprobs(cfg: Any) -> bool:
    """`algo.old_logprobs`: recompute them with a forward before updating (`recompute`, or `auto` with more than one
    update per rollout or the vLLM engine, whose numerics differ) instead of taking the engine's. Stale batches
    (rollout.max_staleness > 0) alone keep the rollout's (bypass: the PPO ratio against the policy that sampled)."""
    algo, update, rollout = cfg.algo, cfg.update, cfg.rollout
    nominal = rollout.prompts_per_step * rollout.group_size
    several_updates = update.epochs > 1 or update.mini_batch_size not in (0, nominal)
    return algo.old_logprobs == "recompute" or (algo.old_logprobs == "auto" and (
        several_updates or rollout.engine == "vllm"))


def check_clip_ranges(clip_low: float, clip_high: float, dual_clip: float = 0.0) -> None:
    """The ranges the policy losses of mmrl.core need (a cpgd log(1 - clip_low) fails past them), named by key."""
    if not 0 <= clip_low < 1:
        raise ValueError(f"algo.clip_low: expected 0 <= clip_low < 1, got {clip_low}")
    if clip_high < 0:
        raise ValueError(f"algo.clip_high: expected >= 0, got {clip_high}")
    if dual_clip and dual_clip <= 1:
        raise ValueError(f"algo.dual_clip: expected 0 (off) or a constant > 1 (e.g. 3.0), got {dual_clip}")
