"""Model families on CPU: each family's tiny model, the Flow-GRPO step split and the rollout against diffusers.

    .venv/bin/python benchmarks/families.py [--families wan21,wan22_a14b,z_image,flux2,flux2_klein] [--steps 4]
        [--repeats 5] [--threads 1]

For every family's tiny checkpoint (`mmrl.tiny`, the real diffusers / transformers classes):

1. Flow-GRPO step split: `mmrl.diffusion.flow_grpo.train` for `--steps` steps (the first, with one-off warm-up,
   left out), measured as in `flow_grpo_step.py` (whose `bench` this reuses): transformer forward time (hooks on the
   transformer), backward time (`Tensor.backward`), and the rest of the step (SDE math, text encoders, VAE decode,
   reward, optimizer, logging) as a share of the step; min / median / max over the measured steps.
2. Rollout against diffusers' own pipeline, same work: encode the prompts, then a deterministic 8-step rollout of 4
   samples from the same initial noise, with the family's guidance (CFG where it has one), no decode (the pipeline
   with `output_type="latent"`); interleaved (`_timing.interleaved`), min / median / max; and the max |difference|
   of the final latents (0 = bitwise equal). The pipeline encodes its negative prompt on every call, the family
   once per model: the one text-encoder pass this saves is part of what is measured.

Prints Markdown tables and the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
from _timing import interleaved, machine, speedup

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MMRL_NO_PROGRESS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPTS = ["a red circle on a blue background", "a green square on a white background"]
VIDEO_REWARD = "reward.components={motion_amount: 1.0, f: {reward: video_frames, image_reward: jpeg_compressibility}}"


def _wan(root, variant):
    from mmrl.tiny import build_tiny_wan

    return build_tiny_wan(root / variant, variant=variant)


def _builder(name):
    from mmrl import tiny

    return lambda root: getattr(tiny, f"build_tiny_{name}")(root / name)


# family -> (build(root) -> path, size, frames, guidance scale); what the rollout comparison and the step run use
FAMILIES = {
    "wan21": (lambda root: _wan(root, "2.1"), 32, 5, 5.0),
    "wan22_a14b": (lambda root: _wan(root, "2.2_a14b"), 32, 5, 5.0),
    "z_image": (_builder("z_image"), 64, 1, 4.0),
    "flux2": (_builder("flux2"), 64, 1, 4.0),
    "flux2_klein": (_builder("flux2_klein"), 64, 1, 4.0),
}


def pipeline_call(model, x0, size, frames, gs, steps):
    """Diffusers' own pipeline of the family on the same initial noise (its latent layout), latents out."""
    prompts = [p for p in PROMPTS for _ in range(2)]  # a fresh list per call (Z-Image writes into it)
    kw = dict(prompt=prompts, num_inference_steps=steps, guidance_scale=gs, height=size, width=size,
              output_type="latent", max_sequence_length=model.max_sequence_length)
    name = type(model.pipe).__name__
    if name == "WanPipeline":
        return model.pipe(latents=x0.clone(), num_frames=frames, negative_prompt=[""] * 4, **kw).frames
    if name == "Flux2Pipeline":
        return model.pipe(latents=x0.clone(), **kw).images  # packed tokens out
    return model.pipe(latents=x0.clone(), **kw).images


def our_latents_like_pipeline(model, latents):
    """Our final latents in the layout the pipeline's latent output has."""
    name = type(model.pipe).__name__
    if name == "Flux2Pipeline":
        return model.pipe._pack_latents(latents)
    if name == "Flux2KleinPipeline":
        mean, std = model._bn_stats(latents)
        return model.pipe._unpatchify_latents(latents * std + mean)
    return latents


def rollout_vs_pipeline(path, size, frames, gs, repeats, steps=8):
    from mmrl.diffusion.models import load_flow_model
    from mmrl.diffusion.sampling import sample_groups

    model = load_flow_model(path, num_frames=frames, max_sequence_length=32)
    gen = torch.Generator().manual_seed(0)
    x0 = model.initial_noise(4, size, size, gen)
    result = {}

    def ours():
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            result["ours"] = sample_groups(model, model.encode_prompts(PROMPTS), 2, num_steps=steps, height=size,
                                           width=size, guidance_scale=gs, noise_level=0.0, generator=g, decode=False)

    def theirs():
        result["pipe"] = pipeline_call(model, x0, size, frames, gs, steps)

    times = interleaved({"mmrl": ours, "diffusers": theirs}, repeats=repeats, warmup=1)
    assert torch.equal(result["ours"].latents[:, 0], x0)  # the same noise went into both
    diff = (our_latents_like_pipeline(model, result["ours"].latents[:, -1]) - result["pipe"]).abs().max().item()
    params = sum(p.numel() for p in model.transformer.parameters())
    return times, diff, params


def step_split(name, path, size, frames, steps, out):
    from flow_grpo_step import bench

    overrides = ["model.max_sequence_length=32", "rollout.num_steps=4"]
    if frames > 1:
        overrides += [f"rollout.num_frames={frames}", VIDEO_REWARD]
    return bench(name, path, size, steps, out, overrides=overrides)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"subset of: {', '.join(FAMILIES)}")
    ap.add_argument("--steps", type=int, default=4, help="Flow-GRPO steps per family (the first is left out)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rollout repeats")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.families.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise SystemExit(f"--families: unknown {unknown}; valid: {list(FAMILIES)}")
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is left out)")
    torch.set_num_threads(args.threads)
    print(f"`python benchmarks/families.py {' '.join(argv if argv is not None else sys.argv[1:])}` - "
          f"{machine(args.threads)}\n", flush=True)
    roll_rows, step_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in names:
            build, size, frames, gs = FAMILIES[name]
            path = build(root)
            times, diff, params = rollout_vs_pipeline(path, size, frames, gs, args.repeats)
            what = f"{size}px" + (f" x {frames} frames" if frames > 1 else "")
            roll_rows.append((name, f"{params / 1e3:.0f}k", what, times["mmrl"].fmt(1e3, 0),
                              times["diffusers"].fmt(1e3, 0), speedup(times["diffusers"], times["mmrl"]),
                              f"{diff:.1e}"))
            res = step_split(name, path, size, frames, args.steps, root / f"run_{name}")
            step_rows.append((name, res["step_s"].fmt(1e3, 0), res["fwd_s"].fmt(1e3, 0), res["bwd_s"].fmt(1e3, 0),
                              res["overhead"].fmt(100, 0), f"{res['drift']:.1e}"))
            print(f"{name} done", file=sys.stderr, flush=True)
    from _timing import markdown_table

    print("Rollout: prompt encoding + 8 ODE steps, 4 samples, guidance on; ms min / median / max, interleaved\n")
    print(markdown_table(["family", "transformer params", "size", "mmrl", "diffusers pipeline", "diffusers / mmrl",
                          "max abs latents difference"], roll_rows))
    print(f"\nFlow-GRPO step ({args.steps - 1} measured steps, 4 prompts x 4 samples, 4 sampling steps, LoRA rank 8, "
          f"2 updates, KL 0.04): ms and % of the step, min / median / max\n")
    print(markdown_table(["family", "step ms", "transformer forward ms", "transformer backward ms",
                          "rest of the step %", "max logprob drift"], step_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
