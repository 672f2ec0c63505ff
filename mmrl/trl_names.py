"""TRL's flat keyword names on the recipe configs: `mmrl.VLMGRPOConfig(learning_rate=1e-5, num_generations=4)`.

A recipe's `Config` takes its own sections and keys, and also the names a TRL `GRPOConfig` (a transformers
`TrainingArguments`) uses for the same settings; each such name sets the config keys that mean the same here
(`learning_rate` -> `optim.lr`, `num_generations` -> `rollout.group_size`, ...: `translate`, the table in
docs/python-api.md). A TRL or transformers name with no counterpart in the recipe is refused, naming what to use
instead: never ignored. Three names belong to the trainer rather than to a config key (`num_train_epochs`,
`reward_weights`, `logging_steps`); they stay on the config object as `trainer_args` and `mmrl.Trainer` resolves
them (steps from the dataset size, the reward section, the callbacks' `on_log` cadence). `read` gives the values
back under the TRL names (`cfg.learning_rate`), as transformers callbacks read them from `args`.

It imports nothing of mmrl (mmrl.config calls into it): a ValueError raised here becomes mmrl.config's ConfigError.
"""

# source: TRL's GRPOConfig and transformers' TrainingArguments field names and meanings as read at huggingface/trl
# f2cd57710ae345ea6428ae95363267fcf38a3dc8 (VERSION 1.10.0.dev0: trl/trainer/grpo_config.py, grpo_trainer.py)

from __future__ import annotations

import dataclasses
import numbers
import os
from typing import Any, Callable

# TRL name -> the config keys it sets, the first the recipe has
SIMPLE: dict[str, tuple[str, ...]] = {
    "learning_rate": ("optim.lr",),
    "num_generations": ("rollout.group_size",),
    "max_completion_length": ("rollout.max_new_tokens",),
    "temperature": ("rollout.temperature",),
    "top_p": ("rollout.top_p",),
    "top_k": ("rollout.top_k",),
    "beta": ("algo.kl.coef", "algo.beta"),  # DPO (no KL term): its beta is TRL DPOConfig's beta
    "num_iterations": ("update.epochs",),
    "max_steps": ("train.max_steps",),
    "save_steps": ("train.save_every",),
    "save_total_limit": ("train.keep_last",),
    "max_grad_norm": ("update.max_grad_norm",),
    "weight_decay": ("optim.weight_decay",),
    "warmup_steps": ("optim.warmup_steps",),
    "adam_epsilon": ("optim.eps",),
    "gradient_checkpointing": ("model.gradient_checkpointing",),
    "eval_steps": ("log.eval_every",),
    "entropy_coef": ("algo.entropy_coef",),
}
TRAINER_ARGS = ("num_train_epochs", "reward_weights", "logging_steps")

# GRPOConfig's own fields at the commit above, and max_prompt_length of earlier TRL versions (TrainingArguments'
# fields come from transformers when it is installed)
TRL_GRPO_FIELDS = frozenset(
    "model_init_kwargs trust_remote_code router_aux_loss_coef disable_dropout cast_lm_head_to_fp32 "
    "remove_unused_columns num_generations num_generations_eval max_completion_length ds3_gather_for_generation "
    "shuffle_dataset pad_to_multiple_of generation_batch_size steps_per_generation temperature top_p top_k min_p "
    "generation_kwargs chat_template_kwargs repetition_penalty cache_implementation use_vllm vllm_mode "
    "vllm_model_impl vllm_enable_sleep_mode vllm_structured_outputs_regex vllm_server_base_url vllm_server_host "
    "vllm_server_port vllm_server_timeout vllm_group_port vllm_gpu_memory_utilization vllm_max_model_length "
    "vllm_tensor_parallel_size beta num_iterations epsilon delta epsilon_high sapo_temperature_neg "
    "sapo_temperature_pos vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg importance_sampling_level "
    "reward_weights multi_objective_aggregation scale_rewards loss_type mask_truncated_completions sync_ref_model "
    "ref_model_mixup_alpha ref_model_sync_steps top_entropy_quantile entropy_coef use_adaptive_entropy "
    "entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target max_tool_calling_iterations "
    "vllm_importance_sampling_correction vllm_importance_sampling_mode vllm_importance_sampling_clip_max "
    "vllm_importance_sampling_clip_min off_policy_mask_threshold use_bias_correction_kl log_completions "
    "log_multimodal num_completions_to_print log_unique_prompts log_completions_hub_repo "
    "use_transformers_continuous_batching transformers_continuous_batching_config use_transformers_paged "
    "vllm_importance_sampling_cap max_prompt_length".split())

