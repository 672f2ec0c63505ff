"""Diffusion RL algorithms on one tiny task: time to a high held-out reward, as a ratio to Flow-GRPO, over 5 seeds.

Same model (the data-trained tiny SD3 in assets/tiny_sd3_shapes), prompts, reward, seeds and sample budget per step
(4 prompts x 8 images from an 8-step sampler); everything else is each algorithm's setting from its paper or public
script as far as it carries over to a model this size (ALGOS, cited in docs/faster-diffusion.md). Every run is
evaluated the same way: ODE sampling of the 26 held-out prompts of assets/prompts/shapes_eval.txt at 64x64 with
fixed noise, after step 1 and every `eval_every` steps of the algorithm (ALGOS; evaluation forks the RNG, so it
changes no training number).

Clocks per run, all excluding model loading and evaluation: CPU seconds of the process (`time.process_time`, one
torch thread: robust to other jobs on a shared machine, unlike wall time, which is reported too) and transformer
evaluations (sample rows through the transformer, rollout and training passes alike).

The target (high): seed s's target is what Flow-GRPO reaches after `--steps` steps (default 105, five times the
21 steps of the earlier, easier target), the mean of its last two evaluations. Flow-GRPO runs first (every seed),
then every other algorithm runs until its held-out reward reaches the target, or until it has spent as much CPU
time as Flow-GRPO's whole run of that seed (or `--steps` x `--cap` steps): not reaching it then means "not faster
than Flow-GRPO". A run's time to target is where its held-out curve (the starting model at 0, then every evaluation)
first reaches the target, linearly interpolated between the two evaluations around the crossing; the width of that
interval relative to the time is the grid's bound on the figure (reported; a crossing at the first evaluation makes
the time an upper bound and the speed-up a lower bound, marked `>=`). Speed-up in seed s = Flow-GRPO's time to
target / the algorithm's, summarised as mean and sample std over the seeds where both reached it.

    .venv/bin/python benchmarks/compare_diffusion_algos.py                 # the full table: 10 algorithms x 5 seeds
    .venv/bin/python benchmarks/compare_diffusion_algos.py --jobs 2        # two runs at once (CPU time is per run)
    .venv/bin/python benchmarks/compare_diffusion_algos.py --quick         # the whole pipeline on a tiny budget

Finished runs in `--out` with the same settings are kept: an interrupted pass continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from _diffusion_algos import ALGOS, QUEUE_ORDER, Algo  # noqa: F401  (Algo: for callers adding rows)

REPO = Path(__file__).resolve().parents[1]


DEFAULT_STEPS = 105
# --quick (tests/test_benchmarks.py, the docs test): the whole pipeline on a tiny budget; its numbers mean nothing
QUICK = {"steps": 2, "algos": ["flow_grpo", "flow_grpo_fast", "dgpo", "awm"],
         "overrides": ["rollout.prompts_per_step=2", "rollout.group_size=4", "log.eval_max_prompts=3"]}


def _overrides(model: str, steps: int, reward: str, out: Path, seed: int, eval_every: int) -> list[str]:
    """The shared task forced on every recipe: model, prompts, reward, seed, samples per step, sampler steps, image
    size, step count, and the same held-out evaluation (64x64, ODE, 8 steps, 26 prompts, fixed noise)."""
    return [f"model.path={model}", f"seed={seed}", "device=cpu", "dtype=float32", "num_threads=1",
            f"data.train_prompts={REPO / 'assets/prompts/shapes_train.txt'}", "rollout.prompts_per_step=4",
            "rollout.group_size=8", "rollout.num_steps=8", "rollout.height=64", "rollout.width=64",
            f"reward.components={{{reward}: 1.0}}", f"train.max_steps={steps}", "train.save_every=0",
            "train.resume=never", "log.sample_every=0", f"output_dir={out}",
            f"data.eval_prompts={REPO / 'assets/prompts/shapes_eval.txt'}", f"log.eval_every={eval_every}",
            "log.eval_max_prompts=26", "rollout.eval_num_steps=8", "rollout.eval_guidance_scale=1.0",
            "rollout.eval_height=64", "rollout.eval_width=64"]


def crossing(curve: list[tuple[float, float]], target: float) -> tuple[float, int] | None:
    """(first clock at which the piecewise-linear curve [(clock, value), ...] reaches `target`, index of the point
    where it does); None: never."""
    for i, (c, v) in enumerate(curve):
        if v >= target:
            if i == 0:
                return c, 0
            c0, v0 = curve[i - 1]
            return c0 + (target - v0) / (v - v0) * (c - c0), i
    return None


def time_to_target(curve: list[tuple[float, float]], target: float) -> float | None:
    """First clock at which the piecewise-linear curve [(clock, value), ...] reaches `target` (None: never)."""
    hit = crossing(curve, target)
    return None if hit is None else hit[0]


def grid_bound(curve: list[tuple[float, float]], target: float) -> tuple[float, bool] | None:
    """How far the evaluation grid bounds a time to target: (width of the interval between the two evaluations
    around the crossing / the time, True when the crossing is before the first evaluation after the start, so the
    time is an upper bound only); None when never reached or reached at the start."""
    hit = crossing(curve, target)
    if hit is None or hit[1] == 0 or hit[0] <= 0:
        return None
    t, i = hit
    return (curve[i][0] - curve[i - 1][0]) / t, i == 1


def mean_std(values: list[float]) -> tuple[float, float]:
    """(mean, sample std; 0 for one value); (nan, nan) for none."""
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def targets_of(flow_runs: dict[int, list[dict]]) -> dict[int, float]:
    """Seed -> the mean of Flow-GRPO's last two held-out evaluations in that seed."""
    out = {}
    for seed, rows in flow_runs.items():
        ev = [r["eval/reward/mean"] for r in rows if r.get("eval/reward/mean") is not None]
        out[seed] = statistics.fmean(ev[-2:])
    return out


