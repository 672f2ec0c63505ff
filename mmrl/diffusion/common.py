"""Diffusion bookkeeping the flow-matching recipes share; no algorithm lives here.

- `load_recipe_model(cfg, device, dtype)`: the config's flow model (path, text length, frames, family options).
- `build_policy_states(model, model_cfg, old=, ref=)`: LoRA (or full fine-tuning, `model.lora.rank: 0`) policy
  states on `model.transformer` from a recipe's `model:` section (the loop's `setup_training` wraps them).
- `vae_encode(model, images)`: images in [0, 1] -> latents as the flow model sees them (the inverse of
  `FlowModel.decode`'s scaling). `LatentCache`: those latents kept on disk in the run directory.
- `sample_sigmas(...)`, `noise_latents(...)`, `flow_matching_mse(...)`: training points of the
  rectified-flow objective `x_s = (1 - s) x0 + s eps`, target velocity `eps - x0`.
- `evaluate_ode(...)`: deterministic sampling on held-out prompts with fixed noise, scored (training reward,
  `log.judges`, sample statistics) and saved; `sample_grid(...)`: the run's sample grids (fixed prompts and noise,
  step 0 onwards, `grid_due`); `NoSamples` (ranks > 0 in an evaluation every rank runs under FSDP).
- `TransformerEvalCounter`: transformer evaluations (sample rows through the network), for cost plots.

Rewards and advantages over several ranks: `mmrl.diffusion.scoring`. The loop every recipe runs:
`mmrl.diffusion.loop`.
"""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from mmrl.perf.meter import counting_paused, not_counted
from mmrl.run.directory import Run

Tensor = torch.Tensor

__all__ = [
    "load_recipe_model", "build_policy_states", "vae_encode", "LatentCache", "sample_sigmas", "noise_latents",
    "flow_matching_mse", "ode_images", "evaluate_ode", "evaluator", "grid_prompts", "grid_due", "sample_grid",
    "TransformerEvalCounter", "not_counted", "NoSamples",
]


# ------------------------------------------------------------------------------------------ the model


def load_recipe_model(cfg: Any, device: Any, dtype: Any):
    """The flow model of a recipe config: `model.path` with `model.max_sequence_length` (0 = the family's),
    `rollout.num_frames` (videos when > 1) and `model.family_options` (`load_flow_model`)."""
    from mmrl.diffusion.models import load_flow_model

    return load_flow_model(cfg.model.path, device, dtype, cfg.model.max_sequence_length or None,
                           num_frames=cfg.rollout.num_frames, family_options=cfg.model.family_options)


# ------------------------------------------------------------------------------------------ policy states


def build_policy_states(model: Any, model_cfg: Any, *, old: bool, ref: bool):
    """Wrap `model.transformer` in `PolicyStates` ("default" trains; "old" if `old`; "ref" if `ref`).

    LoRA (`model.lora.rank > 0`): "ref" is the base model (adapters off) or `model.lora.init_path`, free of
    charge. Full fine-tuning (`rank: 0`): "old"/"ref" are parameter snapshots (+100% of the transformer's memory
    each), kept only when asked for. `model.transformer` is set to the wrapped module.
    """
    from mmrl.adapters import PolicyStates
    from mmrl.training import peft_lora_config

    lora = model_cfg.lora
    if lora.enabled:
        # the saved adapter_config.json names the pipeline it applies to (peft's base_model_name_or_path)
        lora_cfg = peft_lora_config(lora, model.lora_target_modules,
                                    base_model_name_or_path=str(Path(model_cfg.path).resolve()))
        states = PolicyStates(model.transformer, lora_cfg, old=old, ref_adapter_path=lora.init_path or None)
    else:
        model.transformer.requires_grad_(True)
        states = PolicyStates(model.transformer, None, old=old, keep_ref_copy=ref)
    if model_cfg.gradient_checkpointing:
        states.model.enable_gradient_checkpointing()  # blocks recomputed in backward (no-grad passes: unchanged)
    model.transformer = states.model
    return states


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
        if enabled and self.dir.is_dir():  # made with the first shard: a start that fails before leaves nothing
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
                self.dir.mkdir(parents=True, exist_ok=True)
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


# ------------------------------------------------------------------------------------------ evaluation


