"""Prompt-rewriter RL: GRPO trains a VLM/LLM to rewrite the user's prompt for a frozen text-to-image model.

One step reads top to bottom:
  1. rollout  - `rollout.group_size` rewrites per user prompt from the policy (the vlm_grpo rollout engine; text-only,
                or with a reference image from `data.image_key`); the rewrite is the whole response, or the match of
                `data.answer_pattern` (no match or empty: the user's prompt, counted in rollout/unparsed);
  2. render   - the frozen renderer (any `mmrl.diffusion.models` family, `renderer.path`) draws every rewrite with a
                deterministic ODE sampler; the rewrites of one user prompt share one initial noise
                (`renderer.same_noise`), so they differ only by what the prompt says;
  3. rewards  - zoo image rewards (`reward.components`, a judge such as `vlm_judge` included) score each image
                against the user's prompt, or against `metadata[reward.intent_key]` (the intent, e.g. a caption);
  4. advantages - a registered estimator (`algo.advantage`, GRPO: per-group normalisation) over all ranks' rewards;
  5. loss/step - the vlm_grpo update (`mmrl.vlm.update.policy_update`: PPO-clipped token ratios, KL to the
                reference = adapters off, mini-batches, gradient accumulation, non-finite guard).

Evaluation (`log.eval_every`, and before training): greedy rewrites of the fixed `data.eval_prompts`, rendered from a
fixed noise per prompt and scored: eval/reward/mean; at the start also the user prompts rendered as they are
(eval/identity/reward/mean) and, with `reward.intent_key`, the intents themselves (eval/intent/reward/mean: what a
perfect rewriter would reach). Sample grids show user prompt -> rewrite -> reward under each image
(samples/step_N.png; the full texts in samples/step_N.jsonl).

Several processes (`torchrun`, `dist.strategy: ddp`): each rank rewrites and renders its share of the prompts,
rewards are all-gathered for the advantages, the policy update is vlm_grpo's (global mini-batches); rank 0 logs,
evaluates and writes checkpoints. FSDP is not supported (the renderer is replicated anyway).

    summary = train(load_config("configs/joint/rewriter_tiny.yaml"))   # mmrl.config.load_config

Sources of the published settings used by the real config: G-U-N/UniRL (PromptRL, arXiv 2602.01382) scripts/train/rl/
train_qmatters.sh at 1c09137 (Qwen-VL-3B rewriter, GRPO, 8 generations, lr 1e-5, KL beta 3e-4); microsoft/DKI_LLM
RePrompt/train_reprompt.py at ba38e65 (the rewrite inside <answer>...</answer>, scored against the plain user prompt).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from mmrl.config import RunConfig, TrainConfig
from mmrl.core import get_advantage_estimator, kl_estimate
from mmrl.diffusion import config as diffusion_config
from mmrl.distributed import DistConfig
from mmrl.run.checkpoint import restore_checkpoint
from mmrl.run.start import closes_runs, start_run
from mmrl.training import KLConfig, OnNonfinite, OptimConfig, UpdateGuard, build_optimizer, check_rewards, finite_stats
from mmrl.training.judges import build_judges, check_judges
from mmrl.training.steps import StepLoop
from mmrl.vlm import config as vlm_config
from mmrl.vlm.grpo_checks import check_clip_ranges

__all__ = ["Config", "train"]


@dataclass
class DataConfig:
    train_prompts: str = "assets/prompts/rewriter_train.jsonl"
    """User prompts: .txt (one per line) or .jsonl with `prompt` (other keys = metadata: intent, image, ...)."""
    eval_prompts: str = "assets/prompts/rewriter_eval.jsonl"
    """Fixed held-out user prompts rewritten greedily at every evaluation (empty = no evaluation)."""
    template: str = "Rewrite for the image generator: {prompt}"
    """The user turn shown to the rewriter; {prompt} = the user's prompt (`<image>` marks the reference image)."""
    system_prompt: str = ""
    """Optional system message (empty: the chat template's default)."""
    answer_pattern: str = ""
    """Regex whose group 1 is the rewrite (e.g. `<answer>(.*?)</answer>`); empty = the whole response."""
    image_key: str = ""
    """Metadata key of a reference image path shown to the rewriter (its template needs `<image>`); empty = text."""
    format_examples: str = ""
    """The format warm start's targets: a prompt file of well-formed rewrites, each drawn at random for a random
    training prompt (NOT matched to it); or a .jsonl whose every row has `prompt` and `response`: supervised on those
    pairs (the demo's pairs keep each prompt's shape and name random colours, or copy the prompt: the format and the
    habit of reading the prompt, not which words a prompt needs)."""