CLOCKS = ("cpu_s", "wall_s", "train_evals", "step")


def summarise(runs: dict[str, dict[int, list[dict]]], base: dict[int, float]) -> dict:
    """Per algorithm and seed: curves (from the starting model's evaluation `base[seed]` at clock 0), time, steps
    and transformer evaluations to the seed's Flow-GRPO target, the grid's bound, speed-ups; then mean and std over
    the seeds."""
    out: dict = {"baseline_eval": base, "targets": targets_of(runs["flow_grpo"])}
    for name, per_seed in runs.items():
        res: dict = {"seeds": {}}
        for seed, rows in per_seed.items():
            evals = [r for r in rows if r.get("eval/reward/mean") is not None]
            curves = {k: [(0.0, base[seed])] + [(r["step"] if k == "step" else r[f"bench/{k}"], r["eval/reward/mean"])
                                                for r in evals] for k in CLOCKS}
            target = out["targets"].get(seed)
            bound = grid_bound(curves["cpu_s"], target) if target is not None else None
            res["seeds"][seed] = {
                "target": target, "eval_final": evals[-1]["eval/reward/mean"] if evals else None,
                "eval_best": max(r["eval/reward/mean"] for r in evals) if evals else None,
                "steps": len(rows), "cpu_s": rows[-1]["bench/cpu_s"], "wall_s": rows[-1]["bench/wall_s"],
                "train_evals": rows[-1]["bench/train_evals"],
                "grid_bound": None if bound is None else bound[0], "first_eval": bool(bound and bound[1]),
                **{f"ttt_{k}": (time_to_target(c, target) if target is not None else None) for k, c in curves.items()},
                "curve": [(r["step"], r["bench/cpu_s"], r["eval/reward/mean"]) for r in evals]}
        out[name] = res
    for name in runs:
        res = out[name]
        for k in CLOCKS:
            got = {s: v[f"ttt_{k}"] for s, v in res["seeds"].items() if v[f"ttt_{k}"] is not None}
            res[f"ttt_{k}"] = mean_std(list(got.values()))
            ratios = [out["flow_grpo"]["seeds"][s][f"ttt_{k}"] / t for s, t in got.items()
                      if s in out["flow_grpo"]["seeds"] and out["flow_grpo"]["seeds"][s][f"ttt_{k}"] and t > 0]
            res[f"speedup_{k}"] = mean_std(ratios)
            res[f"reached_{k}"] = f"{len(got)}/{len(res['seeds'])}"
        bounds = [v["grid_bound"] for v in res["seeds"].values() if v["grid_bound"] is not None]
        res["grid_bound_max"] = max(bounds) if bounds else None
        res["first_eval"] = sum(v["first_eval"] for v in res["seeds"].values())
        res["eval_final"] = mean_std([v["eval_final"] for v in res["seeds"].values() if v["eval_final"] is not None])
        res["cpu_s_per_step"] = mean_std([v["cpu_s"] / v["steps"] for v in res["seeds"].values()])
        res["evals_per_step"] = mean_std([v["train_evals"] / v["steps"] for v in res["seeds"].values()])
    return out


