"""Model families on CPU: each family's tiny model, the Flow-GRPO step split and the rollout against diffusers.

    .venv/bin/python benchmarks/families.py [--families wan21,qwen_image,...] [--steps 4] [--repeats 5] [--threads 1]

For every tiny case of every registered family (`mmrl.diffusion.models.tiny_cases()`: each family's file declares
its tiny checkpoint of the real diffusers / transformers classes; images here at 64 px, guidance on):

1. Flow-GRPO step split: `mmrl.diffusion.flow_grpo.train` for `--steps` steps (the first, with one-off warm-up,
   left out), measured as in `flow_grpo_step.py` (whose `bench` this reuses): transformer forward time (hooks on the
   transformer), backward time (`Tensor.backward`), and the rest of the step (SDE math, text encoders, VAE decode,
   reward, optimizer, logging) as a share of the step; min / median / max over the measured steps.
2. Rollout against diffusers' own pipeline, same work: encode the prompts, then a deterministic 8-step rollout of 4
   samples from the same initial noise, with the family's guidance (CFG where it has one), no decode (the pipeline
   with `output_type="latent"`); interleaved (`_timing.interleaved`), min / median / max; and the max |difference|
   of the final latents (0 = bitwise equal). The pipeline encodes its negative prompt on every call, the family
   once per model: the one text-encoder pass this saves is part of what is measured. Edit families: one instruction
   with one source image (shapes edit task) and 4 samples; both sides encode the instruction with the image and VAE-
   encode the image (the Qwen-Image-Edit pipelines always condition on a ~1024^2 copy, so both get a 1024x1024 source).

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
INSTRUCTION = "make the circle red"
VIDEO_REWARD = "reward.components={motion_amount: 1.0, f: {reward: video_frames, image_reward: jpeg_compressibility}}"


# where this benchmark departs from a family's tiny case: images at 64 px (a video keeps its case's size) and these
# guidance scales, so that every rollout runs its guidance path (CFG, or a guidance embedding)
IMAGE_SIZE = 64
GUIDANCE = {"sd3": 4.5, "wan21": 5.0, "wan22_a14b": 5.0, "z_image": 4.0, "flux2": 4.0, "flux2_klein": 4.0}


def _families() -> dict:
    """case -> (build(root) -> path, size, frames, guidance scale, pipeline class): what the rollout comparison and the
    step run use, one row per tiny case."""
    from mmrl.diffusion.models import tiny_cases

    out = {}
    for name, case in tiny_cases().items():
        frames = case.rollout.get("num_frames", 1)
        size = case.rollout["height"] if frames > 1 else IMAGE_SIZE
        out[name] = (lambda root, case=case: case.build_at(root / case.name), size, frames,
                     GUIDANCE.get(name, case.rollout["guidance_scale"]), case.pipeline)
    return out


FAMILIES = _families()
# edit pipelines that condition on a fixed-area copy of the source whatever the target size: that side, for both
SOURCE_SIDE = {"QwenImageEditPipeline": 1024, "QwenImageEditPlusPipeline": 1024}
PACKED = ("FluxPipeline", "FluxKontextPipeline", "QwenImagePipeline", "QwenImageEditPipeline",
          "QwenImageEditPlusPipeline")  # 2x2-packed latents in and out of the pipeline


def _packed(model, x):
    b, c, h, w = x.shape
    return model.pipe._pack_latents(x.clone(), b, c, h, w)


def pipeline_call(model, x0, size, frames, gs, steps, source=None):
    """Diffusers' own pipeline of the family on the same initial noise (its latent layout), latents out."""
    prompts = [p for p in PROMPTS for _ in range(2)]  # a fresh list per call (Z-Image writes into it)
    kw = dict(prompt=prompts, num_inference_steps=steps, guidance_scale=gs, height=size, width=size,
              output_type="latent", max_sequence_length=model.max_sequence_length)
    name = type(model.pipe).__name__
    if name in ("QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline"):  # "true CFG"
        kw["true_cfg_scale"] = kw.pop("guidance_scale")
        if name == "QwenImagePipeline":
            return model.pipe(latents=_packed(model, x0), negative_prompt=[""] * 4, **kw).images
        kw.update(prompt=INSTRUCTION, image=source, negative_prompt="", num_images_per_prompt=4)
        return model.pipe(latents=_packed(model, x0), **kw).images
    if name == "FluxKontextPipeline":  # its defaults resize target and source to ~1024^2: keep both as given
        kw.update(prompt=INSTRUCTION, image=source, num_images_per_prompt=4, max_area=size * size, _auto_resize=False)
        return model.pipe(latents=_packed(model, x0), **kw).images
    if name == "FluxPipeline":
        return model.pipe(latents=_packed(model, x0), **kw).images
    if name == "StableDiffusion3Pipeline":
        return model.pipe(latents=x0.clone(), negative_prompt=[""] * 4, **kw).images
    if name == "WanPipeline":
        return model.pipe(latents=x0.clone(), num_frames=frames, negative_prompt=[""] * 4, **kw).frames
    if name == "Flux2Pipeline":
        return model.pipe(latents=x0.clone(), **kw).images  # packed tokens out
    if name == "LTX2Pipeline":
        return _ltx2_call(model, x0, size, frames, kw)
    if name == "HunyuanVideo15Pipeline":  # its guider holds the scale; the family set its text budget on the pipe
        from diffusers.guiders import ClassifierFreeGuidance

        model.pipe.guider = ClassifierFreeGuidance(guidance_scale=kw.pop("guidance_scale"))
        kw.pop("max_sequence_length")
        return model.pipe(latents=x0.clone(), num_frames=frames, **kw).frames
    return model.pipe(latents=x0.clone(), **kw).images


