"""Train the tiny Janus's VQ decoder so its image tokens mean colours: the CPU `janus_grpo` demo's model.

A random VQ decoder turns every token grid into a near-grey image, so an image reward cannot tell the policy's token
choices apart (docs/ar-image.md). This script gives the tiny Janus (`mmrl.tiny.build_tiny_janus`: 16 x 16 images
from a 4 x 4 token grid, 64-entry codebook, VQ width 4 at full resolution, understanding aligner at the Llama
width 32) a decoder whose tokens are solid colour
patches: token 8 c + v is the shapes colour c (`mmrl.pipelines.shapes.COLORS`, in its order) mixed with grey by
v / 10 (v = 0: the pure colour, 7: 70% grey), `token_palette()`.

Only the VQ-VAE's decoder side is trained (codebook `quantize.embedding`, `post_quant_conv`, `decoder`; AdamW, cosine
learning rate to a tenth, gradient norm clipped to 1): MSE + L1
between `vqmodel.decode(grid)` and the grid's palette colours upsampled to pixels, on grids drawn as one token
everywhere (what a policy that found the prompt's colour emits), independent tokens, or one token with a quarter
of the cells redrawn. The Llama decoder, the generation head, the understanding tower and the VQ encoder stay
random: GRPO has to learn which tokens paint the colour a prompt names. One change to them: the generation head's
`proj_out` is redrawn at std 1 / sqrt(width) (`redraw_head_input`): at transformers' initializer_range 0.02 and width
32 the head's logits are ~0.005 and a prompt's colour word moves them by ~0.001, too little for a few dozen GRPO steps
to act on (measured: the policy's entropy stayed at ln 64 and the reward at its control's); redrawn, the guided
policy still starts near uniform (entropy ~4.13 of 4.16) and the colour word moves the logits by ~30% of their spread.

Saved with `save_pretrained` (weights stored in float16 to halve the asset; `load_janus` loads them as float32) with
the tiny `JanusProcessor`, plus `pretraining.json` (settings, loss, seconds, the palette check of the saved model).
The shipped `assets/tiny_janus_shapes` is `python -m mmrl.ar_image.pretrain_tiny assets/tiny_janus_shapes` (the
defaults; about a CPU minute on one thread).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from mmrl.pipelines.shapes import COLORS
from mmrl.run.files import refuse_foreign_output

__all__ = ["SHADES", "token_palette", "palette_check", "redraw_head_input", "pretrain_tiny_janus", "main"]

SHADES = 8  # tokens per shapes colour: 8 colours x 8 shades = the tiny codebook's 64 entries
GREY = 0.5


def token_palette(num_tokens: int = 64) -> torch.Tensor:
    """[num_tokens, 3] colour in [0, 1] of each token (module docstring): token 8 c + v = colour c mixed v / 10
    with grey."""
    names = list(COLORS)
    if num_tokens != len(names) * SHADES:
        raise ValueError(f"token_palette: the palette has {len(names)} colours x {SHADES} shades = "
                         f"{len(names) * SHADES} tokens, the codebook has {num_tokens}")
    base = torch.tensor([COLORS[n] for n in names], dtype=torch.float32) / 255
    mix = (torch.arange(SHADES, dtype=torch.float32) / 10)[None, :, None]
    return ((1 - mix) * base[:, None, :] + mix * GREY).reshape(-1, 3)


def _vq(model):
    return model.model.vqmodel


def _grid_side(model) -> int:
    return int(_vq(model).quantize.quant_state_dims[0])


def _targets(grids: torch.Tensor, palette: torch.Tensor, side: int, size: int) -> torch.Tensor:
    """[b, 3, size, size] in [-1, 1]: each token's palette colour over its cell."""
    cells = palette[grids].view(grids.shape[0], side, side, 3).permute(0, 3, 1, 2)
    return F.interpolate(cells, size=(size, size), mode="nearest") * 2 - 1


