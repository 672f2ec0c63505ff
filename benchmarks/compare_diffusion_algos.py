"""Flow-GRPO vs DiffusionNFT vs online Diffusion-DPO vs AWM on one tiny task, side by side (CPU, a few minutes).

Same model (the data-trained tiny SD3 in assets/tiny_sd3_shapes), same prompts, same reward, same seed,
same sample budget per step (4 prompts x 8 images from an 8-step sampler, 64x64) and the same number of
steps; everything else (LoRA or full fine-tuning, learning rate, CFG, SDE or ODE, trained timesteps) is
each recipe's shipped tiny config (flow_grpo_tiny / nft_tiny / dpo_tiny_online / awm_tiny.yaml). Measured per
step: reward of the step's rollout images, wall-clock since the run started (model loading included,
the same for all), and transformer evaluations (sample rows through the transformer, counted by a
wrapper around SD3Model._forward, i.e. every transformer call: rollout and training, policy, old and reference
passes alike). Rollout rewards are not comparable across recipes that sample differently (SDE images
compress worse than ODE images), so every recipe is also evaluated the same way: ODE sampling of the 26
held-out prompts of assets/prompts/shapes_eval.txt with fixed noise at step 1, every steps/3 and at the
end. Prints a table and writes one PNG (reward vs wall-clock, reward vs transformer evaluations).

    .venv/bin/python benchmarks/compare_diffusion_algos.py [--steps 60] [--out runs/compare_diffusion]

Not a test: the numbers are what this machine measured, whatever they are.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


TINY_CONFIGS = {"flow_grpo": "flow_grpo_tiny.yaml", "nft": "nft_tiny.yaml", "dpo_online": "dpo_tiny_online.yaml",
                "awm": "awm_tiny.yaml"}


def _configs(model: str, steps: int, reward: str, out: Path, seed: int) -> dict[str, list]:
    """Each recipe's shipped tiny config (its own tuned optimiser settings), with the shared task forced:
    same model, prompts, reward, seed, prompts x images per step, sampler steps, image size, step count."""
    shared = [f"model.path={model}", f"seed={seed}", "device=cpu", "dtype=float32",
              f"data.train_prompts={REPO / 'assets/prompts/shapes_train.txt'}", "rollout.prompts_per_step=4",
              "rollout.group_size=8", "rollout.num_steps=8", "rollout.height=64", "rollout.width=64",
              f"reward.components={{{reward}: 1.0}}", f"train.max_steps={steps}", "train.save_every=0",
              "train.resume=never", "log.sample_every=0",
              # same held-out evaluation for all: ODE, fixed noise, 26 prompts, at step 1, every steps/3, last
              f"data.eval_prompts={REPO / 'assets/prompts/shapes_eval.txt'}", f"log.eval_every={max(1, steps // 3)}",
              "log.eval_max_prompts=26", "rollout.eval_num_steps=8", "rollout.eval_guidance_scale=1.0"]
    return {name: [REPO / "configs/diffusion" / path, shared + [f"output_dir={out / name}"]]
            for name, path in TINY_CONFIGS.items()}


@torch.no_grad()
def _baseline_eval(model_path: str, reward: str, seed: int) -> float:
    """The held-out evaluation of the starting model: the same prompts, noise (generator seeded like
    `common.evaluate_ode`) and ODE sampler as the recipes' `eval/reward/mean`."""
    from mmrl.diffusion.scoring import load_reward_fn
    from mmrl.diffusion.models import load_flow_model
    from mmrl.diffusion.sampling import sample_groups
    from mmrl.pipelines.data import load_prompts

    model = load_flow_model(model_path, "cpu", torch.float32)
    reward_fn = load_reward_fn({reward: 1.0}, "cpu")
    prompts = [it.prompt for it in load_prompts(REPO / "assets/prompts/shapes_eval.txt")[:26]]
    gen = torch.Generator().manual_seed(seed + 12345)
    traj = sample_groups(model, model.encode_prompts(prompts), 1, num_steps=8, height=64, width=64,
                         guidance_scale=1.0, noise_level=0.0, generator=gen)
    return reward_fn(images=traj.images, prompts=prompts).scores.float().mean().item()