def _ltx2_call(model, x0, size, frames, kw):
    """LTX2Pipeline from the family's joint state (video latents, then packed audio latents, both normalised), with
    CFG only (its STG, modality guidance and rescale off: the family has none); the result back in the state layout."""
    pipe = model.pipe
    video, audio = model.split(x0, size, size)
    ca, mel = model._audio_dims()
    avae, vae = pipe.audio_vae, pipe.vae
    audio4 = (audio * avae.latents_std + avae.latents_mean).unflatten(2, (ca, mel)).transpose(1, 2)
    out = pipe(latents=pipe._pack_latents(video), audio_latents=audio4, num_frames=frames, negative_prompt=[""] * 4,
               audio_guidance_scale=model.audio_guidance_scale,  # None: the video's (the pipeline's default is 7)
               stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0,
               guidance_rescale=0.0, audio_guidance_rescale=0.0, **kw)
    v = pipe._normalize_latents(out.frames, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    return model.join(v, (out.audio.transpose(1, 2).flatten(2, 3) - avae.latents_mean) / avae.latents_std)


def our_latents_like_pipeline(model, latents):
    """Our final latents in the layout the pipeline's latent output has."""
    name = type(model.pipe).__name__
    if name in PACKED:
        return _packed(model, latents)
    if name == "Flux2Pipeline":
        return model.pipe._pack_latents(latents)
    if name == "Flux2KleinPipeline":
        mean, std = model._bn_stats(latents)
        return model.pipe._unpatchify_latents(latents * std + mean)
    return latents


def rollout_vs_pipeline(path, size, frames, gs, repeats, steps=8):
    import random

    from mmrl.diffusion.conditioning import encode_items
    from mmrl.diffusion.models import load_flow_model
    from mmrl.diffusion.sampling import sample_groups
    from mmrl.pipelines.data import PromptItem
    from mmrl.pipelines.edits import shapes_edit_example

    from mmrl.diffusion.models import flow_model_class

    edit = flow_model_class(path).needs_source_image  # an edit pipeline keeps every token: no cut on either side
    model = load_flow_model(path, num_frames=frames, max_sequence_length=None if edit else 32)
    gen = torch.Generator().manual_seed(0)
    x0 = model.initial_noise(4, size, size, gen)
    result = {}
    items, group, source, side = [PromptItem(p) for p in PROMPTS], 2, None, size
    if edit:  # one instruction, one source image, 4 samples (the pipelines take one image)
        side = SOURCE_SIDE.get(type(model.pipe).__name__, size)
        source = shapes_edit_example(random.Random(0), side)["source"]
        items, group = [PromptItem(INSTRUCTION, {"source_image": source})], 4

    def ours():
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            result["ours"] = sample_groups(model, encode_items(model, items, side, side), group, num_steps=steps,
                                           height=size, width=size, guidance_scale=gs, noise_level=0.0, generator=g,
                                           decode=False)

    def theirs():
        result["pipe"] = pipeline_call(model, x0, size, frames, gs, steps, source)

    times = interleaved({"mmrl": ours, "diffusers": theirs}, repeats=repeats, warmup=1)
    assert torch.equal(result["ours"].latents[:, 0], x0)  # the same noise went into both
    diff = (our_latents_like_pipeline(model, result["ours"].latents[:, -1]) - result["pipe"]).abs().max().item()
    params = sum(p.numel() for p in model.transformer.parameters())
    return times, diff, params


def step_split(name, path, size, frames, steps, out):
    from flow_grpo_step import bench

    from mmrl.diffusion.models import flow_model_class
    from mmrl.pipelines.edits import make_shapes_edit_file

    overrides = ["model.max_sequence_length=32", "rollout.num_steps=4"]
    if frames > 1:
        overrides += [f"rollout.num_frames={frames}", VIDEO_REWARD]
    if flow_model_class(path).needs_source_image:  # edit rows (source image, instruction), shapes edit task
        overrides.append(f"data.train_prompts={make_shapes_edit_file(out.parent / f'edits_{name}', n=32)}")
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
            build, size, frames, gs, _ = FAMILIES[name]
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