# what to use instead, for names people set often
HINTS = {
    "steps_per_generation": "one batch is sampled per step: rollout.prompts_per_step x rollout.group_size "
                            "(per_device_train_batch_size x gradient_accumulation_steps)",
    "generation_batch_size": "one batch is sampled per step: rollout.prompts_per_step x rollout.group_size "
                             "(per_device_train_batch_size x gradient_accumulation_steps)",
    "max_prompt_length": "prompts are not truncated here",
    "model_init_kwargs": "pass a loaded model object, and bf16 / fp16 (dtype) for its precision",
    "num_generations_eval": "evaluation is greedy (VLM) or ODE sampling (diffusion): one completion per prompt",
    "warmup_ratio": "use warmup_steps (optim.warmup_steps)",
    "push_to_hub": "write the model with trainer.save_model(DIR) and upload DIR",
    "hub_model_id": "write the model with trainer.save_model(DIR) and upload DIR",
    "run_name": "a run is named by its output_dir",
    "min_p": "sampling takes temperature, top_p and top_k",
    "repetition_penalty": "sampling takes temperature, top_p and top_k",
    "per_device_eval_batch_size": "evaluation batches follow update.micro_batch_size (diffusion) or "
                                  "rollout.micro_batch_size (VLM)",
    "lora_r": "pass peft_config=LoraConfig(...) to mmrl.Trainer, or set model.lora.rank",
    # the names that map in the VLM recipes but not in the diffusion ones
    "temperature": "a diffusion rollout's randomness is its SDE noise (rollout.noise_level)",
    "top_p": "a diffusion rollout samples no tokens",
    "top_k": "a diffusion rollout samples no tokens",
    "max_completion_length": "the image size is rollout.height x rollout.width",
}


# ------------------------------------------------------------------------------------------ dotted keys
def has_key(cfg: Any, dotted: str) -> bool:
    obj = cfg
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(obj) or part not in {f.name for f in dataclasses.fields(obj)}:
            return False
        obj = getattr(obj, part)
    return True


def get_key(cfg: Any, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _first(cfg: Any, keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if has_key(cfg, k)), None)


def _recipe(cfg: Any) -> str:
    return getattr(cfg, "algorithm", "") or type(cfg).__name__


def no_counterpart(cfg: Any, name: str, hint: str = "") -> str:
    return (f"{name}: TRL's {name} has no counterpart in {_recipe(cfg)}"
            + (f"; {hint}" if hint else "") + " (the TRL names that map: docs/python-api.md)")


def _is_trl_name(name: str) -> bool:
    if name in TRL_GRPO_FIELDS or name in HINTS:
        return True
    try:  # TrainingArguments' fields (output_dir, logging_dir, ...), when transformers is installed
        from transformers import TrainingArguments
    except ImportError:
        return False
    return name in {f.name for f in dataclasses.fields(TrainingArguments)}