@dataclass
class RendererConfig:
    path: str = "assets/tiny_sd3_shapes"
    """Local diffusers pipeline directory of the frozen text-to-image model (any registry family)."""
    height: int = 64
    """Image height."""
    width: int = 64
    """Image width."""
    num_steps: int = 8
    """ODE (Euler) sampling steps."""
    guidance_scale: float = 1.0
    """Classifier-free guidance (SD3) / guidance embedding (FLUX); 1 = off."""
    max_sequence_length: int = 0
    """T5 tokens per prompt (0 = the family's default)."""
    family_options: dict[str, Any] = field(default_factory=dict)
    """`FlowModel.configure` keywords of the family."""
    same_noise: bool = True
    """The rewrites of one user prompt start from the same initial noise (they differ only by their text)."""
    micro_batch_size: int = 0
    """Images per transformer call (0 = all of a step)."""


@dataclass
class RewardConfig(diffusion_config.AggregationFields, diffusion_config.RewardConfig):  # + components, aggregation
    components: dict[str, Any] = field(default_factory=lambda: {"pickscore": 1.0})
    """Zoo image rewards: name -> weight, or name -> {weight, reward: registered name, <load kwargs>}."""
    on_nonfinite: OnNonfinite = "error"
    """A NaN/inf reward: `error` (stop, naming the component and the rewrite) or `drop_sample` (advantage 0)."""
    intent_key: str = ""
    """Score against metadata[intent_key] (e.g. the intended caption) instead of the user's prompt."""


@dataclass
class AlgoConfig:
    advantage: str = "grpo"
    """Advantage estimator from mmrl.core (grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline)."""
    policy_loss: str = "ppo_clip"
    """Policy loss from the mmrl.core registry (ppo_clip, gspo, cpgd, reinforce)."""
    clip_low: float = 0.2
    """Clip epsilon below 1."""
    clip_high: float = 0.28
    """Clip epsilon above 1."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 for negative advantages (0 = off): bounds the loss of a token whose ratio has grown
    large, which several PPO passes over one batch (`update.epochs`) can produce."""
    loss_agg: vlm_config.LossAgg = "token-mean"
    """Loss aggregation over tokens."""
    kl: KLConfig = field(default_factory=KLConfig)
    """KL(policy || reference = adapters off) as a loss term: coef (0 = no reference pass), estimator."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (0 = entropy is only logged)."""


@dataclass
class RewriterLogConfig(vlm_config.LogConfig):  # + sample_every, num_samples, eval_every, judges, hacking, trackers
    eval_max_prompts: int = 32
    """At most this many evaluation prompts."""


