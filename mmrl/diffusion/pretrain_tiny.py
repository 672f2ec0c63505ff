"""Pretrain the tiny SD3 pipeline on synthetic shapes so the CPU Flow-GRPO demo has something to improve.

A randomly initialised VAE decodes every latent to almost the same grey image (CALIBRATION.md), so
pixel rewards are constant and RL has nothing to move. This script gives the tiny model a few CPU
minutes of real data:

1. AutoencoderKL (from ``mmrl.tiny.build_tiny_sd3``): L1 + MSE reconstruction + a small KL on 64x64 images
   of ``mmrl.pipelines.shapes``; then the latent mean/std over the data become the VAE's
   ``shift_factor`` / ``scaling_factor`` so the flow model sees roughly unit-variance latents.
2. SD3 transformer: rectified-flow objective on (caption, latent) pairs. Text conditioning comes from
   the pipeline's own (frozen, random but deterministic) CLIP + T5 encoders through
   ``pipe.encode_prompt``; the captions' embeddings are computed once. Timesteps: logit-normal u mapped
   through the scheduler's shift (sigma = s*u / (1 + (s-1)*u)), as in SD3 training. 10% of captions are
   dropped to the empty prompt so classifier-free guidance works. The EMA of the weights is saved.

The result is the full pipeline, saved with ``save_pretrained`` (loads with
``StableDiffusion3Pipeline.from_pretrained(out_dir)``), plus ``pretraining.json`` (settings, losses,
seconds). What is simplified away: no perceptual/GAN loss for the VAE, text encoders are not trained,
single-resolution (64x64) data only.

CLI: ``python -m mmrl.diffusion.pretrain_tiny OUT --steps N [--vae-steps M] [--grid grid.png]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from mmrl.pipelines.shapes import sample_scene
from mmrl.run.files import refuse_foreign_output

__all__ = ["pretrain_tiny_sd3", "make_shape_pool", "encode_captions", "sample_images", "main"]

# Fixed evaluation prompts (also what the demo grids show).
EVAL_PROMPTS = [
    "a red circle on a blue background",
    "a yellow square on a black background",
    "a white triangle on a green background",
    "a purple circle on an orange background",
]


def make_shape_pool(n: int, seed: int, size: int = 64, n_shapes: int | tuple[int, int] = (1, 1)):
    """``n`` random scenes -> (images float [n, 3, size, size] in [-1, 1], captions list[str])."""
    rng = random.Random(seed)
    images, captions = [], []
    for _ in range(n):
        scene = sample_scene(rng, n_shapes=n_shapes, size=size)
        images.append(torch.frombuffer(bytearray(scene.image.tobytes()), dtype=torch.uint8).view(size, size, 3))
        captions.append(scene.caption)
    x = torch.stack(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    return x, captions


@torch.no_grad()
def encode_captions(pipe, captions: Sequence[str], max_sequence_length: int = 256, chunk: int = 64):
    """(prompt_embeds [N, L, D], pooled [N, P]) from the pipeline's own text encoders, in chunks."""
    embeds, pooled = [], []
    for i in range(0, len(captions), chunk):
        pe, _, pp, _ = pipe.encode_prompt(list(captions[i:i + chunk]), None, None, do_classifier_free_guidance=False,
                                          max_sequence_length=max_sequence_length)
        embeds.append(pe.float())
        pooled.append(pp.float())
    return torch.cat(embeds), torch.cat(pooled)