@torch.no_grad()
def _baseline_eval(model_path: str, reward: str, seed: int, n_prompts: int = 26) -> float:
    """The held-out evaluation of the starting model: the recipes' `eval/reward/mean` at step 0 (same prompts, noise
    generator seeded like `common.evaluate_ode`, 64x64 ODE sampler). It does not depend on the seed's training."""
    from mmrl.diffusion.models import load_flow_model
    from mmrl.diffusion.sampling import sample_groups
    from mmrl.diffusion.scoring import load_reward_fn
    from mmrl.pipelines.data import load_prompts

    model = load_flow_model(model_path, "cpu", torch.float32)
    reward_fn = load_reward_fn({reward: 1.0}, "cpu")
    prompts = [it.prompt for it in load_prompts(REPO / "assets/prompts/shapes_eval.txt")[:n_prompts]]
    gen = torch.Generator().manual_seed(seed + 12345)
    scores = []
    for lo in range(0, len(prompts), 32):  # the recipes' evaluation batches (update.micro_batch_size 32)
        chunk = prompts[lo:lo + 32]
        traj = sample_groups(model, model.encode_prompts(chunk), 1, num_steps=8, height=64, width=64,
                             guidance_scale=1.0, noise_level=0.0, generator=gen)
        scores.append(reward_fn(images=traj.images, prompts=chunk).scores.float())
    return torch.cat(scores).mean().item()


class Clocks:
    """Training clocks of the run in progress: started when the recipe enters its step loop (`Run.progress`),
    with the CPU/wall time and transformer evaluations spent in `evaluate_ode` subtracted."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.cpu0 = self.wall0 = None
        self.eval_cpu = self.eval_wall = 0.0
        self.evals = self.eval_evals = 0

    def start(self) -> None:
        self.cpu0, self.wall0 = time.process_time(), time.perf_counter()

    def row(self) -> dict:
        return {"bench/cpu_s": time.process_time() - self.cpu0 - self.eval_cpu,
                "bench/wall_s": time.perf_counter() - self.wall0 - self.eval_wall,
                "bench/train_evals": self.evals - self.eval_evals}


def _instrument(clocks: Clocks):
    """Patch Run.progress / Run.log, common.evaluate_ode and SD3Model.transformer_velocity; returns the undo
    function."""
    from mmrl.diffusion import common
    from mmrl.diffusion.models import SD3Model
    from mmrl.run.directory import Run

    saved = (Run.progress, Run.log, common.evaluate_ode, SD3Model.transformer_velocity)

    def progress(self, *a, **kw):
        clocks.start()
        return saved[0](self, *a, **kw)

    def log(self, step, metrics):
        return saved[1](self, step, {**metrics, **clocks.row()})

    def evaluate_ode(*a, **kw):
        cpu, wall, n = time.process_time(), time.perf_counter(), clocks.evals
        try:
            return saved[2](*a, **kw)
        finally:
            clocks.eval_cpu += time.process_time() - cpu
            clocks.eval_wall += time.perf_counter() - wall
            clocks.eval_evals += clocks.evals - n

    def forward(self, latents, *a, **kw):  # every transformer call, whoever makes it
        clocks.evals += int(latents.shape[0])
        return saved[3](self, latents, *a, **kw)

    Run.progress, Run.log, common.evaluate_ode, SD3Model.transformer_velocity = progress, log, evaluate_ode, forward

    def undo():
        Run.progress, Run.log, common.evaluate_ode, SD3Model.transformer_velocity = saved
    return undo


class StopAt:
    """A run callback (`mmrl.run.trackers`): ends the run after the step whose held-out reward reaches `target`, or
    once the run's training CPU time reaches `cpu_cap` (None: no such stop)."""

    def __init__(self, target: float | None, cpu_cap: float | None):
        self.target, self.cpu_cap = target, cpu_cap
        self.stop_requested = False
        self.why = ""

    def on_log(self, step: int, row: dict) -> None:
        ev = row.get("eval/reward/mean")
        if self.target is not None and ev is not None and ev >= self.target:
            self.stop_requested, self.why = True, f"target {self.target:.4f} reached ({ev:.4f})"
        elif self.cpu_cap is not None and row.get("bench/cpu_s", 0.0) >= self.cpu_cap:
            self.stop_requested, self.why = True, f"CPU cap {self.cpu_cap:.1f} s reached"


