"""Every model family's tiny model: our rollout against diffusers' own pipeline, and the Flow-GRPO step split.

    .venv/bin/python benchmarks/families.py [--families QwenImagePipeline,...] [--repeats 5] [--steps 3] [--threads 1]

Driven by the registry: every family `mmrl.diffusion.models` registers, built from `mmrl.tiny.FAMILY_BUILDERS`
(a registered family without a tiny builder or a `PIPELINE_CALLS` entry below fails naming it). Per family:

1. Rollout vs pipeline, the same work: one prompt (edit families: and one source image), 4 images, 8 ODE steps,
   64x64, the family's guidance (`SETTINGS`), initial noise from the same seeded generator (both draw the same
   numbers; checked), decoded to images. Ours =
   `encode_items` (text encoders, the source's VAE encode) + `sample_groups(noise_level=0)` (transformer, Euler
   steps, VAE decode); diffusers = the pipeline's `__call__(..., output_type="pt")`, which does the same. Timed
   interleaved (`_timing.interleaved`, A B / B A ...), seconds min / median / max; the last column is the max |latent
   difference| of the two final latents (`output_type="latent"`), the parity the family tests assert. Qwen-Image-Edit's
   pipelines always condition on a ~1024^2 copy of the source, so both sides get a 1024x1024 source there.
2. Flow-GRPO step split (`flow_grpo_step.bench`: LoRA r=8, KL 0.04, EMA, 4 prompts x 4 images, 8 steps, 2
   updates): per measured step, the transformer's forward and backward time and the rest (text encoders, VAE,
   SDE math, reward, optimizer, framework), as fractions of the step, min / median / max over steps 2..N.

Prints Markdown tables and the command line.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

import torch
from _timing import interleaved, machine, markdown_table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# guidance per family (CFG above 1 for the CFG families; the guidance-embedding value for FLUX.1-dev / Kontext);
# families not listed: 1.0. Edit families are those whose FlowModel has `needs_source_image`.
SETTINGS = {"StableDiffusion3Pipeline": 4.5, "FluxPipeline": 3.5, "QwenImagePipeline": 4.0,
            "QwenImageEditPipeline": 4.0, "QwenImageEditPlusPipeline": 4.0, "FluxKontextPipeline": 2.5}
PROMPT, INSTRUCTION = "a red circle on a blue background", "make the circle red"
STEPS, IMAGES, SIZE = 8, 4, 64


def _packed(model, x):
    b, c, h, w = x.shape
    return model.pipe._pack_latents(x.clone(), b, c, h, w)


def _cfg_kw(g, key="guidance_scale", neg=True):
    return {key: g, **({"negative_prompt": [""] * IMAGES} if neg and g > 1 else {})}


# pipeline class -> the diffusers call doing the rollout's work: f(model, guidance, source PIL or None) -> kwargs
PIPELINE_CALLS = {
    "StableDiffusion3Pipeline": lambda m, g, src: dict(
        prompt=[PROMPT] * IMAGES, max_sequence_length=m.max_sequence_length, **_cfg_kw(g)),
    "FluxPipeline": lambda m, g, src: dict(
        prompt=[PROMPT] * IMAGES, guidance_scale=g, max_sequence_length=m.max_sequence_length),
    "QwenImagePipeline": lambda m, g, src: dict(
        prompt=[PROMPT] * IMAGES, max_sequence_length=m.max_sequence_length, **_cfg_kw(g, "true_cfg_scale")),
    "QwenImageEditPipeline": lambda m, g, src: dict(
        image=src, prompt=INSTRUCTION, negative_prompt="", true_cfg_scale=g, num_images_per_prompt=IMAGES),
    "QwenImageEditPlusPipeline": lambda m, g, src: dict(
        image=src, prompt=INSTRUCTION, negative_prompt="", true_cfg_scale=g, num_images_per_prompt=IMAGES),
    "FluxKontextPipeline": lambda m, g, src: dict(
        image=src, prompt=INSTRUCTION, num_images_per_prompt=IMAGES, guidance_scale=g, max_area=SIZE * SIZE,
        _auto_resize=False, max_sequence_length=m.max_sequence_length),
}
# the source image side each edit pipeline conditions on (the Qwen-Image-Edit pipelines resize to ~1024^2)
SOURCE_SIDE = {"QwenImageEditPipeline": 1024, "QwenImageEditPlusPipeline": 1024}


def families(wanted: list[str]) -> list[str]:
    from mmrl.diffusion.models import available_families
    from mmrl.tiny import FAMILY_BUILDERS

    names = wanted or available_families()
    unknown = [n for n in names if n not in available_families()]
    if unknown:
        raise SystemExit(f"--families: unknown {unknown}; registered: {available_families()}")
    missing = [n for n in names if n not in FAMILY_BUILDERS or n not in PIPELINE_CALLS]
    if missing:
        raise SystemExit(f"families without a tiny builder (mmrl.tiny.FAMILY_BUILDERS) or a PIPELINE_CALLS entry in "
                         f"benchmarks/families.py: {missing}")
    return names


def rollout_vs_pipeline(name: str, path: Path, repeats: int):
    """(Spread ours, Spread diffusers, max |final latent difference|)."""
    import random

    from mmrl.diffusion.conditioning import encode_items
    from mmrl.diffusion.models import load_flow_model
    from mmrl.diffusion.sampling import sample_groups
    from mmrl.pipelines.data import PromptItem
    from mmrl.pipelines.edits import shapes_edit_example

    model = load_flow_model(path)
    g = SETTINGS.get(name, 1.0)
    src, item = None, PromptItem(PROMPT)
    if model.needs_source_image:
        side = SOURCE_SIDE.get(name, SIZE)
        src = shapes_edit_example(random.Random(0), side)["source"]
        item = PromptItem(INSTRUCTION, {"source_image": src})

    def ours(decode=True):  # initial noise from a seeded generator: the same numbers the pipeline draws
        with torch.no_grad():
            emb = encode_items(model, [item], SOURCE_SIDE.get(name, SIZE), SOURCE_SIDE.get(name, SIZE))
            return sample_groups(model, emb, IMAGES, num_steps=STEPS, height=SIZE, width=SIZE, guidance_scale=g,
                                 noise_level=0.0, generator=torch.Generator().manual_seed(0), decode=decode)

    def pipe(output_type="pt"):
        return model.pipe(num_inference_steps=STEPS, height=SIZE, width=SIZE, output_type=output_type,
                          generator=torch.Generator().manual_seed(0), **PIPELINE_CALLS[name](model, g, src)).images

    ref = pipe("latent")
    traj = ours(decode=False)
    final, start = traj.latents[:, -1], traj.latents[:, 0]
    assert torch.equal(start, model.initial_noise(IMAGES, SIZE, SIZE, torch.Generator().manual_seed(0)))
    diff = float(((_packed(model, final) if ref.dim() == 3 else final) - ref).abs().max())
    t = interleaved({"ours": ours, "diffusers": pipe}, repeats=repeats, warmup=1)
    return t["ours"], t["diffusers"], diff


def step_split(name: str, path: Path, steps: int, tmp: Path):
    from flow_grpo_step import bench

    from mmrl.diffusion.models import MODEL_FAMILIES
    from mmrl.pipelines.edits import make_shapes_edit_file

    overrides = [f"rollout.guidance_scale={SETTINGS.get(name, 1.0)}"]
    if MODEL_FAMILIES[name].needs_source_image:
        overrides.append(f"data.train_prompts={make_shapes_edit_file(tmp / 'edits', n=32)}")
    return bench(name, path, SIZE, steps, tmp / "run", 0, overrides)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="", help="comma-separated pipeline classes (default: every registered one)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds of rollout vs pipeline")
    ap.add_argument("--steps", type=int, default=3, help="Flow-GRPO steps per family (the first is not measured)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.steps < 2 or args.repeats < 1:
        raise SystemExit(f"--steps must be >= 2 and --repeats >= 1, got {args.steps}, {args.repeats}")
    torch.set_num_threads(args.threads)
    from mmrl.tiny import FAMILY_BUILDERS

    names = families([n.strip() for n in args.families.split(",") if n.strip()])
    rollout_rows, split_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            path = FAMILY_BUILDERS[name](Path(tmp) / f"model{i}")
            ours, theirs, diff = rollout_vs_pipeline(name, path, args.repeats)
            rollout_rows.append((name, ours.fmt(), theirs.fmt(), f"{theirs.median / ours.median:.2f}x",
                                 f"{diff:.1e}"))
            r = step_split(name, path, args.steps, Path(tmp) / f"step{i}")
            fwd = [f / s for f, s in zip(r["fwd_s"].values, r["step_s"].values)]
            bwd = [b / s for b, s in zip(r["bwd_s"].values, r["step_s"].values)]
            pct = lambda v: " / ".join(f"{100 * x:.0f}" for x in (min(v), sorted(v)[len(v) // 2], max(v)))  # noqa: E731
            split_rows.append((name, r["step_s"].fmt(), pct(fwd), pct(bwd), r["overhead"].fmt(100, 0),
                               f"{r['drift']:.1e}"))
    print(f"\n`{shlex.join(['python', 'benchmarks/families.py', *sys.argv[1:]])}` - {machine()}\n")
    print(f"Rollout vs diffusers' pipeline, the same work: 1 prompt x {IMAGES} images, {STEPS} ODE steps, "
          f"{SIZE}x{SIZE}, prompt encoding + denoising + VAE decode; {args.repeats} interleaved rounds after 1 "
          f"warm-up, seconds min / median / max\n")
    print(markdown_table(["family", "ours s", "diffusers s", "diffusers / ours (medians)", "max abs latent diff"],
                         rollout_rows))
    print(f"\nFlow-GRPO step split (tiny models, 4 prompts x 4 images, {STEPS} steps, LoRA r=8, KL 0.04, EMA, 2 "
          f"updates; steps 2..{args.steps}): % of the step, min / median / max\n")
    print(markdown_table(["family", "step s", "transformer fwd %", "transformer bwd %", "everything else %",
                          "max logprob drift"], split_rows))


if __name__ == "__main__":
    main()
