"""Flow-GRPO step-time breakdown and framework overhead on CPU.

    .venv/bin/python benchmarks/flow_grpo_step.py [--steps 6] [--medium-steps 3] [--threads 1] [--models tiny,medium]
        [--prompts N] [--decode-repeats 7] [config overrides, e.g. update.epochs=2]

For two SD3-architecture models (the tiny test model and a larger CPU-sized one) it runs
`mmrl.diffusion.flow_grpo.train` for a few steps and reports, per step: rollout / reward / train time, the
time spent in the transformer (forward passes timed by hooks on the transformer module, backward passes by
timing `Tensor.backward`, which runs the transformer's backward plus a few element-wise ops), and

    overhead = (step time - transformer forward - transformer backward) / step time

i.e. everything that is not the network: SDE math, prompt encoding, VAE decode, reward, advantages,
optimizer, logging. A second ratio also leaves out VAE decode, text encoders and the reward (model work
outside the policy); the VAE decode alone is shown in brackets. Every step after the first (which includes
one-off warm-up) is one repeat: times are medians over those steps, the two ratios min / median / max.
`--prompts N` trains on a fixed set of the first N prompts of shapes_train.txt, so the prompt-embedding cache
is warm after N / 4 steps (default: all 146 prompts, every measured step sees new prompts).

A second table times the tiny model's VAE decode of one rollout batch (16 images, 64 px) as the rollout does
it and in the variants that could make it cheaper (inference_mode, two chunks of 8, one image at a time,
channels_last), interleaved (`_timing.interleaved`), each with its max |difference| from the shipped decode:
a variant is only usable if it is bit-identical (0). Two more rows time the shipped decode in two worker
processes, one with glibc's default malloc (MMRL_NO_MALLOC_TUNING=1) and one tuned (`mmrl.runtime.tune_malloc`,
which `start_run` applies, so the training runs above are tuned unless that variable is set), interleaved with
each other; separate processes because glibc's adaptive mmap threshold cannot be restored by `mallopt` once set.
`--decode-repeats 0` skips that table. Prints markdown tables and the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from _timing import interleaved, machine, speedup, spread_of

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MMRL_NO_PROGRESS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build_models(root: Path) -> dict[str, tuple[Path, int]]:
    """name -> (pipeline dir, image size)."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    from mmrl.tiny import build_tiny_sd3

    tiny = build_tiny_sd3(root / "tiny")
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny))
    torch.manual_seed(0)
    big = SD3Transformer2DModel(
        sample_size=24, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=32, num_attention_heads=4,
        joint_attention_dim=32, caption_projection_dim=128, pooled_projection_dim=32, out_channels=4,
        pos_embed_max_size=64)
    StableDiffusion3Pipeline(**{**pipe.components, "transformer": big}).save_pretrained(root / "medium")
    return {"tiny (78k, 64px)": (tiny, 64),
            f"medium ({sum(p.numel() for p in big.parameters()) / 1e6:.1f}M, 96px)": (root / "medium", 96)}


def _timed(fn, clock):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            clock.other += time.perf_counter() - t
            clock.vae += time.perf_counter() - t
    return wrapper


class TransformerClock:
    """Accumulates transformer forward time (module hooks) and backward time (Tensor.backward)."""

    def __init__(self):
        self.other = 0.0  # VAE decode + text encoders (model work that is not the policy network)
        self.vae = 0.0  # VAE decode alone
        self._t1 = 0.0
        self.fwd = 0.0
        self.bwd = 0.0
        self._t0 = 0.0
        self._orig_backward = torch.Tensor.backward

    def attach(self, module):
        module.register_forward_pre_hook(lambda *a: setattr(self, "_t0", time.perf_counter()))
        module.register_forward_hook(lambda *a: setattr(self, "fwd", self.fwd + time.perf_counter() - self._t0))

    def attach_other(self, module):
        module.register_forward_pre_hook(lambda *a: setattr(self, "_t1", time.perf_counter()))
        module.register_forward_hook(lambda *a: setattr(self, "other", self.other + time.perf_counter() - self._t1))

    def __enter__(self):
        clock, orig = self, self._orig_backward

        def timed_backward(tensor, *a, **kw):
            t = time.perf_counter()
            try:
                return orig(tensor, *a, **kw)
            finally:
                clock.bwd += time.perf_counter() - t

        torch.Tensor.backward = timed_backward
        return self

    def __exit__(self, *exc):
        torch.Tensor.backward = self._orig_backward


