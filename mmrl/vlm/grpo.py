"""GRPO-family RL for Qwen-VL policies: rollout -> rewards -> advantages -> loss -> optimizer step.

One step: sample `rollout.batch_size` prompts, generate `rollout.n` responses each, score them with a
reward from the zoo (+ DAPO soft overlong punishment), optionally keep only groups whose rewards differ
(DAPO dynamic sampling, regenerating up to `algo.max_gen_batches` rounds), compute advantages with a
registered estimator (grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline), then `algo.ppo_epochs`
passes of clipped policy-gradient updates (clip-higher, token-level aggregation modes, KL to the reference
as a loss term or a reward penalty) in mini-batches with gradient accumulation over micro-batches.

Several processes (`torchrun ... dist.strategy=ddp`, see mmrl/distributed.py): `rollout.batch_size` and
`algo.mini_batch_size` stay global; every rank generates its contiguous share of the step's prompts, advantages
use the all-gathered rewards (group statistics over the whole batch), each rank's loss is weighted so DDP's
gradient average equals the gradient of the global mini-batch loss, every rank runs the same number of
mini-batches (a zero-weight micro-batch when it has nothing left), DAPO rounds stop on the minimum kept count over
ranks, and rank 0 alone logs, saves samples, evaluates and writes checkpoints (resumable on any number of ranks).

`dist.strategy=fsdp` (LoRA or full fine-tuning, HF engine): the model's decoder layers are sharded with FSDP2 (the vision tower stays in
the root unit, so text-only and image forwards issue the same collectives) before the optimizer is built, and
`PolicyStates.refresh()` follows the shards. FSDP needs paired forwards on every rank: ranks get equal prompt counts,
a rank whose responses all finished keeps running masked decode forwards until every rank is done
(`HFRolloutEngine(step_sync=ctx.any_rank)`); with DAPO dynamic sampling ranks keep different numbers of rows, so the
old/reference passes run inside `LockstepForwards` (dummy forwards pair the extra ones) and training mini-batches are
padded to equal micro-batch counts with zero-weight ones; the vision-feature cache is off, and evaluation runs on
every rank (rank 0 reports). Checkpoints gather full adapters and AdamW state (collective; the same files DDP writes).

Vision features (`train.reuse_vision_features`): each prompt's images go through the vision tower once per step
and the features are reused by its n responses and by the reference / old / training log-prob passes
(`mmrl.vlm.common.VisionCache`); the training pass recomputes them when the vision tower is trained.

The reference policy is the same model with LoRA adapters off (`PolicyStates.use("ref")`), or a frozen
snapshot for full fine-tuning. Log-probs are `log_softmax(logits / temperature)` everywhere.

Format warm start (`warmup.sft_steps`, synthetic shapes data only): a few supervised steps on answers
drawn uniformly from the question's answer vocabulary (NOT the true answers), teaching the randomly
initialised tiny model the answer format only; RL then has to learn the content from the image.
"""

from __future__ import annotations

import importlib.util
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from mmrl.config import RunConfig, TrainConfig
from mmrl.core import agg_loss, clipped_policy_loss, get_advantage_estimator, kl_estimate
from mmrl.pipelines.data import GEO3K_TEMPLATE, PromptSampler, VQAItem, load_visual_qa, require_path
from mmrl.distributed import (DistConfig, DistContext, LockstepForwards, full_optimizer_state_dict,
                               load_full_optimizer_state_dict)
from mmrl.runtime import Run, Timer, get_rng_state, seed_everything, set_rng_state
from mmrl.training import (NONFINITE_KEY, OnNonfinite, UpdateGuard, check_finite_weights, check_rewards, finite_stats,
                           group_keep)
from mmrl.vlm.common import (ShapesQA, VisionCache, collate, compute_logprobs, encode_prompt, language_block_types,
                             load_policy, messages_from_text, pad_to, render_prompt, response_logprobs,
                             vision_has_adapters, vision_tower, vision_tower_trainable)
from mmrl.vlm.rollout import ENGINES, GenRequest, SamplingParams, make_engine


@dataclass
class ModelConfig:
    path: str = ""
    """Local checkpoint directory (transformers format: Qwen2-VL, Qwen2.5-VL, Qwen3-VL). Never a hub id."""
    build_tiny: str = ""
    """Demo only: if `path` has no checkpoint, build this tiny random model there first (qwen2_vl | qwen25_vl)."""
    finetune: str = "lora"
    """`lora` (adapters on the language model; ref = adapters off) or `full` (ref = a weight snapshot, +1x memory)."""
    lora_rank: int = 64
    """LoRA rank r."""
    lora_alpha: int = 64
    """LoRA alpha (scale alpha / r)."""
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj"])
    """Language-model linear layers that get LoRA (matched by name under the language model only)."""
    train_vision: bool = False
    """Also train the vision tower (LoRA on its qkv/proj/fc1/fc2/gate/up/down, or its full weights); else frozen."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% slower); for real model sizes."""
    freeze: list[str] = field(default_factory=list)
    """Exclude parameters whose name contains one of these (e.g. lm_head, embed_tokens) from the RL updates (the
    format warm start still trains them). Adam moves rarely-used vocabulary rows by ~lr per step on noise alone."""


@dataclass
class DataConfig:
    kind: str = "shapes"
    """`shapes` (synthetic scenes, exact answers, infinite, seeded) or `geo3k` (jsonl/parquet via load_visual_qa)."""
    path: str = ""
    """geo3k: training file (.jsonl/.json/.parquet) with images/problem/answer."""
    val_path: str = ""
    """geo3k: optional held-out file for greedy eval accuracy (first `eval_size` rows)."""
    image_root: str = ""
    """geo3k: folder relative image paths are resolved against (default: the file's folder)."""
    template: str = GEO3K_TEMPLATE
    """Prompt template: geo3k uses {problem}; shapes uses {question}."""
    system_prompt: str = ""
    """Optional system message (empty: the chat template's default)."""
    on_error: str = "skip"
    """geo3k rows with an unreadable image: `skip` (warn with the path) or `raise`."""
    limit: int = 0
    """geo3k: use at most this many rows (0 = all)."""
    qa_kinds: list[str] = field(default_factory=lambda: ["color"])
    """shapes: question kinds to draw from (color, count, shape, position)."""
    colors: list[str] = field(default_factory=lambda: ["red", "green", "blue", "yellow", "orange", "purple"])
    """shapes: shape colours."""
    backgrounds: list[str] = field(default_factory=lambda: ["white"])
    """shapes: background colours."""
    n_shapes: list[int] = field(default_factory=lambda: [1, 1])
    """shapes: inclusive [min, max] number of shapes per scene."""
    shape_size: list[float] = field(default_factory=lambda: [0.3, 0.5])
    """shapes: [min, max] shape size as a fraction of the image side."""
    image_size: int = 56
    """shapes: rendered image side in pixels (56 = 4 vision tokens for a Qwen-VL after merging)."""
    min_pixels: int = 0
    """Resize every image to at least this many pixels (qwen smart_resize; 0 = the processor's own limits)."""
    max_pixels: int = 0
    """Resize every image to at most this many pixels (0 = the processor's own limits)."""
    eval_size: int = 64
    """Fixed eval prompts (shapes: a separate seeded stream) scored greedily."""


