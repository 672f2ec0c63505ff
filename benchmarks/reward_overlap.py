"""Rollout + reward with the reward scored in a worker thread while the next micro-batch is sampled
(`reward.score_while_sampling`, as flow_grpo's executor) against the synchronous path, on a slow reward (the real PP-OCRv4
OCR reward) and the tiny shapes SD3. Interleaved in one process (min / median / max); the rewards of both paths
are checked to be identical on every repeat.

    python benchmarks/reward_overlap.py --threads 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved, machine, speedup  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--micro", type=int, default=4, help="rollout micro-batch (images per chunk scored at once)")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--ocr-threads", type=int, default=1,
                    help="onnxruntime intra-op threads of the OCR reward (1: the rollout keeps the other core, as a "
                         "GPU rollout leaves the CPU to the reward; -1: onnxruntime's default, all cores)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from mmrl.diffusion.models import load_flow_model
    from mmrl.diffusion.sampling import sample_groups
    from mmrl.diffusion.scoring import AsyncRewardScorer, load_reward_fn

    model = load_flow_model(REPO / "assets" / "tiny_sd3_shapes", "cpu", torch.float32)
    engine = {"intra_op_num_threads": args.ocr_threads, "inter_op_num_threads": 1} if args.ocr_threads > 0 else {}
    reward = load_reward_fn({"ocr": {"weight": 1.0, "engine_kwargs": engine}}, "cpu")
    prompts = [f'a sign that says "HELLO {i}"' for i in range(args.prompts)]
    embeds = model.encode_prompts(prompts)
    rows = [p for p in prompts for _ in range(args.group)]
    kw = dict(num_steps=8, height=args.size, width=args.size, guidance_scale=1.0, noise_level=0.7,
              batch_size=args.micro)
    results: dict[str, list] = {"synchronous": [], "async": []}

    def sync():
        traj = sample_groups(model, embeds, args.group, generator=torch.Generator().manual_seed(0), **kw)
        results["synchronous"].append(reward(images=traj.images, prompts=rows, metadata=[{}] * len(rows)).scores)

    def overlapped():
        scorer = AsyncRewardScorer(reward)
        sample_groups(model, embeds, args.group, generator=torch.Generator().manual_seed(0),
                      on_images=lambda lo, hi, im: scorer.submit(im, rows[lo:hi], [{}] * (hi - lo)), **kw)
        results["async"].append(scorer.output().scores)
        scorer.close()

    t = interleaved({"synchronous": sync, "async": overlapped}, repeats=args.repeats, warmup=1)
    same = all(torch.equal(a, b) for a, b in zip(results["synchronous"], results["async"]))
    n = args.prompts * args.group
    print(f"# Reward overlap: rollout + OCR reward of {n} images ({args.prompts} prompts x {args.group}, "
          f"{args.size}px, micro-batch {args.micro}, OCR threads {args.ocr_threads}); {machine(args.threads)}")
    print("| path | seconds per step (min / median / max) |")
    print("|---|---|")
    for name, s in t.items():
        print(f"| {name} | {s.fmt()} |")
    print(f"\nspeed-up of the median: {speedup(t['synchronous'], t['async'])}; rewards identical on every repeat: "
          f"{same}")
    if not same:
        raise SystemExit("async rewards differ from the synchronous path")


if __name__ == "__main__":
    main()
