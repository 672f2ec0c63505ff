"""Janus GRPO on the shapes colour reward: does the reward rise for a real reason? Trained vs a control, over seeds.

Model: assets/tiny_janus_shapes, whose VQ decoder paints each token a known colour and whose language model was
briefly trained on the shapes captions, so it starts weakly prompt-conditioned (mmrl.ar_image.pretrain_tiny). Task:
configs/ar_image/janus_grpo_tiny_shapes.yaml (reward prompt_color: the soft fraction of pixels in the background
colour the prompt names). Two arms per seed: `trained`
(the config as shipped) and `control` (the same config at optim.lr 1e-8: the same prompts, sampling and reward, no
learning). Per run: the rollout reward (metrics.jsonl `reward/mean`) of the first and the last 5 steps, and the
held-out reward: the 24 prompts of assets/prompts/shapes_eval.txt x `--eval-images` images, sampled with a fixed
seed, of the starting model and of the run's last checkpoint. Also the held-out samples of the starting model and of
the trained arm's last checkpoint (first seed) as PNG grids, and every number in OUT/results.json.

    .venv/bin/python benchmarks/janus_color_demo.py [--seeds 0 1 2] [--steps N] [--jobs 2] [--out DIR]

Not a test: the numbers are what this machine measured, whatever they are.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG = "configs/ar_image/janus_grpo_tiny_shapes.yaml"
EVAL_PROMPTS = "assets/prompts/shapes_eval.txt"
CONTROL_LR = 1e-8
WINDOW = 5  # steps averaged at each end of the rollout curve


def _env() -> dict:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               MMRL_NO_PROGRESS="1", TOKENIZERS_PARALLELISM="false")
    return env


def _train(r: dict) -> None:
    """One run's `mmrl train` command, its output in <out>/<name>.log; a failure stops with the log's tail."""
    r["dir"].parent.mkdir(parents=True, exist_ok=True)
    log_path = r["dir"].parent / f"{r['dir'].name}.log"
    with open(log_path, "w") as log:
        code = subprocess.run(r["cmd"], cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        tail = log_path.read_text().strip().splitlines()[-5:]
        raise SystemExit(f"janus_color_demo: {r['name']} failed (exit {code}):\n" + "\n".join(tail))


def _train_all(runs: list[dict], jobs: int) -> None:
    """Every `runs` entry's `mmrl train` command, `jobs` at a time (the standard thread pool, as
    compare_diffusion_algos runs its processes)."""
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for done in [pool.submit(_train, r) for r in runs]:
            done.result()


def _rollout_rewards(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["reward/mean"] for r in rows]


@torch.no_grad()
def held_out(cfg, adapters: Path | None, prompts: list[str], n_images: int, seed: int):
    """(mean held-out reward, images [len(prompts) * n, 3, H, W], scores) of the config's model, with the LoRA
    adapters of a checkpoint (`adapters`: its adapters/ folder) or without (the starting model)."""
    from mmrl.ar_image.grpo import build_states
    from mmrl.rewards import load as load_reward

    states, policy = build_states(cfg, torch.device("cpu"), torch.float32)
    if adapters is not None:
        states.load(adapters)
    reward = load_reward(dict(cfg.reward.components), device="cpu")
    gen = torch.Generator().manual_seed(seed)
    images, scores = [], []
    for p in prompts:
        tokens, _ = policy.sample(policy.image_prompt_ids(p), n_images, generator=gen)
        imgs = policy.decode(tokens)
        images.append(imgs)
        scores.append(reward(imgs, [p] * n_images, None).scores.float())
    scores = torch.cat(scores)
    return float(scores.mean()), torch.cat(images), scores


def _mean_sd(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None, help="train.max_steps (default: the config's)")
    ap.add_argument("--eval-images", type=int, default=4, help="images per held-out prompt")
    ap.add_argument("--jobs", type=int, default=2, help="training runs at a time (one thread each)")
    ap.add_argument("--out", default="runs/janus_color_demo")
    ap.add_argument("--reuse", action="store_true", help="evaluate runs already in OUT, train nothing")
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps <= WINDOW:
        raise SystemExit(f"janus_color_demo: --steps must be > {WINDOW} (first and last {WINDOW} steps), "
                         f"got {args.steps}")
    from mmrl.config import load_config
    from mmrl.pipelines.data import load_prompts

    torch.set_num_threads(1)
    out = Path(args.out).resolve()
    arms = {"trained": [], "control": [f"optim.lr={CONTROL_LR}"]}
    steps = [f"train.max_steps={args.steps}"] if args.steps else []
    runs = []
    for seed in args.seeds:
        for arm, extra in arms.items():
            d = out / f"{arm}_seed{seed}"
            overrides = [f"output_dir={d}", f"seed={seed}", *steps, *extra]
            runs.append({"name": d.name, "dir": d, "seed": seed, "arm": arm, "overrides": overrides,
                         "cmd": [sys.executable, "-m", "mmrl.cli", "train", CONFIG, *overrides]})
    t0 = time.time()
    if not args.reuse:
        _train_all(runs, args.jobs)
    train_s = time.time() - t0
    prompts = [it.prompt for it in load_prompts(REPO / EVAL_PROMPTS)]
    results, start = [], {}
    for r in runs:
        cfg = load_config(REPO / CONFIG, r["overrides"])
        if r["seed"] not in start:  # the starting model: the same for both arms of a seed
            start[r["seed"]] = held_out(cfg, None, prompts, args.eval_images, r["seed"])
        last = max((r["dir"] / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        end = held_out(cfg, last / "adapters", prompts, args.eval_images, r["seed"])
        curve = _rollout_rewards(r["dir"])
        results.append({"seed": r["seed"], "arm": r["arm"], "steps": len(curve), "checkpoint": last.name,
                        "rollout_first": statistics.mean(curve[:WINDOW]),
                        "rollout_last": statistics.mean(curve[-WINDOW:]),
                        "held_out_start": start[r["seed"]][0], "held_out_end": end[0], "rollout_curve": curve})
        if r["arm"] == "trained" and r["seed"] == args.seeds[0]:
            from mmrl.run.plots import save_image_grid

            for name, (_, images, scores) in (("start", start[r["seed"]]), ("trained", end)):
                captions = [f"{s:.2f} {p}" for p, s in zip([p for p in prompts for _ in range(args.eval_images)],
                                                            scores.tolist())]
                save_image_grid(images, captions, out / f"held_out_{name}.png", cols=2 * args.eval_images)
    print(f"| seed | arm | rollout first {WINDOW} | rollout last {WINDOW} | held-out start | held-out end |")
    print("|---|---|---|---|---|---|")
    for x in results:
        print(f"| {x['seed']} | {x['arm']} | {x['rollout_first']:.3f} | {x['rollout_last']:.3f} | "
              f"{x['held_out_start']:.3f} | {x['held_out_end']:.3f} |")
    for arm in arms:
        rows = [x for x in results if x["arm"] == arm]
        print(f"| mean ± sd | {arm} | " + " | ".join(_mean_sd([x[k] for x in rows]) for k in
              ("rollout_first", "rollout_last", "held_out_start", "held_out_end")) + " |")
    summary = {"config": CONFIG, "control_lr": CONTROL_LR, "eval_images": args.eval_images,
               "eval_prompts": EVAL_PROMPTS, "train_seconds": train_s, "runs": results}
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"results: {out / 'results.json'}; held-out samples: {out / 'held_out_start.png'}, "
          f"{out / 'held_out_trained.png'}")
    return summary


if __name__ == "__main__":
    main()