def _run_key(name: str, seed: int, args, target: float | None, cpu_cap: float | None) -> tuple[Path, list, dict]:
    """(run dir, overrides, the settings a finished run records in bench_done.json)."""
    algo = ALGOS[name]
    run_dir = Path(args.out) / f"{name}_s{seed}"
    every = 1 if args.quick else algo.eval_every
    steps = args.steps if name == "flow_grpo" else args.steps * args.cap
    overrides = (_overrides(args.model, steps, args.reward, run_dir, seed, every)
                 + (QUICK["overrides"] if args.quick else []) + algo.overrides)
    key: dict = {"config": algo.config, "overrides": overrides}
    if name != "flow_grpo":
        key["stop"] = {"target": target, "cpu_cap": cpu_cap}
    return run_dir, overrides, key


def _finished(run_dir: Path, key: dict) -> bool:
    done = run_dir / "bench_done.json"  # written after a finished run: its exact settings
    return done.is_file() and json.loads(done.read_text()) == key


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def run_one(name: str, seed: int, args, target: float | None = None, cpu_cap: float | None = None) -> list[dict]:
    """Train `name` on `seed` in this process (or keep the finished run of the same settings); its metrics rows."""
    from mmrl.config import load_config, recipe_module
    from mmrl.run.trackers import callbacks_active

    algo = ALGOS[name]
    run_dir, overrides, key = _run_key(name, seed, args, target, cpu_cap)
    done = run_dir / "bench_done.json"
    if not _finished(run_dir, key):
        cfg = load_config(REPO / "configs/diffusion" / algo.config, overrides)
        clocks = Clocks()
        undo = _instrument(clocks)
        stop = StopAt(target, cpu_cap)
        try:
            with callbacks_active([stop]):
                recipe_module(cfg.algorithm).train(cfg)
        finally:
            undo()
        done.write_text(json.dumps(key))
    rows = _rows(run_dir)
    last = rows[-1]
    print(f"[compare] seed {seed} {name}: {len(rows)} steps, {last['bench/cpu_s']:.1f} CPU s, "
          f"{last['bench/wall_s']:.1f} wall s (training only)", flush=True)
    return rows


def _run_in_subprocess(name: str, seed: int, args, target: float | None, cpu_cap: float | None) -> list[dict]:
    """run_one in a fresh process (its own clocks and memory); its output in <run dir>/bench.log."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", name, "--seeds", str(seed), "--model", args.model,
           "--steps", str(args.steps), "--cap", str(args.cap), "--reward", args.reward, "--out", str(args.out)]
    cmd += (["--target", repr(target)] if target is not None else []) + (
        ["--cpu-cap", repr(cpu_cap)] if cpu_cap is not None else []) + (["--quick"] if args.quick else [])
    run_dir, _, key = _run_key(name, seed, args, target, cpu_cap)
    if _finished(run_dir, key):  # kept: no process to start
        return _rows(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "bench.log", "w") as log:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, check=False)
    print(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else f"[compare] seed {seed} {name}: no output",
          flush=True)
    if proc.returncode:
        raise SystemExit(f"[compare] seed {seed} {name} failed (exit {proc.returncode}): see {run_dir / 'bench.log'}")
    return _rows(run_dir)


def _stops(flow_rows: list[dict]) -> tuple[float, float]:
    """(target, CPU cap) of the other algorithms in a seed: Flow-GRPO's last two evaluations, its whole CPU time."""
    return targets_of({0: flow_rows})[0], flow_rows[-1]["bench/cpu_s"]