@dataclass
class RolloutConfig:
    engine: str = "hf"
    """`hf` (transformers sampling loop) or `vllm` (needs the [vllm] extra and a GPU)."""
    batch_size: int = 8
    """Prompts per RL step (groups)."""
    n: int = 8
    """Responses per prompt (group size); >= 2 for the group-relative estimators (grpo, dr_grpo, rloo,
    reinforce_pp_baseline) and dynamic sampling; reinforce_pp (batch-whitened) also trains with 1."""
    temperature: float = 1.0
    """Sampling temperature (log-probs use the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = -1
    """Top-k filter (<= 0 = off)."""
    max_new_tokens: int = 16
    """Maximum response length in tokens."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (the response is cut after the token completing one; finish_reason 'stop')."""
    gen_batch_size: int = 64
    """Max sequences decoded together by the HF engine."""
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra vllm.LLM(...) arguments (gpu_memory_utilization, tensor_parallel_size, ...)."""


@dataclass
class RewardConfig:
    name: str = "exact_match"
    """Reward from the zoo (mmrl.rewards.available()); scored on the response text with metadata['answer']."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for mmrl.rewards.load(name, **kwargs)."""
    accuracy_key: str = ""
    """details key with 0/1 accuracy (e.g. `accuracy` for geo3k); empty: accuracy = score > 0.5."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: penalise responses longer than max_new_tokens - this (0 = off)."""
    overlong_penalty: float = 1.0
    """Penalty at max_new_tokens (linear ramp over the buffer)."""
    on_nonfinite: OnNonfinite = "error"
    """A NaN/inf reward: `error` (stop, naming the reward component and the response) or `drop_sample` (train
    without it: it leaves its group's advantage statistics, a group left with < 2 responses is not trained on; the
    count is logged as reward/nonfinite_samples)."""


@dataclass
class AlgoConfig:
    advantage: str = "grpo"
    """Advantage estimator from mmrl.core (grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and generate more until the batch is full."""
    max_gen_batches: int = 4
    """DAPO: at most this many generation rounds per step; then train on the groups kept so far."""
    clip_low: float = 0.2
    """PPO clip epsilon below 1."""
    clip_high: float = 0.28
    """PPO clip epsilon above 1 (clip-higher; = clip_low for symmetric PPO)."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 for negative advantages (0 = off)."""
    loss_agg: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (norm = max_new_tokens)."""
    kl_coef: float = 0.0
    """Weight of KL(policy || reference) (0 = no reference forward)."""
    kl_estimator: str = "k3"
    """k1 | k2 | k3 (low_var_kl) | abs."""
    kl_in_reward: bool = False
    """Subtract kl_coef * sum_t KL_t from each sequence reward instead of adding a loss term."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (0 = entropy is only logged)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batch_size: int = 0
    """Sequences per optimizer step (0 = the whole rollout batch, one step per epoch)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward (gradient accumulation inside a mini-batch)."""
    old_logprobs: str = "auto"
    """`recompute` (a forward before updating), `rollout` (the engine's) or `auto` (recompute when more than
    one update per rollout or with vLLM)."""


@dataclass
class WarmupConfig:
    sft_steps: int = 0
    """Format-only warm start steps (shapes only; answers drawn uniformly from the answer vocabulary)."""
    lr: float = 1e-3
    """Warm-start learning rate (Adam)."""
    batch_size: int = 32
    """Warm-start prompts per step."""
    params: list[str] = field(default_factory=lambda: ["lm_head"])
    """Train only parameters whose name contains one of these (empty = all). Fitting random answers teaches
    the model to ignore the image, so by default only the output layer learns the format."""


@dataclass
class LogConfig:
    sample_every: int = 25
    """Save a grid of (image, question, response, reward) to samples/ every this many steps (0 = off)."""
    n_samples: int = 16
    """Samples per grid."""
    eval_every: int = 25
    """Greedy eval accuracy on the fixed eval prompts every this many steps (0 = only first and last)."""


@dataclass
class VLMTrainConfig(TrainConfig):
    lr: float = 1e-6
    """Adam(W) learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max gradient norm (0 = off)."""
    lr_warmup_steps: int = 0
    """Linear learning-rate warm-up (optimizer steps)."""
    reuse_vision_features: bool = True
    """Run the vision tower once per prompt image set per step and reuse the features for all n responses and
    the reference / old / training log-prob passes (exact: same embeddings). The training pass still recomputes
    them with gradients when the vision tower is trained; a reference pass with LoRA on the vision tower gets its
    own cache. false = every forward runs the vision tower (the plain path)."""


@dataclass
class Config(RunConfig):
    algorithm: str = "vlm_grpo"
    """Recipe name."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and ground truth."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward and reward shaping."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Advantages, loss, KL, updates."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """Optional format-only warm start (part of the tiny recipe)."""
    log: LogConfig = field(default_factory=LogConfig)
    """Samples and eval."""
    train: VLMTrainConfig = field(default_factory=VLMTrainConfig)
    """Training loop."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Multi-process training under torchrun / accelerate launch (strategy none|ddp|fsdp (LoRA, hf engine, no
    dynamic sampling), backend, find_unused_parameters)."""


# ---------------------------------------------------------------------------------------------- data


def build_data(cfg: Config) -> tuple[Any, list[VQAItem]]:
    """(resumable training stream with .next(n)/.state_dict(), fixed eval items)."""
    d = cfg.data
    if d.kind == "shapes":
        return ShapesQA(d, cfg.seed), ShapesQA(d, cfg.seed + 7919).next(d.eval_size)
    if d.kind == "geo3k":
        if not d.path:
            raise ValueError("data.path: geo3k data needs a .jsonl/.json/.parquet file")
        kw = dict(image_root=d.image_root or None, template=d.template, on_error=d.on_error)
        items = load_visual_qa(d.path, limit=d.limit or None, **kw)
        evals = load_visual_qa(d.val_path, limit=d.eval_size, **kw) if d.val_path and d.eval_size else []
        return PromptSampler(items, seed=cfg.seed), evals
    raise ValueError(f"data.kind: expected 'shapes' or 'geo3k', got {d.kind!r}")


def to_request(item: VQAItem, processor: Any, data: DataConfig, n: int | None = None) -> GenRequest:
    text = render_prompt(processor, messages_from_text(item.prompt, data.system_prompt or None))
    images = list(item.images)
    if data.min_pixels or data.max_pixels:
        from mmrl.pipelines.images import resize_for_qwen

        images = [resize_for_qwen(im, data.min_pixels or None, data.max_pixels or None) for im in images]
    return GenRequest(prompt_text=text, images=images, n=n, metadata=item.metadata)


# ---------------------------------------------------------------------------------------------- pieces


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO soft overlong punishment: 0 up to max_len - buffer, then linearly down to -factor at max_len.

    lengths[B] -> penalty[B] (<= 0)."""
    # source: DAPO arXiv 2503.14476 eq. 13; verl dapo reward manager (overlong_buffer)
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    exceed = lengths.float() - (max_len - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0)


