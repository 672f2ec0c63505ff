"""Pretrain a tiny FLUX.1 Kontext pipeline on synthetic shape edits, so the CPU edit demo has an editor to improve.

A randomly initialised editor outputs noise and no reward can tell a good edit from a bad one (CALIBRATION.md);
this script gives a tiny `FluxKontextPipeline` a few CPU minutes of real edits:

- data: `mmrl.pipelines.edits.shapes_edit_example` triples (source scene, "make the <shape> <colour>", the same
  scene with the shape recoloured);
- VAE: the shapes-trained AutoencoderKL of `assets/tiny_sd3_shapes` (4 latent channels, its shift / scale),
  frozen; source and target images are encoded once (posterior means);
- text: the tiny FLUX.1 CLIP + T5 encoders (random, frozen, deterministic), every instruction encoded once;
- transformer: `FluxTransformer2DModel` (2 double + 2 single blocks, 4 heads x 16, guidance embedding) trained
  with the rectified-flow objective on the target latents, the source latents appended to the sequence exactly
  as `FluxKontextModel` / the pipeline do (image ids with first axis 1), a fixed guidance value (2.5, the
  published Kontext RL setting), noise levels drawn logit-normal through the schedule's shift at 64x64. The EMA of
  the weights is saved.

The result loads with `FluxKontextPipeline.from_pretrained(out_dir)` (`pretraining.json` holds the settings,
losses, seconds). What is simplified away: one resolution (64x64), one shape per scene, recolouring edits only;
the edit is imperfect on purpose-built budgets, which is what RL then improves.

CLI: ``python -m mmrl.diffusion.pretrain_tiny_edit OUT --steps N``.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from mmrl.diffusion.pretrain_tiny import _drop_temp_paths, _lr_factor, _update
from mmrl.pipelines.edits import shapes_edit_example
from mmrl.run.files import refuse_foreign_output

__all__ = ["pretrain_tiny_kontext", "GUIDANCE", "main"]

REPO = Path(__file__).resolve().parents[2]
SHAPES_SD3 = REPO / "assets" / "tiny_sd3_shapes"
GUIDANCE = 2.5  # the guidance-embedding value trained with (source: Flow-Factory examples/grpo/lora/flux1_kontext)


def _edit_pool(n: int, seed: int, size: int = 64):
    """(source images, target images) float [n, 3, size, size] in [-1, 1], instructions list[str]."""
    rng = random.Random(seed)
    examples = [shapes_edit_example(rng, size) for _ in range(n)]

    def stack(pils):
        x = torch.stack([torch.frombuffer(bytearray(p.tobytes()), dtype=torch.uint8).view(size, size, 3) for p in pils])
        return x.permute(0, 3, 1, 2).float() / 127.5 - 1.0

    return (stack([e["source"] for e in examples]), stack([e["target"] for e in examples]),
            [e["instruction"] for e in examples])


@torch.no_grad()
def _latents(vae, images, chunk=256):
    z = torch.cat([vae.encode(images[i:i + chunk]).latent_dist.mean for i in range(0, len(images), chunk)])
    return (z - vae.config.shift_factor) * vae.config.scaling_factor


def _train(pipe, src, tgt, text_index, text, steps, batch_size, lr, flow_shift, ema_decay, gen, progress):
    transformer = pipe.transformer
    transformer.train().requires_grad_(True)
    params = list(transformer.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    ema = copy.deepcopy(transformer).eval().requires_grad_(False)
    b, c, h, w = batch_size, src.shape[1], src.shape[2], src.shape[3]
    ids = pipe._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32)
    image_ids = ids.clone()
    image_ids[..., 0] = 1
    ids = torch.cat([ids, image_ids])
    embeds, pooled = text
    txt_ids = torch.zeros(embeds.shape[1], 3)
    guidance = torch.full([b], GUIDANCE)
    n_tok = (h // 2) * (w // 2)
    hist = []
    bar = tqdm(range(steps), desc="kontext", disable=not progress)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr * _lr_factor(step, steps, max(1, steps // 20))
        idx = torch.randint(0, src.shape[0], (b,), generator=gen)
        x0, cond, k = tgt[idx], src[idx], text_index[idx]
        # source: SD3 paper (Esser et al. 2024) logit-normal noise levels, through the schedule's time shift
        u = torch.sigmoid(torch.randn(b, generator=gen))
        sigma = flow_shift * u / (1 + (flow_shift - 1) * u)
        noise = torch.randn(x0.shape, generator=gen)
        xt = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise
        packed = torch.cat([pipe._pack_latents(xt, b, c, h, w), pipe._pack_latents(cond, b, c, h, w)], dim=1)
        pred = transformer(hidden_states=packed, timestep=sigma, guidance=guidance, pooled_projections=pooled[k],
                           encoder_hidden_states=embeds[k], txt_ids=txt_ids, img_ids=ids, return_dict=False)[0]
        target = pipe._pack_latents(noise - x0, b, c, h, w)
        loss = F.mse_loss(pred[:, :n_tok], target)
        _update(opt, loss, params, ema, transformer, step, ema_decay, hist, bar)
    transformer.load_state_dict(ema.state_dict())
    transformer.eval().requires_grad_(False)
    tail = max(1, min(100, steps))
    return {"transformer/loss": sum(hist[-tail:]) / tail if hist else float("nan")}


def pretrain_tiny_kontext(out_dir, steps: int = 3000, seed: int = 0, *, batch_size: int = 32, lr: float = 2e-3,
                          pool_size: int = 4096, ema_decay: float = 0.995, max_sequence_length: int = 16,
                          vae_from: str | Path = SHAPES_SD3, progress: bool = True) -> dict:
    """Build a tiny FluxKontextPipeline around the shapes VAE of `vae_from`, train its transformer on synthetic
    shape edits, save it to `out_dir`; returns (and writes to `out_dir/pretraining.json`) a summary."""
    from diffusers import AutoencoderKL, FluxKontextPipeline
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from mmrl.tiny.diffusion_models import _flux_parts

    if steps < 1:
        raise ValueError(f"pretrain_tiny_kontext: steps must be >= 1, got {steps}")
    out_dir = refuse_foreign_output(out_dir, "model_index.json", "pretrain_tiny_kontext")
    t_start, c_start = time.time(), time.process_time()
    gen = torch.Generator().manual_seed(seed)
    vae = AutoencoderKL.from_pretrained(Path(vae_from) / "vae").eval().requires_grad_(False)
    with tempfile.TemporaryDirectory() as tmp:
        FluxKontextPipeline(**_flux_parts(seed, vae=vae, num_layers=2, num_single_layers=2, heads=4)).save_pretrained(
            Path(tmp) / "init")
        pipe = FluxKontextPipeline.from_pretrained(Path(tmp) / "init")
    pipe.set_progress_bar_config(disable=True)
    for enc in (pipe.text_encoder, pipe.text_encoder_2, pipe.vae):
        enc.requires_grad_(False)

    src_img, tgt_img, instructions = _edit_pool(pool_size, seed)
    src, tgt = _latents(pipe.vae, src_img), _latents(pipe.vae, tgt_img)
    unique = sorted(set(instructions))
    with torch.no_grad():
        pe, pooled, _ = pipe.encode_prompt(prompt=unique, prompt_2=None, max_sequence_length=max_sequence_length)
    lookup = {t: i for i, t in enumerate(unique)}
    text_index = torch.tensor([lookup[t] for t in instructions])
    c = pipe.scheduler.config
    n_tok = (src.shape[2] // 2) * (src.shape[3] // 2)
    mu = calculate_shift(n_tok, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    flow_shift = float(torch.tensor(mu).exp())  # exponential time shift at this resolution: sigma' = e^mu s / ...
    summary = {"seed": seed, "steps": steps, "batch_size": batch_size, "lr": lr, "pool_size": pool_size,
               "ema_decay": ema_decay, "max_sequence_length": max_sequence_length, "guidance": GUIDANCE,
               "flow_shift": flow_shift, "instructions": len(unique), "vae_from": str(Path(vae_from).name)}
    t0, c0 = time.time(), time.process_time()
    summary.update(_train(pipe, src, tgt, text_index, (pe.float(), pooled.float()), steps, batch_size, lr,
                          flow_shift, ema_decay, gen, progress))
    summary["transformer/seconds"] = time.time() - t0
    summary["transformer/cpu_seconds"] = time.process_time() - c0
    summary["seconds"] = time.time() - t_start
    summary["cpu_seconds"] = time.process_time() - c_start
    if out_dir.exists():
        shutil.rmtree(out_dir)
    pipe.save_pretrained(out_dir)
    _drop_temp_paths(out_dir)
    (out_dir / "pretraining.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary["path"] = str(out_dir)
    return summary


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m mmrl.diffusion.pretrain_tiny_edit", description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output directory (new, empty, or an earlier pipeline directory: overwritten)")
    ap.add_argument("--steps", type=int, default=3000, help="transformer steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--pool-size", type=int, default=4096, help="synthetic edits to train on")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    summary = pretrain_tiny_kontext(args.out, steps=args.steps, seed=args.seed, batch_size=args.batch_size,
                                    pool_size=args.pool_size)
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