def _lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _train_vae(vae, images, steps, batch_size, lr, kl_weight, gen, progress):
    vae.train()
    params = [p for p in vae.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    per_sample = None
    l1_hist, kl_hist = [], []
    bar = tqdm(range(steps), desc="vae", disable=not progress)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr * _lr_factor(step, steps, max(1, steps // 20))
        x = images[torch.randint(0, images.shape[0], (batch_size,), generator=gen)]
        post = vae.encode(x).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=gen)
        recon = vae.decode(z).sample
        per_sample = per_sample or z[0].numel()
        l1 = (recon - x).abs().mean()
        kl = post.kl().mean() / per_sample  # per latent element
        loss = l1 + F.mse_loss(recon, x) + kl_weight * kl  # MSE term: large colour errors go first
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        l1_hist.append(l1.item())
        kl_hist.append(kl.item())
        if step % 10 == 0:
            bar.set_postfix(l1=f"{sum(l1_hist[-50:]) / len(l1_hist[-50:]):.4f}", kl=f"{kl.item():.3f}")
    vae.eval()
    tail = max(1, min(50, steps))
    return {"vae/l1": sum(l1_hist[-tail:]) / tail if l1_hist else float("nan"),
            "vae/kl": sum(kl_hist[-tail:]) / tail if kl_hist else float("nan")}


@torch.no_grad()
def _encode_pool(vae, images, chunk=256):
    means, stds = [], []
    for i in range(0, images.shape[0], chunk):
        post = vae.encode(images[i:i + chunk]).latent_dist
        means.append(post.mean)
        stds.append(post.std)
    return torch.cat(means), torch.cat(stds)


def _update(opt, loss, params, ema, model, step, ema_decay, hist, bar) -> None:
    """One optimizer step (gradient norm clipped to 1), then the EMA of the weights (decay warmed up as
    min(decay, (1 + step) / (10 + step))); the loss goes to `hist` and, every 10 steps, the progress bar."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    with torch.no_grad():
        d = min(ema_decay, (1 + step) / (10 + step))
        for pe, p in zip(ema.parameters(), model.parameters()):
            pe.lerp_(p, 1 - d)
    hist.append(loss.item())
    if step % 10 == 0:
        bar.set_postfix(loss=f"{sum(hist[-50:]) / len(hist[-50:]):.4f}")


def _train_transformer(transformer, lat_mean, lat_std, shift, scale, cap_index, text, null_index,
                       steps, batch_size, lr, caption_dropout, flow_shift, ema_decay, gen, progress):
    transformer.train()
    params = [p for p in transformer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    ema = copy.deepcopy(transformer).eval().requires_grad_(False)
    hist = []
    bar = tqdm(range(steps), desc="transformer", disable=not progress)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr * _lr_factor(step, steps, max(1, steps // 20))
        embeds, pooled = text[int(torch.randint(0, len(text), (1,), generator=gen))]
        idx = torch.randint(0, lat_mean.shape[0], (batch_size,), generator=gen)
        z = lat_mean[idx] + lat_std[idx] * torch.randn(lat_mean[idx].shape, generator=gen)
        x0 = (z - shift) * scale
        cond = cap_index[idx].clone()
        cond[torch.rand(batch_size, generator=gen) < caption_dropout] = null_index
        # source: SD3 paper (Esser et al. 2024) sec. 3.1 logit-normal sampling; time shift as in
        # diffusers FlowMatchEulerDiscreteScheduler: sigma = s*u / (1 + (s - 1)*u)
        u = torch.sigmoid(torch.randn(batch_size, generator=gen))
        sigma = flow_shift * u / (1 + (flow_shift - 1) * u)
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        pred = transformer(hidden_states=xt, timestep=sigma * 1000, encoder_hidden_states=embeds[cond],
                           pooled_projections=pooled[cond], return_dict=False)[0]
        loss = F.mse_loss(pred, noise - x0)  # rectified-flow velocity target
        _update(opt, loss, params, ema, transformer, step, ema_decay, hist, bar)
    transformer.load_state_dict(ema.state_dict())
    transformer.eval()
    tail = max(1, min(100, steps))
    return {"transformer/loss": sum(hist[-tail:]) / tail if hist else float("nan")}


def pretrain_tiny_sd3(out_dir, steps: int = 3000, seed: int = 0, *, vae_steps: int = 800,
                      batch_size: int = 32, lr: float = 2e-3, vae_batch_size: int = 16, vae_lr: float = 1e-2,
                      kl_weight: float = 1e-3, pool_size: int = 4096, n_shapes: int | tuple[int, int] = (1, 1),
                      caption_dropout: float = 0.1, ema_decay: float = 0.995,
                      max_sequence_lengths: Sequence[int] = (128, 256), progress: bool = True) -> dict:
    """Build ``mmrl.tiny.build_tiny_sd3(seed)``, train its VAE then its transformer on synthetic shapes,
    save the pipeline to ``out_dir`` and return a summary dict (also written to ``out_dir/pretraining.json``).

    ``steps``: transformer steps (batch ``batch_size``); ``vae_steps``: VAE steps (batch ``vae_batch_size``).
    The defaults are the settings of the shipped ``assets/tiny_sd3_shapes`` (7 CPU minutes on one thread).
    ``max_sequence_lengths``: T5 prompt lengths seen in training, one drawn per step; sampling with a
    different length shifts the conditioning (the T5 padding tokens join the attention). Default: both
    Flow-GRPO's 128 and diffusers' pipeline default 256.
    """
    from diffusers import StableDiffusion3Pipeline

    from mmrl.tiny import build_tiny_sd3

    if steps < 1:
        raise ValueError(f"pretrain_tiny_sd3: steps must be >= 1, got {steps}")
    if vae_steps < 0:
        raise ValueError(f"pretrain_tiny_sd3: vae_steps must be >= 0, got {vae_steps}")
    t_start, c_start = time.time(), time.process_time()
    out_dir = refuse_foreign_output(out_dir, "model_index.json", "pretrain_tiny_sd3",
                                    "pass a new or a pipeline directory")
    gen = torch.Generator().manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        pipe = StableDiffusion3Pipeline.from_pretrained(build_tiny_sd3(Path(tmp) / "init", seed=seed))
    pipe.set_progress_bar_config(disable=True)
    for enc in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        enc.requires_grad_(False)

    images, captions = make_shape_pool(pool_size, seed, size=64, n_shapes=n_shapes)
    summary: dict = {"seed": seed, "steps": steps, "vae_steps": vae_steps, "batch_size": batch_size, "lr": lr,
                     "vae_batch_size": vae_batch_size, "vae_lr": vae_lr, "kl_weight": kl_weight,
                     "pool_size": pool_size, "n_shapes": list(n_shapes) if not isinstance(n_shapes, int) else n_shapes,
                     "caption_dropout": caption_dropout, "ema_decay": ema_decay,
                     "max_sequence_lengths": list(max_sequence_lengths)}

    # (a) VAE
    t0, c0 = time.time(), time.process_time()
    summary.update(_train_vae(pipe.vae, images, vae_steps, vae_batch_size, vae_lr, kl_weight, gen, progress))
    lat_mean, lat_std = _encode_pool(pipe.vae, images)
    shift = lat_mean.mean().item()
    scale = 1.0 / lat_mean.std().item()
    pipe.vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    summary.update({"vae/seconds": time.time() - t0, "vae/cpu_seconds": time.process_time() - c0,
                    "vae/shift_factor": shift, "vae/scaling_factor": scale,
                    "vae/posterior_std_scaled": (lat_std.mean() * scale).item()})

    # (b) transformer on (caption, latent) pairs
    t0, c0 = time.time(), time.process_time()
    unique = sorted(set(captions))
    text = [encode_captions(pipe, unique + [""], max_sequence_length=n) for n in max_sequence_lengths]
    lookup = {c: i for i, c in enumerate(unique)}
    cap_index = torch.tensor([lookup[c] for c in captions])
    flow_shift = float(pipe.scheduler.config.shift)
    summary.update(_train_transformer(pipe.transformer, lat_mean, lat_std, shift, scale, cap_index, text,
                                      len(unique), steps, batch_size, lr, caption_dropout, flow_shift, ema_decay,
                                      gen, progress))
    summary["transformer/seconds"] = time.time() - t0
    summary["transformer/cpu_seconds"] = time.process_time() - c0
    summary["seconds"] = time.time() - t_start
    summary["cpu_seconds"] = time.process_time() - c_start

    if out_dir.exists():
        shutil.rmtree(out_dir)  # checked up front: empty or an earlier pipeline directory
    pipe.save_pretrained(out_dir)
    _drop_temp_paths(out_dir)
    (out_dir / "pretraining.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary["path"] = str(out_dir)
    return summary


def _drop_temp_paths(root: Path) -> None:
    """Remove ``_name_or_path`` (the temporary build directory) from the saved configs: it is only a
    record of where the weights were loaded from, and a temp path would leak into the shipped asset."""
    for cfg in [root / "model_index.json", *root.glob("*/config.json")]:
        data = json.loads(cfg.read_text())
        if "_name_or_path" in data:
            del data["_name_or_path"]
            cfg.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def sample_images(pipe, prompts: Sequence[str], seeds: Sequence[int], num_inference_steps: int = 8,
                  guidance_scale: float = 1.0, size: int = 64) -> torch.Tensor:
    """One image per (prompt, seed): float [len(prompts) * len(seeds), 3, size, size] in [0, 1], prompt-major."""
    out = []
    for p in prompts:
        gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
        out.append(pipe([p] * len(seeds), num_inference_steps=num_inference_steps, height=size, width=size,
                        guidance_scale=guidance_scale, generator=gens, output_type="pt").images)
    return torch.cat(out)


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m mmrl.diffusion.pretrain_tiny", description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output directory (new, empty, or an earlier pipeline directory: overwritten)")
    ap.add_argument("--steps", type=int, default=3000, help="transformer steps")
    ap.add_argument("--vae-steps", type=int, default=800, help="VAE steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--grid", default=None, help="also save a sample grid PNG of the evaluation prompts here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    summary = pretrain_tiny_sd3(args.out, steps=args.steps, seed=args.seed, vae_steps=args.vae_steps,
                                batch_size=args.batch_size)
    if args.grid:
        from diffusers import StableDiffusion3Pipeline

        from mmrl.run.plots import save_image_grid

        pipe = StableDiffusion3Pipeline.from_pretrained(args.out)
        pipe.set_progress_bar_config(disable=True)
        seeds = list(range(8))
        imgs = sample_images(pipe, EVAL_PROMPTS, seeds)
        save_image_grid(imgs, [p for p in EVAL_PROMPTS for _ in seeds], args.grid, cols=len(seeds))
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