def bench(name: str, path: Path, size: int, steps: int, out: Path, prompts: int = 0, overrides=()) -> dict:
    import mmrl.diffusion.models as models
    from mmrl.config import load_config
    from mmrl.diffusion import flow_grpo
    from mmrl.run.directory import Run

    clock = TransformerClock()
    orig_load = models.load_flow_model
    per_step: list[tuple[float, float, float, float]] = []

    def load_and_hook(*a, **kw):
        m = orig_load(*a, **kw)
        clock.attach(m.transformer)
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
            if getattr(m.pipe, name, None) is not None:
                clock.attach_other(getattr(m.pipe, name))
        m.vae.decode = _timed(m.vae.decode, clock)
        return m

    prompt_file = REPO / "assets/prompts/shapes_train.txt"
    if prompts:  # a fixed set of the first N prompts (steady state of the prompt-embedding cache)
        lines = [ln for ln in prompt_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")][:prompts]
        prompt_file = out.parent / f"prompts_{prompts}.txt"
        prompt_file.write_text("\n".join(lines) + "\n")
    cfg = load_config({
        "algorithm": "flow_grpo", "output_dir": str(out), "seed": 0, "device": "cpu",
        "model": {"path": str(path), "lora": {"rank": 8, "alpha": 16}},
        "data": {"train_prompts": str(prompt_file)},
        "rollout": {"prompts_per_step": 4, "height": size, "width": size, "num_steps": 8, "group_size": 4,
                    "guidance_scale": 4.5},
        "update": {"micro_batch_size": 8, "mini_batch_size": 8},  # 2 optimizer updates per step
        "algo": {"kl": {"coef": 0.04}, "ema": True},
        "train": {"max_steps": steps, "save_every": 0, "resume": "never"},
        "reward": {"components": {"jpeg_compressibility": 1.0}},
        "log": {"sample_every": 0},
    }, list(overrides))
    # per-step transformer time: snapshot the clock whenever a metrics row is logged
    orig_log = Run.log

    def log_and_snapshot(run, step, metrics):
        per_step.append((clock.fwd, clock.bwd, clock.other, clock.vae))
        return orig_log(run, step, metrics)

    Run.log = log_and_snapshot
    models.load_flow_model = load_and_hook
    try:
        with clock:
            flow_grpo.train(cfg)
    finally:
        models.load_flow_model = orig_load
        Run.log = orig_log
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # per-step clock deltas: snapshot k is taken when step k is logged, so deltas start at step 2 (the first
    # step includes one-off warm-up and is left out, as are its metrics rows)
    delta = [[b[j] - a[j] for j in range(4)] for a, b in zip(per_step, per_step[1:])]
    rows = rows[1:]
    steps = []
    for r, (fwd, bwd, other, vae) in zip(rows, delta):
        step_s, reward = r["time/step_s"], r.get("time/reward_s", 0.0)
        steps.append({"step_s": step_s, "rollout_s": r.get("time/rollout_s", 0.0), "reward_s": reward,
                      "train_s": r.get("time/train_s", 0.0), "fwd_s": fwd, "bwd_s": bwd, "other_s": other,
                      "vae_s": vae, "overhead": (step_s - fwd - bwd) / step_s,
                      "framework": (step_s - fwd - bwd - other - reward) / step_s})
    res = {k: spread_of([st[k] for st in steps]) for k in steps[0]}
    res["model"] = name
    res["drift"] = max(r["diag/logprob_drift"] for r in rows)
    return res


def decode_variants(path: Path, size: int, n: int, repeats: int) -> list[tuple[str, object, float]]:
    """(variant, Spread of seconds, max |image - shipped image|) for the VAE decode of one rollout batch."""
    import copy

    from mmrl.diffusion.models import load_flow_model

    model = load_flow_model(path)
    z = model.initial_noise(n, size, size, torch.Generator().manual_seed(0))
    vae_cl = copy.deepcopy(model.vae).to(memory_format=torch.channels_last)

    def shipped():  # what sample_groups does: one decode per rollout micro-batch, under no_grad
        with torch.no_grad():
            return model.decode(z, size, size)

    def inference():
        with torch.inference_mode():
            return model.decode(z, size, size)

    def chunks(k):
        def f():
            with torch.no_grad():
                return torch.cat([model.decode(z[i:i + k], size, size) for i in range(0, n, k)])
        return f

    def channels_last():
        with torch.no_grad():
            img = vae_cl.decode(z.contiguous(memory_format=torch.channels_last), return_dict=False)[0]
        return (img.float() / 2 + 0.5).clamp(0, 1)  # scaling 1, shift 0 for the tiny VAE (as vae_decode)

    fns = {f"shipped (no_grad, batch {n})": shipped, "inference_mode": inference,
           f"2 chunks of {n // 2}": chunks(n // 2), "1 image at a time": chunks(1), "channels_last": channels_last}
    ref = shipped()
    diffs = {k: float((f().contiguous() - ref).abs().max()) for k, f in fns.items()}
    times = interleaved(fns, repeats=repeats, warmup=1)
    return [(k, times[k], diffs[k]) for k in fns]


def decode_worker(path: str, size: int, n: int, out: str) -> None:
    """`--decode-worker`: a process that decodes the rollout batch of `decode_variants` once per line read from
    stdin and answers each with a line; its first decode is saved to `out`. Its malloc is whatever
    `mmrl.runtime.tune_malloc` leaves (MMRL_NO_MALLOC_TUNING=1: glibc's defaults, untouched)."""
    from mmrl.diffusion.models import load_flow_model
    from mmrl.runtime import tune_malloc

    tuned = tune_malloc()
    torch.set_num_threads(1)
    model = load_flow_model(Path(path))
    z = model.initial_noise(n, size, size, torch.Generator().manual_seed(0))
    print(f"ready tuned={tuned}", flush=True)
    first = True
    for _ in sys.stdin:
        with torch.no_grad():
            img = model.decode(z, size, size)
        if first:
            torch.save(img, out)
            first = False
        print("done", flush=True)


def malloc_variants(path: Path, size: int, n: int, repeats: int, tmp: Path) -> list[tuple[str, object, float]]:
    """(variant, Spread of seconds, max |image - default image|): the same decode as `decode_variants`' shipped one,
    in two worker processes, one with glibc's default malloc and one tuned (`mmrl.runtime.tune_malloc`), timed
    interleaved (`_timing.interleaved`: each call sends one line and waits for the answer, ~0.1 ms of pipe).
    Two processes because glibc's default mmap threshold adapts at run time and no `mallopt` call restores that."""
    import subprocess

    workers = {}
    for name, extra in (("glibc default malloc", {"MMRL_NO_MALLOC_TUNING": "1"}), ("malloc tuned", {})):
        out = tmp / f"decode_{len(workers)}.pt"
        env = {k: v for k, v in os.environ.items() if k != "MMRL_NO_MALLOC_TUNING"}
        env.update(OMP_NUM_THREADS="1", **extra)
        p = subprocess.Popen([sys.executable, __file__, "--decode-worker", str(path), str(size), str(n), str(out)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        ready = p.stdout.readline().strip()
        expected = f"ready tuned={name == 'malloc tuned'}"
        if ready != expected:
            raise RuntimeError(f"decode worker ({name}): expected {expected!r}, got {ready!r}")
        workers[name] = (p, out)

    def call(p):
        def f():
            p.stdin.write("go\n")
            p.stdin.flush()
            if p.stdout.readline().strip() != "done":
                raise RuntimeError("decode worker died")
        return f

    try:
        times = interleaved({k: call(p) for k, (p, _) in workers.items()}, repeats=repeats, warmup=1)
    finally:
        for p, _ in workers.values():
            p.stdin.close()
            p.wait(timeout=60)
    ref = torch.load(workers["glibc default malloc"][1])
    return [(k, times[k], float((torch.load(o) - ref).abs().max())) for k, (_, o) in workers.items()]


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--decode-worker":
        return decode_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="training steps of the tiny model (the first is not measured)")
    ap.add_argument("--medium-steps", type=int, default=3,
                    help="training steps of the medium model (20-35 s each on one core; the first is not measured)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", default="tiny,medium", help="comma-separated subset of: tiny, medium")
    ap.add_argument("--prompts", type=int, default=0,
                    help="train on the first N prompts of shapes_train.txt (0 = all 146: every step sees new prompts)")
    ap.add_argument("--decode-repeats", type=int, default=7,
                    help="interleaved rounds of the tiny VAE decode variants (0 = skip that table)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. update.epochs=2")
    args = ap.parse_args()
    if min(args.steps, args.medium_steps) < 2:
        raise SystemExit(f"--steps and --medium-steps must be >= 2 (the first step is warm-up and not measured), "
                         f"got {args.steps} and {args.medium_steps}")
    wanted = [m.strip() for m in args.models.split(",") if m.strip()]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        built = build_models(tmp)
        models = {n: v for n, v in built.items() if n.split()[0] in wanted}
        results = [bench(n, p, s, args.medium_steps if n.startswith("medium") else args.steps, tmp / f"run{i}",
                         args.prompts, args.overrides) for i, (n, (p, s)) in enumerate(models.items())]
        decode = decode_variants(*next(iter(built.values())), 16, args.decode_repeats) if args.decode_repeats else []
        mallocs = malloc_variants(*next(iter(built.values())), 16, args.decode_repeats, tmp) \
            if args.decode_repeats else []
    from mmrl.runtime import tune_malloc

    malloc_note = ("glibc malloc tuned at run start (mmrl.runtime.tune_malloc)" if tune_malloc()  # (again: harmless)
                   else "glibc malloc not tuned (MMRL_NO_MALLOC_TUNING set, or not Linux/glibc)")
    print(f"\nFlow-GRPO step on CPU ({machine()}); 4 prompts x 4 images, 8 steps, CFG 4.5, "
          f"LoRA r=8, beta 0.04, EMA; {args.prompts or 146} training prompts; "
          f"{' '.join(args.overrides) or 'no overrides'}; {malloc_note}; steps 2..N are the repeats "
          f"(N = {args.steps} tiny, {args.medium_steps} medium): seconds are medians, overheads min / median / max\n")
    print("| model | step s | rollout s | reward s | train s | transformer fwd s | transformer bwd s "
          "| VAE + text enc s (VAE) | overhead % | overhead excl. VAE/text/reward % | max drift |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        m = {k: v.median for k, v in r.items() if hasattr(v, "median")}
        print(f"| {r['model']} | {m['step_s']:.2f} | {m['rollout_s']:.2f} | {m['reward_s']:.3f} | {m['train_s']:.2f} | "
              f"{m['fwd_s']:.2f} | {m['bwd_s']:.2f} | {m['other_s']:.3f} ({m['vae_s']:.3f}) | "
              f"**{r['overhead'].fmt(100, 1)}** | {r['framework'].fmt(100, 1)} | {r['drift']:.1e} |")
    if decode:
        print(f"\nVAE decode of one rollout batch, tiny model (16 images, 64 px), {args.decode_repeats} interleaved "
              f"rounds after 1 warm-up. Rows 1-5 in this process ({malloc_note.split(' (')[0]}); the last two: the "
              f"shipped decode in two worker processes, glibc's default malloc vs tuned, interleaved with each other\n")
        print("| variant | ms min / median / max | speed-up vs first row of its group (medians) "
              "| max abs difference from shipped |")
        print("|---|---|---|---|")
        for group in (decode, mallocs):
            for i, (k, t, d) in enumerate(group):
                print(f"| {k} | {t.fmt(1e3, 1)} | {speedup(group[0][1], t) if i else '(reference)'} | {d:.1e} |")
    print(f"\ncommand: .venv/bin/python benchmarks/flow_grpo_step.py --steps {args.steps} "
          f"--medium-steps {args.medium_steps} --threads {args.threads} "
          f"--models {args.models} --prompts {args.prompts} --decode-repeats {args.decode_repeats} "
          f"{' '.join(args.overrides)}".rstrip())


if __name__ == "__main__":
    main()
