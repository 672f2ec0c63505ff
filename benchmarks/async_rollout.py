"""Rollouts in their own process vs the synchronous loop, on the same 2 CPU cores: steps/s and reward gain per
wall-second of the tiny CPU recipes, and how close the overlap comes to its ideal.

    .venv/bin/python benchmarks/async_rollout.py [--recipes vlm_grpo,flow_grpo] [--steps 40,20] [--repeats 3]
                                                 [--skip 5] [--max-staleness 1] [--mode process]
                                                 [--out runs/bench_async] [--set KEY=VALUE ...] [--quick]
                                                 [--leave-out VARIANT ...]

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

The overlap table (docs/async.md#metrics defines the keys): per async variant, the means over the measured steps of
its own `async/*` metrics (`mmrl.training.overlap.overlap_summary`): R and T per step, the ideal speed-up
(R + T) / max(R, T), the achieved one (R + T) / step time, their ratio, and both idle fractions. Then the A/B row:
`async, bypass` (the same computation as the synchronous loop: no extra forward) against `sync 1 thread` of the same
round, achieved = the synchronous run's seconds per step / the async run's, ideal = (R + T) / max(R, T) of the
synchronous run (R: its `time/rollout_s` + `time/reward_s`, T: the rest of its step).

`--mode` names how the rollouts run beside the trainer (MODES): `process` (one rollout process per trainer process,
`rollout.worker=process`) or `ranks` (a rollout rank beside the trainer rank in one torch.distributed world, the async
variants launched by torchrun with 2 processes: `rollout.worker=ranks dist.rollout_ranks=1`).
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
sys.path.insert(0, str(REPO))

from mmrl.training.overlap import OVERLAP_KEYS, ideal_speedup, overlap_summary  # noqa: E402

CONFIGS = {
    "vlm_grpo": ("configs/vlm/grpo_tiny_shapes.yaml", ["log.eval_every=0", "log.sample_every=0", "data.eval_size=8"]),
    "flow_grpo": ("configs/diffusion/flow_grpo_tiny.yaml", ["log.eval_every=0", "log.sample_every=0"]),
}
# --quick: 4 steps, 1 round, the first step skipped, and each recipe's batch made small
QUICK = {"vlm_grpo": ["warm_start.steps=2", "data.eval_size=2", "rollout.prompts_per_step=2", "rollout.group_size=4"],
         "flow_grpo": ["rollout.prompts_per_step=2", "rollout.group_size=4"]}
# how the rollouts run beside the trainer, one thread per side
MODES = {"process": ["num_threads=1", "rollout.worker=process", "rollout.worker_threads=1"],
         "ranks": ["num_threads=1", "rollout.worker=ranks", "dist.rollout_ranks=1", "rollout.worker_threads=1"]}
# the launcher of a mode's async variants (none: one process)
LAUNCH = {"ranks": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]}


def variants(mode: str) -> dict[str, tuple[int, list[str]]]:
    """name -> (threads per process, overrides): the two synchronous baselines and `mode`'s two async variants."""
    side = MODES[mode]
    return {
        "sync 2 threads": (2, ["num_threads=2"]),
        "sync 1 thread": (1, ["num_threads=1"]),
        "async, decoupled PPO": (1, [*side, "algo.old_logprobs=recompute", "algo.rollout_correction.is_level=token"]),
        "async, bypass": (1, [*side, "algo.old_logprobs=rollout"]),
    }


VARIANTS = variants("process")
AB = ("async, bypass", "sync 1 thread")  # the A/B pair of the overlap table: the same computation per step


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


def sync_overlap(rows: list[dict], skip: int) -> dict[str, float]:
    """R and T per step of a synchronous run after the first `skip` steps (R: `time/rollout_s` + `time/reward_s`,
    T: the rest of `time/step_s`) and the ideal speed-up of overlapping them."""
    rows = [r for r in rows if r["step"] > skip]
    total = sum(r["time/step_s"] for r in rows)
    rollout = sum(r.get("time/rollout_s", 0.0) + r.get("time/reward_s", 0.0) for r in rows)
    return {"rollout_s": rollout / len(rows), "trainer_s": (total - rollout) / len(rows),
            "ideal": ideal_speedup(rollout, total - rollout)}


