"""`mmrl eval CONFIG [--checkpoint DIR]`: a diffusion policy scored on held-out prompts, written as a report.

    from mmrl.config import load_config
    from mmrl.eval import run_eval
    report = run_eval(load_config("configs/diffusion/flow_grpo_tiny.yaml"), "runs/flow_grpo_tiny")

What it does, top to bottom:
  1. the config's flow model (`model.path`), with a checkpoint's adapters applied (state "default", or "old" =
     the EMA / old policy) or, without a checkpoint, the base model (plus `model.lora.init_path` when set: the
     policy a run starts from);
  2. deterministic ODE sampling (noise_level 0) of `samples_per_prompt` images per prompt with
     `rollout.eval_num_steps` / `rollout.eval_guidance_scale` / `rollout.eval_height` x `rollout.eval_width` (0 = the
     training `rollout.height` x `rollout.width`); prompt i's
     initial noise comes from its own generator seeded `seed * 1_000_003 + i`, so an image does not depend on
     which other prompts are evaluated;
  3. the images are rounded to 8 bits and saved (`images/p<i>_s<j>.png`); everything below scores those saved
     images, so the report can be recomputed from the files alone (videos, `rollout.num_frames` > 1: the 8-bit
     frames are scored and each video is saved as `images/p<i>_s<j>.mp4` for viewing, H.264 being lossy; an
     audio-video family's sound goes into that MP4 and beside it as `images/p<i>_s<j>.wav`, and audio rewards
     score it);
  4. every reward of `reward.components` (each component and the weighted sum; non-finite scores are counted
     and left out of the statistics) and, for prompts of the shapes grammar, the GenEval-style check of
     `mmrl.pipelines.shapes_check` (object / color / count / position / background accuracy and overall; of a video:
     its first frame);
  5. `<out>/eval_report.json` and `<out>/eval_grid.png` (the first `grid_images` images with prompt, reward, check;
     videos: `eval_grid.mp4`).

Default `<out>`: `<run>/eval/<step_N>[_<state>]` inside the checkpoint's run directory; for the base model
`<output_dir>/eval/base`. Statistics: mean and unbiased std (as the
training metrics `reward/mean`, `reward/std`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from mmrl.config import RECIPES, to_dict
from mmrl.pipelines.shapes_check import accuracy, check_images
from mmrl.pipelines.videos import as_pcm16

__all__ = ["run_eval", "resolve_checkpoint", "state_dir", "apply_checkpoint", "copy_full_weights", "prompt_seed",
           "reward_stats", "sha256_file", "prepare_out_dir", "write_json", "default_out_dir"]

_STATES = ("default", "old")


def prompt_seed(seed: int, index: int) -> int:
    """Seed of the generator that draws prompt `index`'s initial noise."""
    return int(seed) * 1_000_003 + int(index)


def resolve_checkpoint(path: str | Path, what: str = "--checkpoint", verify: bool = True) -> tuple[Path, int | None]:
    """(adapters directory, step or None) from a run directory (its newest complete checkpoint), a
    `checkpoints/step_N/` directory, or that directory's `adapters/`. Errors name what is missing (`what`: the
    option or command the path came from). `verify`: the files checked against the checkpoint's manifest (False:
    only where they are, for a caller that verifies them when it loads)."""
    from mmrl.adapters import INDEX_NAME
    from mmrl.run.files import checkpoint_step, list_checkpoints, verify_checkpoint

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{what} {p}: not found")
    if not p.is_dir():
        raise ValueError(f"{what} {p}: expected a directory (a run directory or checkpoints/step_N/), got a file")
    if (p / "checkpoints").is_dir():  # a run directory: its newest complete checkpoint
        found = list_checkpoints(p / "checkpoints")
        if not found:
            raise FileNotFoundError(f"{what} {p}: the run directory has no complete checkpoint in checkpoints/")
        p = found[-1][1]
    if (p / INDEX_NAME).is_file() or (p / "default").is_dir():
        adapters, step_dir = p, p.parent
    elif (p / "adapters").is_dir():
        adapters, step_dir = p / "adapters", p
    else:
        raise FileNotFoundError(f"{what} {p}: no adapters/ in it (expected a run directory, checkpoints/step_N/ "
                                f"or its adapters/, as `mmrl train` writes them)")
    step = None
    if step_dir.name.startswith("step_"):
        step = checkpoint_step(step_dir)  # refuses an incomplete (interrupted) checkpoint
        if verify:
            verify_checkpoint(step_dir)  # and one whose files changed since they were written
    return adapters, step