def _settings(cfg) -> str:
    """One line of what differs between the recipes."""
    m, s, a = cfg.model, cfg.rollout, cfg.algo
    tune = f"LoRA r{m.lora.rank}" if m.lora.rank else "full FT"
    if cfg.algorithm == "flow_grpo":
        extra = f"SDE a={s.noise_level}, trains {int(s.num_steps * s.timestep_fraction)} steps, KL {a.kl.coef}"
    elif cfg.algorithm == "nft":
        extra = f"ODE, NFT beta {a.guidance_beta}, trains {int(s.num_steps * a.timestep_fraction)} t, kl {a.kl.coef}"
    elif cfg.algorithm == "awm":
        extra = (f"ODE from {a.rollout_state}, {a.weighting}, K={a.num_train_timesteps} t, clip {a.clip_range:g}, "
                 f"kl old {a.old_kl_coef:g} ref {a.kl.coef:g}")
    else:
        extra = f"{'ODE' if s.noise_level == 0 else f'SDE a={s.noise_level}'}, beta {a.beta}, {a.pairing}"
    return f"{tune}, lr {cfg.optim.lr:g}, CFG {s.guidance_scale:g}, {extra}"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(REPO / "assets/tiny_sd3_shapes"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--reward", default="jpeg_compressibility")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "runs/compare_diffusion"))
    ap.add_argument("--only", nargs="*", default=None, help="subset of flow_grpo nft dpo_online awm")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MMRL_NO_PROGRESS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from mmrl.config import load_config, recipe_module
    from mmrl.diffusion.models import SD3Model
    from mmrl.runtime import Run

    out = Path(args.out)
    evals = {"n": 0}
    original_forward = SD3Model._forward

    def counted_forward(self, latents, *a, **kw):  # every transformer call, whoever makes it
        evals["n"] += int(latents.shape[0])
        return original_forward(self, latents, *a, **kw)

    SD3Model._forward = counted_forward
    base_eval = _baseline_eval(args.model, args.reward, args.seed)
    print(f"[compare] starting model, held-out ODE eval reward: {base_eval:.4f}")

    original_log = Run.log

    def log(self, step, metrics):  # add the benchmark's clocks to every metrics row
        metrics = dict(metrics)
        metrics["bench/wall_s"] = time.time() - self._t0
        metrics["bench/transformer_evals"] = evals["n"]
        return original_log(self, step, metrics)

    Run.log = log
    results: dict[str, list[dict]] = {}
    settings: dict[str, str] = {}
    try:
        for name, (path, overrides) in _configs(args.model, args.steps, args.reward, out, args.seed).items():
            if args.only and name not in args.only:
                continue
            evals["n"] = 0
            cfg = load_config(path, overrides)
            settings[name] = _settings(cfg)
            t0 = time.time()
            recipe_module(cfg.algorithm).train(cfg)
            rows = [json.loads(x) for x in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
            results[name] = rows
            print(f"[compare] {name}: {len(rows)} steps in {time.time() - t0:.1f} s")
    finally:
        Run.log = original_log
        SD3Model._forward = original_forward

    # ---- table
    print(f"\nreward = {args.reward}; {args.steps} steps x 4 prompts x 8 images, seed {args.seed}, "
          f"{args.threads} CPU thread(s); held-out ODE eval of the starting model: {base_eval:.4f}\n")
    hdr = (f"{'algorithm':<11} {'first5':>9} {'last5':>9} {'rise':>8} {'rise/std':>8} {'eval@1':>8} {'eval@end':>8} "
           f"{'wall s':>7} {'s/step':>7} {'T-evals':>9} {'evals/step':>10}")
    print(hdr)
    print("-" * len(hdr))
    summary: dict = {"_baseline_eval": base_eval}
    for name, rows in results.items():
        k = min(5, len(rows))
        first = sum(r["reward/mean"] for r in rows[:k]) / k
        last = sum(r["reward/mean"] for r in rows[-k:]) / k
        std0 = sum(r["reward/std"] for r in rows[:k]) / k
        wall = rows[-1]["bench/wall_s"]
        ev = rows[-1]["bench/transformer_evals"]
        step_s = sum(r["time/step_s"] for r in rows) / len(rows)
        ev_rows = [r["eval/reward/mean"] for r in rows if r.get("eval/reward/mean") is not None]
        ev0, ev1 = (ev_rows[0], ev_rows[-1]) if ev_rows else (float("nan"), float("nan"))
        summary[name] = {"reward_first5": first, "reward_last5": last, "rise": last - first,
                         "eval_reward_step1": ev0, "eval_reward_last": ev1,
                         "rise_in_std": (last - first) / std0 if std0 else 0.0, "wall_s": wall,
                         "step_s": step_s, "transformer_evals": ev}
        summary[name]["settings"] = settings[name]
        print(f"{name:<11} {first:>9.4f} {last:>9.4f} {last - first:>+8.4f} {summary[name]['rise_in_std']:>8.2f} "
              f"{ev0:>8.4f} {ev1:>8.4f} {wall:>7.1f} {step_s:>7.2f} {ev:>9d} {ev // len(rows):>10d}")

    print()
    for name in results:
        print(f"  {name}: {settings[name]}")

    # ---- plot
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    for i, (name, rows) in enumerate(results.items()):
        r = [x["reward/mean"] for x in rows]
        smooth = [sum(r[max(0, j - 4):j + 1]) / len(r[max(0, j - 4):j + 1]) for j in range(len(r))]  # last-5 mean
        for ax, key in ((axes[0], "bench/wall_s"), (axes[1], "bench/transformer_evals")):
            x = [row[key] for row in rows]
            ax.plot(x, r, "o", ms=2, alpha=0.35, color=f"C{i}")
            ax.plot(x, smooth, "-", lw=2, color=f"C{i}", label=f"{name} (rollouts, mean of last 5 steps)")
            ev = [(row[key], row["eval/reward/mean"]) for row in rows if row.get("eval/reward/mean") is not None]
            ax.plot([e[0] for e in ev], [e[1] for e in ev], "s--", ms=5, color=f"C{i}", label=f"{name} (held-out ODE eval)")
    axes[0].set_xlabel("wall-clock since start (s, CPU, 1 thread)")
    axes[1].set_xlabel("transformer evaluations (sample rows)")
    for ax in axes:
        ax.axhline(base_eval, color="gray", ls=":", lw=1, label="starting model (held-out ODE eval)")
        ax.set_ylabel(f"reward/mean ({args.reward})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("tiny SD3 shapes: Flow-GRPO vs DiffusionNFT vs online Diffusion-DPO vs AWM (same prompts, seed, "
                 "samples/step)")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    png = out / "compare_diffusion_algos.png"
    fig.savefig(png)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\nplot: {png}")
    return summary


if __name__ == "__main__":
    main()