def overlap_table(results: dict[str, list[dict]]) -> list[list[str]]:
    """Rows of the overlap table (module docstring) from each round's measurements of every variant."""
    cols = ("async_rollout_s", "async_trainer_s", "async_ideal_speedup", "async_achieved_speedup",
            "async_achieved_over_ideal", "async_trainer_idle_frac", "async_rollout_idle_frac")
    table = []
    for v in [v for v in results if v.startswith("async")]:
        cells = [spread_of([m["overlap"][c] for m in results[v]]) for c in cols]
        table.append([f"{v} (in-run)", *(c.fmt(digits=3) for c in cells[:2]), *(c.fmt(digits=2) for c in cells[2:])])
    a, b = (results[v] for v in AB)  # round r of each: an interleaved pair
    base = [m["sync_overlap"] for m in b]
    achieved = [ma["steps_per_s"] / mb["steps_per_s"] for ma, mb in zip(a, b)]
    ratio = [x / s["ideal"] for x, s in zip(achieved, base)]
    table.append([f"{AB[0]} vs {AB[1]} (A/B)", spread_of([s["rollout_s"] for s in base]).fmt(digits=3),
                  spread_of([s["trainer_s"] for s in base]).fmt(digits=3),
                  spread_of([s["ideal"] for s in base]).fmt(digits=2), spread_of(achieved).fmt(digits=2),
                  spread_of(ratio).fmt(digits=2), "-", "-"])
    return table


def run_once(recipe: str, variant: str, steps: int, k: int, out: Path, extra_overrides: list[str],
             mode: str = "process") -> tuple[list[dict], float]:
    cfg, extra = CONFIGS[recipe]
    threads, overrides = variants(mode)[variant]
    if variant.startswith("async"):
        overrides = [*overrides, f"rollout.max_staleness={k}"]
    if out.exists():
        shutil.rmtree(out)
    launch = LAUNCH.get(mode, []) if variant.startswith("async") else []
    cmd = [sys.executable, *launch, "-m", "mmrl.cli", "train", cfg, f"output_dir={out}", f"train.max_steps={steps}",
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
    ap.add_argument("--steps", default="40,20", help="train.max_steps per recipe (one number for all, or one each)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the variants")
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the measurement")
    ap.add_argument("--max-staleness", type=int, default=1, help="rollout.max_staleness of the async variant")
    ap.add_argument("--mode", default="process", choices=list(MODES),
                    help="how the rollouts run beside the trainer: process = one rollout process per trainer process, "
                         "ranks = a rollout rank beside the trainer rank (torchrun, 2 processes)")
    ap.add_argument("--out", default="runs/bench_async", help="run directories go here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="another config override for every run (e.g. a smaller batch for a quick check)")
    ap.add_argument("--quick", action="store_true", help="does it run: 4 steps, 1 round, --skip 1, small batches")
    ap.add_argument("--leave-out", action="append", default=[], metavar="VARIANT",
                    help="a variant not to run (e.g. 'sync 2 threads' on a loaded machine); the tables need "
                         f"{AB[1]!r} and {AB[0]!r}")
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
    names = [v for v in variants(args.mode) if v not in args.leave_out]
    bad = [v for v in args.leave_out if v not in variants(args.mode) or v in AB]
    if bad:
        raise SystemExit(f"--leave-out: {bad} cannot be left out; choose among "
                         f"{[v for v in variants(args.mode) if v not in AB]}")
    print(f"{machine(1)}; `{' '.join(['python', 'benchmarks/async_rollout.py', *(argv or sys.argv[1:])])}`; "
          f"async = rollout.max_staleness={args.max_staleness}, mode {args.mode}; after the first {args.skip} steps; "
          f"{args.repeats} interleaved rounds (min / median / max)\n")
    for recipe, n in zip(recipes, steps):
        results: dict[str, list[dict]] = {v: [] for v in names}
        for r in range(args.repeats):
            for variant in names[r % len(names):] + names[:r % len(names)]:
                out = REPO / args.out / recipe / variant.replace(", ", "_").replace(" ", "_")
                extra = [*(QUICK[recipe] if args.quick else []), *args.set]
                rows, wall = run_once(recipe, variant, n, args.max_staleness, out, extra, args.mode)
                m = measure(rows, args.skip)
                m["wall"] = wall
                if variant.startswith("async"):
                    m["staleness"] = max(row.get("rollout/staleness/max", 0.0) for row in rows)
                    m["overlap"] = overlap_summary(rows, skip=args.skip)
                    missing = [k for k in OVERLAP_KEYS if k.replace("/", "_") not in m["overlap"]]
                    if missing:
                        raise SystemExit(f"{recipe} / {variant}: no {missing} in {out / 'metrics.jsonl'}")
                else:
                    m["sync_overlap"] = sync_overlap(rows, args.skip)
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
        stale = max(m["staleness"] for v in names if v.startswith("async") for m in results[v])
        print(f"\n#### {recipe}: overlap, mode {args.mode} (max staleness seen {stale:.0f}; per round: means over "
              f"the measured steps)\n")
        print(markdown_table(["variant", "R s/step", "T s/step", "ideal (R+T)/max(R,T)", "achieved",
                              "achieved / ideal", "trainer idle", "rollout idle"], overlap_table(results)))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