@torch.no_grad()
def ode_images(model: Any, states: Any, state: str, reward_fn: Any, items: Sequence[Any], *, num_steps: int,
               guidance_scale: float, height: int, width: int, batch_size: int = 8, seed: int = 0):
    """(images [N, 3, H, W] (videos [N, F, 3, H, W]), final latents [N, ...], scores [N] or None without a reward,
    component scores {name: [N]}, sound): one deterministic (ODE) image per item with policy state `state`, from the
    same initial noise every time it is called; sound: {audio [N, C, S], sample_rate, fps} of an audio-video family
    (decoded to be saved with the samples and scored by audio rewards), else {}. The global RNG streams (CPU, and the
    model's CUDA device) are forked: whatever a reward or the sampler draws from them here, training continues
    exactly as if no evaluation had run (how often one evaluates changes no training number)."""
    from mmrl.diffusion.conditioning import encode_items
    from mmrl.diffusion.sampling import sample_groups
    from mmrl.rewards.audio import takes_audio
    from mmrl.rewards.latent import takes_latents

    gen = torch.Generator(device=model.device).manual_seed(seed + 12345)
    images, finals, sounds, scores, details = [], [], [], [], defaultdict(list)
    cuda = [model.device] if torch.device(model.device).type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), states.use(state):
        for lo in range(0, len(items), max(1, batch_size)):
            chunk = items[lo:lo + batch_size]
            emb = encode_items(model, chunk, height, width)  # + source images (edit models)
            traj = sample_groups(model, emb, 1, num_steps=num_steps, height=height, width=width,
                                 guidance_scale=guidance_scale, noise_level=0.0, generator=gen,
                                 decode_audio=model.has_audio)
            images.append(traj.images)
            finals.append(traj.latents[:, -1])
            if traj.audio is not None:
                sounds.append(traj.audio)
            if reward_fn is None:
                continue
            kw = {"latents": traj.latents[:, -1]} if takes_latents(reward_fn) else {}  # (images decoded: shown)
            if takes_audio(reward_fn):
                kw.update(audio=traj.audio, sample_rate=model.audio_sample_rate)
            out = reward_fn(images=traj.images, prompts=[it.prompt for it in chunk],
                            metadata=[it.metadata for it in chunk], **kw)
            scores.append(out.scores.detach().float().cpu())
            for name in getattr(reward_fn, "components", {}):
                details[name].append(torch.as_tensor(out.details[name]).float().cpu())
    sound = ({"audio": torch.cat(sounds).cpu(), "sample_rate": model.audio_sample_rate, "fps": model.frame_rate}
             if sounds else {})
    return (torch.cat(images), torch.cat(finals), torch.cat(scores) if scores else None,
            {k: torch.cat(v) for k, v in details.items()}, sound)


def _captions(items: Sequence[Any], scores: torch.Tensor | None) -> list[str]:
    """Reward first (a wrapped caption never hides it), then the whole prompt."""
    return [(f"reward {scores[i]:.3g} | " if scores is not None else "") + items[i].prompt for i in range(len(items))]


def evaluate_ode(model: Any, states: Any, state: str, reward_fn: Any, items: Sequence[Any], run: Run, step: int, *,
                 num_steps: int, guidance_scale: float, height: int, width: int, batch_size: int = 8,
                 seed: int = 0, num_images: int = 16, judges: Any = None) -> dict[str, float]:
    """Deterministic (ODE) sampling of one image per held-out prompt with the same initial noise at
    every evaluation, computed with policy state `state`; saves samples/eval_step_<N>.png (edit rows: source, edit,
    instruction panels). Metrics: the reward (`eval/reward/*`), the images' statistics (`eval/sample/*`,
    `mmrl.diffusion.diagnostics`) and, with a `JudgePanel` (`log.judges`), every judge and the reward-hacking rule
    (`judge/*`)."""
    from mmrl.diffusion.conditioning import sample_panels
    from mmrl.diffusion.diagnostics import sample_statistics

    images, finals, s, details, sound = ode_images(model, states, state, reward_fn, items, num_steps=num_steps,
                                                   guidance_scale=guidance_scale, height=height, width=width,
                                                   batch_size=batch_size, seed=seed)
    n = min(num_images, len(items))
    if sound:
        sound = {**sound, "audio": sound["audio"][:n]}
    run.save_samples(step, *sample_panels(images[:n], _captions(items[:n], s), [it.metadata for it in items[:n]]),
                     name=f"eval_step_{step:06d}.png", **sound)
    metrics = {"eval/reward/mean": s.mean().item(), "eval/reward/std": s.std().item() if len(s) > 1 else 0.0}
    metrics.update({f"eval/reward/{k}": v.mean().item() for k, v in details.items()})
    metrics.update(sample_statistics(images, finals, prefix="eval/sample/"))
    if judges is not None:
        cuda = [images.device] if images.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # a judge that samples leaves the training RNG untouched
            metrics.update(judges.observe(step, s, images=images, prompts=[it.prompt for it in items],
                                          metadata=[it.metadata for it in items]))
    return metrics


