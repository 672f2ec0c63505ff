"""Diffusion RL algorithms on one tiny task: time to a target held-out reward, as a ratio to Flow-GRPO, over seeds.

Same model (the data-trained tiny SD3 in assets/tiny_sd3_shapes), prompts, reward, seeds, sample budget per step
(4 prompts x 8 images from an 8-step sampler) and number of steps; everything else is each recipe's shipped tiny
config (flow_grpo_tiny, mixgrpo_tiny, mixgrpo_flash_tiny, dgpo_tiny, nft_tiny, dpo_tiny_online, awm_tiny.yaml;
`flow_grpo_lowres` = flow_grpo_tiny trained at 32x32 and evaluated at 64x64). Every run is evaluated the same way, and
often: ODE sampling of the 26 held-out prompts of assets/prompts/shapes_eval.txt at 64x64 with fixed noise every
`--eval-every` steps (evaluation forks the RNG, so it changes no training number).

Clocks per run, all excluding model loading and evaluation: CPU seconds of this process (`time.process_time`, one
torch thread: robust to other jobs on a shared machine, unlike wall time, which is reported too) and transformer
evaluations (sample rows through the transformer, rollout and training passes alike).

Time to target: the target of seed s is what Flow-GRPO reaches in the budget in that seed (the mean of its last two
held-out evaluations); a run's time to target is where its held-out curve (starting model at 0, then every
evaluation) first reaches the target, linearly interpolated between evaluations; not reaching it within the budget is
reported as such. The speed-up of an algorithm in seed s = Flow-GRPO's time to target / its own, summarised as mean
and sample std over the seeds where both reached it.

    .venv/bin/python benchmarks/compare_diffusion_algos.py [--steps 60] [--seeds 0 1 2] [--eval-every 3]
    .venv/bin/python benchmarks/compare_diffusion_algos.py --reduced      # the `make bench` pass (see --help)
    (... --seeds 1 & ... --seeds 2 &; then ... --seeds 0 1 2 --reuse: seeds in parallel, one table)

Not a test: the numbers are what this machine measured, whatever they are.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# name -> (shipped tiny config, extra overrides, the published speed claim it can be set beside)
ALGOS: dict[str, tuple[str, list[str], str]] = {
    "flow_grpo": ("flow_grpo_tiny.yaml", [], "baseline"),
    "mixgrpo": ("mixgrpo_tiny.yaml", [], "~50% less time than DanceGRPO (arXiv 2507.21802)"),
    "mixgrpo_flash": ("mixgrpo_flash_tiny.yaml", [], "71% less time than DanceGRPO (arXiv 2507.21802)"),
    "dgpo": ("dgpo_tiny.yaml", [], "~20x faster than Flow-GRPO (arXiv 2510.08425)"),
    "flow_grpo_lowres": ("flow_grpo_tiny.yaml", ["rollout.height=32", "rollout.width=32"], "-"),
    "nft": ("nft_tiny.yaml", [], "-"),
    "awm": ("awm_tiny.yaml", [], "-"),
    "dpo_online": ("dpo_tiny_online.yaml", [], "-"),
}
REDUCED = dict(steps=21, eval_every=3, algos=["flow_grpo", "mixgrpo", "mixgrpo_flash", "dgpo", "flow_grpo_lowres"])
# --quick (run by tests/test_benchmarks.py): the whole pipeline on a small budget; its numbers mean nothing
QUICK = dict(steps=2, eval_every=1, algos=REDUCED["algos"],
             overrides=["rollout.prompts_per_step=2", "rollout.group_size=4", "log.eval_max_prompts=3"])


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


def time_to_target(curve: list[tuple[float, float]], target: float) -> float | None:
    """First clock at which the piecewise-linear curve [(clock, value), ...] reaches `target` (None: never)."""
    for i, (c, v) in enumerate(curve):
        if v >= target:
            if i == 0:
                return c
            c0, v0 = curve[i - 1]
            return c0 + (target - v0) / (v - v0) * (c - c0)
    return None


def mean_std(values: list[float]) -> tuple[float, float]:
    """(mean, sample std; 0 for one value); (nan, nan) for none."""
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(runs: dict[str, dict[int, list[dict]]], base: dict[int, float]) -> dict:
    """Per algorithm and seed: curves (from the starting model's evaluation `base[seed]` at clock 0), time and
    transformer evaluations to the seed's Flow-GRPO target, speed-ups; then mean and std over the seeds."""
    out: dict = {"baseline_eval": base, "targets": {}}
    for seed, rows in runs["flow_grpo"].items():
        ev = [r["eval/reward/mean"] for r in rows if r.get("eval/reward/mean") is not None]
        out["targets"][seed] = statistics.fmean(ev[-2:])
    for name, per_seed in runs.items():
        res: dict = {"seeds": {}}
        for seed, rows in per_seed.items():
            evals = [r for r in rows if r.get("eval/reward/mean") is not None]
            curves = {k: [(0.0, base[seed])] + [(r[f"bench/{k}"], r["eval/reward/mean"]) for r in evals]
                      for k in ("cpu_s", "wall_s", "train_evals")}
            target = out["targets"].get(seed)
            res["seeds"][seed] = {
                "target": target, "eval_final": evals[-1]["eval/reward/mean"] if evals else None,
                "cpu_s": rows[-1]["bench/cpu_s"], "wall_s": rows[-1]["bench/wall_s"],
                "train_evals": rows[-1]["bench/train_evals"],
                "reward_first5": statistics.fmean(r["reward/mean"] for r in rows[:5]),
                "reward_last5": statistics.fmean(r["reward/mean"] for r in rows[-5:]),
                **{f"ttt_{k}": (time_to_target(c, target) if target is not None else None) for k, c in curves.items()},
                "curve": [(r["step"], r["bench/cpu_s"], r["eval/reward/mean"]) for r in evals]}
        out[name] = res
    for name in runs:
        res = out[name]
        for k in ("cpu_s", "wall_s", "train_evals"):
            got = {s: v[f"ttt_{k}"] for s, v in res["seeds"].items() if v[f"ttt_{k}"] is not None}
            res[f"ttt_{k}"] = mean_std(list(got.values()))
            ratios = [out["flow_grpo"]["seeds"][s][f"ttt_{k}"] / t for s, t in got.items()
                      if s in out["flow_grpo"]["seeds"] and out["flow_grpo"]["seeds"][s][f"ttt_{k}"] and t > 0]
            res[f"speedup_{k}"] = mean_std(ratios)
            res[f"reached_{k}"] = f"{len(got)}/{len(res['seeds'])}"
        res["eval_final"] = mean_std([v["eval_final"] for v in res["seeds"].values() if v["eval_final"] is not None])
        res["cpu_s_per_step"] = mean_std([v["cpu_s"] / len(runs[name][s]) for s, v in res["seeds"].items()])
        res["evals_per_step"] = mean_std([v["train_evals"] / len(runs[name][s]) for s, v in res["seeds"].items()])
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
        self.evals = 0
        self.in_eval = False
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


def _fmt(ms: tuple[float, float], digits: int = 2, suffix: str = "") -> str:
    m, s = ms
    return "-" if m != m else f"{m:.{digits}f} ± {s:.{digits}f}{suffix}"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(REPO / "assets/tiny_sd3_shapes"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--eval-every", type=int, default=3, help="held-out evaluation every this many steps")
    ap.add_argument("--reward", default="jpeg_compressibility")
    ap.add_argument("--out", default=str(REPO / "runs/compare_diffusion"))
    ap.add_argument("--only", nargs="*", default=None, help=f"subset of {' '.join(ALGOS)} (flow_grpo always runs)")
    ap.add_argument("--reduced", action="store_true",
                    help=f"the make-bench pass: {REDUCED['steps']} steps, evaluation every {REDUCED['eval_every']}, "
                         f"algorithms {' '.join(REDUCED['algos'])} (the seeds as given)")
    ap.add_argument("--quick", action="store_true",
                    help=f"a smoke pass: {QUICK['steps']} steps, evaluation every step, 2 prompts x 4 images, "
                         f"3 held-out prompts, algorithms {' '.join(QUICK['algos'])}")
    ap.add_argument("--reuse", action="store_true",
                    help="keep runs already finished in --out with the same settings (run seeds in parallel "
                         "processes, then once more with all seeds and --reuse to summarise)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.reduced:
        args.steps, args.eval_every, args.only = REDUCED["steps"], REDUCED["eval_every"], REDUCED["algos"]
    if args.quick:
        args.steps, args.eval_every, args.only = QUICK["steps"], QUICK["eval_every"], QUICK["algos"]
    quick = QUICK["overrides"] if args.quick else []
    names = [n for n in ALGOS if not args.only or n in args.only or n == "flow_grpo"]
    unknown = sorted(set(args.only or []) - set(ALGOS))
    if unknown:
        raise SystemExit(f"--only: unknown algorithm(s) {unknown}; valid: {list(ALGOS)}")
    if len(args.seeds) < 1 or args.steps < 2 * args.eval_every:
        raise SystemExit("--seeds: at least one; --steps: at least two evaluations (2 x --eval-every)")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MMRL_NO_PROGRESS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from mmrl.config import load_config, recipe_module

    out = Path(args.out)
    n_eval = 3 if args.quick else 26
    base = {s: _baseline_eval(args.model, args.reward, s, n_eval) for s in args.seeds}  # the eval noise depends on the seed
    print(f"[compare] starting model, held-out ODE eval reward per seed: "
          f"{ {s: round(v, 4) for s, v in base.items()} }", flush=True)
    clocks = Clocks()
    undo = _instrument(clocks)
    runs: dict[str, dict[int, list[dict]]] = {n: {} for n in names}
    try:
        for seed in args.seeds:  # seeds outer, algorithms inner: a change of machine load falls on all of them
            for name in names:
                path, extra, _ = ALGOS[name]
                run_dir = out / f"{name}_s{seed}"
                overrides = _overrides(args.model, args.steps, args.reward, run_dir, seed, args.eval_every) + quick + extra
                done = run_dir / "bench_done.json"  # written after a finished run: its exact config file + overrides
                key = {"config": path, "overrides": overrides}
                if not (args.reuse and done.is_file() and json.loads(done.read_text()) == key):
                    cfg = load_config(REPO / "configs/diffusion" / path, overrides)
                    clocks.reset()
                    recipe_module(cfg.algorithm).train(cfg)
                    done.write_text(json.dumps(key))
                runs[name][seed] = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
                last = runs[name][seed][-1]
                print(f"[compare] seed {seed} {name}: {len(runs[name][seed])} steps, {last['bench/cpu_s']:.1f} CPU s, "
                      f"{last['bench/wall_s']:.1f} wall s (training only)", flush=True)
    finally:
        undo()
    summary = summarise(runs, base)
    _print_table(summary, names, args, base)
    _plot(summary, names, out, args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return summary


def _print_table(summary: dict, names: list[str], args, base: dict) -> None:
    targets = ", ".join(f"{s}: {t:.4f}" for s, t in summary["targets"].items())
    print(f"\nreward = {args.reward}; {args.steps} steps x 4 prompts x 8 images; seeds {args.seeds}; held-out ODE eval "
          f"(26 prompts, 64x64) every {args.eval_every} steps; starting model "
          f"{statistics.fmean(base.values()):.4f}; target per seed = Flow-GRPO's last two evals: {targets}\n")
    hdr = ["algorithm", "reached", "CPU s to target", "speed-up (CPU)", "speed-up (T-evals)", "speed-up (wall)",
           "final eval", "CPU s/step", "T-evals/step", "published claim"]
    rows = []
    for n in names:
        r = summary[n]
        rows.append([n, r["reached_cpu_s"], _fmt(r["ttt_cpu_s"], 1), _fmt(r["speedup_cpu_s"], 2, "x"),
                     _fmt(r["speedup_train_evals"], 2, "x"), _fmt(r["speedup_wall_s"], 2, "x"), _fmt(r["eval_final"], 3),
                     _fmt(r["cpu_s_per_step"], 2), f"{r['evals_per_step'][0]:.0f}", ALGOS[n][2]])
    print("| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    print("\nmean ± sample std over the seeds (speed-ups: over the seeds where both runs reached the target)")


def _plot(summary: dict, names: list[str], out: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for i, n in enumerate(names):
        for j, (seed, v) in enumerate(summary[n]["seeds"].items()):
            xs = [0.0] + [c for _, c, _ in v["curve"]]
            ys = [summary["baseline_eval"][seed]] + [e for _, _, e in v["curve"]]
            ax.plot(xs, ys, "-o", ms=2, lw=1.2, color=f"C{i}", alpha=0.8, label=n if j == 0 else None)
    for t in summary["targets"].values():
        ax.axhline(t, color="gray", ls=":", lw=1)
    ax.set_xlabel("training CPU seconds (1 thread; evaluation and loading excluded)")
    ax.set_ylabel(f"held-out ODE reward ({args.reward})")
    ax.set_title("tiny SD3 shapes: held-out reward vs training cost, one line per seed (dotted: targets)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "compare_diffusion_algos.png")
    print(f"plot: {out / 'compare_diffusion_algos.png'}")


if __name__ == "__main__":
    main()
