"""A GPU check, ready to run: on a CUDA machine with no network, build random models of the real architectures at
their real size (mmrl.tiny.random_real: SD3.5-Medium, FLUX.1-dev, Qwen2.5-VL-3B), run every recipe for a few steps in
bf16 through `mmrl train` (each in its own process, so peak memory is per recipe; vlm_grpo_ranks under torchrun: on 4
GPUs 2 trainer ranks with DDP, each with a rollout rank, on 2 GPUs one pair), and print one JSON object:
images/s or tokens/s, TFLOP per step and MFU (mmrl.perf: FLOPs from the architecture, the device's dense bf16 peak),
peak GPU memory, and the largest log-prob drift between rollout and training (must be ~0).

    python benchmarks/gpu_check.py [--out runs/gpu_check] [--steps 3] [--only flow_grpo,vlm_grpo]
    python benchmarks/gpu_check.py --small --steps 2     # CPU, the same models at tiny widths: what the test runs

Each recipe starts from its tiny CPU config (configs/*/…_tiny*.yaml: the same task, reward and algorithm settings)
with the model, device, dtype and resolution overridden (RECIPES below); rewards need no weights (JPEG size, exact
match, the grid environment). Exit status 1 when a recipe fails (its JSON entry has the error's last lines).
`flow_grpo_flux_sp2` runs under torchrun on 2 processes (2 GPUs; gloo on CPU with --small) with every FLUX forward
split over the tokens (`dist.sequence_parallel: 2`); a machine with fewer GPUs reports it skipped with the reason
(so does `vlm_grpo_ranks` with fewer than 2; `--small` runs it with 2 pairs on 4 CPU processes).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

# recipe -> (tiny config, architecture, overrides on a GPU). Batch sizes stay the tiny configs' (a few steps measure
# throughput, not learning) except the training micro-batch: 4 images (8 rows with CFG) at 512 px, the resolution of
# the real recipes, keeps full fine-tuning of SD3.5-M within 80 GB (docs/scaling.md, memory at real width).
DIFFUSION_GPU = ["rollout.height=512", "rollout.width=512", "update.micro_batch_size=4"]
RECIPES: dict[str, tuple[str, str, list[str]]] = {
    "flow_grpo": ("configs/diffusion/flow_grpo_tiny.yaml", "sd35_medium", DIFFUSION_GPU),
    "flow_grpo_flux": ("configs/diffusion/flow_grpo_tiny.yaml", "flux1_dev", DIFFUSION_GPU + ["rollout.guidance_scale=3.5"]),
    # the same on 2 processes splitting every FLUX forward over the tokens (dist.sequence_parallel): its per-process
    # peak memory beside flow_grpo_flux's is what the split saves
    "flow_grpo_flux_sp2": ("configs/diffusion/flow_grpo_tiny.yaml", "flux1_dev",
                           DIFFUSION_GPU + ["rollout.guidance_scale=3.5", "dist.sequence_parallel=2"]),
    "dpo": ("configs/diffusion/dpo_tiny_online.yaml", "sd35_medium", DIFFUSION_GPU),
    "nft": ("configs/diffusion/nft_tiny.yaml", "sd35_medium", DIFFUSION_GPU),
    "awm": ("configs/diffusion/awm_tiny.yaml", "sd35_medium", DIFFUSION_GPU),
    # (no lm_head warm start: Qwen2.5-VL-3B ties it to the embeddings; a throughput check needs no format prior)
    "vlm_grpo": ("configs/vlm/grpo_tiny_shapes.yaml", "qwen25_vl_3b", ["warm_start.steps=0"]),
    "vlm_multiturn": ("configs/vlm/multiturn_grid_tiny.yaml", "qwen25_vl_3b", ["warm_start.steps=0"]),
    # ranks 0-1 train (DDP over NCCL in their own group), rank 2 + i generates and scores for rank i (4 GPUs; each
    # pair's channel over gloo); max_staleness 0: the rollout's log-probs must equal the trainer's (drift ~0), so the
    # pushed weights arrived whole
    "vlm_grpo_ranks": ("configs/vlm/grpo_tiny_shapes.yaml", "qwen25_vl_3b",
                       ["warm_start.steps=0", "rollout.worker=ranks"]),
}


# recipes launched with torchrun on this many processes (one per GPU; gloo processes on CPU with --small): the first
# count the machine's GPUs allow; a rank-pair recipe gets dist.rollout_ranks = half of it
PROCESSES = {"flow_grpo_flux_sp2": (2,), "vlm_grpo_ranks": (4, 2)}
PAIRED = ("vlm_grpo_ranks",)


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def summarise_run(recipe: str, out: Path, arch: str, params: int) -> dict:
    """Throughput, FLOPs, MFU, memory and drift of one finished run, from its metrics.jsonl and config.yaml."""
    import yaml

    cfg = yaml.safe_load((out / "config.yaml").read_text())
    rows = [r for r in _rows(out) if r.get("step", 0) >= 1]
    if not rows:
        raise ValueError(f"{out}: no training step in metrics.jsonl")
    timed = rows[1:] or rows  # the first step includes warm-up (kernels, allocator, caches)
    step_s = statistics.median(r["time/step_s"] for r in timed)
    ro = cfg.get("rollout", {})
    res: dict = {"model": arch, "params_b": params / 1e9, "steps": len(rows), "step_s": step_s}
    samples = int(ro.get("prompts_per_step", 0)) * int(ro.get("group_size", 1))
    if cfg["algorithm"] in ("flow_grpo", "dpo", "nft", "awm"):
        res["images_per_s"] = samples / step_s
    else:
        # generated tokens per step: mean per response (turn-summed in multi-turn) x responses sampled, dynamic
        # sampling's extra rounds included
        key = next((k for k in ("rollout/response_length/mean", "rollout/tokens/policy_mean") if k in timed[0]), None)
        if key is not None:
            per_step = [r[key] * (r.get("rollout/dynamic/episodes_sampled")
                                  or r.get("rollout/dynamic/rounds", 1) * samples) for r in timed]
            res["tokens_per_s"] = statistics.median(per_step) / step_s
    for key, name in (("perf/tflops_per_step", "tflops_per_step"), ("perf/mfu", "mfu")):
        vals = [r[key] for r in timed if r.get(key) is not None]
        if vals:
            res[name] = statistics.median(vals)
    mem = [r["perf/peak_memory_gib"] for r in rows if r.get("perf/peak_memory_gib") is not None]
    if mem:
        res["peak_memory_gib"] = max(mem)
    drift = [r["diag/logprob_drift"] for r in rows if r.get("diag/logprob_drift") is not None]
    if drift:
        res["max_logprob_drift"] = max(drift)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/gpu_check", help="run directories and the built models go here")
    ap.add_argument("--steps", type=int, default=3, help="training steps per recipe (the first is not timed)")
    ap.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(RECIPES)}")
    ap.add_argument("--small", action="store_true", help="CPU, tiny widths, float32 (checks the whole path)")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(RECIPES)
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise SystemExit(f"--only: unknown recipe(s) {unknown}; valid: {list(RECIPES)}")
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    import torch

    import mmrl.diffusion.models  # noqa: F401  (the families register their architectures)
    from mmrl.perf.architectures import get_architecture
    from mmrl.tiny.random_real import build_random_model

    if not args.small and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; run with --small for the CPU check")
    out = Path(args.out)
    dtype = torch.float32 if args.small else torch.bfloat16
    report: dict = {"device": "cpu" if args.small else torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "small": args.small, "command": shlex.join(["python", "benchmarks/gpu_check.py",
                                                                *(sys.argv[1:] if argv is None else argv)]),
                    "recipes": {}}
    models: dict[str, tuple[Path, int]] = {}
    failed = []
    for name in names:
        config, arch_name, gpu_overrides = RECIPES[name]
        counts = PROCESSES.get(name, (1,))
        fits = [n for n in counts if args.small or n <= torch.cuda.device_count()]
        if not fits:
            report["recipes"][name] = {"config": config, "skipped": f"needs {min(counts)} GPUs, this machine has "
                                                                    f"{torch.cuda.device_count()}"}
            continue
        nproc = fits[0]
        if arch_name not in models:  # built once, shared by the recipes that train it
            path = out / "models" / (arch_name + ("_small" if args.small else ""))
            if not (path / ("model_index.json" if "qwen" not in arch_name else "config.json")).is_file():
                t0 = time.perf_counter()
                build_random_model(arch_name, path, small=args.small, dtype=dtype)
                print(f"[gpu_check] built {arch_name} in {time.perf_counter() - t0:.0f} s: {path}", file=sys.stderr)
            models[arch_name] = (path, get_architecture(arch_name, args.small).parameters())
        path, params = models[arch_name]
        run_dir = out / name
        overrides = [f"output_dir={run_dir}", f"model.path={path}", f"train.max_steps={args.steps}",
                     f"train.save_every={args.steps}", "train.resume=never", "train.overwrite=true",
                     "log.eval_every=0", "log.sample_every=0"]
        # batch and image sizes: on a GPU only; --small keeps the tiny configs' (where rollouts run: both)
        sized = [o for o in gpu_overrides if o.startswith(("rollout.", "update.")) and not o.startswith("rollout.worker")]
        overrides += [o for o in gpu_overrides if o not in sized]
        overrides += [f"dist.rollout_ranks={nproc // 2}"] if name in PAIRED else []
        overrides += (["device=cpu", "dtype=float32"] if args.small
                      else ["device=cuda", "dtype=bfloat16", "num_threads=0", *sized])
        launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else []
        cmd = [sys.executable, *launch, "-m", "mmrl.cli", "train", str(REPO / config), *overrides]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                              env=dict(os.environ, MMRL_NO_PROGRESS="1", HF_HUB_OFFLINE="1"))
        entry: dict = {"config": config, "wall_s": time.perf_counter() - t0, "processes": nproc}
        if proc.returncode:
            failed.append(name)
            entry["error"] = "\n".join(proc.stderr.strip().splitlines()[-12:])
        else:
            try:
                entry.update(summarise_run(name, run_dir, arch_name, params))
            except (ValueError, KeyError, OSError) as exc:
                failed.append(name)
                entry["error"] = f"{type(exc).__name__}: {exc}"
        report["recipes"][name] = entry
        print(f"[gpu_check] {name}: {'FAILED' if 'error' in entry else 'ok'} ({entry['wall_s']:.0f} s)",
              file=sys.stderr, flush=True)
    report["failed"] = failed
    print(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