def state_dir(adapters: Path, state: str) -> Path:
    """`adapters/<state>/`, or an error naming the states the checkpoint holds."""
    from mmrl.adapters import INDEX_NAME

    if state not in _STATES:
        raise ValueError(f"--state: expected one of {list(_STATES)}, got {state!r}")
    sub = Path(adapters) / state
    if not sub.is_dir():
        index = Path(adapters) / INDEX_NAME
        have = json.loads(index.read_text()).get("written", []) if index.is_file() else \
            sorted(d.name for d in Path(adapters).iterdir() if d.is_dir())
        raise FileNotFoundError(f"checkpoint {adapters}: no policy state {state!r} (saved: {have}; 'old' exists only "
                                f"for runs that keep one, e.g. algo.ema: true)")
    return sub


def sha256_file(path: Path) -> str:
    """sha256 of a file, or of a directory's files (relative names and contents, sorted by name)."""
    h = hashlib.sha256()
    files = sorted(p for p in Path(path).rglob("*") if p.is_file()) if Path(path).is_dir() else [Path(path)]
    for file in files:
        if file != Path(path):
            h.update(str(file.relative_to(path)).encode())
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def apply_checkpoint(model: Any, adapters: Path, state: str = "default") -> dict:
    """Put the saved policy state `state` of `adapters/` (PolicyStates.save layout) into `model.transformer`:
    a LoRA becomes the transformer's active adapter, full fine-tuning weights are copied in. Returns provenance
    ({"mode", "state", "weights", "sha256"})."""
    from mmrl.adapters import (FULL_WEIGHTS_NAME, PEFT_WEIGHTS_NAME, PolicyStates, load_sharded_state,
                               sharded_weights_dir)

    shards = sharded_weights_dir(adapters)  # full fine-tuning weights as every rank's shards (dist.checkpoint: sharded)
    sub = state_dir(adapters, state) if shards is None else None
    if sub is not None and (sub / PEFT_WEIGHTS_NAME).is_file():
        # the saved adapter becomes PolicyStates' frozen "ref" and the initial (active) "default": exactly its weights
        states = PolicyStates(model.transformer, None, ref_adapter_path=sub)
        model.transformer = states.model
        weights, mode = sub / PEFT_WEIGHTS_NAME, "lora"
    elif shards is not None or (sub / FULL_WEIGHTS_NAME).is_file():
        weights, mode = (shards, "full") if shards is not None else (sub / FULL_WEIGHTS_NAME, "full")
        copy_full_weights(model.transformer, weights,
                          load_sharded_state(adapters, state) if shards is not None else None)
    else:
        raise FileNotFoundError(f"checkpoint state {sub}: neither {PEFT_WEIGHTS_NAME} (LoRA) nor {FULL_WEIGHTS_NAME} "
                                f"(full fine-tuning) in it")
    return {"mode": mode, "state": state, "weights": str(weights), "sha256": sha256_file(weights)}


def copy_full_weights(module: torch.nn.Module, weights: Path, saved: dict | None = None) -> None:
    """Copy a full fine-tuning state (`model.safetensors`: parameter name -> tensor, as PolicyStates saves it; or
    `saved`, the same read from a sharded checkpoint's directory `weights`) into `module`'s parameters. Parameters
    that were frozen in training are not in the file and keep the base weights; a tensor that is not a parameter of
    `module`, or of another shape, is an error naming it."""
    from safetensors.torch import load_file

    if saved is None:
        saved = load_file(str(weights))
    own = dict(module.named_parameters())
    unexpected = [k for k in saved if k not in own]
    if unexpected or not saved:
        raise ValueError(f"{weights} does not fit the model of model.path: {len(unexpected)} of its "
                         f"{len(saved)} tensors are not model parameters (e.g. {unexpected[:3]})")
    bad = [k for k, v in saved.items() if v.shape != own[k].shape]
    if bad:
        raise ValueError(f"{weights}: {bad[0]} has shape {tuple(saved[bad[0]].shape)}, the model's is "
                         f"{tuple(own[bad[0]].shape)} ({len(bad)} tensors differ)")
    with torch.no_grad():
        for k, v in saved.items():
            own[k].copy_(v.to(own[k].device, own[k].dtype))


