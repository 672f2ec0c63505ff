"""Flow-GRPO with a bf16 rollout sampler: what the rollout/trainer mismatch does, and what recomputing pi_old and
rollout correction (TIS / MIS) change. One tiny task (the shapes-pretrained tiny SD3, JPEG incompressibility,
configs/diffusion/flow_grpo_tiny.yaml), the same seed and steps for every variant:

  fp32             rollout and trainer in fp32 (the shipped config)
  bf16/rollout     rollout.precision=bf16, PPO ratio against the rollout's bf16 log-probs (Flow-GRPO as is)
  bf16/recompute   + algo.old_logprobs=recompute (pi_old from a no-grad fp32 forward before the update)
  bf16/TIS+MIS     + algo.rollout_correction: sequence-level TIS (cap 2) and step-level MIS ([0.5, 2])

Reported per variant: rollout reward of the first and last 5 steps, held-out ODE reward at the end (26 prompts,
fixed noise), the mean PPO clip fraction, the largest |trainer - old| log-prob gap before the first update
(diag/logprob_drift: the ratio's distance from 1 at the start), the mean rollout/trainer KL (k3) and the
transformer evaluations per step (the cost of the recompute: counted, not timed; the variants run one after the
other, so wall-clock times would not be comparable). `--clip-range` sets algo.clip_range for all variants (the tiny config has 1e-3; Flow-GRPO
publishes 1e-4). Prints a markdown table and the command.

    .venv/bin/python benchmarks/rollout_precision.py [--steps 30] [--clip-range 1e-4] [--out runs/rollout_precision]

Not a test: the numbers are what this machine measured, whatever they are.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MMRL_NO_PROGRESS", "1")
sys.path.insert(0, str(REPO))

VARIANTS = {
    "fp32": [],
    "bf16/rollout": ["rollout.precision=bf16"],
    "bf16/recompute": ["rollout.precision=bf16", "algo.old_logprobs=recompute"],
    "bf16/TIS+MIS": ["rollout.precision=bf16", "algo.old_logprobs=recompute",
                     "algo.rollout_correction.is_level=sequence", "algo.rollout_correction.is_threshold=2.0",
                     "algo.rollout_correction.rs_level=token", "algo.rollout_correction.rs_threshold=2.0"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--clip-range", type=float, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from mmrl.config import load_config
    from mmrl.diffusion.flow_grpo import train
    from mmrl.testing import metrics_rows

    out = Path(args.out or tempfile.mkdtemp(prefix="rollout_precision_"))
    shared = [f"model.path={REPO / 'assets/tiny_sd3_shapes'}", f"train.max_steps={args.steps}", "train.save_every=0",
              "train.resume=never", "log.sample_every=0", f"log.eval_every={args.steps}", "log.eval_max_prompts=26",
              f"data.train_prompts={REPO / 'assets/prompts/shapes_train.txt'}",
              f"data.eval_prompts={REPO / 'assets/prompts/shapes_eval.txt'}"]
    if args.clip_range is not None:
        shared.append(f"algo.clip_range={args.clip_range}")
    rows = []
    for name, extra in VARIANTS.items():
        run_dir = out / name.replace("/", "_").replace("+", "_")
        cfg = load_config(str(REPO / "configs/diffusion/flow_grpo_tiny.yaml"),
                          shared + extra + [f"output_dir={run_dir}"])
        train(cfg)
        m = metrics_rows(run_dir)
        mean = lambda k, rs=m: sum(r[k] for r in rs if r.get(k) is not None) / max(1, sum(  # noqa: E731
            r.get(k) is not None for r in rs))
        rows.append({
            "variant": name, "reward first 5": mean("reward/mean", m[:5]), "reward last 5": mean("reward/mean", m[-5:]),
            "held-out": m[-1].get("eval/reward/mean"), "clipfrac": mean("policy/clipfrac"),
            "max drift": max(r["diag/logprob_drift"] for r in m),
            "k3 rollout/trainer": mean("rollout/correction/k3_kl") if "rollout/correction/k3_kl" in m[0] else None,
            "transformer evals/step":  # steps 2..N-1 (step N also evaluates)
                (m[-2]["cost/transformer_evals"] - m[0]["cost/transformer_evals"]) / max(1, len(m) - 2)})
    print(f"\n`{' '.join(['.venv/bin/python', *sys.argv])}` ({args.steps} steps, clip_range "
          f"{args.clip_range if args.clip_range is not None else 'of the config (1e-3)'})\n")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(v if isinstance(v, str) else "-" if v is None else f"{v:.4g}" for v in r.values())
              + " |")
    (out / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
