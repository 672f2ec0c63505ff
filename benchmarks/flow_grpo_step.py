"""Flow-GRPO step-time breakdown and framework overhead on CPU.

    .venv/bin/python benchmarks/flow_grpo_step.py [--steps 4] [--threads 1] [--models tiny,medium]
        [--prompts N] [config overrides, e.g. train.num_inner_epochs=2]

For two SD3-architecture models (the tiny test model and a larger CPU-sized one) it runs
`mmrl.diffusion.flow_grpo.train` for a few steps and reports, per step (mean over steps after the first):
rollout / reward / train time, the time spent in the transformer (forward passes timed by hooks on the
transformer module, backward passes by timing `Tensor.backward`, which runs the transformer's backward
plus a few element-wise ops), and

    overhead = (step time - transformer forward - transformer backward) / step time

i.e. everything that is not the network: SDE math, prompt encoding, VAE decode, reward, advantages,
optimizer, logging. A second ratio also leaves out VAE decode, text encoders and the reward (model work
outside the policy); the VAE decode alone is shown in brackets. `--prompts N` trains on a fixed set of the
first N prompts of shapes_train.txt, so the prompt-embedding cache is warm after N / 4 steps (default: all
146 prompts, every measured step sees new prompts). Prints a markdown table and the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MMRL_NO_PROGRESS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build_models(root: Path) -> dict[str, tuple[Path, int]]:
    """name -> (pipeline dir, image size)."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    from mmrl.tiny import build_tiny_sd3

    tiny = build_tiny_sd3(root / "tiny")
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny))
    torch.manual_seed(0)
    big = SD3Transformer2DModel(
        sample_size=24, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=32, num_attention_heads=4,
        joint_attention_dim=32, caption_projection_dim=128, pooled_projection_dim=32, out_channels=4,
        pos_embed_max_size=64)
    StableDiffusion3Pipeline(**{**pipe.components, "transformer": big}).save_pretrained(root / "medium")
    return {"tiny (78k, 64px)": (tiny, 64),
            f"medium ({sum(p.numel() for p in big.parameters()) / 1e6:.1f}M, 96px)": (root / "medium", 96)}


def _timed(fn, clock):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            clock.other += time.perf_counter() - t
            clock.vae += time.perf_counter() - t
    return wrapper


class TransformerClock:
    """Accumulates transformer forward time (module hooks) and backward time (Tensor.backward)."""

    def __init__(self):
        self.other = 0.0  # VAE decode + text encoders (model work that is not the policy network)
        self.vae = 0.0  # VAE decode alone
        self._t1 = 0.0
        self.fwd = 0.0
        self.bwd = 0.0
        self._t0 = 0.0
        self._orig_backward = torch.Tensor.backward

    def attach(self, module):
        module.register_forward_pre_hook(lambda *a: setattr(self, "_t0", time.perf_counter()))
        module.register_forward_hook(lambda *a: setattr(self, "fwd", self.fwd + time.perf_counter() - self._t0))

    def attach_other(self, module):
        module.register_forward_pre_hook(lambda *a: setattr(self, "_t1", time.perf_counter()))
        module.register_forward_hook(lambda *a: setattr(self, "other", self.other + time.perf_counter() - self._t1))

    def __enter__(self):
        clock, orig = self, self._orig_backward

        def timed_backward(tensor, *a, **kw):
            t = time.perf_counter()
            try:
                return orig(tensor, *a, **kw)
            finally:
                clock.bwd += time.perf_counter() - t

        torch.Tensor.backward = timed_backward
        return self

    def __exit__(self, *exc):
        torch.Tensor.backward = self._orig_backward