def _draw_grids(batch: int, side: int, num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, side^2] token grids: a third one token everywhere, a third independent tokens, a third one token
    with a quarter of the cells redrawn."""
    n = side * side
    kind = torch.randint(0, 3, (batch, 1), generator=gen)
    free = torch.randint(0, num_tokens, (batch, n), generator=gen)
    one = torch.randint(0, num_tokens, (batch, 1), generator=gen).expand(batch, n)
    mostly = torch.where(torch.rand(batch, n, generator=gen) < 0.75, one, free)
    return torch.where(kind == 0, one, torch.where(kind == 1, free, mostly))


@torch.no_grad()
def palette_check(model, images_per_kind: int = 64, seed: int = 0) -> dict:
    """How well the VQ decoder paints `token_palette()`: `uniform_max_err` / `uniform_mean_err` (the largest / mean
    distance, RGB in [0, 1], between a one-token image's mean colour and its token's colour, over every token),
    `mosaic_mae` (mean absolute pixel error, [0, 1] scale, on random grids of independent tokens)."""
    vq = _vq(model)
    palette = token_palette(vq.config.num_embeddings)
    side, size = _grid_side(model), vq.config.resolution
    tokens = torch.arange(palette.shape[0])[:, None].expand(-1, side * side)
    uniform = (vq.decode(tokens).float().clamp(-1, 1) + 1) / 2
    err = (uniform.mean((2, 3)) - palette).norm(dim=1)
    gen = torch.Generator().manual_seed(seed)
    grids = torch.randint(0, palette.shape[0], (images_per_kind, side * side), generator=gen)
    mosaic = (vq.decode(grids).float().clamp(-1, 1) + 1) / 2
    mae = (mosaic - (_targets(grids, palette, side, size) + 1) / 2).abs().mean()
    return {"uniform_max_err": float(err.max()), "uniform_mean_err": float(err.mean()), "mosaic_mae": float(mae)}


@torch.no_grad()
def redraw_head_input(model, seed: int) -> float:
    """Redraw `generation_head.proj_out.weight` ~ N(0, 1 / width) from its own generator (module docstring); returns
    the std."""
    layer = model.model.generation_head.proj_out
    std = layer.in_features ** -0.5
    gen = torch.Generator().manual_seed(seed)
    layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * std)
    return std


def _train_decoder(model, steps: int, batch_size: int, lr: float, gen: torch.Generator) -> dict:
    vq = _vq(model)
    params = [*vq.quantize.embedding.parameters(), *vq.post_quant_conv.parameters(), *vq.decoder.parameters()]
    model.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    palette = token_palette(vq.config.num_embeddings)
    side, size = _grid_side(model), vq.config.resolution
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=lr / 10)
    hist = []
    vq.train()
    for _ in range(steps):
        grids = _draw_grids(batch_size, side, palette.shape[0], gen)
        target = _targets(grids, palette, side, size)
        out = vq.decode(grids)
        loss = F.mse_loss(out, target) + (out - target).abs().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        hist.append(loss.item())
    vq.eval()
    model.requires_grad_(False)
    tail = max(1, min(50, steps))
    return {"decoder/loss_first": hist[0] if hist else float("nan"),
            "decoder/loss_last": sum(hist[-tail:]) / tail if hist else float("nan")}


def pretrain_tiny_janus(out_dir, steps: int = 600, seed: int = 0, *, batch_size: int = 16, lr: float = 1e-2,
                        image_size: int = 16, patch_size: int = 4, vq_top_width: int = 4) -> dict:
    """Build `mmrl.tiny.build_tiny_janus(seed, image_size, patch_size, vq_top_width)`, train its VQ decoder to the
    palette (module docstring), save it to `out_dir` and return a summary (also `out_dir/pretraining.json`).
    The defaults are the settings of the shipped `assets/tiny_janus_shapes`."""
    from transformers import JanusProcessor

    from mmrl.ar_image.janus import load_janus
    from mmrl.tiny import build_tiny_janus

    if steps < 1:
        raise ValueError(f"pretrain_tiny_janus: steps must be >= 1, got {steps}")
    out_dir = refuse_foreign_output(out_dir, "pretraining.json", "pretrain_tiny_janus",
                                    "pass a new or an earlier output directory")
    t0, c0 = time.time(), time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        init = build_tiny_janus(Path(tmp) / "init", seed=seed, image_size=image_size, patch_size=patch_size,
                                vq_top_width=vq_top_width, aligner_dim=32)
        model, _ = load_janus(init, torch.device("cpu"), torch.float32)
        processor = JanusProcessor.from_pretrained(init)
    summary: dict = {"seed": seed, "steps": steps, "batch_size": batch_size, "lr": lr, "image_size": image_size,
                     "patch_size": patch_size, "vq_top_width": vq_top_width,
                     **{f"random/{k}": v for k, v in palette_check(model).items()}}
    summary["generation_head/proj_out_std"] = redraw_head_input(model, seed)
    summary.update(_train_decoder(model, steps, batch_size, lr, torch.Generator().manual_seed(seed)))
    summary.update({"seconds": time.time() - t0, "cpu_seconds": time.process_time() - c0})
    if out_dir.exists():
        shutil.rmtree(out_dir)  # checked up front: empty or an earlier output of this script
    model.to(torch.float16).save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    saved, _ = load_janus(out_dir, torch.device("cpu"), torch.float32)  # the check is of what was written
    summary.update({f"trained/{k}": v for k, v in palette_check(saved).items()})
    (out_dir / "pretraining.json").write_text(json.dumps(summary, indent=1) + "\n")
    return {**summary, "path": str(out_dir)}


@torch.no_grad()
def palette_grid(model, path) -> Path:
    """A PNG of every token's one-token image (8 rows of colours x 8 shades) and 8 random mosaics."""
    from mmrl.run.plots import save_image_grid

    vq, side = _vq(model), _grid_side(model)
    n = vq.config.num_embeddings
    grids = torch.cat([torch.arange(n)[:, None].expand(-1, side * side),
                       torch.randint(0, n, (SHADES, side * side), generator=torch.Generator().manual_seed(0))])
    images = (vq.decode(grids).float().clamp(-1, 1) + 1) / 2
    names = [f"{name} {v}" for name in COLORS for v in range(SHADES)] + ["mosaic"] * SHADES
    return save_image_grid(images, names, path, cols=SHADES, min_cell=48)


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m mmrl.ar_image.pretrain_tiny", description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output directory (new, empty, or an earlier output: overwritten)")
    ap.add_argument("--steps", type=int, default=600, help="decoder steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--grid", default=None, help="also save the palette grid PNG here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    summary = pretrain_tiny_janus(args.out, steps=args.steps, seed=args.seed)
    if args.grid:
        from mmrl.ar_image.janus import load_janus

        palette_grid(load_janus(args.out, torch.device("cpu"), torch.float32)[0], args.grid)
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
