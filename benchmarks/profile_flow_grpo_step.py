"""Where a Flow-GRPO step's time goes, by sampling: py-spy over `flow_grpo_step.py`, stacks folded into categories.

    .venv/bin/python benchmarks/profile_flow_grpo_step.py [--steps 12] [--rate 500] [--prompts 0] [--top 12]
    .venv/bin/python benchmarks/profile_flow_grpo_step.py --raw prof.txt      # fold an existing py-spy raw file

Runs `py-spy record -r RATE -f raw` (the `dev` extra installs py-spy) on `benchmarks/flow_grpo_step.py --models tiny
--steps N --decode-repeats 0 --threads 1` and keeps the samples taken inside a training step (a stack through one of
the step's parts: `sample_groups`, `PromptEmbedCache` / `encode_prompts`, `score_rollout`, `global_advantages`,
`train_on_rollout`). Each kept sample is put in the first category its stack matches: transformer forward (a frame
in diffusers' transformer_sd3 / transformer_flux), backward (autograd's `run_backward`), VAE decode
(`FlowModel.vae_decode`), text encoders (transformers' CLIP / T5 modelling), reward (`score_rollout`), else
framework, itself split by the innermost mmrl function of the stack. Prints a markdown table of shares of the step
samples (the first step, warm-up, is included; with --steps 12 it is a small part) and the command lines. A sampling
profile counts where the interpreter is, so the split differs from flow_grpo_step.py's hook timing by the module-call
overhead it puts on the side of the caller; the shares are what to compare.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the step's parts, by function name (py-spy writes methods as Class.method)
STEP_PARTS = {"sample_groups", "PromptEmbedCache.__call__", "encode_prompts", "score_rollout", "global_advantages",
              "train_on_rollout"}
# (category, substrings of a frame that put a sample in it), first match wins
CATEGORIES = (
    ("transformer forward", ("diffusers/models/transformers/transformer_sd3.py",
                             "diffusers/models/transformers/transformer_flux.py")),
    ("transformer backward", ("run_backward",)),
    ("VAE decode", ("FlowModel.vae_decode (",)),
    ("text encoders", ("transformers/models/clip/modeling_clip.py", "transformers/models/t5/modeling_t5.py")),
    ("reward", ("score_rollout (",)),
)


def fold(lines) -> tuple[Counter, Counter]:
    """py-spy raw lines ('frame;frame;... count') -> (samples per category, framework samples per innermost mmrl
    function). Samples outside a training step are dropped."""
    cats, framework = Counter(), Counter()
    for line in lines:
        stack, _, n = line.rstrip().rpartition(" ")  # (a sample with no Python frame has an empty stack)
        if not n.isdigit():
            continue
        frames = stack.split(";")
        names = [f.split(" (")[0] for f in frames]
        if not any(q in STEP_PARTS or q.rsplit(".", 1)[-1] in STEP_PARTS for q in names):
            continue
        cat = next((name for name, keys in CATEGORIES if any(k in f for f in frames for k in keys)), "framework")
        cats[cat] += int(n)
        if cat == "framework":
            mine = [f for f in frames if "mmrl/" in f]
            framework[mine[-1].split(" (")[0] if mine else frames[-1].split(" (")[0]] += int(n)
    return cats, framework


def table(cats: Counter, framework: Counter, top: int) -> str:
    total = sum(cats.values())
    if not total:
        raise SystemExit("no samples inside a training step (is py-spy allowed to trace? see its --help)")
    out = ["| part of the step | samples | share |", "|---|---|---|"]
    for name, _ in (*CATEGORIES, ("framework", ())):
        out.append(f"| {name} | {cats[name]} | {cats[name] / total:.1%} |")
    out.append(f"| **all step samples** | {total} | 100% |")
    out += ["", f"Framework samples by innermost mmrl function (top {top}):", "",
            "| function | samples | share of the step |", "|---|---|---|"]
    out += [f"| `{fn}` | {n} | {n / total:.2%} |" for fn, n in framework.most_common(top)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    ap.add_argument("--prompts", type=int, default=0, help="flow_grpo_step.py --prompts (0 = new prompts every step)")
    ap.add_argument("--top", type=int, default=12, help="framework functions listed")
    ap.add_argument("--raw", help="fold this py-spy raw file instead of recording one")
    args = ap.parse_args()
    if args.raw:
        cats, framework = fold(Path(args.raw).read_text().splitlines())
        print(table(cats, framework, args.top))
        return
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.is_file():
        raise SystemExit(f"py-spy not found next to {sys.executable}: pip install py-spy (or the `dev` extra)")
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.txt"
        bench = [sys.executable, str(HERE / "flow_grpo_step.py"), "--models", "tiny", "--steps", str(args.steps),
                 "--decode-repeats", "0", "--threads", "1", "--prompts", str(args.prompts)]
        cmd = [str(spy), "record", "-r", str(args.rate), "-f", "raw", "-o", str(raw), "--", *bench]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if proc.returncode != 0 or not raw.is_file():
            raise SystemExit(f"py-spy failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
        cats, framework = fold(raw.read_text().splitlines())
    print(f"Flow-GRPO step, tiny SD3, {args.steps} steps, py-spy at {args.rate} Hz; "
          f"{'new prompts every step' if not args.prompts else f'{args.prompts} prompts'}\n")
    print(table(cats, framework, args.top))
    print(f"\ncommand: .venv/bin/python benchmarks/profile_flow_grpo_step.py --steps {args.steps} --rate {args.rate} "
          f"--prompts {args.prompts} --top {args.top}")


if __name__ == "__main__":
    main()