def bench(name: str, path: Path, size: int, steps: int, out: Path, prompts: int = 0, overrides=()) -> dict:
    import mmrl.diffusion.models as models
    from mmrl.config import load_config
    from mmrl.diffusion import flow_grpo

    clock = TransformerClock()
    orig_load = models.load_flow_model
    per_step: list[tuple[float, float]] = []

    def load_and_hook(*a, **kw):
        m = orig_load(*a, **kw)
        clock.attach(m.transformer)
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
            if getattr(m.pipe, name, None) is not None:
                clock.attach_other(getattr(m.pipe, name))
        m.vae.decode = _timed(m.vae.decode, clock)
        return m

    prompt_file = REPO / "assets/prompts/shapes_train.txt"
    if prompts:  # a fixed set of the first N prompts (steady state of the prompt-embedding cache)
        lines = prompt_file.read_text().splitlines()[:prompts]
        prompt_file = out.parent / f"prompts_{prompts}.txt"
        prompt_file.write_text("\n".join(lines) + "\n")
    cfg = load_config({
        "algorithm": "flow_grpo", "output_dir": str(out), "seed": 0, "device": "cpu",
        "model": {"path": str(path), "lora_rank": 8, "lora_alpha": 16},
        "data": {"train_prompts": str(prompt_file), "prompts_per_step": 4},
        "sample": {"height": size, "width": size, "num_steps": 8, "group_size": 4, "guidance_scale": 4.5},
        "train": {"max_steps": steps, "save_every": 0, "resume": "never", "micro_batch_size": 8, "beta": 0.04,
                  "ema": True},
        "reward": {"components": {"jpeg_compressibility": 1.0}},
        "log": {"sample_every": 0},
    }, list(overrides))
    # per-step transformer time: snapshot the clock whenever a metrics row is logged
    orig_log = flow_grpo.Run.log

    def log_and_snapshot(run, step, metrics):
        per_step.append((clock.fwd, clock.bwd, clock.other, clock.vae))
        return orig_log(run, step, metrics)

    flow_grpo.Run.log = log_and_snapshot
    models.load_flow_model = load_and_hook
    try:
        with clock:
            flow_grpo.train(cfg)
    finally:
        models.load_flow_model = orig_load
        flow_grpo.Run.log = orig_log
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    fwd = [b[0] - a[0] for a, b in zip(per_step, per_step[1:])]
    bwd = [b[1] - a[1] for a, b in zip(per_step, per_step[1:])]
    other = [b[2] - a[2] for a, b in zip(per_step, per_step[1:])]
    vae = [b[3] - a[3] for a, b in zip(per_step, per_step[1:])]
    rows = rows[1:]  # the first step includes one-off warm-up
    mean = lambda k: sum(r.get(k, 0.0) for r in rows) / len(rows)  # noqa: E731
    step_s = mean("time/step_s")
    net = sum(fwd) / len(fwd) + sum(bwd) / len(bwd)
    reward = mean("time/reward_s")
    return {"model": name, "step_s": step_s, "rollout_s": mean("time/rollout_s"), "reward_s": reward,
            "train_s": mean("time/train_s"), "fwd_s": sum(fwd) / len(fwd), "bwd_s": sum(bwd) / len(bwd),
            "other_s": sum(other) / len(other), "vae_s": sum(vae) / len(vae), "overhead": (step_s - net) / step_s,
            "framework": (step_s - net - sum(other) / len(other) - reward) / step_s,
            "drift": max(r["diag/logprob_drift"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", default="tiny,medium", help="comma-separated subset of: tiny, medium")
    ap.add_argument("--prompts", type=int, default=0,
                    help="train on the first N prompts of shapes_train.txt (0 = all 146: every step sees new prompts)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. train.num_inner_epochs=2")
    args = ap.parse_args()
    wanted = [m.strip() for m in args.models.split(",") if m.strip()]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        models = {n: v for n, v in build_models(tmp).items() if n.split()[0] in wanted}
        results = [bench(n, p, s, args.steps, tmp / f"run{i}", args.prompts, args.overrides)
                   for i, (n, (p, s)) in enumerate(models.items())]
    print(f"\nFlow-GRPO step on CPU ({args.threads} thread(s)); 4 prompts x 4 images, 8 steps, CFG 4.5, "
          f"LoRA r=8, beta 0.04, EMA; {args.prompts or 146} training prompts; "
          f"{' '.join(args.overrides) or 'no overrides'}; mean over steps 2..{args.steps}\n")
    print("| model | step s | rollout s | reward s | train s | transformer fwd s | transformer bwd s "
          "| VAE + text enc s (VAE) | overhead | overhead excl. VAE/text/reward | max drift |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['reward_s']:.3f} | {r['train_s']:.2f} | "
              f"{r['fwd_s']:.2f} | {r['bwd_s']:.2f} | {r['other_s']:.3f} ({r['vae_s']:.3f}) | "
              f"{100 * r['overhead']:.1f}% | {100 * r['framework']:.1f}% | {r['drift']:.1e} |")
    print(f"\ncommand: .venv/bin/python benchmarks/flow_grpo_step.py --steps {args.steps} --threads {args.threads} "
          f"--models {args.models} --prompts {args.prompts} {' '.join(args.overrides)}".rstrip())


if __name__ == "__main__":
    main()