def keep_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling filter: bool[B], True for samples whose group has reward variance > 0."""
    _, inv = torch.unique(group_ids, return_inverse=True)
    g = int(inv.max()) + 1
    lo = torch.full((g,), float("inf")).scatter_reduce(0, inv, rewards.float(), "amin")
    hi = torch.full((g,), float("-inf")).scatter_reduce(0, inv, rewards.float(), "amax")
    return (hi > lo)[inv]


def score(reward_model: Any, results: list, cfg: Config, validate: bool = False
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(scores[B] incl. overlong penalty, components {name: [B]}, accuracy[B]).

    `validate`: NaN/inf scores raise naming the component and the response (`reward.on_nonfinite: error`), or stay
    in the scores as the mark of a dropped sample (`drop_sample`; `collect_rollouts` keeps only finite ones)."""
    out = reward_model(completions=[r.text for r in results], metadata=[r.metadata for r in results])
    base = out.scores.float()
    if validate:
        check_rewards(base, out.details, cfg.reward.on_nonfinite, reward=getattr(reward_model, "name", cfg.reward.name),
                      components=list(getattr(reward_model, "components", {})),
                      labels=[f"prompt {r.request_index}, response {r.sample_index}: {r.text[:40]!r}" for r in results])
    comps = {k: v.float() for k, v in out.details.items() if isinstance(v, torch.Tensor) and v.shape == base.shape}
    key = cfg.reward.accuracy_key
    acc = comps[key] if key else (base > 0.5).float()
    lengths = torch.tensor([len(r.response_ids) for r in results])
    pen = overlong_penalty(lengths, cfg.rollout.max_new_tokens, cfg.reward.overlong_buffer, cfg.reward.overlong_penalty)
    if cfg.reward.overlong_buffer > 0:
        comps["overlong"] = pen
    return base + pen, comps, acc


@dataclass
class Rollouts:
    """What one step trains on (kept groups, request-major) plus every generated sample's score for logging."""

    results: list
    items: list
    scores: torch.Tensor
    comps: dict
    group_ids: torch.Tensor
    all_scores: torch.Tensor
    all_acc: torch.Tensor
    rounds: int
    all_kinds: list = field(default_factory=list)
    nonfinite: int = 0  # samples dropped for a NaN/inf reward (reward.on_nonfinite: drop_sample)


def collect_rollouts(next_items: Callable[[int], list], generate: Callable[[list], list],
                     score_fn: Callable[[list], tuple], batch_size: int, n: int, dynamic: bool,
                     max_rounds: int, count: Callable[[list], int] = len) -> Rollouts:
    """Generate `n` responses for `batch_size` prompts; with `dynamic` (DAPO) drop groups whose rewards are all
    equal and generate further rounds (at most `max_rounds`) until `batch_size` groups are kept.

    `generate(items) -> results` (each with `.request_index` into items), `score_fn(results) -> (scores[B],
    components {name: [B]}, accuracy[B])`. Without `dynamic` exactly one round is kept whole. `count(kept)` is
    the kept sample count the stopping rule reads (several processes: the minimum over ranks, so every rank runs
    the same rounds and consumes the same global data). A non-finite score marks a dropped sample: it is never
    kept, and neither is the rest of a group left with fewer than 2 finite scores (with n >= 2)."""
    # source: DAPO arXiv 2503.14476 sec. 3.2 (dynamic sampling); verl dapo ray_trainer (max_num_gen_batches)
    kept, kept_items, S, C, gids, all_s, all_a, kinds = [], [], [], {}, [], [], [], []
    rounds = nonfinite = 0
    while rounds < (max(1, max_rounds) if dynamic else 1) and count(kept) < batch_size * n:
        rounds += 1
        items = next_items(batch_size)
        results = generate(items)
        scores, comps, acc = score_fn(results)
        all_s.append(scores), all_a.append(acc)
        kinds += [getattr(r, "metadata", {}).get("kind") for r in results]
        ids = torch.tensor([r.request_index for r in results])
        finite = torch.isfinite(scores)
        nonfinite += int((~finite).sum())
        keep = group_keep(finite, ids, min_size=min(2, n))  # all True when every score is finite
        if dynamic and keep.any():
            keep[keep.clone()] = keep_groups(scores[keep], ids[keep])
        for i in keep.nonzero().flatten().tolist():
            if len(kept) >= batch_size * n:
                break
            kept.append(results[i])
            kept_items.append(items[results[i].request_index])
            S.append(scores[i]), gids.append(rounds * 1_000_000 + results[i].request_index)
            for k, v in comps.items():
                C.setdefault(k, []).append(v[i])
    empty = torch.zeros(0)
    return Rollouts(kept, kept_items, torch.stack(S) if S else empty, {k: torch.stack(v) for k, v in C.items()},
                    torch.tensor(gids, dtype=torch.long), torch.cat(all_s), torch.cat(all_a), rounds, kinds, nonfinite)


