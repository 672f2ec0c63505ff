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
    al, ro, up, d, w, log = cfg.algo, cfg.rollout, cfg.update, cfg.data, cfg.warm_start, cfg.log
    kl_estimate(torch.zeros(1), torch.zeros(1), al.kl.estimator)  # unknown names raise with the valid list
    get_advantage_estimator(al.advantage)
    get_policy_loss(al.policy_loss)
    nominal = ro.prompts_per_step * ro.group_size
    check_async_rollout(cfg, recomputes_old=recompute_old_logprobs(cfg))
    if cfg.reward.aggregation == "normalise_then_sum" and (al.kl.in_reward or cfg.reward.running_norm):
        raise ValueError("reward.aggregation=normalise_then_sum normalises each reward component in its groups: it "
                         "cannot take algo.kl.in_reward or reward.running_norm (they change the summed reward only)")
    if log.judges and (not d.eval_size or (d.kind == "geo3k" and not d.val_path)):
        raise ValueError("log.judges are scored on the eval prompts: set data.eval_size > 0 (and data.val_path for "
                         f"geo3k), got eval_size={d.eval_size}, val_path={d.val_path!r}")
    check_judges(log, "text")  # they score the policy's responses
    if cfg.dist.strategy == "fsdp" and ro.engine != "hf":
        raise ValueError("dist.strategy=fsdp: vlm_grpo supports FSDP with rollout.engine=hf only")
    if cfg.model.lora.init_path:
        raise ValueError("model.lora.init_path: vlm_grpo starts LoRA from scratch (leave it empty)")
    if al.rollout_correction.enabled and not recompute_old_logprobs(cfg) and al.policy_loss != "reinforce":
        raise ValueError(f"algo.rollout_correction with the rollout's log-probs as pi_old (algo.old_logprobs="
                         f"{al.old_logprobs}: bypass) and algo.policy_loss={al.policy_loss}: the ratio pi / pi_rollout "
                         f"already is the importance weight, so the correction would do nothing; use "
                         f"algo.old_logprobs=recompute (decoupled) or algo.policy_loss=reinforce (bypass + policy "
                         f"gradient: weights and masks from the current policy, verl's pg_is / pg_rs)")
    if al.old_logprobs == "rollout" and (up.epochs > 1 or up.mini_batch_size not in (0, nominal)):
        raise ValueError("algo.old_logprobs=rollout needs exactly one update per rollout (update.epochs=1, "
                         "update.mini_batch_size=0)")
    for key, value, least in (("rollout.prompts_per_step", ro.prompts_per_step, 1),
                              ("rollout.group_size", ro.group_size, 1),
                              ("rollout.max_new_tokens", ro.max_new_tokens, 1),
                              ("rollout.micro_batch_size", ro.micro_batch_size, 1),
                              ("rollout.temperature", ro.temperature, 0),
                              ("algo.max_gen_batches", al.max_gen_batches, 1),
                              ("reward.overlong_buffer", cfg.reward.overlong_buffer, 0),
                              ("data.eval_size", d.eval_size, 0), ("data.limit", d.limit, 0),
                              ("data.min_pixels", d.min_pixels, 0), ("data.max_pixels", d.max_pixels, 0),
                              ("data.image_size", d.image_size, 4 if d.kind == "shapes" else 0),  # render_scene's least
                              ("log.sample_every", log.sample_every, 0), ("log.eval_every", log.eval_every, 0),
                              ("log.num_samples", log.num_samples, 1 if log.sample_every else 0)):
        if value < least:
            raise ValueError(f"{key}: expected >= {least}, got {value}")
    check_clip_ranges(al.clip_low, al.clip_high, al.dual_clip)
    up.updates_per_epoch(nominal)  # mini_batch_size must divide the nominal batch
    if not 0 < ro.top_p <= 1:
        raise ValueError(f"rollout.top_p: expected 0 < top_p <= 1, got {ro.top_p}")
    if ro.group_size < 2 and al.dynamic_sampling:
        raise ValueError(f"rollout.group_size={ro.group_size}: algo.dynamic_sampling keeps only groups whose rewards "
                         f"differ, which needs rollout.group_size >= 2")
    if ro.group_size < 2 and needs_groups(al.advantage):
        raise ValueError(f"rollout.group_size={ro.group_size}: algo.advantage={al.advantage} compares the responses "
                         f"to one prompt, so a group of one gets advantage 0 and nothing would train; use "
                         f"rollout.group_size >= 2 (or algo.advantage=reinforce_pp, which normalises over the batch)")
    if nominal < 2:
        raise ValueError(f"rollout.prompts_per_step * rollout.group_size = {nominal}: one response per step has "
                         f"advantage 0 under every estimator; use at least 2")
    if ro.engine == "vllm":
        from mmrl.vlm.vllm_engine import check_vllm_rollout

        check_vllm_rollout(ro)  # installed, importable, built for a device this machine has; temperature <= 2
    if w.steps and d.kind != "shapes":
        raise ValueError("warm_start.steps > 0 needs data.kind=shapes (answer vocabularies are known there only)")
    try:
        d.template.format(problem="", question="")
    except (KeyError, IndexError) as exc:
        raise ValueError(f"data.template: unknown placeholder {exc} in {d.template!r} (known: {{problem}}, "
                         f"{{question}})") from None
    except ValueError as exc:  # e.g. an unmatched brace
        raise ValueError(f"data.template: {d.template!r} is not a format string ({exc})") from None
    if d.kind == "shapes":
        for key in ("n_shapes", "shape_size"):
            if len(getattr(d, key)) != 2:
                raise ValueError(f"data.{key}: expected [min, max], got {getattr(d, key)}")
        ShapesQA(d, cfg.seed).item(0)  # a dry draw: bad colours, counts, sizes fail now, not after the model load
    else:  # geo3k
        if not d.path:
            raise ValueError("data.path: geo3k data needs a .jsonl/.json/.parquet file or a save_to_disk directory")
        require_path("data.path", d.path, "data file", kind="data")
        if d.val_path:
            require_path("data.val_path", d.val_path, "data file", kind="data")
        if d.image_root:
            require_path("data.image_root", d.image_root, "image folder", kind="dir")


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
    al, up, ro = cfg.algo, cfg.update, cfg.rollout
    return al.old_logprobs == "recompute" or (al.old_logprobs == "auto" and (
        up.epochs > 1 or up.mini_batch_size not in (0, ro.prompts_per_step * ro.group_size) or ro.engine == "vllm"))


def check_clip_ranges(clip_low: float, clip_high: float, dual_clip: float = 0.0) -> None:
    """The ranges the policy losses of mmrl.core need (a cpgd log(1 - clip_low) fails past them), named by key."""
    if not 0 <= clip_low < 1:
        raise ValueError(f"algo.clip_low: expected 0 <= clip_low < 1, got {clip_low}")
    if clip_high < 0:
        raise ValueError(f"algo.clip_high: expected >= 0, got {clip_high}")
    if dual_clip and dual_clip <= 1:
        raise ValueError(f"algo.dual_clip: expected 0 (off) or a constant > 1 (e.g. 3.0), got {dual_clip}")