def evaluator(model: Any, states: Any, state: str, reward_fn: Any, items: Sequence[Any], cfg: Any,
              judges: Any = None):
    """`evaluate_ode` with a recipe's settings (`rollout.eval_*`, image size, `update.micro_batch_size`, seed,
    `log.num_samples`) and its `JudgePanel`: call the result as `evaluate(run_or_NoSamples, step)`."""
    from functools import partial

    rollout = cfg.rollout
    return partial(evaluate_ode, model, states, state, reward_fn, items, num_steps=rollout.eval_num_steps,
                   guidance_scale=rollout.eval_guidance_scale, height=rollout.eval_hw[0], width=rollout.eval_hw[1],
                   batch_size=max(1, cfg.update.micro_batch_size), seed=cfg.seed, num_images=cfg.log.num_samples,
                   judges=judges)


def grid_prompts(cfg: Any, eval_items: Sequence[Any], train_items: Sequence[Any]) -> list:
    """The prompts of every sample grid of a run: the first `log.num_samples` eval prompts (else training prompts)."""
    return list(eval_items or train_items)[: cfg.log.num_samples]


def grid_due(cfg: Any, step: int) -> bool:
    """A sample grid at step 0 (the starting policy, before any update), every `log.sample_every` steps and at
    the last step."""
    every = cfg.log.sample_every
    return bool(every) and (step % every == 0 or step == cfg.train.max_steps)


def sample_grid(model: Any, states: Any, state: str, reward_fn: Any, items: Sequence[Any], run: Any, step: int,
                cfg: Any) -> None:
    """samples/step_<N>.png: one image per grid prompt (`grid_prompts`), ODE with the eval settings
    (`rollout.eval_num_steps`, `rollout.eval_guidance_scale`) and the same initial noise in every grid, so the grids
    of a run show one policy changing; captions "reward <reward> | <prompt>", word-wrapped (edit rows: each result after
    its source image); an audio-video family's sound beside it (step_<N>_s<i>.wav and .mp4 with sound)."""
    if not items:
        return
    rollout = cfg.rollout
    with not_counted():  # cost/transformer_evals and perf/tflops_per_step count training work only
        images, _, scores, _, sound = ode_images(model, states, state, reward_fn, items,
                                                 num_steps=rollout.eval_num_steps,
                                                 guidance_scale=rollout.eval_guidance_scale, height=rollout.height,
                                                 width=rollout.width, batch_size=max(1, cfg.update.micro_batch_size),
                                                 seed=cfg.seed)
    from mmrl.diffusion.conditioning import sample_panels

    run.save_samples(step, *sample_panels(images, _captions(items, scores), [it.metadata for it in items]), **sound)


# ------------------------------------------------------------------------------------------ cost accounting


class TransformerEvalCounter:
    """Counts transformer evaluations, one per sample row of every forward call (a CFG forward on a
    doubled batch counts twice), through a forward pre-hook; forwards inside `not_counted()` are left out.
    Resumable (`state_dict`)."""

    def __init__(self, module: torch.nn.Module):
        self.count = 0
        self._synced = 0  # the global count (all ranks) at the last `sync`
        self._handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        if counting_paused():
            return
        if isinstance(x, torch.Tensor):
            self.count += int(x.shape[0])
        elif isinstance(x, (list, tuple)):  # a list of per-sample latents (Z-Image's transformer)
            self.count += len(x)

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = self._synced = int(state["count"])

    def sync(self, ctx: Any) -> int:
        """The global count: this rank's evaluations since the last sync are summed over ranks (a collective)."""
        self.count = self._synced = self._synced + int(ctx.all_reduce_sum(self.count - self._synced))
        return self.count

    def remove(self) -> None:
        self._handle.remove()


class NoSamples:
    """Stand-in run for ranks > 0 in an FSDP evaluation (they compute, rank 0 writes the grid)."""

    def save_samples(self, *args, **kwargs) -> None:
        pass
