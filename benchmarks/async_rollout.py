"""Rollouts in their own process vs the synchronous loop, on the same 2 CPU cores: steps/s and reward gain per
wall-second of the tiny CPU recipes.

    .venv/bin/python benchmarks/async_rollout.py [--recipes vlm_grpo,flow_grpo] [--steps 60,30] [--repeats 3]
                                                 [--skip 5] [--max-staleness 1] [--out runs/bench_async]
                                                 [--set KEY=VALUE ...] [--quick]

`--quick` checks that the script runs (4 steps, 1 round, smaller batches: QUICK; the numbers mean nothing).

Four variants of each recipe's tiny config (configs/vlm/grpo_tiny_shapes.yaml, configs/diffusion/flow_grpo_tiny.yaml),
each a whole `mmrl train` run in its own process:

* `sync 2 threads`: the synchronous loop given both cores (`num_threads=2`, OMP_NUM_THREADS=2);
* `sync 1 thread`: the synchronous loop with one thread (the recipes' default on this machine);
* `async, decoupled PPO`: `rollout.worker=process rollout.max_staleness=K` (default 1), trainer and rollout process
  with one torch thread each (2 processes on the 2 cores), pi_old recomputed by the trainer
  (`algo.old_logprobs=recompute`: one more no-grad forward per step) and TIS weights pi_old / pi_rollout
  (`algo.rollout_correction.is_level=token`);
* `async, bypass`: the same with `algo.old_logprobs=rollout` (the PPO ratio taken against the stale rollout's
  log-probs; no extra forward).

The variants run in rounds (in this order, then rotated: a change of machine load lands on all of them) and
`--repeats` rounds give min / median / max per variant. Measured from each run's metrics.jsonl, after the first
`--skip` steps (the async run's first step waits for its rollout process to load the model; start-up is not part of
a long run's throughput): steps/s = steps / sum of their `time/step_s`, and reward gain per wall-second = (mean
`reward/mean` of the last 5 measured steps - mean of the first 5) / the same seconds. The whole process's wall time
(imports, model loading, warm start, evaluation) is printed too. Every run starts from the same seed; the async run's
batches are one policy version stale, so its reward per *step* may differ from the synchronous runs'.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _timing import machine, markdown_table, spread_of

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

CONFIGS = {
    "vlm_grpo": ("configs/vlm/grpo_tiny_shapes.yaml", ["log.eval_every=0", "log.sample_every=0", "data.eval_size=8"]),
    "flow_grpo": ("configs/diffusion/flow_grpo_tiny.yaml", ["log.eval_every=0", "log.sample_every=0"]),
}
# --quick: 4 steps, 1 round, the first step skipped, and each recipe's batch made small
QUICK = {"vlm_grpo": ["warm_start.steps=2", "data.eval_size=2", "rollout.prompts_per_step=2", "rollout.group_size=4"],
         "flow_grpo": ["rollout.prompts_per_step=2", "rollout.group_size=4"]}
ASYNC = ["num_threads=1", "rollout.worker=process", "rollout.worker_threads=1"]
VARIANTS = {  # name -> (threads per process, overrides)
    "sync 2 threads": (2, ["num_threads=2"]),
    "sync 1 thread": (1, ["num_threads=1"]),
    "async, decoupled PPO": (1, [*ASYNC, "algo.old_logprobs=recompute", "algo.rollout_correction.is_level=token"]),
    "async, bypass": (1, [*ASYNC, "algo.old_logprobs=rollout"]),
}


def measure(rows: list[dict], skip: int) -> dict[str, float]:
    """steps/s and reward gain per wall-second of the steps after the first `skip` (see the module docstring)."""
    rows = [r for r in rows if r["step"] > skip]
    if len(rows) < 2:
        raise ValueError(f"measure: {len(rows)} step(s) after skipping {skip}; run more --steps")
    seconds = sum(r["time/step_s"] for r in rows)
    k = min(5, len(rows) // 2)
    first = sum(r["reward/mean"] for r in rows[:k]) / k
    last = sum(r["reward/mean"] for r in rows[-k:]) / k
    return {"steps_per_s": len(rows) / seconds, "reward_gain_per_s": (last - first) / seconds, "seconds": seconds,
            "reward_last": last}


def run_once(recipe: str, variant: str, steps: int, k: int, out: Path, extra_overrides: list[str]
             ) -> tuple[list[dict], float]:
    cfg, extra = CONFIGS[recipe]
    threads, overrides = VARIANTS[variant]
    if variant.startswith("async"):
        overrides = [*overrides, f"rollout.max_staleness={k}"]
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "mmrl.cli", "train", cfg, f"output_dir={out}", f"train.max_steps={steps}",
           "train.save_every=0", *extra, *overrides, *extra_overrides]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", MMRL_NO_PROGRESS="1", PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{recipe} / {variant} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows, wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="vlm_grpo,flow_grpo", help=f"comma-separated subset of {list(CONFIGS)}")
    ap.add_argument("--steps", default="60,30", help="train.max_steps per recipe (one number for all, or one each)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the variants")
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the measurement")
    ap.add_argument("--max-staleness", type=int, default=1, help="rollout.max_staleness of the async variant")
    ap.add_argument("--out", default="runs/bench_async", help="run directories go here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="another config override for every run (e.g. a smaller batch for a quick check)")
    ap.add_argument("--quick", action="store_true", help="does it run: 4 steps, 1 round, --skip 1, small batches")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.skip = "4", 1, 1
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    bad = [r for r in recipes if r not in CONFIGS]
    if bad:
        raise SystemExit(f"--recipes: unknown {bad}; valid: {list(CONFIGS)}")
    steps = [int(s) for s in args.steps.split(",")]
    steps = steps * len(recipes) if len(steps) == 1 else steps
    if len(steps) != len(recipes) or args.repeats < 1 or min(steps) <= args.skip + 1:
        raise SystemExit(f"--steps: one value, or one per recipe ({len(recipes)}), each > --skip + 1; --repeats >= 1")
    print(f"{machine(1)}; `{' '.join(['python', 'benchmarks/async_rollout.py', *(argv or sys.argv[1:])])}`; "
          f"async = rollout.max_staleness={args.max_staleness}; after the first {args.skip} steps; "
          f"{args.repeats} interleaved rounds (min / median / max)\n")
    names = list(VARIANTS)
    for recipe, n in zip(recipes, steps):
        results: dict[str, list[dict]] = {v: [] for v in names}
        for r in range(args.repeats):
            for variant in names[r % len(names):] + names[:r % len(names)]:
                out = REPO / args.out / recipe / variant.replace(", ", "_").replace(" ", "_")
                extra = [*(QUICK[recipe] if args.quick else []), *args.set]
                rows, wall = run_once(recipe, variant, n, args.max_staleness, out, extra)
                m = measure(rows, args.skip)
                m["wall"] = wall
                if variant.startswith("async"):
                    m["staleness"] = max(row.get("rollout/staleness/max", 0.0) for row in rows)
                    m["idle"] = [row.get("time/async/trainer_idle_ratio") for row in rows if row["step"] > args.skip]
                results[variant].append(m)
                print(f"  {recipe} round {r + 1} {variant}: {m['steps_per_s']:.2f} steps/s, reward gain "
                      f"{m['reward_gain_per_s']:+.4f}/s, process wall {wall:.0f} s", file=sys.stderr, flush=True)
        base = spread_of([m["steps_per_s"] for m in results["sync 1 thread"]]).median
        table = []
        for v in names:
            sps = spread_of([m["steps_per_s"] for m in results[v]])
            gain = spread_of([m["reward_gain_per_s"] for m in results[v]])
            last = spread_of([m["reward_last"] for m in results[v]])
            wall = spread_of([m["wall"] for m in results[v]])
            table.append([v, sps.fmt(digits=2), f"{sps.median / base:.2f}x", gain.fmt(digits=4),
                          last.fmt(digits=3), wall.fmt(digits=0)])
        print(f"### {recipe}: {n} steps, {CONFIGS[recipe][0]}\n")
        print(markdown_table(["variant", "steps/s", "vs sync 1 thread (median)", "reward gain / wall-s",
                              "reward, last 5 steps", "process wall s"], table))
        for v in [v for v in names if v.startswith("async")]:
            idle = [x for m in results[v] for x in m["idle"] if x is not None]
            if idle:
                print(f"\n{v}: max staleness {max(m['staleness'] for m in results[v]):.0f}; trainer idle ratio "
                      f"{spread_of(idle).fmt(digits=2)} (min / median / max over measured steps)")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