def reward_stats(values: Sequence[float]) -> dict:
    """{"mean", "std" (unbiased; 0 for one value), "n", "nonfinite"} over the finite values (None when none)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    ok = t[torch.isfinite(t)]
    return {"mean": ok.mean().item() if len(ok) else None, "std": ok.std().item() if len(ok) > 1 else 0.0,
            "n": len(ok), "nonfinite": len(t) - len(ok)}


def _json_num(v: float) -> float | None:
    return float(v) if torch.isfinite(torch.tensor(float(v))) else None


def write_json(path: Path, obj: dict) -> None:
    """`obj` as indented JSON in `path`, atomically (a temp file beside it, renamed)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def default_out_dir(cfg: Any, adapters: Path | None, label: str) -> Path:
    """`<run>/eval/<label>` of the checkpoint's own run directory (the run it belongs to, wherever the config's
    output_dir points); the base model, or adapters outside a run directory: `<output_dir>/eval/<label>`."""
    if adapters is not None and adapters.parent.parent.name == "checkpoints":
        return adapters.parent.parent.parent / "eval" / label
    return Path(cfg.output_dir) / "eval" / label


def prepare_out_dir(out: Path, stale: str) -> None:
    """`out` and `out/images` created and probed, before any model loads: a read-only disk (a run on a read-only
    mount, the default `--out`) is one line. Images of an earlier eval (`stale`, a glob) are removed, so a rerun in the
    same directory leaves none behind."""
    from mmrl.run.files import probe_writable

    try:
        for directory in (out, out / "images"):
            probe_writable(directory)
        for old in (out / "images").glob(stale):
            old.unlink()
    except OSError as exc:
        raise ValueError(f"mmrl eval: cannot write into {out} ({exc.strerror or exc}); pass --out DIR, a directory "
                         f"on a writable disk") from None


