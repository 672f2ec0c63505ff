"""Pretrain the tiny Janus into a weak text-to-image generator of the shapes scenes: the CPU `janus_grpo` demo's model.

Real GRPO fine-tunes a pretrained generator; this script makes the tiny analogue in two stages, on the tiny Janus of
`mmrl.tiny.build_tiny_janus` (16 x 16 images from a 4 x 4 token grid, 64-entry codebook, VQ width 4 at full
resolution, understanding aligner at the Llama width 32):

1. The VQ decoder (`_train_decoder`): a random one turns every token grid into a near-grey image, so an image reward
   cannot tell token choices apart. Trained alone, it paints token 8 c + v as a solid patch of the shapes colour c
   (`mmrl.pipelines.shapes.COLORS`, in its order) mixed with grey by v / 10 (`token_palette()`). Trained: codebook
   `quantize.embedding`, `post_quant_conv`, `decoder` (AdamW, cosine learning rate to a tenth, gradient norm clipped
   to 1), MSE + L1 between `vqmodel.decode(grid)` and the grid's palette colours upsampled to pixels, on grids drawn
   as one token everywhere, independent tokens, or one token with a quarter of the cells redrawn. Before it, the
   generation head's `proj_out` is redrawn at std 1 / sqrt(width) (`redraw_head_input`; at transformers' 0.02 the
   head's logits are ~0.005).
2. The language model, briefly (`_train_lm`): teacher forcing (cross-entropy of the generation head's logits) on the
   training captions (`assets/prompts/shapes_train.txt`) paired with their scenes as palette tokens
   (`caption_grid`: a scene rendered at 16 px, each 4 x 4 cell the pure token of its majority colour), a tenth of
   the rows with the prompt replaced by the unconditional one (pad but BOS and begin-of-image, what guided sampling
   uses). Trained: the Llama decoder with its embeddings, the image-token embeddings and aligner, the generation
   head. `lm_steps` is kept small on purpose: a random language model's prompt features are arbitrary and GRPO erases
   them (docs/ar-image.md); a few dozen steps leave the model weakly prompt-conditioned (held-out `prompt_color` at
   guidance 5 clearly above a random model's, far below the 0.91-0.97 of one-token images of the prompt's colour),
   which is what GRPO can then raise.

Saved with `save_pretrained` (weights stored in float16 to halve the asset; `load_janus` loads them as float32) with
the tiny `JanusProcessor`, plus `pretraining.json` (settings, losses, seconds, the palette check and the prompt
conditioning of the saved model). The shipped `assets/tiny_janus_shapes` is
`python -m mmrl.ar_image.pretrain_tiny assets/tiny_janus_shapes` (the defaults).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from mmrl.pipelines.shapes import COLORS, parse_caption, sample_scene
from mmrl.run.files import refuse_foreign_output

__all__ = ["SHADES", "token_palette", "palette_check", "redraw_head_input", "caption_grid", "background_token_prob",
           "pretrain_tiny_janus", "main"]

SHADES = 8  # tokens per shapes colour: 8 colours x 8 shades = the tiny codebook's 64 entries
GREY = 0.5
REPO = Path(__file__).resolve().parents[2]
TRAIN_PROMPTS = REPO / "assets" / "prompts" / "shapes_train.txt"
EVAL_PROMPTS = REPO / "assets" / "prompts" / "shapes_eval.txt"
LM_STEPS = 50  # language-model steps of the shipped asset: weakly prompt-conditioned (module docstring)


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


def caption_grid(prompt: str, rng: random.Random, side: int = 4, size: int = 16) -> torch.Tensor:
    """[side^2] palette tokens of a scene of one-shape caption `prompt` (`mmrl.pipelines.shapes.sample_scene`
    with its shape colour, kind and background, `size` px): each cell the pure token (8 c) of its majority colour
    (ties: the earlier colour of COLORS)."""
    parsed = parse_caption(prompt)
    if len(parsed["objects"]) != 1 or parsed["objects"][0][0] != 1:
        raise ValueError(f"caption_grid: expected a one-shape caption ('a red circle on a blue background'), "
                         f"got {prompt!r}")
    (_, colour, kind), = parsed["objects"]
    scene = sample_scene(rng, n_shapes=1, colors=[colour], kinds=[kind], backgrounds=[parsed["background"]],
                         size=size)
    pixels = torch.frombuffer(bytearray(scene.image.tobytes()), dtype=torch.uint8).view(size, size, 3)
    ref = torch.tensor(list(COLORS.values()), dtype=torch.uint8)
    index = (pixels[:, :, None, :] == ref).all(-1).to(torch.int64).argmax(-1)  # every pixel is exactly one colour
    cell = size // side
    cells = index.view(side, cell, side, cell).permute(0, 2, 1, 3).reshape(side * side, cell * cell)
    return F.one_hot(cells, len(COLORS)).sum(1).argmax(1) * SHADES


def _lm_logits(model, prompt_ids: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
    """[b, T, codebook] generation-head logits of `grids` [b, T] after `prompt_ids` [b, L] (one prompt length),
    teacher-forced: the conditional half of `JanusPolicy.guided_logits`."""
    embeds = torch.cat([model.get_input_embeddings()(prompt_ids),
                        model.prepare_embeddings_for_image_generation(grids[:, :-1])], 1)
    hidden = model.model.language_model(inputs_embeds=embeds).last_hidden_state
    return model.model.generation_head(hidden[:, prompt_ids.shape[1] - 1:])


def _prompt_rows(policy, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """([P, L] prompt ids, [P, L] their unconditional rows); the shapes captions share one length."""
    ids = [policy.prompt_ids(p) for p in prompts]
    if len({x.shape[1] for x in ids}) != 1:
        raise ValueError(f"pretrain_tiny_janus: the prompts tokenise to lengths {sorted({x.shape[1] for x in ids})}, "
                         "expected one length (one-shape shapes captions)")
    ids = torch.cat(ids)
    return ids, policy._cond_uncond(ids)[len(ids):]  # the policy's own unconditional rows


def _train_lm(model, processor, prompts, steps: int, batch_size: int, lr: float, uncond_prob: float,
              seed: int) -> dict:
    from mmrl.ar_image.janus import JanusPolicy

    inner = model.model
    params = [*inner.language_model.parameters(), *inner.generation_embeddings.parameters(),
              *inner.generation_aligner.parameters(), *inner.generation_head.parameters()]
    model.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    ids, uncond = _prompt_rows(JanusPolicy(model, processor, guidance_scale=5.0), prompts)
    side, size = _grid_side(model), _vq(model).config.resolution
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    hist = []
    model.train()
    for _ in range(steps):
        pick = torch.randint(0, len(prompts), (batch_size,), generator=gen)
        drop = torch.rand(batch_size, generator=gen) < uncond_prob
        grids = torch.stack([caption_grid(prompts[i], rng, side, size) for i in pick.tolist()])
        rows = torch.where(drop[:, None], uncond[pick], ids[pick])
        logits = _lm_logits(model, rows, grids)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), grids.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        hist.append(loss.item())
    model.eval()
    model.requires_grad_(False)
    tail = max(1, min(10, steps))
    return {"lm/loss_first": hist[0], "lm/loss_last": sum(hist[-tail:]) / tail}


@torch.no_grad()
def background_token_prob(model, processor, prompts, guidance_scale: float = 5.0) -> float:
    """Mean over `prompts` and the grid's positions of the guided probability (what the policy samples) of the pure
    token of the prompt's background colour, teacher-forced on the all-background grid (the image `prompt_color`
    scores best). A model that ignores the prompt gives about 1 / codebook."""
    from mmrl.ar_image.janus import JanusPolicy

    policy = JanusPolicy(model, processor, guidance_scale=guidance_scale)
    names, out = list(COLORS), []
    for p in prompts:
        token = names.index(parse_caption(p)["background"]) * SHADES
        grid = torch.full((1, policy.num_tokens), token)
        out.append(torch.softmax(policy.guided_logits(policy.prompt_ids(p), grid), -1)[0, :, token].mean())
    return float(torch.stack(out).mean())


@torch.no_grad()
def held_out_reward(model, processor, prompts, images_per_prompt: int = 4, seed: int = 0,
                    guidance_scale: float = 5.0) -> float:
    """Mean `prompt_color` of `images_per_prompt` guided samples per prompt (a fixed sampling seed)."""
    from mmrl.ar_image.janus import JanusPolicy
    from mmrl.rewards import load as load_reward

    policy = JanusPolicy(model, processor, guidance_scale=guidance_scale)
    reward, gen, scores = load_reward({"prompt_color": 1.0}), torch.Generator().manual_seed(seed), []
    for p in prompts:
        tokens, _ = policy.sample(policy.prompt_ids(p), images_per_prompt, generator=gen)
        scores.append(reward(policy.decode(tokens), [p] * images_per_prompt, None).scores.float())
    return float(torch.cat(scores).mean())


def _conditioning(model, processor) -> dict:
    from mmrl.pipelines.data import load_prompts

    prompts = [it.prompt for it in load_prompts(EVAL_PROMPTS)]
    return {"held_out/background_token_prob": background_token_prob(model, processor, prompts),
            "held_out/prompt_color": held_out_reward(model, processor, prompts)}


def pretrain_tiny_janus(out_dir, steps: int = 600, seed: int = 0, *, batch_size: int = 16, lr: float = 1e-2,
                        image_size: int = 16, patch_size: int = 4, vq_top_width: int = 4, lm_steps: int = LM_STEPS,
                        lm_batch_size: int = 32, lm_lr: float = 3e-3, uncond_prob: float = 0.1) -> dict:
    """Build `mmrl.tiny.build_tiny_janus(seed, image_size, patch_size, vq_top_width)`, train its VQ decoder to the
    palette (`steps`, `batch_size`, `lr`), then its language model on the training captions (`lm_steps`,
    `lm_batch_size`, `lm_lr`, `uncond_prob`; 0 steps: the language model stays random), save it to `out_dir` and
    return a summary (also `out_dir/pretraining.json`). The defaults are the settings of the shipped
    `assets/tiny_janus_shapes`."""
    from transformers import JanusProcessor

    from mmrl.ar_image.janus import load_janus
    from mmrl.pipelines.data import load_prompts
    from mmrl.tiny import build_tiny_janus

    if steps < 1 or lm_steps < 0:
        raise ValueError(f"pretrain_tiny_janus: steps must be >= 1 and lm_steps >= 0, got {steps} and {lm_steps}")
    out_dir = refuse_foreign_output(out_dir, "pretraining.json", "pretrain_tiny_janus",
                                    "pass a new or an earlier output directory")
    t0, c0 = time.time(), time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        init = build_tiny_janus(Path(tmp) / "init", seed=seed, image_size=image_size, patch_size=patch_size,
                                vq_top_width=vq_top_width, aligner_dim=32)
        model, _ = load_janus(init, torch.device("cpu"), torch.float32)
        processor = JanusProcessor.from_pretrained(init)
    summary: dict = {"seed": seed, "steps": steps, "batch_size": batch_size, "lr": lr, "image_size": image_size,
                     "patch_size": patch_size, "vq_top_width": vq_top_width, "lm_steps": lm_steps,
                     "lm_batch_size": lm_batch_size, "lm_lr": lm_lr, "uncond_prob": uncond_prob,
                     **{f"random/{k}": v for k, v in palette_check(model).items()}}
    summary["generation_head/proj_out_std"] = redraw_head_input(model, seed)
    summary.update(_train_decoder(model, steps, batch_size, lr, torch.Generator().manual_seed(seed)))
    if lm_steps:
        prompts = [it.prompt for it in load_prompts(TRAIN_PROMPTS)]
        summary.update(_train_lm(model, processor, prompts, lm_steps, lm_batch_size, lm_lr, uncond_prob, seed))
    summary.update({"seconds": time.time() - t0, "cpu_seconds": time.process_time() - c0})
    if out_dir.exists():
        shutil.rmtree(out_dir)  # checked up front: empty or an earlier output of this script
    model.to(torch.float16).save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    saved, _ = load_janus(out_dir, torch.device("cpu"), torch.float32)  # the checks are of what was written
    summary.update({f"trained/{k}": v for k, v in palette_check(saved).items()})
    summary.update(_conditioning(saved, processor))
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
    ap.add_argument("--lm-steps", type=int, default=LM_STEPS, help="language-model steps (0: it stays random)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--grid", default=None, help="also save the palette grid PNG here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    summary = pretrain_tiny_janus(args.out, steps=args.steps, seed=args.seed, lm_steps=args.lm_steps)
    if args.grid:
        from mmrl.ar_image.janus import load_janus

        palette_grid(load_janus(args.out, torch.device("cpu"), torch.float32)[0], args.grid)
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
