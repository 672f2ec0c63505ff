"""What one RL step costs each diffusion algorithm: on the benchmark's task, and at its paper's sampler and CFG.

compare_diffusion_algos.py measures time to a target on a task without classifier-free guidance and with 8 sampler
steps. The papers' speed claims are against Flow-GRPO's published recipe, which samples 10 steps with CFG 4.5 and
trains every step with CFG (both branches in one doubled batch) plus a reference pass with CFG, while DGPO trains
and references without CFG and DiffusionNFT / AWM are CFG-free throughout. This script runs each algorithm for a
few steps in both settings and reports per-step CPU seconds and transformer evaluations (sample rows through the
transformer), so a speed-up can be split into "fewer steps to the target" (the algorithm, measured on the task) and
"cheaper steps" (per-step cost, which depends on the sampler and CFG):

    composed = (Flow-GRPO's steps to target / the algorithm's, from compare_diffusion_algos' summary.json)
               x (Flow-GRPO's CPU s per step / the algorithm's, at the published settings)

The composed column is a product of two measurements, not a measurement of a run: it says what the task's
step-count gain would be worth at the published per-step costs. Same model, prompts, reward and samples per step
(4 prompts x 8 images) as compare_diffusion_algos; every run is 3 steps (the first one's cost is left out).

    .venv/bin/python benchmarks/algo_step_cost.py [--summary runs/compare_diffusion/<stamp>/summary.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_diffusion_algos import ALGOS, QUICK, REPO, Clocks, _instrument, _overrides

# the published per-step settings that differ from the task's (10 sampler steps for every row, as Flow-GRPO and DGPO;
# sources: docs/faster-diffusion.md "Settings")
PUBLISHED: dict[str, list[str]] = {
    "flow_grpo": ["rollout.guidance_scale=4.5"],                     # flow_grpo config/grpo.py: CFG 4.5, train.cfg
    "flow_grpo_fast": ["rollout.window_range=[0,5]"],                # *_fast_nocfg: no CFG, window in the first half
    "cps": ["rollout.guidance_scale=4.5"],
    "mixgrpo": ["rollout.window_range=[0,8]"],                       # FLUX.1-dev, guidance-distilled: no CFG
    "mixgrpo_flash": ["rollout.window_range=[0,8]"],
    "dgpo": ["rollout.guidance_scale=4.5", "algo.trunc_steps=6"],    # CFG rollouts, training and reference without
    "dgpo_emaref": ["algo.trunc_steps=6"],                           # dgpo_wocfg_emaref.py: CFG-free
    "nft": [],                                                       # CFG-free
    "awm": [],                                                       # CFG-free
    "dpo_online": ["rollout.guidance_scale=4.5"],
    "flow_grpo_lowres": ["rollout.guidance_scale=4.5"],
}
STEPS = 3


def step_cost(name: str, published: bool, args) -> dict:
    """CPU s and transformer evaluations per step of `name` over steps 2..STEPS (step 1 warms up)."""
    from mmrl.config import load_config, recipe_module

    algo = ALGOS[name]
    run_dir = Path(args.out) / f"{name}_{'published' if published else 'task'}"
    overrides = (_overrides(args.model, STEPS, args.reward, run_dir, args.seed, 1) + algo.overrides
                 + (["rollout.num_steps=10"] + PUBLISHED[name] if published else []) + ["log.eval_every=0"]
                 + (QUICK["overrides"] if args.quick else []))
    cfg = load_config(REPO / "configs/diffusion" / algo.config, overrides)
    undo = _instrument(Clocks())
    try:
        recipe_module(cfg.algorithm).train(cfg)
    finally:
        undo()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    n = len(rows) - 1
    return {"cpu_s": (rows[-1]["bench/cpu_s"] - rows[0]["bench/cpu_s"]) / n,
            "evals": (rows[-1]["bench/train_evals"] - rows[0]["bench/train_evals"]) / n}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(REPO / "assets/tiny_sd3_shapes"))
    ap.add_argument("--reward", default="jpeg_compressibility")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", default=None, help=f"subset of {' '.join(ALGOS)} (flow_grpo always runs)")
    ap.add_argument("--summary", default=None, help="compare_diffusion_algos' summary.json: adds the composed column")
    ap.add_argument("--out", default=str(REPO / "runs/algo_step_cost"))
    ap.add_argument("--quick", action="store_true", help="2 prompts x 4 images per step (the numbers mean little)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.only or []) - set(ALGOS))
    if unknown:
        raise SystemExit(f"--only: unknown algorithm(s) {unknown}; valid: {list(ALGOS)}")
    names = [n for n in ALGOS if not args.only or n in args.only or n == "flow_grpo"]
    torch.set_num_threads(1)
    os.environ.setdefault("MMRL_NO_PROGRESS", "1")
    summary = json.loads(Path(args.summary).read_text()) if args.summary else None
    cost = {n: {"task": step_cost(n, False, args), "published": step_cost(n, True, args)} for n in names}
    base = cost["flow_grpo"]
    hdr = ["algorithm", "T-evals/step (task)", "CPU s/step (task)", "T-evals/step (published)",
           "CPU s/step (published)", "cheaper steps (published, CPU)", "fewer steps (task)", "composed",
           "paper's claim"]
    print("| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr))
    for n in names:
        c = cost[n]
        c["per_step_x"] = base["published"]["cpu_s"] / c["published"]["cpu_s"]
        steps_x = None
        if summary and n in summary and not math.isnan(summary[n]["speedup_step"][0]):
            steps_x = summary[n]["speedup_step"][0]
        c["steps_x"], c["composed_x"] = steps_x, None if steps_x is None else steps_x * c["per_step_x"]
        print("| " + " | ".join([
            ALGOS[n].label, f"{c['task']['evals']:.0f}", f"{c['task']['cpu_s']:.2f}", f"{c['published']['evals']:.0f}",
            f"{c['published']['cpu_s']:.2f}", f"{c['per_step_x']:.2f}x", "-" if steps_x is None else f"{steps_x:.2f}x",
            "-" if steps_x is None else f"{c['composed_x']:.1f}x", ALGOS[n].claim]) + " |")
    print(f"\nper step: mean of steps 2-{STEPS}; published: 10 sampler steps and each paper's CFG use (PUBLISHED); "
          "fewer steps: mean over seeds of Flow-GRPO's steps to target / the algorithm's (compare_diffusion_algos)")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "cost.json").write_text(json.dumps(cost, indent=1) + "\n")
    return cost


if __name__ == "__main__":
    main()