@dataclass
class Config(RunConfig):
    algorithm: str = "prompt_rewriter"
    """Recipe name."""
    model: vlm_config.ModelConfig = field(default_factory=vlm_config.ModelConfig)
    """The rewriter (a Qwen-VL checkpoint; LoRA or full fine-tuning)."""
    renderer: RendererConfig = field(default_factory=RendererConfig)
    """The frozen text-to-image model."""
    data: DataConfig = field(default_factory=DataConfig)
    """User prompts, template, answer format."""
    rollout: vlm_config.RolloutConfig = field(default_factory=vlm_config.RolloutConfig)
    """Rewrite sampling (engine, prompts_per_step, group_size, temperature, max_new_tokens, ...)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Image rewards of the renders."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Advantages, policy loss, KL."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    """AdamW and its learning-rate schedule."""
    update: vlm_config.VLMUpdateConfig = field(default_factory=vlm_config.VLMUpdateConfig)
    """Epochs, mini-batches (sequences per update, global; 0 = the whole batch), micro-batches, clipping."""
    warm_start: vlm_config.WarmStartConfig = field(
        default_factory=lambda: vlm_config.WarmStartConfig(params=["lm_head"]))
    """Optional format warm start on `data.format_examples` (random well-formed rewrites, or prompt/response pairs)."""
    log: RewriterLogConfig = field(default_factory=RewriterLogConfig)
    """Samples and evaluation."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop length, checkpoints, resume."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Several processes under torchrun (strategy none|ddp)."""


def check_config(cfg: Config) -> None:
    """Fail before loading any model (one line naming the key, expected vs got)."""
    from mmrl.diffusion.models import flow_model_class
    from mmrl.pipelines.data import require_path

    rollout, data, algo = cfg.rollout, cfg.data, cfg.algo
    get_advantage_estimator(algo.advantage)
    check_clip_ranges(algo.clip_low, algo.clip_high, algo.dual_clip)
    kl_estimate(torch.zeros(1), torch.zeros(1), algo.kl.estimator)
    if cfg.dist.strategy == "fsdp":
        raise ValueError("dist.strategy=fsdp: prompt_rewriter supports none or ddp")
    if rollout.worker != "inline":  # (the rollout section is vlm_grpo's; the rewriter renders in its own process)
        raise ValueError(f"rollout.worker={rollout.worker}: prompt_rewriter rolls out in the trainer process only "
                         f"(rollout.worker=inline)")
    if rollout.group_size < 2 or rollout.prompts_per_step < 1:
        raise ValueError(f"rollout.group_size >= 2 and rollout.prompts_per_step >= 1 expected (GRPO compares the "
                         f"rewrites of one prompt); got {rollout.group_size}, {rollout.prompts_per_step}")
    require_path("data.train_prompts", data.train_prompts, "prompt file")
    if data.eval_prompts:
        require_path("data.eval_prompts", data.eval_prompts, "prompt file")
    flow_model_class(cfg.renderer.path, "renderer.path")  # the renderer's folder, named by its own key
    if "{prompt}" not in data.template:
        raise ValueError(f"data.template: expected a {{prompt}} placeholder, got {data.template!r}")
    if bool(data.image_key) != ("<image>" in data.template):
        raise ValueError(f"data.image_key={data.image_key!r} and data.template={data.template!r}: a reference image "
                         f"needs both (the key and an <image> placeholder) or neither")
    if data.answer_pattern:
        try:
            if re.compile(data.answer_pattern).groups < 1:
                raise ValueError(f"data.answer_pattern {data.answer_pattern!r}: needs one group, the rewrite")
        except re.error as exc:
            raise ValueError(f"data.answer_pattern {data.answer_pattern!r} is not a regex ({exc})") from None
    if cfg.warm_start.steps and not data.format_examples:
        raise ValueError("warm_start.steps > 0 needs data.format_examples (well-formed rewrites to draw from)")
    if data.format_examples:  # a prompt file, or a .jsonl of prompt/response pairs
        require_path("data.format_examples", data.format_examples, "prompt file")
    if cfg.log.judges and not data.eval_prompts:
        raise ValueError("log.judges are scored at every evaluation: set data.eval_prompts (the held-out prompts)")
    check_judges(cfg.log, "image")  # they score the renderer's images
    cfg.update.updates_per_epoch(rollout.prompts_per_step * rollout.group_size)  # mini_batch_size must divide it


def rewrite_of(text: str, user_prompt: str, pattern: str) -> tuple[str, bool]:
    """(the prompt the renderer gets, parsed): the response (or `pattern`'s group 1) stripped; the user's prompt when
    there is no match or nothing is left."""
    if pattern:
        m = re.search(pattern, text, flags=re.DOTALL)
        text = m.group(1) if m else ""
    text = text.strip()
    return (text, True) if text else (user_prompt, False)


# ------------------------------------------------------------------------------------------ training


@closes_runs  # the run directory's lock released however train() ends; a failed start leaves nothing
def train(cfg: Config) -> dict:
    from mmrl.core.multi_reward import multi_reward_advantages
    from mmrl.diffusion.models import load_flow_model
    from mmrl.diffusion.scoring import component_scores, load_reward_fn, reward_weights
    from mmrl.pipelines.data import PromptSampler, load_prompts
    from mmrl.training import attach_flops_meter, summarise
    from mmrl.vlm.batch import RolloutBatch
    from mmrl.vlm.policy import build_policy, rl_parameters
    from mmrl.vlm.rollout_collect import make_rollout_engine, sampling_params
    from mmrl.vlm.update import PolicyGradientLoss, contiguous_minibatches, policy_update

    check_config(cfg)
    rollout, algo, update, renderer_cfg = cfg.rollout, cfg.algo, cfg.update, cfg.renderer
    ctx, run = start_run(cfg, {"rollout.prompts_per_step": rollout.prompts_per_step,
                               "update.mini_batch_size": update.mini_batch_size})
    train_items = load_prompts(cfg.data.train_prompts)
    eval_items = load_prompts(cfg.data.eval_prompts)[: cfg.log.eval_max_prompts] if cfg.data.eval_prompts else []
    reward_fn = load_reward_fn(cfg.reward.components, run.device)
    renderer = load_flow_model(renderer_cfg.path, run.device, run.dtype, renderer_cfg.max_sequence_length or None,
                               family_options=renderer_cfg.family_options, key="renderer.path")
    renderer.transformer.requires_grad_(False)
    with ctx.main_process_first():  # rank 0 builds the tiny demo policy (model.build_tiny) before the others load it
        states, processor = build_policy(cfg.model, run.device, run.dtype, keep_ref=algo.kl.coef > 0)
    model, tok = states.model, processor.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    engine, syncer = make_rollout_engine(cfg, states, processor)
    sampling = sampling_params(rollout)
    summary: dict[str, Any] = {}
    if run.find_resume() is None and cfg.warm_start.steps > 0:  # before any RL: identical on every rank
        from mmrl.vlm.warm_start import format_warm_start

        summary["warm_start_loss"] = format_warm_start(model, states.named_trainable_parameters(), cfg.warm_start,
                                                       _warm_start_pairs(cfg, processor, train_items, eos_id), pad_id)
        if not cfg.model.lora.enabled and "ref" in states.states:  # the reference is the warm-started model
            states.copy("default", "ref")
    params = rl_parameters(states, cfg.model.freeze)
    tmodel = ctx.wrap_model(model, cfg.dist.strategy, find_unused_parameters=cfg.dist.find_unused_parameters)
    updates = cfg.train.max_steps * update.epochs * update.updates_per_epoch(rollout.prompts_per_step
                                                                             * rollout.group_size)
    optimizer, lr_sched = build_optimizer(params, cfg.optim, total_steps=updates)
    sampler = PromptSampler(train_items, seed=cfg.seed)
    stateful = {"optimizer": optimizer, "lr_scheduler": lr_sched, "data": sampler}
    judges = build_judges(cfg.log, run.device, stateful, len(eval_items))  # scored on the eval renders
    start, _ = restore_checkpoint(ctx, run, states, stateful)
    loss_fn = PolicyGradientLoss(algo.policy_loss, algo.clip_low, algo.clip_high, algo.dual_clip, algo.loss_agg,
                                 rollout.max_new_tokens, algo.entropy_coef, algo.kl.coef, algo.kl.estimator, False)
    guard = UpdateGuard(update.max_skipped_updates, ctx, run)
    estimator = get_advantage_estimator(algo.advantage)
    if start == 0 and ctx.is_main and eval_items:  # before training: the rewriter, the identity and the intents
        first = evaluate(cfg, engine, processor, renderer, reward_fn, eval_items, run, 0, baselines=True,
                         judges=judges)  # (also the judges' baseline)
        summary.update({f"first/{k}": v for k, v in first.items()})
        print(f"[prompt_rewriter] before RL: {first}", flush=True)
    attach_flops_meter(model)  # perf/tflops_per_step of the policy's forwards and backwards (not the renderer's)

    def evaluate_after(step: int, metrics: dict) -> None:
        """Greedy rewrites of the eval prompts every log.eval_every steps and at the end (rank 0)."""
        if ctx.is_main and eval_items and ((cfg.log.eval_every and step % cfg.log.eval_every == 0)
                                           or step == cfg.train.max_steps):
            with steps.timer("eval"):
                metrics.update(evaluate(cfg, engine, processor, renderer, reward_fn, eval_items, run, step,
                                        judges=judges))

    steps = StepLoop(ctx, run, cfg, start, states=states, stateful=stateful, fsdp=False, judges=judges,
                     after_step=evaluate_after, postfix=lambda m: {"reward": f"{float(m['reward/mean']):.3f}"})
    for step in steps:
        metrics, timer = steps.metrics, steps.timer
        # ---- 1. rewrites: this rank's share of the prompts, group_size each (request-major)
        items = ctx.shard(sampler.next(rollout.prompts_per_step))
        with timer("rollout"):
            results = engine.generate([_request(cfg, processor, it) for it in items], sampling)
        users = [items[x.request_index].prompt for x in results]
        parsed = [rewrite_of(x.text, u, cfg.data.answer_pattern) for x, u in zip(results, users)]
        rewrites = [p for p, _ in parsed]
        # ---- 2. render every rewrite (frozen model, no gradient); one noise per user prompt
        with timer("render"):
            groups = torch.tensor([x.request_index for x in results])
            images = render(renderer, rewrites, renderer_cfg, groups if renderer_cfg.same_noise else None)
        # ---- 3. rewards against the user's prompt (or its intent)
        with timer("reward"):
            targets = [_target(items[x.request_index], cfg.reward.intent_key) for x in results]
            out = reward_fn(images=images, prompts=targets, metadata=[items[x.request_index].metadata
                                                                      for x in results])
            scores = out.scores.detach().float().cpu()
            check_rewards(scores, out.details, cfg.reward.on_nonfinite, reward="reward.components",
                          components=list(getattr(reward_fn, "components", {})),
                          labels=[f"{u!r} -> {w!r}" for u, w in zip(users, rewrites)])
        finite = torch.isfinite(scores)
        scores_t = torch.where(finite, scores, torch.zeros_like(scores))
        # ---- 4. advantages over all ranks' rewards (a non-finite reward: advantage 0, no gradient)
        r_all, g_all = ctx.gather_group_rewards(scores_t, groups, scope="rank")
        if cfg.reward.aggregation == "normalise_then_sum":  # GDPO: each component in its own groups
            comps = torch.nan_to_num(component_scores(reward_fn, out), nan=0.0, posinf=0.0, neginf=0.0)
            adv_all = multi_reward_advantages(ctx.all_gather_tensor(comps), reward_weights(reward_fn),
                                              lambda x: estimator(x, g_all), cfg.reward.aggregation,
                                              mask=ctx.all_gather_tensor(finite.float()).bool())
        else:
            adv_all = estimator(r_all, g_all)
        adv = ctx.local_slice(adv_all) * finite
        metrics.update(finite_stats(ctx.all_gather_tensor(scores)))
        for k in getattr(reward_fn, "components", {}):
            metrics[f"reward/{k}"] = ctx.all_gather_tensor(torch.as_tensor(out.details[k]).float().cpu()).mean()
        lens = ctx.all_gather_tensor(torch.tensor([len(x.response_ids) for x in results], dtype=torch.float32))
        metrics.update({"rollout/response_length/mean": lens.mean(),
                        "rollout/unparsed": 1.0 - sum(ok for _, ok in parsed) / len(parsed),
                        "rollout/changed": sum(w != u for w, u in zip(rewrites, users)) / len(users)})
        # ---- 5. the vlm_grpo update on the rewrite tokens
        batch = RolloutBatch.build(model, [x.prompt_ids for x in results], [x.response_ids for x in results],
                                   [x.mm for x in results], pad_id,
                                   rollout_logprobs=[x.response_logprobs for x in results])
        batch.advantages = adv.to(batch.device)
        if algo.kl.coef > 0:
            with timer("ref"), states.use("ref"):
                batch.ref_logprobs = batch.logprobs(model, update.micro_batch_size, rollout.temperature)
        n_updates = update.epochs * update.updates_per_epoch(rollout.prompts_per_step * rollout.group_size)
        if n_updates > 1 or rollout.engine == "vllm":  # pi_old from the trainer (hf engine's log-probs are exact)
            with timer("old_logprob"):
                batch.old_logprobs = batch.logprobs(model, update.micro_batch_size, rollout.temperature)
        else:
            batch.old_logprobs = batch.rollout_logprobs
        mini_batch = update.mini_batch_size // ctx.world_size or len(results)
        with timer("train"):
            res = policy_update(tmodel, batch, optimizer, params, loss_fn=loss_fn,
                                minibatches=contiguous_minibatches(len(results), len(results), mini_batch),
                                micro_batch_size=update.micro_batch_size, epochs=update.epochs,
                                max_grad_norm=update.max_grad_norm, temperature=rollout.temperature,
                                entropy_grad=algo.entropy_coef != 0, guard=guard, step=step,
                                lr_scheduler=lr_sched, ctx=ctx)
        metrics["diag/logprob_drift"] = max(ctx.all_gather_object(res.drift)) if ctx.enabled else res.drift
        metrics.update(res.metrics())
        metrics.update(guard.pop_metrics())
        metrics["policy/lr"] = lr_sched.get_last_lr()[0]
        if syncer is not None:
            metrics.update(syncer.sync())
        if ctx.is_main and cfg.log.sample_every and (step % cfg.log.sample_every == 0 or step == 1):
            save_rewrites(run, step, f"step_{step:06d}", images, users, rewrites, scores, cfg.log.num_samples)
    steps.close()
    ctx.close()
    if not ctx.is_main:
        return {}
    evals = [row for row in run.read_metrics() if row.get("eval/reward/mean") is not None]
    if evals:
        summary["eval_reward_last"] = evals[-1]["eval/reward/mean"]
    return summarise(run, "prompt_rewriter", extra_keys=("eval/reward/mean",)) | summary


def _target(item: Any, intent_key: str) -> str:
    """The text a reward scores an image against: the user's prompt, or metadata[intent_key]."""
    if intent_key and intent_key not in item.metadata:
        raise ValueError(f"reward.intent_key={intent_key!r}: prompt {item.prompt!r} has no such metadata key "
                         f"(has: {sorted(item.metadata)})")
    return str(item.metadata[intent_key]) if intent_key else item.prompt


def _request(cfg: Config, processor: Any, item: Any, n: int | None = None):
    """The rewriter's chat request for one user prompt (+ its reference image)."""
    from mmrl.vlm.common import messages_from_text, render_prompt
    from mmrl.vlm.rollout import GenRequest

    data = cfg.data
    text = render_prompt(processor, messages_from_text(data.template.replace("{prompt}", item.prompt),
                                                       data.system_prompt or None))
    images = [item.metadata[data.image_key]] if data.image_key else []
    return GenRequest(prompt_text=text, images=images, n=n, metadata=item.metadata)


@torch.no_grad()
def render(model: Any, prompts: list[str], renderer: RendererConfig, groups: torch.Tensor | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Images [B, 3, H, W] of `prompts` from the frozen renderer (deterministic ODE); rows with equal `groups` start
    from the same initial noise (None: each its own)."""
    from mmrl.diffusion.sampling import sample_groups

    n = int(groups.max()) + 1 if groups is not None else len(prompts)
    noise = model.initial_noise(n, renderer.height, renderer.width, generator)
    if groups is not None:
        noise = noise[groups.to(noise.device)]
    traj = sample_groups(model, model.encode_prompts(prompts), 1, num_steps=renderer.num_steps,
                         height=renderer.height, width=renderer.width, guidance_scale=renderer.guidance_scale,
                         noise_level=0.0, batch_size=renderer.micro_batch_size or None, initial_noise=noise)
    return traj.images


def save_rewrites(run: Any, step: int, name: str, images: torch.Tensor, users: list[str], rewrites: list[str],
                  scores: torch.Tensor, n: int) -> None:
    """samples/<name>.png: the first `n` renders with "user -> rewrite | r=..." under each (cells upscaled so the
    captions fit), and samples/<name>.jsonl with the full texts."""
    n = min(n, len(users))
    big = torch.nn.functional.interpolate(images[:n].float(), scale_factor=max(1, 256 // images.shape[-1]),
                                          mode="nearest")
    run.save_samples(step, big, [f"{u} -> {w} | r={float(s):.2f}" for u, w, s in zip(users, rewrites, scores)][:n],
                     name=f"{name}.png")
    rows = [{"user": u, "rewrite": w, "reward": float(s)} for u, w, s in zip(users, rewrites, scores)]
    (run.samples_dir / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))


@torch.no_grad()
def evaluate(cfg: Config, engine: Any, processor: Any, renderer: Any, reward_fn: Any, items: list, run: Any,
             step: int, baselines: bool = False, judges: Any = None) -> dict[str, float]:
    """Greedy rewrites of the eval prompts, rendered from fixed noise (generator seeded with the run's seed, one noise
    per prompt) and scored: {"eval/reward/mean", "eval/reward/<component>", ...}; with `baselines` also the user
    prompts as they are (eval/identity/...) and the intents (eval/intent/..., with reward.intent_key); with a
    `JudgePanel` (`log.judges`) every judge on the rewriter's renders and the reward-hacking rule. The global RNG
    is forked: evaluating changes no training number."""
    from mmrl.vlm.rollout import SamplingParams

    with torch.random.fork_rng(devices=[]):
        res = engine.generate([_request(cfg, processor, it, n=1) for it in items],
                              SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens,
                                             stop=cfg.rollout.stop))
        users = [it.prompt for it in items]
        variants = {"": [rewrite_of(x.text, u, cfg.data.answer_pattern)[0] for x, u in zip(res, users)]}
        if baselines:
            variants["identity/"] = users
            if cfg.reward.intent_key:
                variants["intent/"] = [_target(it, cfg.reward.intent_key) for it in items]
        targets = [_target(it, cfg.reward.intent_key) for it in items]
        out: dict[str, float] = {}
        for prefix, prompts in variants.items():
            gen = torch.Generator(device=renderer.device).manual_seed(cfg.seed + 12345)
            images = render(renderer, prompts, cfg.renderer, generator=gen)
            o = reward_fn(images=images, prompts=targets, metadata=[it.metadata for it in items])
            out[f"eval/{prefix}reward/mean"] = float(o.scores.float().mean())
            for k in getattr(reward_fn, "components", {}):
                out[f"eval/{prefix}reward/{k}"] = float(torch.as_tensor(o.details[k]).float().mean())
            if prefix == "" and judges is not None:
                out.update(judges.observe(step, o.scores, images=images, prompts=targets,
                                          metadata=[it.metadata for it in items]))
            if prefix == "":
                save_rewrites(run, step, f"eval_step_{step:06d}", images, users, prompts, o.scores.float(),
                              cfg.log.num_samples)
    return out


def _warm_start_pairs(cfg: Config, processor: Any, items: list, eos_id: int):
    """`next_pairs(step)` of the format warm start, on its own data stream (the RL data order is untouched): pairs
    from data.format_examples, or random training prompts with random rewrites drawn from it as targets."""
    from mmrl.pipelines.data import PromptSampler, load_prompts
    from mmrl.vlm.common import encode_prompt

    examples = load_prompts(cfg.data.format_examples)
    paired = any("response" in it.metadata for it in examples)  # a file of pairs: each row's own response
    bad = [i for i, it in enumerate(examples) if paired and not isinstance(it.metadata.get("response"), str)]
    if bad:
        raise ValueError(f"data.format_examples {cfg.data.format_examples}: row {bad[0]} has no string 'response'")
    stream = PromptSampler(examples if paired else items, seed=cfg.seed + 104729)
    rng, tok, texts = random.Random(cfg.seed), processor.tokenizer, [it.prompt for it in examples]

    def next_pairs(_step: int):
        rows = stream.next(cfg.warm_start.batch_size)
        enc = [encode_prompt(processor, q.prompt_text, q.images) for q in (_request(cfg, processor, it) for it in rows)]
        targets = [tok.encode(it.metadata["response"] if paired else rng.choice(texts)) + [eos_id] for it in rows]
        return [e.input_ids for e in enc], targets, [e.mm for e in enc]
    return next_pairs