def build_policy(cfg: Config, device: torch.device, dtype: torch.dtype):
    from mmrl.adapters import PolicyStates

    m = cfg.model
    path = Path(m.path)
    if m.build_tiny and not (path / "config.json").is_file():
        from mmrl import tiny

        builders = {"qwen2_vl": tiny.build_tiny_qwen2_vl, "qwen25_vl": tiny.build_tiny_qwen25_vl}
        if m.build_tiny not in builders:
            raise ValueError(f"model.build_tiny: expected one of {sorted(builders)}, got {m.build_tiny!r}")
        builders[m.build_tiny](path, seed=0)
    model, processor = load_policy(path, device, dtype)
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    keep_ref = cfg.algo.kl_coef > 0
    if m.finetune == "full":
        if not m.train_vision:
            for n, p in model.named_parameters():
                if ".visual." in f".{n}":
                    p.requires_grad_(False)
        return PolicyStates(model, None, keep_ref_copy=keep_ref), processor
    if m.finetune != "lora":
        raise ValueError(f"model.finetune: expected 'lora' or 'full', got {m.finetune!r}")
    from peft import LoraConfig

    lm = "|".join(m.lora_target_modules)
    pattern = rf".*language_model.*\.({lm})"
    if m.train_vision:
        pattern += r"|.*visual\.blocks.*\.(qkv|proj|fc1|fc2|gate_proj|up_proj|down_proj)"
    lora = LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha, target_modules=pattern, lora_dropout=0.0)
    return PolicyStates(model, lora), processor


def agg_weight(mask: torch.Tensor, mini_mask_sum: float, mini_rows: int, mode: str) -> float:
    """Share of a mini-batch's loss that one micro-batch carries, so accumulated grads equal the full-batch loss."""
    if mode == "token-mean":
        return float(mask.sum()) / max(mini_mask_sum, 1.0)
    return float((mask.sum(-1) > 0).sum()) / max(mini_rows, 1)


def per_kind(acc: torch.Tensor, kinds: list, prefix: str) -> dict[str, float]:
    """{prefix/<kind>: mean accuracy} for samples that carry a question kind (shapes data)."""
    out: dict[str, list[float]] = {}
    for a, k in zip(acc.tolist(), kinds):
        if k is not None:
            out.setdefault(f"{prefix}/{k}", []).append(a)
    return {k: sum(v) / len(v) for k, v in out.items()} if len(out) > 1 else {}


@torch.no_grad()
def evaluate(engine: Any, processor: Any, items: list[VQAItem], reward_model: Any, cfg: Config) -> dict[str, float]:
    """Greedy accuracy on the fixed eval items: {"eval/accuracy": ..., "eval/accuracy/<kind>": ...}."""
    if not items:
        return {}
    reqs = [to_request(it, processor, cfg.data, n=1) for it in items]
    res = engine.generate(reqs, SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens,
                                                stop=cfg.rollout.stop))
    _, _, acc = score(reward_model, res, cfg)
    return {"eval/accuracy": float(acc.mean()), **per_kind(acc, [it.metadata.get("kind") for it in items], "eval/accuracy")}