def run_all(names: list[str], args) -> dict[str, dict[int, list[dict]]]:
    """Flow-GRPO in every seed, then the others against its targets; `--jobs` runs at once."""
    runs: dict[str, dict[int, list[dict]]] = {n: {} for n in names}
    others = sorted((n for n in names if n != "flow_grpo"), key=QUEUE_ORDER.index)
    if args.jobs <= 1:
        for seed in args.seeds:
            runs["flow_grpo"][seed] = run_one("flow_grpo", seed, args)
            for n in others:
                runs[n][seed] = run_one(n, seed, args, *_stops(runs["flow_grpo"][seed]))
        return runs
    with ThreadPoolExecutor(args.jobs) as pool:
        flows = {s: pool.submit(_run_in_subprocess, "flow_grpo", s, args, None, None) for s in args.seeds}
        runs["flow_grpo"] = {s: f.result() for s, f in flows.items()}
        jobs = {(n, s): pool.submit(_run_in_subprocess, n, s, args, *_stops(runs["flow_grpo"][s]))
                for n in others for s in args.seeds}
        for (n, s), f in jobs.items():
            runs[n][s] = f.result()
    return runs


def _fmt(ms: tuple[float, float], digits: int = 2, suffix: str = "") -> str:
    m, s = ms
    return "-" if math.isnan(m) else f"{m:.{digits}f} ± {s:.{digits}f}{suffix}"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(REPO / "assets/tiny_sd3_shapes"))
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="Flow-GRPO's steps; its final level is the target")
    ap.add_argument("--cap", type=int, default=4, help="the others stop after --steps x this many steps at most")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--reward", default="jpeg_compressibility")
    ap.add_argument("--out", default=str(REPO / "runs/compare_diffusion"))
    ap.add_argument("--only", nargs="*", default=None, help=f"subset of {' '.join(ALGOS)} (flow_grpo always runs)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own process with one thread")
    ap.add_argument("--quick", action="store_true",
                    help=f"a smoke pass: {QUICK['steps']} steps, evaluation every step, 2 prompts x 4 images, "
                         f"3 held-out prompts, algorithms {' '.join(QUICK['algos'])}")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a worker: one algorithm, one seed
    ap.add_argument("--target", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cpu-cap", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.only = QUICK["steps"], args.only or QUICK["algos"]
    names = [n for n in ALGOS if not args.only or n in args.only or n == "flow_grpo"]
    unknown = sorted(set(args.only or []) - set(ALGOS))
    if unknown:
        raise SystemExit(f"--only: unknown algorithm(s) {unknown}; valid: {list(ALGOS)}")
    if len(args.seeds) < 1 or args.steps < 2 or args.cap < 1:
        raise SystemExit("--seeds: at least one; --steps: at least 2 (two evaluations); --cap: at least 1")
    torch.set_num_threads(1)
    os.environ.setdefault("MMRL_NO_PROGRESS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.one:
        return {"rows": run_one(args.one, args.seeds[0], args, args.target, args.cpu_cap)}

    out = Path(args.out)
    n_eval = 3 if args.quick else 26
    base = {s: _baseline_eval(args.model, args.reward, s, n_eval) for s in args.seeds}  # the eval noise depends on the seed
    print(f"[compare] starting model, held-out ODE eval reward per seed: "
          f"{ {s: round(v, 4) for s, v in base.items()} }", flush=True)
    runs = run_all(names, args)
    summary = summarise(runs, base)
    _print_table(summary, names, args, base)
    _plot(summary, names, out, args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return summary


def _print_table(summary: dict, names: list[str], args, base: dict) -> None:
    targets = ", ".join(f"{s}: {t:.4f}" for s, t in summary["targets"].items())
    print(f"\nreward = {args.reward}; 4 prompts x 8 images per step; seeds {args.seeds}; held-out ODE eval (26 prompts, "
          f"64x64); starting model {statistics.fmean(base.values()):.4f}; target per seed = Flow-GRPO's last two "
          f"evals after {args.steps} steps: {targets}\n")
    hdr = ["algorithm", "reached", "CPU s to target", "speed-up (CPU)", "speed-up (T-evals)", "speed-up (wall)",
           "steps to target", "grid bound", "held-out at stop", "CPU s/step", "T-evals/step", "paper's claim",
           "claimed x"]
    print("| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr))
    for n in names:
        r = summary[n]
        lower = ">= " if r["first_eval"] else ""
        bound = "-" if r["grid_bound_max"] is None else f"{100 * r['grid_bound_max']:.0f}%"
        row = [ALGOS[n].label if n in ALGOS else n, r["reached_cpu_s"], _fmt(r["ttt_cpu_s"], 1),
               lower + _fmt(r["speedup_cpu_s"], 2, "x"), lower + _fmt(r["speedup_train_evals"], 2, "x"),
               lower + _fmt(r["speedup_wall_s"], 2, "x"), _fmt(r["ttt_step"], 1), bound, _fmt(r["eval_final"], 3),
               _fmt(r["cpu_s_per_step"], 2), f"{r['evals_per_step'][0]:.0f}",
               ALGOS[n].claim if n in ALGOS else "-", ALGOS[n].claim_x if n in ALGOS else "-"]
        print("| " + " | ".join(str(c) for c in row) + " |")
    print("\nmean ± sample std over the seeds (speed-ups: over the seeds where both runs reached the target); grid "
          "bound: the widest evaluation interval around a crossing, as a share of its time to target; >=: a seed "
          "crossed before its first evaluation (the speed-up is a lower bound)")


def _plot(summary: dict, names: list[str], out: Path, args) -> None:
    """One panel per algorithm: its held-out reward vs training CPU seconds, one line per seed (colour = seed), over
    Flow-GRPO's seeds in grey; dotted: the seeds' targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), dpi=100, sharex=True, sharey=True,
                             squeeze=False)
    seeds = list(summary["flow_grpo"]["seeds"])
    lo = min(summary["baseline_eval"].values()) - 0.1
    hi = max(summary["targets"].values()) + 0.1

    def curve(name, seed):
        v = summary[name]["seeds"][seed]
        return [0.0] + [c for _, c, _ in v["curve"]], [summary["baseline_eval"][seed]] + [e for _, _, e in v["curve"]]

    for ax, n in zip(axes.flat, names):
        for seed in seeds:
            ax.plot(*curve("flow_grpo", seed), color="0.75", lw=0.8)
        for j, seed in enumerate(summary[n]["seeds"]):
            ax.plot(*curve(n, seed), "-o", ms=1.2, lw=1.0, color=f"C{j % 10}", label=f"seed {seed}")
        for t in summary["targets"].values():
            ax.axhline(t, color="0.4", ls=":", lw=0.7)
        r = summary[n]
        ax.set_title(f"{ALGOS[n].label if n in ALGOS else n}: {r['reached_cpu_s']} reached", fontsize=9)
        ax.set_ylim(lo, hi)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("training CPU s (1 thread)", fontsize=8)
    fig.supylabel(f"held-out ODE reward ({args.reward})", fontsize=9)
    axes.flat[0].legend(fontsize=6)
    fig.suptitle("tiny SD3 shapes: held-out ODE reward vs training CPU time, one line per seed "
                 "(grey: Flow-GRPO; dotted: each seed's target)", fontsize=10)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "compare_diffusion_algos.png")
    plt.close(fig)
    print(f"plot: {out / 'compare_diffusion_algos.png'}")


if __name__ == "__main__":
    main()
