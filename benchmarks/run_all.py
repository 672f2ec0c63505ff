"""Every benchmark behind the table in docs/performance.md, in one pass: `make bench` runs this.

    .venv/bin/python benchmarks/run_all.py [--only flow_grpo_step,rewards_throughput] [--out runs/bench.md]

Each benchmark runs in its own process, one after the other (never two at once: they would time each other; only
compare_diffusion_algos runs two of its training runs at once, and reports each run's own CPU time),
with the arguments listed in BENCHMARKS, one torch thread each (the machine of the published numbers has 2
cores shared with other jobs). Prints one Markdown report - date, machine, this exact command, then every
benchmark's command, its output and its wall time - and writes it to `--out` too. A benchmark that fails is
reported as FAILED with the end of its error output, the others still run, and the pass exits with status 1
(no partial table passes as a full one).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from _timing import machine

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# name -> arguments ("{stamp}": this pass's start time, so a pass never meets an earlier pass's run directory);
# the order of the table in docs/performance.md. "script:variant" runs benchmarks/script.py with other arguments.
BENCHMARKS: dict[str, list[str]] = {
    "flow_grpo_step": ["--threads", "1"],
    # the steady state of the prompt-embedding cache (every step of a run after its first epoch over the prompts):
    # a fixed set of 4 prompts, encoded in the unmeasured first step
    "flow_grpo_step:cached_prompts": ["--threads", "1", "--models", "tiny", "--prompts", "2", "--decode-repeats", "0"],
    "adapter_states": ["--threads", "1"],
    "rope_index": ["--threads", "1"],
    "rewards_throughput": ["--threads", "1"],
    # a latent reward (dina_lrm): the rollout's VAE decode skipped vs done, interleaved steps of one run
    "latent_reward_step": ["--threads", "1", "--rounds", "8"],
    "vlm_step": ["--part", "all", "--threads", "1"],
    "reward_overlap": ["--threads", "1"],
    # the table of docs/faster-diffusion.md: 10 algorithms x 5 seeds to Flow-GRPO's level after 105 steps, two runs
    # at once (each in its own process with one thread; the table's main clock is each run's own CPU time)
    "compare_diffusion_algos": ["--jobs", "2", "--out", "runs/compare_diffusion/{stamp}"],
    # the per-step cost table beside it (each row 3 steps on the task and at its paper's sampler and CFG)
    "algo_step_cost": ["--summary", "runs/compare_diffusion/{stamp}/summary.json", "--out", "runs/algo_step_cost/{stamp}"],
    "families": ["--threads", "1"],
    # a rollout process beside the trainer vs the synchronous loop with 2 and with 1 thread (sets its own threads)
    "async_rollout": ["--steps", "40,20", "--mode", "process", "--out", "runs/bench_async/{stamp}"],
    # the same with the rollouts on a rollout rank of a 2-process torchrun world
    "async_rollout:ranks": ["--steps", "40,20", "--mode", "ranks", "--out", "runs/bench_async_ranks/{stamp}"],
    # per-process peak memory of one 8192-token video row through a Wan transformer, 1 vs 2 processes splitting it
    "sequence_parallel": ["--threads", "1"],
    # label -> reward -> Flow-GRPO / DPO on the shapes world with a scripted labeller (5 seeds, ~6 CPU minutes)
    "preference_loop": ["--out", "runs/preference_loop/{stamp}"],
    # Janus GRPO on the shapes colour reward, trained vs a control at lr 1e-8, 3 seeds (docs/ar-image.md)
    "janus_color_demo": ["--out", "runs/janus_color_demo/{stamp}"],
    # GLM-4.1V and InternVL: mmrl's HF rollout engine vs transformers' generate, greedy, the same tokens
    "vlm_families_rollout": ["--threads", "1"],
    # Janus guided image-token rollout vs transformers' generate(generation_mode="image"), same tokens (16 and 576)
    "janus_rollout": ["--threads", "1"],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    ap.add_argument("--out", default="", help="also write the report to this Markdown file")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"--only: unknown benchmark(s) {unknown}; valid: {list(BENCHMARKS)}")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", MMRL_NO_PROGRESS="1")
    this = shlex.join(["python", "benchmarks/run_all.py", *(sys.argv[1:] if argv is None else argv)])
    report = [f"# Benchmarks, one pass\n\n`{this}` - {machine(1)}; each benchmark in its own process, one at a "
              f"time, 1 torch thread\n"]
    print(report[0], flush=True)
    t_all = time.perf_counter()
    failed: list[str] = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in names:
        bench_args = [a.format(stamp=stamp) for a in BENCHMARKS[name]]
        script = name.split(":")[0]
        cmd = [sys.executable, str(HERE / f"{script}.py"), *bench_args]
        shown = shlex.join(["python", f"benchmarks/{script}.py", *bench_args])
        print(f"running {shown} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        took = time.perf_counter() - t0
        if proc.returncode:
            failed.append(name)
            err = "\n".join(proc.stderr.strip().splitlines()[-15:])
            section = f"## {name}\n\n`{shown}` FAILED (exit {proc.returncode}) after {took:.0f} s\n\n```\n{err}\n```\n"
        else:
            section = f"## {name}\n\n`{shown}` ({took:.0f} s)\n\n{proc.stdout.strip()}\n"
        report.append(section)
        print(section, flush=True)
    tail = f"total {time.perf_counter() - t_all:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else "")
    report.append(tail + "\n")
    print(tail)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(report))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
