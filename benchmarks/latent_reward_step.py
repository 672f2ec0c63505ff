"""Flow-GRPO step time with a latent reward: the VAE decode skipped (as shipped) vs done anyway, on the tiny SD3.

    .venv/bin/python benchmarks/latent_reward_step.py [--rounds 4] [--threads 1] [config overrides]

One `mmrl.diffusion.flow_grpo.train` run on the tiny SD3 (`mmrl.tiny.build_tiny_sd3`, 64 px, 4 prompts x 4 samples,
8 sampling steps, CFG 4.5: the tiny row of flow_grpo_step.py) with `reward.components: {dina_lrm: 1.0}` on the
tiny DiNa-LRM (`mmrl.tiny.build_tiny_dina_lrm`). Every step after the first two (one warm-up step of each variant)
is one repeat of one variant: `skip decode` (the shipped rollout: the reward gets the final latents, nothing is
decoded) or `decode` (`mmrl.rewards.latent.needs_pixels` patched to say yes for that step: the rollout decodes its
16 images as it does for a pixel reward, then the same latent reward scores the same latents). The variants
alternate in rounds whose order rotates (skip decode, decode / decode, skip decode / ...: `_timing.interleaved`'s
order), so machine-load changes fall on both. Reports `time/step_s` and `time/rollout_s` per variant as
min / median / max over `--rounds` steps each, and the speed-up of the medians. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from _timing import Spread, machine, speedup

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MMRL_NO_PROGRESS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS = ("skip decode", "decode")


def schedule(rounds: int) -> list[str]:
    """The variant of every step: one warm-up step of each, then `rounds` rotating rounds."""
    order = list(VARIANTS)
    for r in range(rounds):
        k = r % len(VARIANTS)
        order += list(VARIANTS[k:] + VARIANTS[:k])
    return order


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="measured steps per variant (default 4)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import mmrl.rewards.latent as latent
    from mmrl.config import load_config
    from mmrl.diffusion import flow_grpo
    from mmrl.tiny import build_tiny_dina_lrm, build_tiny_sd3

    steps = schedule(args.rounds)
    shipped, calls = latent.needs_pixels, []

    def needs_pixels(reward):  # one call per rollout: the step's variant
        calls.append(steps[len(calls)])
        return True if calls[-1] == "decode" else shipped(reward)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        policy, dina = build_tiny_sd3(root / "sd3"), build_tiny_dina_lrm(root / "dina")
        cfg = load_config({
            "algorithm": "flow_grpo", "output_dir": str(root / "run"), "seed": 0, "device": "cpu",
            "model": {"path": str(policy), "lora": {"rank": 8, "alpha": 16}},
            "data": {"train_prompts": str(REPO / "assets/prompts/shapes_train.txt")},
            "rollout": {"prompts_per_step": 4, "height": 64, "width": 64, "num_steps": 8, "group_size": 4,
                        "guidance_scale": 4.5},
            "update": {"micro_batch_size": 8, "mini_batch_size": 8},
            "algo": {"kl": {"coef": 0.04}, "ema": True},
            "train": {"max_steps": len(steps), "save_every": 0, "resume": "never"},
            "reward": {"components": {"dina_lrm": {"weight": 1.0, "weights": str(dina)}}},
            "log": {"sample_every": 0},
        }, list(args.overrides))
        latent.needs_pixels = needs_pixels
        try:
            flow_grpo.train(cfg)
        finally:
            latent.needs_pixels = shipped
        rows = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    if calls != steps or len(rows) != len(steps):
        raise SystemExit(f"expected {len(steps)} steps, got {len(rows)} rows and {len(calls)} rollouts")
    measured = list(zip(steps, rows))[len(VARIANTS):]
    table = {v: {k: Spread(tuple(r[k] for s, r in measured if s == v)) for k in ("time/step_s", "time/rollout_s")}
             for v in VARIANTS}
    print(f"# Flow-GRPO step with a latent reward (dina_lrm), tiny SD3, {machine(args.threads)}\n")
    print("| rollout | step s (min / median / max) | rollout s (min / median / max) |")
    print("|---|---|---|")
    for v in VARIANTS:
        print(f"| {v} | {table[v]['time/step_s'].fmt(digits=3)} | {table[v]['time/rollout_s'].fmt(digits=3)} |")
    fast = {k: speedup(table["decode"][k], table["skip decode"][k]) for k in ("time/step_s", "time/rollout_s")}
    print(f"\nskipping the decode: step {fast['time/step_s']} faster, rollout {fast['time/rollout_s']} faster "
          f"({args.rounds} steps of each variant, interleaved)")
    print("command: " + " ".join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