def format_warmup(states: Any, processor: Any, data: ShapesQA, cfg: Config, pad_id: int, eos_id: int) -> float:
    """Supervised steps on random answers from each question's answer vocabulary (format only; see module doc)."""
    w = cfg.warmup
    if cfg.data.kind != "shapes":
        raise ValueError("warmup.sft_steps > 0 needs data.kind=shapes (answer vocabularies are known there only)")
    model, tok = states.model, processor.tokenizer
    params = [p for n, p in states.named_trainable_parameters() if not w.params or any(k in n for k in w.params)]
    if not params:
        raise ValueError(f"warmup.params={w.params}: no trainable parameter name contains any of them")
    opt = torch.optim.Adam(params, lr=w.lr)
    stream = ShapesQA(cfg.data, cfg.seed + 104729)  # its own prompts: the RL stream is untouched
    rng = random.Random(cfg.seed)
    loss = torch.zeros(())
    for _ in range(w.sft_steps):
        items = stream.next(w.batch_size)
        reqs = [to_request(it, processor, cfg.data) for it in items]
        enc = [encode_prompt(processor, r.prompt_text, r.images) for r in reqs]
        targets = [tok.encode(rng.choice(it.metadata["choices"])) + [eos_id] for it in items]
        batch, P, mask = collate(model, [e.input_ids for e in enc], targets, [e.mm for e in enc], pad_id)
        logp, _ = response_logprobs(model, batch, P, batch["input_ids"][:, P:])
        loss = -agg_loss(logp, mask, "token-mean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return float(loss.detach())


# ---------------------------------------------------------------------------------------------- train


def policy_update(model: Any, optimizer: Any, sched: Any, params: list, P_ids: list, R_ids: list, MM: list,
                  old_lp: list, ref_lp: list | None, adv: torch.Tensor, pad_id: int, cfg: Config, *,
                  ctx: DistContext | None = None, train_model: Any = None, vision_cache: VisionCache | None = None,
                  n_local: int | None = None, equal_micro_batches: bool = False, guard: UpdateGuard | None = None,
                  step: int = 0) -> tuple[dict[str, float], float]:
    """`ppo_epochs` passes of mini-batch optimizer steps with micro-batch gradient accumulation.

    Returns (mean metrics, drift): drift = max |log p - old log p| over the first mini-batch, before any step.

    Several processes: `ctx` (a DistContext), `train_model` = the DDP-wrapped `model` (used for the grad-enabled
    forward; `model` is used for collate). `algo.mini_batch_size` is global (each rank takes its 1/world share);
    every rank runs max-over-ranks mini-batches, a rank without rows left runs a zero-weight micro-batch on row 0
    so the gradient all-reduce stays paired; gradients are all-reduced once per mini-batch (`no_sync` on the
    others); loss weights `ctx.loss_scale` make DDP's average the gradient of the global mini-batch loss.
    `n_local` = rows that really count (0: the rows are a placeholder for a rank that kept nothing; default all).
    `vision_cache`: reuse image features in the training forward (bypassed by the cache itself when the vision
    tower requires grad). `equal_micro_batches` (FSDP, where every forward/backward is a collective): each
    mini-batch runs max-over-ranks micro-batches, the missing ones as zero-weight micro-batches on row 0.
    `guard` (`mmrl.training.UpdateGuard`): a mini-batch whose loss or gradient norm is NaN/inf is not applied."""
    al, ro = cfg.algo, cfg.rollout
    ctx = ctx if ctx is not None else DistContext()
    guard = guard or UpdateGuard(cfg.train.max_skipped_updates, ctx)
    fwd = train_model if train_model is not None else model
    N = len(P_ids) if n_local is None else n_local
    if ctx.enabled:  # mini_batch_size is global; loop counts agree over ranks
        mb = al.mini_batch_size // ctx.world_size or ctx.max_int(N)
        n_rows = ctx.max_int(N)
    else:
        mb, n_rows = al.mini_batch_size or N, N
    stats: dict[str, list[float]] = {}
    drift = 0.0
    n_padding = 0
    for epoch in range(al.ppo_epochs):
        for s0 in range(0, n_rows, mb):
            idx = list(range(s0, min(N, s0 + mb)))
            mini_tokens = float(sum(len(R_ids[i]) for i in idx))
            scale, placeholder = 1.0, False
            if ctx.enabled:
                scale = ctx.loss_scale(mini_tokens if al.loss_agg == "token-mean" else len(idx))
                if not idx:  # nothing left on this rank: a zero-weight micro-batch joins the all-reduce
                    idx, scale, placeholder = [0], 0.0, True
            optimizer.zero_grad(set_to_none=True)
            losses = []  # this mini-batch's real micro-batch losses (the update guard checks them)
            micro = [idx[m0:m0 + al.micro_batch_size] for m0 in range(0, len(idx), al.micro_batch_size)]
            if equal_micro_batches and ctx.enabled:
                micro += [None] * (ctx.max_int(len(micro)) - len(micro))
            for j, mi in enumerate(micro):
                padding = mi is None  # FSDP: a zero-weight micro-batch that pairs another rank's extra one
                mi = [0] if padding else mi
                n_padding += padding
                with ctx.no_sync(fwd, sync=j == len(micro) - 1):  # forward AND backward inside
                    batch, P, mask = collate(model, [P_ids[i] for i in mi], [R_ids[i] for i in mi],
                                             [MM[i] for i in mi], pad_id)
                    if vision_cache is not None:
                        batch = vision_cache.apply(batch, [MM[i] for i in mi])
                    T = mask.shape[1]
                    old = pad_to([old_lp[i].tolist() for i in mi], 0.0, torch.float32, length=T).to(mask.device)
                    logp, ent = response_logprobs(fwd, batch, P, batch["input_ids"][:, P:], ro.temperature,
                                                  with_entropy=True, entropy_grad=al.entropy_coef != 0)
                    if epoch == 0 and s0 == 0 and not (placeholder or padding):  # before the first optimizer step
                        drift = max(drift, float(((logp.detach() - old).abs() * mask).max()) if T else 0.0)
                    loss, m = clipped_policy_loss(logp, old, adv[mi], mask, al.clip_low, al.clip_high,
                                                  al.dual_clip or None, al.loss_agg, ro.max_new_tokens)
                    ent_mean = agg_loss(ent, mask, al.loss_agg, ro.max_new_tokens)
                    if al.entropy_coef:
                        loss = loss - al.entropy_coef * ent_mean
                    kl = None
                    if ref_lp is not None and not al.kl_in_reward:
                        ref = pad_to([ref_lp[i].tolist() for i in mi], 0.0, torch.float32, length=T).to(mask.device)
                        kl = agg_loss(kl_estimate(logp, ref, al.kl_estimator), mask, al.loss_agg, ro.max_new_tokens)
                        loss = loss + al.kl_coef * kl
                    weight = 0.0 if padding else agg_weight(mask, mini_tokens, len(idx), al.loss_agg) * scale
                    (loss * weight).backward()
                if placeholder or padding:
                    continue
                losses.append(loss.detach())
                if kl is not None:
                    stats.setdefault("kl", []).append(float(kl.detach()))
                for k in ("clipfrac", "approx_kl", "pg_loss", "ratio_max"):
                    stats.setdefault(f"actor/{k}", []).append(m[k])
                stats.setdefault("actor/entropy", []).append(float(ent_mean.detach()))
            # FSDP2 DTensor gradients included; the norm is computed (for the guard) even without clipping
            gn = ctx.clip_grad_norm_(params, cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf)
            if cfg.train.grad_clip > 0:
                stats.setdefault("actor/grad_norm", []).append(gn)
            if guard.step(optimizer, losses, gn, step):  # NaN/inf loss or gradient: skipped
                sched.step()
    out = {k: max(v) if k.endswith("ratio_max") else sum(v) / len(v) for k, v in stats.items()}
    out["actor/lr"] = sched.get_last_lr()[0]
    if equal_micro_batches and ctx.enabled:
        out["dist/padding_micro_batches"] = sum(ctx.all_gather_object(n_padding))  # summed over ranks
    return out, drift


def check_fsdp_images(items: Sequence[Any]) -> None:
    """FSDP with a trained vision tower: every prompt must show an image. A text-only row leaves the tower without
    gradients on one rank, and FSDP2 reduce-scatters only the gradients that exist, so the collectives would not
    pair (DDP handles it with find_unused_parameters)."""
    bad = [i for i, it in enumerate(items) if not getattr(it, "images", None)]
    if bad:
        raise ValueError(f"dist.strategy=fsdp with a trained vision tower (model.train_vision=true) needs an image in "
                         f"every prompt; {len(bad)} of {len(items)} prompts have none (first: index {bad[0]}); set "
                         f"model.train_vision=false or use dist.strategy=ddp")


def check_config(cfg: Config) -> None:
    """Fail before loading any model on names and numbers that would only be read mid-run."""
    from mmrl.core import AGG_MODES

    al = cfg.algo
    if al.loss_agg not in AGG_MODES:
        raise ValueError(f"algo.loss_agg: expected one of {list(AGG_MODES)}, got {al.loss_agg!r}")
    if al.old_logprobs not in ("auto", "recompute", "rollout"):
        raise ValueError(f"algo.old_logprobs: expected auto | recompute | rollout, got {al.old_logprobs!r}")
    kl_estimate(torch.zeros(1), torch.zeros(1), al.kl_estimator)  # unknown names raise with the valid list
    get_advantage_estimator(al.advantage)
    for name in ("micro_batch_size", "ppo_epochs"):
        if getattr(al, name) < 1:
            raise ValueError(f"algo.{name}: expected >= 1, got {getattr(al, name)}")
    if cfg.dist.strategy == "fsdp":
        if cfg.rollout.engine != "hf":
            raise ValueError("dist.strategy=fsdp: vlm_grpo supports FSDP with rollout.engine=hf only")
    if al.old_logprobs == "rollout" and (al.ppo_epochs > 1 or al.mini_batch_size not in (0, cfg.rollout.batch_size * cfg.rollout.n)):
        raise ValueError("algo.old_logprobs=rollout needs exactly one update per rollout (ppo_epochs=1, mini_batch_size=0)")
    ro, d, w, log = cfg.rollout, cfg.data, cfg.warmup, cfg.log
    # sizes that would otherwise fail deep inside a step (empty torch.cat, negative shapes) or train on nothing
    for key, value, least in (("rollout.batch_size", ro.batch_size, 1), ("rollout.n", ro.n, 1),
                              ("rollout.max_new_tokens", ro.max_new_tokens, 1),
                              ("rollout.gen_batch_size", ro.gen_batch_size, 1),
                              ("rollout.temperature", ro.temperature, 0), ("algo.mini_batch_size", al.mini_batch_size, 0),
                              ("algo.max_gen_batches", al.max_gen_batches, 1),
                              ("reward.overlong_buffer", cfg.reward.overlong_buffer, 0),
                              ("model.lora_rank", cfg.model.lora_rank, 1 if cfg.model.finetune == "lora" else 0),
                              ("data.eval_size", d.eval_size, 0), ("data.limit", d.limit, 0),
                              ("data.min_pixels", d.min_pixels, 0), ("data.max_pixels", d.max_pixels, 0),
                              ("data.image_size", d.image_size, 4 if d.kind == "shapes" else 0),  # render_scene's least
                              ("warmup.sft_steps", w.sft_steps, 0),
                              ("warmup.batch_size", w.batch_size, 1 if w.sft_steps else 0),
                              ("log.sample_every", log.sample_every, 0), ("log.eval_every", log.eval_every, 0),
                              ("log.n_samples", log.n_samples, 1 if log.sample_every else 0)):
        if value < least:
            raise ValueError(f"{key}: expected >= {least}, got {value}")
    if not 0 < ro.top_p <= 1:
        raise ValueError(f"rollout.top_p: expected 0 < top_p <= 1, got {ro.top_p}")
    if ro.n < 2 and al.dynamic_sampling:
        raise ValueError(f"rollout.n={ro.n}: algo.dynamic_sampling keeps only groups whose rewards differ, which needs "
                         f"rollout.n >= 2")
    if ro.n < 2 and _needs_groups(al.advantage):
        raise ValueError(f"rollout.n={ro.n}: algo.advantage={al.advantage} compares the responses to one prompt, so a "
                         f"group of one gets advantage 0 and nothing would train; use rollout.n >= 2 (or "
                         f"algo.advantage=reinforce_pp, which normalises over the whole batch)")
    if ro.batch_size * ro.n < 2:
        raise ValueError(f"rollout.batch_size * rollout.n = {ro.batch_size * ro.n}: one response per step has "
                         f"advantage 0 under every estimator; use at least 2")
    if ro.engine not in ENGINES:
        raise ValueError(f"unknown rollout engine {ro.engine!r} (rollout.engine); valid: {list(ENGINES)}")
    if ro.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError("rollout.engine=vllm: vLLM is not installed (pip install 'mmrl[vllm]', CUDA GPU only); "
                         "use rollout.engine=hf")
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
    elif d.kind == "geo3k":
        if not d.path:
            raise ValueError("data.path: geo3k data needs a .jsonl/.json/.parquet file")
        require_path("data.path", d.path, "data file")
        if d.val_path:
            require_path("data.val_path", d.val_path, "data file")
        if d.image_root:
            require_path("data.image_root", d.image_root, "image folder", kind="dir")
    else:
        raise ValueError(f"data.kind: expected 'shapes' or 'geo3k', got {d.kind!r}")


def _needs_groups(advantage: str) -> bool:
    """True when the estimator gives every group of one sample advantage 0 (grpo, dr_grpo, rloo,
    reinforce_pp_baseline: all relative to the group); reinforce_pp whitens over the whole batch and does not.
    Asked of the estimator itself, so registered custom estimators are judged the same way."""
    adv = get_advantage_estimator(advantage)(torch.tensor([0.0, 1.0]), torch.tensor([0, 1]))
    return not bool(adv.abs().sum() > 0)


def train(cfg: Config) -> dict:
    check_config(cfg)
    ctx = DistContext.init(cfg.dist.backend)
    world = ctx.world_size
    for key, value in (("rollout.batch_size", cfg.rollout.batch_size), ("algo.mini_batch_size", cfg.algo.mini_batch_size)):
        if value % world:
            raise ValueError(f"{key}={value} (global, over all processes) must be divisible by the number of "
                             f"processes ({world})")
    if not ctx.is_main:
        os.environ["MMRL_NO_PROGRESS"] = "1"
    with ctx.main_process_first():
        run = Run(cfg, write_config=ctx.is_main)
    if ctx.enabled:
        run.device = ctx.device  # cuda:LOCAL_RANK (or cpu under gloo)
    timer = Timer(sync_cuda=run.device.type == "cuda")
    with ctx.main_process_first():  # rank 0 builds the tiny demo model (model.build_tiny) before the others load it
        states, processor = build_policy(cfg, run.device, run.dtype)
    model = states.model
    tok = processor.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    ro, al = cfg.rollout, cfg.algo
    fsdp = ctx.enabled and cfg.dist.strategy == "fsdp"
    engine_kw = {"batch_size": ro.gen_batch_size} if ro.engine == "hf" else dict(ro.vllm_kwargs)
    if fsdp:  # every rank runs the same number of decode forwards (finished ranks run masked ones)
        engine_kw["step_sync"] = ctx.any_rank
    engine = make_engine(ro.engine, model, processor, model_path=cfg.model.path, **engine_kw)
    syncer = None
    if ro.engine == "vllm":
        from mmrl.vlm.vllm_sync import VLLMWeightSyncer

        syncer = VLLMWeightSyncer(engine.llm, states, family=model.config.model_type)
    from mmrl import rewards

    reward_model = rewards.load(cfg.reward.name, **cfg.reward.kwargs)
    estimator = get_advantage_estimator(al.advantage)
    data, eval_items = build_data(cfg)
    sampling = SamplingParams(n=ro.n, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                              max_new_tokens=ro.max_new_tokens, stop=ro.stop)
    recompute = al.old_logprobs == "recompute" or (al.old_logprobs == "auto" and (
        al.ppo_epochs > 1 or al.mini_batch_size not in (0, ro.batch_size * ro.n) or ro.engine == "vllm"))

    params = [p for n, p in states.named_trainable_parameters() if not any(f in n for f in cfg.model.freeze)]
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, cfg.train.lr_warmup_steps)))
    start, summary = 0, {}
    ckpt = run.find_resume()
    if ckpt is not None and not fsdp:  # FSDP: optimizer and resume are set up after sharding (below)
        states.load(Path(ckpt) / "policy")
        state = run.load_state(ckpt)
        optimizer.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        data.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        start = state["step"]
        if ctx.is_main:
            run.truncate_metrics(start)
    elif ckpt is None and cfg.warmup.sft_steps > 0:  # (before sharding under FSDP: identical on every rank)
        with timer("warmup"):
            summary["warmup_loss"] = format_warmup(states, processor, data, cfg, pad_id, eos_id)
        summary["warmup_s"] = timer.times["warmup"]
        if states.mode == "full" and "ref" in states.states:  # the reference is the warm-started model
            states.copy("default", "ref")
    updated = {id(p) for p in params}
    for p in states.trainable_parameters():
        p.requires_grad_(id(p) in updated)  # only the optimizer's parameters get gradients from here on
    # DDP registers the parameters that require grad now; used only for the training forward
    # FSDP: only the decoder layers are sharded (the vision tower stays in the root unit), so a text-only forward
    # (decode steps, LockstepForwards dummies) issues the same collectives as an image forward
    tmodel = ctx.wrap_model(model, cfg.dist.strategy, find_unused_parameters=cfg.dist.find_unused_parameters,
                            **({"fsdp_block_types": language_block_types(model)} if fsdp else {}))
    if fsdp:  # fully_shard replaced every parameter by a DTensor shard: follow them, then build the optimizer
        states.refresh()
        params = [p for n, p in states.named_trainable_parameters() if not any(f in n for f in cfg.model.freeze)]
        updated = {id(p) for p in params}
        for p in states.trainable_parameters():
            p.requires_grad_(id(p) in updated)
        optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / max(1, cfg.train.lr_warmup_steps)))
        if ckpt is not None:  # full tensors from the files (any strategy wrote them), this rank's slice kept
            states.load(Path(ckpt) / "policy")
            state = run.load_state(ckpt)
            load_full_optimizer_state_dict(optimizer, state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            data.load_state_dict(state["data"])
            set_rng_state(state["rng"])
            start = state["step"]
            if ctx.is_main:
                run.truncate_metrics(start)
    # vision features may be shared between the policy and reference passes only when no state can change the
    # tower: no LoRA on it and none of its weights in PolicyStates (full fine-tuning with the tower frozen)
    # (off under FSDP: cache hits decide which ranks run the vision tower, and FSDP needs equal forwards)
    reuse = cfg.train.reuse_vision_features and not fsdp
    vision_grads_need_images = fsdp and vision_tower_trainable(model)
    dummy_ids = torch.full((1, 1), pad_id, dtype=torch.long, device=run.device)
    dummies = [0]  # dummy forwards this rank ran in the current step

    def dummy() -> None:
        dummies[0] += 1
        model(input_ids=dummy_ids, use_cache=False)

    def lockstep() -> LockstepForwards:
        """FSDP + dynamic sampling: ranks keep different numbers of rows, so the old/reference passes run different
        numbers of forwards; pair them with 1-token dummies (no-op without FSDP)."""
        return LockstepForwards(ctx, model, dummy=dummy, enabled=fsdp)
    state_ids = {id(p) for p in states.trainable_parameters()}
    share_ref = reuse and not vision_has_adapters(model) and not any(
        id(p) in state_ids for p in vision_tower(model).parameters())
    if start == 0 and (ctx.is_main or fsdp):  # FSDP: every rank runs the eval forwards, rank 0 reports
        first = evaluate(engine, processor, eval_items, reward_model, cfg)
        summary.update({k.replace("eval/accuracy", "eval_accuracy_first"): v for k, v in first.items()})
        if ctx.is_main:
            print(f"[vlm_grpo] eval accuracy before RL: {first}", flush=True)
    guard = UpdateGuard(cfg.train.max_skipped_updates, ctx, run)  # a NaN/inf loss or gradient never reaches the weights
    bar = run.progress(cfg.train.max_steps, start)
    timer.pop()
    for step in range(start + 1, cfg.train.max_steps + 1):
        t_step = Timer()
        if ctx.enabled:  # rank-local sampling noise as a function of (seed, rank, step): nothing per rank to save
            seed_everything(ctx.rank_seed(cfg.seed, step))
        with t_step("step"):
            metrics: dict[str, Any] = {}
            # ---- rollout (+ DAPO dynamic sampling) and rewards
            generated: list = []

            def generate(items):
                if vision_grads_need_images:
                    check_fsdp_images(items)
                with timer("rollout"):
                    results = engine.generate([to_request(it, processor, cfg.data) for it in items], sampling)
                generated[:] = results[:1]  # a placeholder row if this rank keeps nothing (several processes)
                return results

            def score_fn(results):
                with timer("reward"):
                    return score(reward_model, results, cfg, validate=True)

            if ctx.enabled:  # each rank generates its share of the global prompts; DAPO stops on the min over ranks
                roll = collect_rollouts(lambda k: ctx.shard(data.next(k * world)), generate, score_fn,
                                        ro.batch_size // world, ro.n, al.dynamic_sampling, al.max_gen_batches,
                                        count=lambda kept: min(ctx.all_gather_object(len(kept))))
            else:
                roll = collect_rollouts(data.next, generate, score_fn, ro.batch_size, ro.n, al.dynamic_sampling,
                                        al.max_gen_batches)
            kept, kept_items, R = roll.results, roll.items, roll.scores
            all_scores, all_acc = ctx.all_gather_tensor(roll.all_scores), ctx.all_gather_tensor(roll.all_acc)
            all_kinds = [k for part in ctx.all_gather_object(roll.all_kinds) for k in part] if ctx.enabled else roll.all_kinds
            n_kept = int(ctx.all_reduce_sum(len(kept))) if ctx.enabled else len(kept)
            if cfg.reward.on_nonfinite == "drop_sample":
                metrics[NONFINITE_KEY] = int(ctx.all_reduce_sum(roll.nonfinite)) if ctx.enabled else roll.nonfinite
            metrics.update({**finite_stats(all_scores),  # dropped (non-finite) samples left out
                            "accuracy": all_acc.mean(), "dynamic/rounds": roll.rounds,
                            "dynamic/kept_groups": n_kept // ro.n, **per_kind(all_acc, all_kinds, "accuracy")})
            if n_kept:  # several processes: every rank takes part in the update, a rank that kept nothing with a
                # zero-weight placeholder row (its last generated sample)
                rewards_t, gids = roll.scores, roll.group_ids
                comp_keys = sorted({k for part in ctx.all_gather_object(sorted(roll.comps)) for k in part}) \
                    if ctx.enabled else list(roll.comps)
                for k in comp_keys:
                    metrics[f"reward/{k}"] = ctx.all_gather_tensor(roll.comps.get(k, torch.zeros(0))).mean()
                rows = kept or generated
                lens = torch.tensor([len(r.response_ids) for r in kept], dtype=torch.float32)
                all_lens = ctx.all_gather_tensor(lens)
                n_clip = sum(r.finish_reason == "length" for r in kept)
                if ctx.enabled:
                    n_clip = int(ctx.all_reduce_sum(n_clip))
                metrics.update({"response_length/mean": all_lens.mean(), "response_length/max": all_lens.max(),
                                "response/clip_ratio": n_clip / n_kept})
                P_ids, R_ids, MM = [r.prompt_ids for r in rows], [r.response_ids for r in rows], [r.mm for r in rows]
                rollout_lp = [torch.tensor(r.response_logprobs) for r in rows]
                vcache = VisionCache(model) if reuse else None  # this step's images, policy ("default") state
                # ---- reference log-probs, KL as a reward penalty
                ref_lp = None
                if al.kl_coef > 0:
                    ref_cache = vcache if share_ref else (VisionCache(model) if reuse else None)
                    with timer("ref"), states.use("ref"), lockstep():
                        ref_lp, _ = compute_logprobs(model, P_ids, R_ids, MM, pad_id, al.micro_batch_size, ro.temperature,
                                                     vision_cache=ref_cache)
                    if al.kl_in_reward:
                        seq_kl = torch.stack([kl_estimate(o, f, al.kl_estimator).sum()
                                              for o, f in zip(rollout_lp, ref_lp)])[:len(kept)]
                        rewards_t = rewards_t - al.kl_coef * seq_kl
                        if ctx.enabled:
                            metrics["kl"] = float(ctx.all_reduce_sum(seq_kl.sum())) / float(all_lens.sum())
                        else:
                            metrics["kl"] = seq_kl.sum() / lens.sum()
                # ---- advantages (group statistics over the global batch)
                r_all, g_all = ctx.gather_group_rewards(rewards_t, gids, scope="rank")
                adv = ctx.local_slice(estimator(r_all, g_all))
                if not kept:
                    adv = torch.zeros(len(rows))
                # ---- old log-probs
                drift = None
                if recompute:
                    with timer("old_logprob"), lockstep():
                        old_lp, _ = compute_logprobs(model, P_ids, R_ids, MM, pad_id, al.micro_batch_size, ro.temperature,
                                                     vision_cache=vcache)
                    drift = max(float((a - b).abs().max()) if a.numel() else 0.0
                                for a, b in zip(old_lp[:len(kept)], rollout_lp)) if kept else 0.0
                else:
                    old_lp = rollout_lp
                # ---- loss and optimizer steps
                with timer("train"):
                    stats, d = policy_update(model, optimizer, sched, params, P_ids, R_ids, MM, old_lp, ref_lp, adv,
                                             pad_id, cfg, ctx=ctx, train_model=tmodel, vision_cache=vcache,
                                             n_local=len(kept), equal_micro_batches=fsdp, guard=guard, step=step)
                drift = d if drift is None else drift
                if ctx.enabled:
                    drift = max(ctx.all_gather_object(drift))
                if vcache is not None:
                    metrics["vision_cache/calls"] = vcache.vision_calls
                if syncer is not None:  # the engine samples the next step with the updated weights
                    metrics.update(syncer.sync())
                metrics["diag/logprob_drift"] = drift
                metrics.update(stats)
                metrics.update(guard.pop_metrics())
                if fsdp:  # forwards run only to pair another rank's old/reference forwards, summed over ranks
                    metrics["dist/lockstep_dummy_forwards"] = sum(ctx.all_gather_object(dummies[0]))
                    dummies[0] = 0
            if ctx.is_main and cfg.log.sample_every and kept and (step % cfg.log.sample_every == 0 or step == 1) and all(
                    it.images for it in kept_items):
                idx = sorted(range(len(kept)), key=lambda i: kept[i].sample_index)[:cfg.log.n_samples]  # prompts first
                caps = [f"{kept_items[i].prompt.replace('<image>', '')[:40]} -> {kept[i].text[:24]!r} r={float(R[i]):.2f}"
                        for i in idx]
                run.save_samples(step, [kept_items[i].images[0] for i in idx], caps)
            if (ctx.is_main or fsdp) and ((cfg.log.eval_every and step % cfg.log.eval_every == 0) or step == cfg.train.max_steps):
                metrics.update(evaluate(engine, processor, eval_items, reward_model, cfg))
            if step == cfg.train.max_steps:
                summary.update({k.replace("eval/accuracy", "eval_accuracy_last"): v for k, v in metrics.items()
                                if k.startswith("eval/accuracy")})
        metrics.update(timer.pop())
        metrics["time/step_s"] = t_step.times["step"]
        if ctx.is_main:
            run.log(step, metrics)
        bar.update(1)
        bar.set_postfix(reward=f"{float(metrics['reward/mean']):.3f}", acc=f"{float(metrics['accuracy']):.2f}")
        if (cfg.train.save_every and step % cfg.train.save_every == 0) or step == cfg.train.max_steps:
            check_finite_weights(states, step, ctx, run)  # never a checkpoint with NaN/inf weights
            with ctx.checkpoint(run, step) as d:  # rank 0 writes, the others wait
                if fsdp:  # gathering the shards is a collective: every rank takes part, rank 0 writes
                    states.save(Path(d) / "policy" if d is not None else None)
                    opt_sd = full_optimizer_state_dict(optimizer)
                    if d is not None:
                        run.save_state(d, optimizer=opt_sd, scheduler=sched.state_dict(),
                                       data=data.state_dict(), rng=get_rng_state(), step=step)
                elif d is not None:
                    states.save(Path(d) / "policy")
                    run.save_state(d, optimizer=optimizer.state_dict(), scheduler=sched.state_dict(),
                                   data=data.state_dict(), rng=get_rng_state(), step=step)
    bar.close()
    ctx.close()
    if not ctx.is_main:
        return {}
    rows = run.read_metrics()
    acc = [r["accuracy"] for r in rows if r.get("accuracy") is not None]
    if acc:
        k = min(5, len(acc))
        summary.update(train_accuracy_first=sum(acc[:k]) / k, train_accuracy_last=sum(acc[-k:]) / k)
    if "eval_accuracy_first" in summary and "eval_accuracy_last" in summary:
        pairs = [(k[len("eval_accuracy_first"):] or " (all)", summary[k], summary.get(k.replace("first", "last")))
                 for k in summary if k.startswith("eval_accuracy_first")]
        for name, a, b in pairs:
            print(f"[vlm_grpo] eval accuracy{name}: first {a:.3f} -> last {b:.3f}", flush=True)
    return run.finish(summary)