def _choice(name: str, value: Any, table: dict) -> Any:
    key = value if isinstance(value, (str, bool)) else None
    if key not in table:
        raise ValueError(f"{name}={value!r}: expected one of {list(table)}")
    return table[key]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
    return int(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected True or False, got {value!r}")
    return value


# ------------------------------------------------------------------------------------------ the groups
# each: the TRL names it reads together -> {config key: value} (cfg already holds the earlier groups' values)

def _epsilon(cfg: Any, v: dict) -> dict:
    low, high = v.get("epsilon"), v.get("epsilon_high")
    if has_key(cfg, "algo.clip_low"):  # TRL: epsilon_high defaults to epsilon (a symmetric clip)
        out = {} if low is None else {"algo.clip_low": low, "algo.clip_high": low}
        return out if high is None else {**out, "algo.clip_high": high}
    if has_key(cfg, "algo.clip_range"):
        if low is not None and high is not None and high != low:
            raise ValueError(f"epsilon_high={high!r}: {_recipe(cfg)} clips the ratio symmetrically (algo.clip_range); "
                             f"give epsilon alone")
        return {"algo.clip_range": low if low is not None else high}
    name = "epsilon" if low is not None else "epsilon_high"
    raise ValueError(no_counterpart(cfg, name, "its loss has no ratio clip"))


def _batch(cfg: Any, v: dict) -> dict:
    """TRL samples per_device_train_batch_size x gradient_accumulation_steps x processes completions per optimizer
    step (steps_per_generation = gradient_accumulation_steps): here, prompts_per_step whole groups and one update."""
    if not has_key(cfg, "rollout.group_size"):
        raise ValueError(no_counterpart(cfg, next(iter(v))))
    micro = _positive_int("per_device_train_batch_size",
                          v.get("per_device_train_batch_size", get_key(cfg, "update.micro_batch_size")))
    accum = _positive_int("gradient_accumulation_steps", v.get("gradient_accumulation_steps", 1))
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    per_step, group = micro * accum * world, get_key(cfg, "rollout.group_size")
    if per_step % group:
        shown = "per_device_train_batch_size x gradient_accumulation_steps" + (" x WORLD_SIZE" if world > 1 else "")
        raise ValueError(f"{shown} = {per_step} completions per step must be a multiple of num_generations = {group} "
                         f"(rollout.group_size): a step's completions are whole groups")
    return {"update.micro_batch_size": micro, "rollout.prompts_per_step": per_step // group,
            "update.mini_batch_size": 0}


def _dtype(cfg: Any, v: dict) -> dict:
    bf16, fp16 = (_flag(k, v[k]) if k in v else None for k in ("bf16", "fp16"))
    if bf16 and fp16:
        raise ValueError("bf16=True and fp16=True: choose one (dtype)")
    if bf16 or fp16:
        return {"dtype": "bfloat16" if bf16 else "float16"}
    # False: not that precision (the default, float32, stays)
    off = [d for k, d in (("bf16", "bfloat16"), ("fp16", "float16")) if v.get(k) is False]
    return {"dtype": "float32"} if cfg.dtype in off else {}


def _report_to(cfg: Any, v: dict) -> dict:
    value = v["report_to"]
    names = [value] if isinstance(value, str) else list(value or [])
    names = [n for n in names if n != "none"]
    bad = [n for n in names if n not in ("tensorboard", "wandb")]
    if bad:
        raise ValueError(f"report_to: {bad[0]!r} is not a tracker here; valid: 'none', 'tensorboard', 'wandb' "
                         f"(log.trackers; metrics.jsonl is always written)")
    return {"log.trackers": ["jsonl", *names]}


def _scheduler(cfg: Any, v: dict) -> dict:
    end = _choice("lr_scheduler_type", v["lr_scheduler_type"],
                  {"constant": 1.0, "constant_with_warmup": 1.0, "linear": 0.0})
    return {"optim.lr_end_factor": end}  # linear warm-up over warmup_steps in every case


def _betas(cfg: Any, v: dict) -> dict:
    betas = list(get_key(cfg, "optim.betas"))
    return {"optim.betas": [v.get("adam_beta1", betas[0]), v.get("adam_beta2", betas[1])]}


def _scale_rewards(cfg: Any, v: dict) -> dict:
    value = v["scale_rewards"]
    if has_key(cfg, "algo.advantage") and has_key(cfg, "algo.loss_agg"):  # vlm_grpo, prompt_rewriter
        return {"algo.advantage": _choice("scale_rewards", value, {"group": "grpo", True: "grpo", "none": "dr_grpo",
                                                                   False: "dr_grpo", "batch": "reinforce_pp_baseline"})}
    if has_key(cfg, "algo.scale_by_std"):  # vlm_multiturn
        return {"algo.scale_by_std": _choice("scale_rewards", value, {"group": True, True: True, "none": False,
                                                                      False: False})}
    if has_key(cfg, "reward.std_mode"):  # the diffusion recipes always divide by a std
        return {"reward.std_mode": _choice("scale_rewards", value, {"group": "group", True: "group",
                                                                    "batch": "global"})}
    raise ValueError(no_counterpart(cfg, "scale_rewards"))


def _mapped(name: str, key: str, table: dict) -> Callable[[Any, dict], dict]:
    def apply(cfg: Any, v: dict) -> dict:
        if not has_key(cfg, key):
            raise ValueError(no_counterpart(cfg, name))
        return {key: _choice(name, v[name], table)}

    return apply


def _use_vllm(cfg: Any, v: dict) -> dict:
    on = _flag("use_vllm", v["use_vllm"])
    if has_key(cfg, "rollout.engine"):
        return {"rollout.engine": "vllm" if on else "hf"}
    if on:
        raise ValueError(no_counterpart(cfg, "use_vllm", "its rollouts run in diffusers"))
    return {}


def _strategy(name: str, offs: tuple[tuple[str, str, Any], ...]) -> Callable[[Any, dict], dict]:
    """An `*_strategy` name: "steps" is what happens here; "no" sets `key` to `off` for the first (probe, key, off)
    of `offs` whose probe key the recipe has."""
    def apply(cfg: Any, v: dict) -> dict:
        if not _choice(name, v[name], {"steps": False, **({"no": True} if offs else {})}):
            return {}
        key, off = next((k, off) for probe, k, off in offs if has_key(cfg, probe))
        return {key: off}

    return apply


def _what_happens(name: str, value: Any, instead: str) -> Callable[[Any, dict], dict]:
    """A TRL setting accepted only at the value that describes what mmrl does anyway."""
    def apply(cfg: Any, v: dict) -> dict:
        if v[name] != value:
            raise ValueError(f"{name}={v[name]!r}: not supported; {instead}")
        return {}

    return apply


GROUPS: list[tuple[tuple[str, ...], Callable[[Any, dict], dict]]] = [
    *(((name,), (lambda n: lambda cfg, v: _simple(cfg, n, v[n]))(name)) for name in SIMPLE),
    (("epsilon", "epsilon_high"), _epsilon),
    (("per_device_train_batch_size", "gradient_accumulation_steps"), _batch),  # after num_generations
    (("bf16", "fp16"), _dtype),
    (("report_to",), _report_to),
    (("lr_scheduler_type",), _scheduler),
    (("adam_beta1", "adam_beta2"), _betas),
    (("scale_rewards",), _scale_rewards),
    (("loss_type",), _mapped("loss_type", "algo.loss_agg", {"dapo": "token-mean", "grpo": "seq-mean-token-mean",
                                                             "dr_grpo": "seq-mean-token-sum-norm"})),
    (("importance_sampling_level",), _mapped("importance_sampling_level", "algo.policy_loss",
                                             {"token": "ppo_clip", "sequence": "gspo"})),
    (("multi_objective_aggregation",), _mapped("multi_objective_aggregation", "reward.aggregation",
                                               {"sum_then_normalize": "sum_then_normalise",
                                                "normalize_then_sum": "normalise_then_sum"})),
    (("use_vllm",), _use_vllm),
    # no evaluation while training: vlm_grpo no eval rows, vlm_multiturn no eval episodes, diffusion eval_every 0,
    # prompt_rewriter no eval prompts (trainer.evaluate() still evaluates eval_dataset)
    (("eval_strategy",), _strategy("eval_strategy", (
        ("data.eval_size", "data.eval_size", 0), ("env.eval_episodes", "env.eval_episodes", 0),
        ("rollout.height", "log.eval_every", 0), ("data.eval_prompts", "data.eval_prompts", "")))),
    # "no": checkpoints only at the last step (a run always ends with one)
    (("save_strategy",), _strategy("save_strategy", (("train.save_every", "train.save_every", 0),))),
    (("logging_strategy",), _strategy("logging_strategy", ())),
    (("mask_truncated_completions",), _what_happens("mask_truncated_completions", False,
                                                    "overlong responses: reward.overlong_buffer (DAPO's shaping)")),
    (("remove_unused_columns",), _what_happens("remove_unused_columns", False,
                                               "every dataset column reaches the reward functions")),
    (("shuffle_dataset",), _what_happens("shuffle_dataset", True, "prompts are drawn in a seeded order per epoch")),
]


def _simple(cfg: Any, name: str, value: Any) -> dict:
    key = _first(cfg, SIMPLE[name])
    if key is None:
        raise ValueError(no_counterpart(cfg, name, HINTS.get(name, "")))
    return {key: value}


def _check_trainer_arg(name: str, value: Any) -> Any:
    if name == "logging_steps":
        return _positive_int(name, value)
    if name == "num_train_epochs":
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
            raise ValueError(f"num_train_epochs: expected a number > 0, got {value!r}")
        return float(value)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise ValueError(f"reward_weights: expected a list of numbers, got {value!r}")
    return list(value)


def apply(cfg: Any, flat: dict[str, Any], set_keys: Callable[[Any, dict], None]) -> dict:
    """Set the keys the TRL names of `flat` mean on `cfg`, group by group through `set_keys(cfg, {key: value})`
    (which checks and converts like a YAML value); returns the trainer_args among them. ValueError names the first
    name that is unknown, has no counterpart, or whose value does not fit."""
    fields = {f.name for f in dataclasses.fields(cfg)}
    known = {n for names, _ in GROUPS for n in names} | set(TRAINER_ARGS)
    for name in flat:
        if name in known:
            continue
        if _is_trl_name(name):
            raise ValueError(no_counterpart(cfg, name, HINTS.get(name, "")))
        raise ValueError(f"unknown keyword {name!r}: expected one of the config's keys "
                         f"{sorted(fields)} (sections as objects or mappings) or a TRL name (docs/python-api.md)")
    if "num_train_epochs" in flat and "max_steps" in flat:
        raise ValueError("num_train_epochs and max_steps: give one (max_steps = train.max_steps; num_train_epochs: "
                         "steps from the dataset size)")
    for names, group in GROUPS:
        given = {n: flat[n] for n in names if n in flat}
        if not given:
            continue
        values = group(cfg, given)
        if values:
            try:
                set_keys(cfg, values)
            except ValueError as exc:
                shown = ", ".join(f"{n}={given[n]!r}" for n in given)
                raise ValueError(f"{shown} (-> {', '.join(values)}): {exc}") from None
    return {name: _check_trainer_arg(name, flat[name]) for name in TRAINER_ARGS if name in flat}


# ------------------------------------------------------------------------------------------ reading them back
def read(cfg: Any, name: str) -> Any:
    """The value a TRL name stands for on `cfg` (`cfg.learning_rate` = `cfg.optim.lr`); AttributeError for a name
    that is not one, or has no counterpart in the recipe."""
    key = _first(cfg, SIMPLE[name]) if name in SIMPLE else None
    if key is not None:
        return get_key(cfg, key)
    if name in ("epsilon", "epsilon_high"):
        key = _first(cfg, ("algo.clip_low" if name == "epsilon" else "algo.clip_high", "algo.clip_range"))
        if key is not None:
            return get_key(cfg, key)
    if name == "per_device_train_batch_size" and has_key(cfg, "update.micro_batch_size"):
        return cfg.update.micro_batch_size
    if name in ("bf16", "fp16"):
        return cfg.dtype == ("bfloat16" if name == "bf16" else "float16")
    trainer_args = cfg.__dict__.get("trainer_args", {})
    if name in trainer_args:
        return trainer_args[name]
    if name == "logging_steps":
        return 1  # every step's metrics are logged
    raise AttributeError(f"{type(cfg).__name__!r} object has no attribute {name!r}")