def run_eval(cfg: Any, checkpoint: str | Path | None = None, *, state: str = "default", prompts: str | None = None,
             out: str | Path | None = None, seed: int | None = None, samples_per_prompt: int = 1,
             max_prompts: int = 0, batch_size: int = 8, grid_images: int = 32, config_file: str | None = None,
             overrides: Sequence[str] = ()) -> dict:
    """Evaluate the diffusion policy of `cfg` (see the module docstring); returns the report (also written)."""
    from tqdm.auto import tqdm

    from mmrl.diffusion.common import load_recipe_model
    from mmrl.diffusion.conditioning import check_data, encode_items, sample_panels
    from mmrl.diffusion.sampling import sample_groups
    from mmrl.diffusion.scoring import load_reward_fn
    from mmrl.pipelines.data import load_prompts
    from mmrl.rewards.audio import takes_audio
    from mmrl.rewards.latent import takes_latents
    from mmrl.run.plots import save_image_grid, save_video_grid
    from mmrl.runtime import resolve_device, resolve_dtype

    if not RECIPES.get(cfg.algorithm, "").startswith("mmrl.diffusion."):
        diffusion = sorted(k for k, v in RECIPES.items() if v.startswith("mmrl.diffusion."))
        raise ValueError(f"mmrl eval supports diffusion configs ({', '.join(diffusion)}) and VLM ones (vlm_grpo, "
                         f"vlm_multiturn); the config's algorithm is {cfg.algorithm!r}")
    if state not in _STATES:
        raise ValueError(f"--state: expected one of {list(_STATES)}, got {state!r}")
    if samples_per_prompt < 1 or batch_size < 1 or max_prompts < 0:
        raise ValueError(f"samples_per_prompt and batch_size must be >= 1 and max_prompts >= 0, got "
                         f"{samples_per_prompt}, {batch_size}, {max_prompts}")
    if checkpoint is None and state != "default":
        raise ValueError(f"--state {state} needs --checkpoint (the base model has one state)")
    prompt_file = prompts or cfg.data.eval_prompts
    if not prompt_file:
        raise ValueError("no evaluation prompts: pass --prompts FILE or set data.eval_prompts in the config")
    items = load_prompts(prompt_file)[: max_prompts or None]
    check_data(cfg.model.path, eval_prompts=items)  # edit models need source images (and text models take none)
    adapters, step = resolve_checkpoint(checkpoint) if checkpoint is not None else (None, None)
    if adapters is not None:
        state_dir(adapters, state)  # before the model loads: a missing state fails fast
    seed = cfg.seed if seed is None else int(seed)
    label = ("base" if adapters is None else f"step_{step}" if step is not None else "checkpoint") + \
        ("" if state == "default" else f"_{state}")
    out = Path(out) if out is not None else default_out_dir(cfg, adapters, label)
    prepare_out_dir(out, "p*_s*.*")

    t0 = time.perf_counter()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    device, s = resolve_device(cfg.device), cfg.rollout
    reward_fn = load_reward_fn(cfg.reward.components, device, s.num_frames)
    model = load_recipe_model(cfg, device, resolve_dtype(cfg.dtype))
    video = s.num_frames > 1
    if adapters is not None:
        policy = {"checkpoint": str(adapters), "step": step, **apply_checkpoint(model, adapters, state)}
    elif cfg.model.lora.init_path:
        from mmrl.adapters import PolicyStates

        model.transformer = PolicyStates(model.transformer, None, ref_adapter_path=cfg.model.lora.init_path).model
        policy = {"checkpoint": None, "step": None, "mode": "lora", "state": "init_lora_path",
                  "weights": cfg.model.lora.init_path}
    else:
        policy = {"checkpoint": None, "step": None, "mode": "base", "state": None}
    model.transformer.eval()

    # ---- sampling: one generator per prompt, images rounded to 8 bits and saved
    images, files, rows, finals, sounds = [], [], [], [], []
    sound = {"sample_rate": model.audio_sample_rate, "fps": model.frame_rate} if model.has_audio else {}
    bar = tqdm(total=len(items), desc="mmrl eval", unit="prompt", disable=os.environ.get("MMRL_NO_PROGRESS") == "1")
    for i, item in enumerate(items):
        gen = torch.Generator(device=model.device).manual_seed(prompt_seed(seed, i))
        traj = sample_groups(model, encode_items(model, [item], *s.eval_hw), samples_per_prompt,
                             num_steps=s.eval_num_steps, height=s.eval_hw[0], width=s.eval_hw[1],
                             guidance_scale=s.eval_guidance_scale, noise_level=0.0,
                             generator=gen, batch_size=batch_size, decode_audio=model.has_audio)
        u8 = (traj.images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()
        names = [f"images/p{i:04d}_s{j}.{'mp4' if video else 'png'}" for j in range(samples_per_prompt)]
        _save_files(u8, [out / n for n in names], **({"audio": traj.audio.cpu(), **sound} if sound else {}))
        if sound:  # scored as the WAV file holds it (16-bit), as images are scored as their 8-bit files
            sounds.append(as_pcm16(traj.audio.cpu()))
        images.append(u8.float() / 255.0)
        finals.append(traj.latents[:, -1])  # what a latent reward scores
        files.append(names)
        rows += [i] * samples_per_prompt
        bar.update(1)
    bar.close()
    x = torch.cat(images)
    all_prompts = [items[i].prompt for i in rows]
    all_meta = [items[i].metadata for i in rows]

    # ---- rewards: every component and the weighted sum, per image
    components = list(reward_fn.components)  # a composite: details[name] = that component's raw scores
    total, per_comp = [], {c: [] for c in components}
    for lo in range(0, len(x), batch_size):
        sl = slice(lo, lo + batch_size)
        kw = {"latents": torch.cat(finals)[sl]} if takes_latents(reward_fn) else {}
        if takes_audio(reward_fn):
            kw.update(audio=torch.cat(sounds)[sl], sample_rate=sound["sample_rate"])
        res = reward_fn(images=x[sl], prompts=all_prompts[sl], metadata=all_meta[sl], **kw)
        total += res.scores.detach().float().cpu().tolist()
        for c in components:
            per_comp[c] += torch.as_tensor(res.details[c]).detach().float().cpu().reshape(-1).tolist()

    # ---- GenEval-style compositional check (shapes-grammar prompts only)
    checks = check_images(list(x[:, 0] if video else x), all_prompts)
    comp = accuracy(checks)

    per_prompt = []
    for i, item in enumerate(items):
        idx = range(i * samples_per_prompt, (i + 1) * samples_per_prompt)  # prompt i's images are adjacent
        per_prompt.append({
            "prompt": item.prompt, "seed": prompt_seed(seed, i), "images": files[i],
            "reward": [_json_num(total[k]) for k in idx],
            "components": {c: [_json_num(per_comp[c][k]) for k in idx] for c in components},
            "checks": [checks[k]["checks"] if checks[k] else None for k in idx],
            "detected": [checks[k]["detected"] if checks[k] else None for k in idx],
        })
    report = {
        "config_file": str(config_file) if config_file else None, "overrides": list(overrides),
        "algorithm": cfg.algorithm, "model": str(cfg.model.path), "policy": policy, "seed": seed,
        "prompts_file": str(prompt_file), "num_prompts": len(items), "samples_per_prompt": samples_per_prompt,
        "sampling": {"num_steps": s.eval_num_steps, "guidance_scale": s.eval_guidance_scale, "height": s.eval_hw[0],
                     "width": s.eval_hw[1], "num_frames": s.num_frames, "noise_level": 0.0, "device": str(device),
                     "dtype": cfg.dtype},
        "reward": reward_stats(total),
        "components": {c: reward_stats(v) for c, v in per_comp.items()},
        "compositional": comp,
        "per_prompt": per_prompt,
        "out_dir": str(out), "files": {"report": "eval_report.json", "grid": f"eval_grid.{'mp4' if video else 'png'}",
                                       "images": "images/"},
        "time_s": round(time.perf_counter() - t0, 3),
        "config": to_dict(cfg),
    }
    n = min(grid_images, len(x))
    captions = grid_captions(total[:n], checks[:n], all_prompts[:n])
    if video:
        save_video_grid(x[:n], captions, out / "eval_grid.mp4")
    else:
        save_image_grid(*sample_panels(x[:n], captions, all_meta[:n]), out / "eval_grid.png")  # edits: source | result
    write_json(out / "eval_report.json", report)
    return report


def grid_captions(rewards: Sequence[float], checks: Sequence[dict | None], prompts: Sequence[str]) -> list[str]:
    """The eval grid's captions: "reward 0.812 | check ok | prompt" (the shapes check's verdict, "check failed"
    when wrong; none when the check cannot read the prompt, e.g. an edit instruction)."""
    marks = {True: "check ok | ", False: "check failed | ", None: ""}
    return [f"reward {r:.3g} | {marks[c['checks']['correct'] if c else None]}{p}"
            for r, c, p in zip(rewards, checks, prompts)]


def _save_files(u8: torch.Tensor, paths: Sequence[Path], audio: torch.Tensor | None = None,
                sample_rate: int | None = None, fps: float | None = None) -> None:
    """Write uint8 images [N, 3, H, W] to `paths` as PNG (lossless: the report's scores are of these files), or
    videos [N, F, 3, H, W] as MP4 (`mmrl.pipelines.videos.write_video`); `audio` [N, C, S]: each sample's sound in
    its MP4 and beside it as WAV."""
    from PIL import Image

    from mmrl.pipelines.videos import DEFAULT_FPS, write_video, write_wav

    for i, (img, path) in enumerate(zip(u8, paths)):
        wave = None if audio is None else audio[i]
        if wave is not None:
            write_wav(wave, sample_rate, path.with_suffix(".wav"))
        if img.dim() == 4:
            write_video(img.permute(0, 2, 3, 1).numpy(), path, fps or DEFAULT_FPS, audio=wave, sample_rate=sample_rate)
        else:
            Image.fromarray(img.permute(1, 2, 0).numpy()).save(path)
