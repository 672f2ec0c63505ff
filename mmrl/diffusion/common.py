"""Machinery the flow-matching recipes share (Diffusion-DPO, DiffusionNFT; meant for Flow-GRPO too).

Nothing here is an algorithm: it is the setup and bookkeeping around one.

- `build_policy_states(model, model_cfg, old=, ref=)`: LoRA (or full fine-tuning) policy states on
  `model.transformer` from a recipe's `model:` section (the `ModelConfig` of `flow_grpo`).
- `load_reward_fn(components, device)` + `score_images(...)`: the zoo reward of a config and its metrics.
- `vae_encode(model, images)`: images in [0, 1] -> latents as the flow model sees them (the inverse of
  `FlowModel.decode`'s scaling). `LatentCache`: those latents kept on disk in the run directory.
- `sample_sigmas(...)`, `noise_latents(...)`, `flow_matching_mse(...)`: training points of the
  rectified-flow objective `x_s = (1 - s) x0 + s eps`, target velocity `eps - x0`.
- `save_checkpoint(...)` / `restore_checkpoint(...)`: adapters (all states, "old" included) +
  optimizer + scheduler + trackers + data position + counters + RNG, atomically, and exact resume.
- `evaluate_ode(...)`: deterministic sampling on held-out prompts with fixed noise, scored and saved.
- `summarise(run, name)`: `run.finish()` plus the first-5 / last-5 reward check, printed.
- `TransformerEvalCounter`: transformer evaluations (sample rows through the network), for cost plots.
- `init_distributed(cfg, global_sizes)`: the process group (`mmrl.distributed.DistContext`) and the `Run`
  (rank 0 writes the run directory) for a recipe with a `dist:` section; `merge_rank_lists(ctx, lists)`:
  per-rank metric lists concatenated over ranks (the recipes' whole-batch metrics).
- FSDP (LoRA or full fine-tuning; all three recipes): `FullOptimizerState` (full-tensor optimizer state), `save_checkpoint_fsdp` (collective save, rank 0
  writes), `NoSamples` (ranks > 0 in an evaluation every rank runs), `clip_grads`.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from mmrl.config import TrainConfig
from mmrl.runtime import Run, checkpoint_step, get_rng_state, set_rng_state

Tensor = torch.Tensor

__all__ = [
    "lora_config", "build_policy_states", "load_reward_fn", "score_images", "vae_encode", "LatentCache",
    "sample_sigmas", "noise_latents", "flow_matching_mse", "save_checkpoint", "restore_checkpoint",
    "evaluate_ode", "summarise", "TransformerEvalCounter", "TIMING_PREFIX", "init_distributed", "merge_rank_lists",
    "clip_grads", "NoSamples", "FullOptimizerState", "save_checkpoint_fsdp",
]

TIMING_PREFIX = "time/"  # metrics that legitimately differ between two identical runs


# ------------------------------------------------------------------------------------------ policy states


def lora_config(model_cfg: Any, model: Any):
    """peft LoraConfig from a `model:` section (lora_rank, lora_alpha, lora_init, lora_target_modules)."""
    from peft import LoraConfig

    init: Any = {"true": True, "false": False}.get(str(model_cfg.lora_init).lower(), model_cfg.lora_init)
    return LoraConfig(r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha, init_lora_weights=init,
                      target_modules=list(model_cfg.lora_target_modules or model.lora_target_modules))


def build_policy_states(model: Any, model_cfg: Any, *, old: bool, ref: bool):
    """Wrap `model.transformer` in `PolicyStates` ("default" trains; "old" if `old`; "ref" if `ref`).

    LoRA: "ref" is the base model (adapters off) or `model_cfg.init_lora_path`, free of charge.
    Full fine-tuning (`model_cfg.lora: false`): "old"/"ref" are parameter snapshots (+100% of the
    transformer's memory each), kept only when asked for. `model.transformer` is set to the wrapped module.
    """
    from mmrl.adapters import PolicyStates

    if model_cfg.lora:
        states = PolicyStates(model.transformer, lora_config(model_cfg, model), old=old,
                              ref_adapter_path=model_cfg.init_lora_path or None)
    else:
        if model_cfg.init_lora_path:
            raise ValueError("model.init_lora_path needs model.lora: true "
                             "(full fine-tuning starts from the base weights)")
        model.transformer.requires_grad_(True)
        states = PolicyStates(model.transformer, None, old=old, keep_ref_copy=ref)
    model.transformer = states.model
    return states


# ------------------------------------------------------------------------------------------ rewards


def load_reward_fn(components: dict[str, Any], device: Any):
    """`mmrl.rewards.load(mapping)` with a clear error for an empty or unknown component."""
    from mmrl import rewards

    if not components:
        raise ValueError(f"reward.components is empty; give name -> weight, e.g. {{jpeg_compressibility: 1.0}}; "
                         f"available: {rewards.available()}")
    for key, value in components.items():
        name = value.get("reward", key) if isinstance(value, dict) else key
        if name not in rewards.available():
            raise ValueError(f"reward.components: unknown reward '{name}'; available: {rewards.available()}")
    return rewards.load(dict(components), device=str(device))


def score_images(reward_fn: Any, images: Tensor, prompts: list[str], metadata: list[dict],
                 prefix: str = "reward/", on_nonfinite: str = "error") -> tuple[Tensor, dict[str, float]]:
    """scores[B] (float, cpu) and metrics: `<prefix>mean`, `<prefix>std` and one mean per component.

    Every score is validated (`mmrl.training.check_rewards`): a NaN/inf score raises naming the reward component
    and the prompt (`on_nonfinite="error"`), or (`"drop_sample"`) stays in `scores` as the mark of a dropped sample
    (the recipes test `torch.isfinite`) while the metrics cover the finite ones and count the others in
    `reward/nonfinite_samples`."""
    from mmrl.training import check_rewards, finite_stats

    out = reward_fn(images=images, prompts=prompts, metadata=metadata)
    scores = out.scores.detach().float().cpu()
    components = list(getattr(reward_fn, "components", {}))
    keep, metrics = check_rewards(scores, out.details, on_nonfinite, reward=getattr(reward_fn, "name", "reward"),
                                  components=components, labels=[f"prompt {p!r}" for p in prompts or []])
    metrics.update(finite_stats(scores, prefix))
    for name in components:
        v = torch.as_tensor(out.details[name]).float().cpu()
        metrics[f"{prefix}{name}"] = (v[keep] if v.shape == keep.shape else v).mean().item()
    return scores, metrics


# ------------------------------------------------------------------------------------------ VAE latents


@torch.no_grad()
def vae_encode(model: Any, images: Tensor, batch_size: int = 16) -> Tensor:
    """Images float [B, 3, H, W] in [0, 1] -> latents [B, C, h, w] fp32 in the flow model's scale, in
    chunks of `batch_size` (`FlowModel.encode_images`: posterior mean, then (z - shift) * scale)."""
    return torch.cat([model.encode_images(images[lo:lo + batch_size]) for lo in range(0, images.shape[0], batch_size)])


class LatentCache:
    """VAE latents of dataset images, encoded the first time they are needed and kept on disk.

    Keys are the image reference (path string, or the sha1 of raw bytes) plus the target size, so a
    changed resolution never reuses stale latents. Every call that encodes something writes one new
    shard `<dir>/shard_<k>.pt` atomically; a resumed run (same run dir) loads all shards and encodes
    nothing twice. `enabled=False` keeps nothing (for datasets too large to hold: encode every step).
    Latents are posterior means, so cached and fresh latents are the same numbers.
    Several processes share one directory with a distinct `shard_suffix` each (e.g. `_r1`): no two ranks
    write the same file, and every rank (or a later run with any number of ranks) loads all shards.
    """

    def __init__(self, directory: str | Path, height: int, width: int, enabled: bool = True,
                 shard_suffix: str = ""):
        self.dir = Path(directory)
        self.shard_suffix = shard_suffix
        self.height, self.width = int(height), int(width)
        self.enabled = enabled
        self.latents: dict[str, Tensor] = {}
        self._shards = 0
        if enabled:
            self.dir.mkdir(parents=True, exist_ok=True)
            for shard in sorted(self.dir.glob("shard_*.pt")):
                self.latents.update(torch.load(shard, map_location="cpu", weights_only=True))
                self._shards += 1
        self.loaded_from_disk = len(self.latents)
        self.encoded = 0

    def key(self, ref: Any) -> str:
        if isinstance(ref, (bytes, bytearray)):
            body = "sha1:" + hashlib.sha1(ref).hexdigest()
        else:
            body = str(ref)
        return f"{body}@{self.height}x{self.width}"

    def _encode(self, model: Any, refs: Sequence[Any], batch_size: int) -> Tensor:
        from mmrl.pipelines.images import load_image

        pils = []
        for ref in refs:
            if isinstance(ref, (str, Path)) and not Path(ref).is_file():
                raise FileNotFoundError(f"preference image not found: {ref}")
            pils.append(load_image(ref).convert("RGB").resize((self.width, self.height)))
        x = torch.stack([torch.from_numpy(np.array(p, dtype=np.uint8)).permute(2, 0, 1) for p in pils])
        return vae_encode(model, x.float() / 255.0, batch_size).cpu()

    def get(self, model: Any, refs: Sequence[Any], device: Any = "cpu", batch_size: int = 16) -> Tensor:
        """Latents [N, C, h, w] of `refs`, encoding (and, if enabled, storing) the ones not cached."""
        keys = [self.key(r) for r in refs]
        missing = {k: r for k, r in zip(keys, refs) if k not in self.latents}
        fresh: dict[str, Tensor] = {}
        if missing:
            lat = self._encode(model, list(missing.values()), batch_size)
            fresh = {k: z.clone() for k, z in zip(missing, lat)}
            self.encoded += len(fresh)
            if self.enabled:
                self.latents.update(fresh)
                path = self.dir / f"shard_{self._shards:06d}{self.shard_suffix}.pt"
                tmp = path.with_suffix(".pt.tmp")
                torch.save(fresh, tmp)
                os.replace(tmp, path)
                self._shards += 1
        return torch.stack([self.latents[k] if k in self.latents else fresh[k] for k in keys]).to(device)


# ------------------------------------------------------------------------------------------ training points


def sample_sigmas(n: int, mode: str = "uniform", shift: float = 1.0, logit_mean: float = 0.0,
                  logit_std: float = 1.0, generator: torch.Generator | None = None) -> Tensor:
    """n noise levels in (0, 1): u ~ U(0, 1) (`uniform`) or sigmoid(N(mean, std)) (`logit_normal`, SD3
    training), then the scheduler's time shift sigma = shift * u / (1 + (shift - 1) * u)."""
    # source: SD3 paper arXiv 2403.03206 (logit-normal sampling, resolution-dependent shift)
    if mode == "uniform":
        u = torch.rand(n, generator=generator)
    elif mode == "logit_normal":
        u = torch.sigmoid(logit_mean + logit_std * torch.randn(n, generator=generator))
    else:
        raise ValueError(f"timestep sampling mode: expected 'uniform' or 'logit_normal', got {mode!r}")
    if shift <= 0:
        raise ValueError(f"sigma shift must be > 0, got {shift}")
    return shift * u / (1.0 + (shift - 1.0) * u)


def noise_latents(x0: Tensor, sigma: Tensor, noise: Tensor) -> Tensor:
    """Forward process x_s = (1 - s) x0 + s eps, with s [B] broadcast over the latent dims."""
    s = sigma.to(x0.device, torch.float32).view(-1, *([1] * (x0.dim() - 1)))
    return (1.0 - s) * x0 + s * noise


def flow_matching_mse(v_pred: Tensor, x0: Tensor, noise: Tensor) -> Tensor:
    """Per-sample MSE [B] between the predicted velocity and the rectified-flow target eps - x0."""
    err = v_pred.float() - (noise - x0).float()
    return err.pow(2).mean(dim=tuple(range(1, err.dim())))


# ------------------------------------------------------------------------------------------ checkpoints


def save_checkpoint(run: Run, step: int, states: Any, stateful: dict[str, Any], **extra: Any) -> Path:
    """checkpoints/step_<N>/: `adapters/` (every PolicyStates state) + state.pt with each
    `stateful[name].state_dict()`, the `extra` values and the RNG state. Atomic (Run.checkpoint)."""
    with run.checkpoint(step) as d:
        states.save(Path(d) / "adapters")
        run.save_state(d, stateful={k: v.state_dict() for k, v in stateful.items()}, extra=extra,
                       rng=get_rng_state())
    return run.ckpt_dir / f"step_{step}"


def restore_checkpoint(run: Run, states: Any, stateful: dict[str, Any], tag: str = "",
                       truncate: bool = True) -> tuple[int, dict]:
    """Resume per `train.resume`: returns (step, extra) and restores states, `stateful` objects and RNG
    in place; (0, {}) when starting fresh. With `truncate`, metrics.jsonl is cut back to the resumed step
    (to nothing when starting fresh); several processes pass `truncate=ctx.is_main` so that only rank 0,
    the one process that writes metrics.jsonl, rewrites it."""
    ckpt = run.find_resume()
    if ckpt is None:
        if truncate:
            run.truncate_metrics(0)  # a fresh run in an existing directory starts a fresh metrics.jsonl
        return 0, {}
    step = checkpoint_step(ckpt)
    states.load(Path(ckpt) / "adapters")
    state = run.load_state(ckpt)
    missing = [k for k in stateful if k not in state["stateful"]]
    if missing:
        raise ValueError(f"checkpoint {ckpt}: state.pt lacks {missing} (written by another recipe?)")
    for k, obj in stateful.items():
        obj.load_state_dict(state["stateful"][k])
    set_rng_state(state["rng"])
    if truncate:
        run.truncate_metrics(step)
    print(f"[{tag or run.cfg.algorithm}] resumed from {ckpt} (step {step})")
    return step, dict(state.get("extra", {}))


# ------------------------------------------------------------------------------------------ evaluation


@torch.no_grad()
def evaluate_ode(model: Any, states: Any, state: str, reward_fn: Any, items: Sequence[Any], run: Run, step: int, *,
                 num_steps: int, guidance_scale: float, height: int, width: int, batch_size: int = 8,
                 seed: int = 0, num_images: int = 16) -> dict[str, float]:
    """Deterministic (ODE) sampling of one image per held-out prompt with the same initial noise at
    every evaluation, computed with policy state `state`; saves samples/eval_step_<N>.png."""
    from mmrl.diffusion.sampling import sample_groups

    gen = torch.Generator(device=model.device).manual_seed(seed + 12345)
    images, scores, details = [], [], defaultdict(list)
    with states.use(state):
        for lo in range(0, len(items), max(1, batch_size)):
            chunk = items[lo:lo + batch_size]
            emb = model.encode_prompts([it.prompt for it in chunk])
            traj = sample_groups(model, emb, 1, num_steps=num_steps, height=height, width=width,
                                 guidance_scale=guidance_scale, noise_level=0.0, generator=gen)
            out = reward_fn(images=traj.images, prompts=[it.prompt for it in chunk],
                            metadata=[it.metadata for it in chunk])
            images.append(traj.images)
            scores.append(out.scores.detach().float().cpu())
            for name in getattr(reward_fn, "components", {}):
                details[name].append(torch.as_tensor(out.details[name]).float().cpu())
    s = torch.cat(scores)
    n = min(num_images, len(items))
    run.save_samples(step, torch.cat(images)[:n], [f"{items[i].prompt[:48]} | r={s[i]:.3g}" for i in range(n)],
                     name=f"eval_step_{step:06d}.png")
    metrics = {"eval/reward/mean": s.mean().item(), "eval/reward/std": s.std().item() if len(s) > 1 else 0.0}
    metrics.update({f"eval/reward/{k}": torch.cat(v).mean().item() for k, v in details.items()})
    return metrics


# ------------------------------------------------------------------------------------------ summary


def summarise(run: Run, name: str, key: str = "reward/mean", extra_keys: Sequence[str] = ()) -> dict:
    """`run.finish()` plus the mean of `key` over the first 5 and last 5 logged steps (printed)."""
    rows = [r for r in run.read_metrics() if r.get(key) is not None]
    extra: dict[str, Any] = {}
    if rows:
        k = min(5, len(rows))
        first = sum(r[key] for r in rows[:k]) / k
        last = sum(r[key] for r in rows[-k:]) / k
        std_key = key.replace("/mean", "/std")
        first_std = sum(r.get(std_key) or 0.0 for r in rows[:k]) / k
        extra = {"reward_first5": first, "reward_last5": last, "reward_rise": last - first,
                 "reward_first_std": first_std,
                 "reward_rise_in_std": (last - first) / first_std if first_std > 0 else 0.0}
        for ek in extra_keys:
            vals = [r[ek] for r in run.read_metrics() if r.get(ek) is not None]
            if vals:
                extra[f"{ek}_first5"] = sum(vals[:k]) / min(k, len(vals))
                extra[f"{ek}_last5"] = sum(vals[-k:]) / min(k, len(vals))
        print(f"[{name}] {key}: first {k} steps {first:.4g} (per-sample std {first_std:.3g}) -> last {k} steps "
              f"{last:.4g}: rise {last - first:+.4g} = {extra['reward_rise_in_std']:.2f} std")
    return run.finish(extra)


# ------------------------------------------------------------------------------------------ cost accounting


class TransformerEvalCounter:
    """Counts transformer evaluations, one per sample row of every forward call (a CFG forward on a
    doubled batch counts twice), through a forward pre-hook. Resumable (`state_dict`)."""

    def __init__(self, module: torch.nn.Module):
        self.count = 0
        self._handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        if isinstance(x, torch.Tensor):
            self.count += int(x.shape[0])

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = int(state["count"])

    def remove(self) -> None:
        self._handle.remove()


# ------------------------------------------------------------------------------------------ several processes


def init_distributed(cfg: Any, global_sizes: dict[str, int]) -> tuple[Any, Run]:
    """(DistContext, Run) for a recipe with a `dist:` section, launched by torchrun / accelerate or plain python.

    Checks: several processes with `dist.strategy: none` is an error (the ranks would train apart silently);
    every global batch size in `global_sizes` (config key -> value) must be divisible by the number of
    processes. Rank 0 creates the run directory and writes config.yaml first; the other ranks get no progress
    bar and use `ctx.device` (cuda:LOCAL_RANK). One process: exactly `Run(cfg)`."""
    from mmrl.distributed import DistContext

    ctx = DistContext.init(cfg.dist.backend)
    if ctx.enabled and cfg.dist.strategy == "none":  # unsynchronised ranks would silently train apart
        raise ValueError(f"{ctx.world_size} processes were launched but dist.strategy is 'none': add "
                         f"dist.strategy=ddp (gradients are then averaged across processes)")
    for key, n in global_sizes.items():
        if n % ctx.world_size:
            raise ValueError(f"{key}={n} (global) must be divisible by the number of processes ({ctx.world_size})")
    if not ctx.is_main:
        os.environ["MMRL_NO_PROGRESS"] = "1"
    with ctx.main_process_first():
        run = Run(cfg, write_config=ctx.is_main)
    if ctx.enabled:
        run.device = ctx.device  # cuda:LOCAL_RANK (models and rewards load there)
    return ctx, run


def merge_rank_lists(ctx: Any, lists: dict[str, list]) -> dict[str, list]:
    """{key: values of rank 0 + values of rank 1 + ...} (all-gathered; a rank may lack a key). One process:
    `lists` unchanged. A collective: every rank must call it."""
    if not ctx.enabled:
        return lists
    merged: dict[str, list] = defaultdict(list)
    for part in ctx.all_gather_object(dict(lists)):
        for k, v in part.items():
            merged[k] += list(v)
    return merged


# ------------------------------------------------------------------------------------------ FSDP


def clip_grads(params: Any, max_grad_norm: float) -> float:
    """Clip the gradients of `params` to `max_grad_norm` (<= 0: no clipping) and return their total 2-norm as a
    float (``mmrl.distributed.clip_grad_norm``: torch's formula, FSDP2 DTensor gradients included)."""
    from mmrl.distributed import clip_grad_norm

    return clip_grad_norm(list(params), max_grad_norm if max_grad_norm > 0 else math.inf)


class NoSamples:
    """Stand-in run for ranks > 0 in an FSDP evaluation (they compute, rank 0 writes the grid)."""

    def save_samples(self, *args, **kwargs) -> None:
        pass


class FullOptimizerState:
    """An optimizer over FSDP2 DTensor parameters whose state_dict holds full (gathered, CPU) tensors -- a
    collective -- and whose load_state_dict takes full tensors (from any strategy) and keeps this rank's slice,
    so checkpoints are the same as one process writes."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        from mmrl.distributed import full_optimizer_state_dict

        return full_optimizer_state_dict(self.optimizer)

    def load_state_dict(self, sd: dict) -> None:
        from mmrl.distributed import load_full_optimizer_state_dict

        load_full_optimizer_state_dict(self.optimizer, sd)


def save_checkpoint_fsdp(ctx: Any, run: Run, step: int, states, stateful: dict) -> None:
    """`save_checkpoint`'s layout (adapters/ + state.pt) from an FSDP run: every rank gathers, rank 0 writes."""
    with ctx.checkpoint(run, step) as d:
        states.save(Path(d) / "adapters" if d is not None else None)
        full = {k: v.state_dict() for k, v in stateful.items()}
        if d is not None:
            run.save_state(d, stateful=full, extra={}, rng=get_rng_state())


# ------------------------------------------------------------------------------------------ optimizer


@dataclass
class AdamWTrainConfig(TrainConfig):
    """Optimizer keys shared by the diffusion recipes' `train:` sections."""

    lr: float = 3e-4
    """AdamW learning rate."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up over this many optimizer updates."""
    max_grad_norm: float = 1.0
    """Gradient-norm clipping (0 = off)."""


def make_optimizer(params, t: AdamWTrainConfig):
    """AdamW over `params` and its linear warm-up schedule (constant after `t.warmup_steps` updates)."""
    optimizer = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.adam_betas), eps=t.adam_eps,
                                  weight_decay=t.weight_decay)
    warmup = t.warmup_steps
    lr_sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warmup) if warmup > 0 else 1.0)
    return optimizer, lr_sched
