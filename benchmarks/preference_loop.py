"""The whole preference loop on the shapes world: label samples, fit a reward, train against it, measure the result.

A scripted labeller with a hidden preference stands in for a person. It prefers the image with more *foreground*:
the share of pixels farther than `TOL` (max over RGB, in [0, 1]) from the background colour the prompt names
(`mmrl.pipelines.shapes.COLORS`); a difference below `MARGIN` is a tie. No shipped reward computes it, and the base
tiny SD3's samples of one prompt differ in it a lot from seed to seed. ("Circles over squares" is not measurable on
this model: its blobs are too blurry for `mmrl.pipelines.shapes_check` to find the shape.)

  1. samples  - the base model (assets/tiny_sd3_shapes) draws `--k` images of every train prompt
                (assets/prompts/shapes_train.txt) with `mmrl eval` (`run_eval`): an eval folder `mmrl label` reads;
  2. labels   - the label server (`mmrl.label`, in this process, port 0) serves them; the labeller takes items
                through its HTTP API as the page does (GET /api/next, GET /media/<id>/<i>, POST /api/label) and
                decides from the PNG bytes it is served, up to `--pairs` pairs;
  3. reward   - `reward_bt` (configs/reward/bt_clip_tiny.yaml: a tiny CLIP, full fine-tuning) on the written
                preferences; held-out pairwise accuracy (20% of the prompts) with its 95% Wilson interval;
  4. policies - Flow-GRPO (configs/diffusion/flow_grpo_tiny.yaml, reward `learned_pref` on the export, the judges
                `shapes_geneval` and `prompt_color` watching it) and offline Diffusion-DPO
                (configs/diffusion/dpo_tiny_offline.yaml on the same preference file), one run per seed;
  5. measure  - the base model and every trained policy sample the held-out prompts (assets/prompts/
                shapes_eval.txt) with the same noise and sampler (`run_eval`, `--eval-samples` per prompt); per seed:
                the win rate of the trained sample over the base sample of the same (prompt, noise) under the hidden
                preference (ties 0.5; 0.5 = no change), the mean foreground share, the GenEval-style background
                check (is the prompt's background colour still there), the alarm's verdict.

    python benchmarks/preference_loop.py [--seeds 0 1 2 3 4] [--pairs 400] [--grpo-steps 30] [--out DIR]
    python benchmarks/preference_loop.py --quick      # every stage on a few items and 1-2 steps (tests)

Not a test: the numbers are what this machine measured, whatever they are.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
TOL = 0.25
MARGIN = 0.02
JUDGES = {"shapes_geneval": {}, "prompt_color": {}}  # the alarm: GenEval-style checks, background colour
# every sample (labelled, held-out) is drawn alike: the training sampler of flow_grpo_tiny, ODE, 64x64
SAMPLER = ["rollout.eval_num_steps=8", "rollout.eval_guidance_scale=1.0", "rollout.eval_height=64",
           "rollout.eval_width=64"]
QUICK = {"k": 2, "train_prompts": 6, "pairs": 6, "bt_steps": 2, "grpo_steps": 1, "dpo_steps": 1, "eval_prompts": 8,
         "eval_samples": 1, "seeds": [0]}


def foreground(image, prompt: str) -> float:
    """The hidden preference: share of pixels farther than TOL from the prompt's background colour."""
    from mmrl.pipelines.shapes import COLORS, parse_caption

    x = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    bg = np.asarray(COLORS[parse_caption(prompt)["background"]], dtype=np.float32) / 255.0
    return float((np.abs(x - bg).max(axis=-1) > TOL).mean())


def prefer(a: float, b: float) -> float:
    """1 when a wins, 0 when b wins, 0.5 for a tie (closer than MARGIN)."""
    return 0.5 if abs(a - b) < MARGIN else float(a > b)


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def label_through_http(url: str, max_pairs: int, session: str = "scripted") -> dict:
    """The scripted labeller: the page's calls, one item at a time, until `max_pairs` are labelled or none is left."""
    from PIL import Image

    def call(path: str, body: dict | None = None):
        req = urllib.request.Request(url.rstrip("/") + path, method="GET" if body is None else "POST",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            return json.loads(raw) if r.headers.get_content_type() == "application/json" else raw

    counts = {"left": 0, "right": 0, "tie": 0}
    while sum(counts.values()) < max_pairs:
        item = call(f"/api/next?session={session}")
        if item["pair_id"] is None:
            break
        cover = [foreground(Image.open(io.BytesIO(call(m))), item["prompt"]) for m in item["media"]]
        p = prefer(cover[0], cover[1])
        choice = "tie" if p == 0.5 else "left" if p == 1.0 else "right"
        answer = call("/api/label", {"pair_id": item["pair_id"], "choice": choice, "lease": item["lease"]})
        assert answer["recorded"], answer
        counts[choice] += 1
    return {**counts, "progress": call("/api/progress")}


def _coverage(report: dict) -> list[float]:
    """The hidden preference of every image of an eval report, prompt-major (checked: the report's sampler)."""
    got = {k: report["sampling"][k] for k in ("num_steps", "guidance_scale", "height", "width")}
    if got != {"num_steps": 8, "guidance_scale": 1.0, "height": 64, "width": 64}:
        raise RuntimeError(f"{report['out_dir']}: sampled with {got}, not the loop's sampler {SAMPLER}")
    from PIL import Image

    out = Path(report["out_dir"])
    return [foreground(Image.open(out / f), row["prompt"]) for row in report["per_prompt"] for f in row["images"]]


def _background(report: dict) -> float:
    """The GenEval-style check's background accuracy (`mmrl.pipelines.shapes_check`): the prompt's background
    colour is still there."""
    return report["compositional"]["accuracy"]["background"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "runs/preference_loop"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="one Flow-GRPO and one DPO run each")
    ap.add_argument("--k", type=int, default=3, help="base samples per train prompt (every pair of them is an item)")
    ap.add_argument("--train-prompts", type=int, default=0, help="first N train prompts (0 = all 144)")
    ap.add_argument("--pairs", type=int, default=400, help="pairs the scripted labeller labels")
    ap.add_argument("--bt-steps", type=int, default=150, help="reward_bt steps (8 pairs each)")
    ap.add_argument("--grpo-steps", type=int, default=30)
    ap.add_argument("--dpo-steps", type=int, default=60)
    ap.add_argument("--eval-prompts", type=int, default=0, help="first N held-out prompts (0 = all 26)")
    ap.add_argument("--eval-samples", type=int, default=4, help="samples per held-out prompt (same noise for all)")
    ap.add_argument("--quick", action="store_true", help=f"every stage, tiny sizes: {QUICK}")
    args = ap.parse_args(argv)
    if args.quick:
        for key, v in QUICK.items():
            setattr(args, key, v)
    torch.set_num_threads(1)
    os.environ.setdefault("MMRL_NO_PROGRESS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from mmrl.config import load_config, recipe_module
    from mmrl.eval import run_eval
    from mmrl.label.pairs import build_queue
    from mmrl.label.server import LabelServer
    from mmrl.training.judges import judge_fell

    out, t0 = Path(args.out), time.perf_counter()
    times: dict[str, float] = {}
    grpo_yaml = REPO / "configs/diffusion/flow_grpo_tiny.yaml"
    dpo_yaml = REPO / "configs/diffusion/dpo_tiny_offline.yaml"
    base_cfg = load_config(grpo_yaml, [f"output_dir={out / 'base'}", *SAMPLER])

    # 1. samples of the base model, k per train prompt, as an eval folder
    t = time.perf_counter()
    run_eval(base_cfg, prompts=str(REPO / "assets/prompts/shapes_train.txt"), out=out / "samples", seed=1000,
             samples_per_prompt=args.k, max_prompts=args.train_prompts)
    times["samples"] = time.perf_counter() - t

    # 2. the scripted labeller through the HTTP API
    t = time.perf_counter()
    prefs = out / "preferences.jsonl"
    for stale in (prefs, prefs.with_name("preferences.events.jsonl")):
        stale.unlink(missing_ok=True)  # a fresh labelling each pass
    with LabelServer(build_queue(out / "samples", 2), prefs) as server:
        labels = label_through_http(server.url, args.pairs)
    times["labels"] = time.perf_counter() - t
    print(f"[loop] labelled {labels['left'] + labels['right']} pairs and {labels['tie']} ties through {server.url} "
          f"({labels['progress']['total']} items)", flush=True)

    # 3. the reward
    t = time.perf_counter()
    bt_dir = out / "reward_bt"
    bt_cfg = load_config(REPO / "configs/reward/bt_clip_tiny.yaml", [
        f"output_dir={bt_dir}", f"data.pairs={prefs}", "data.build_demo=false", f"model.path={out / 'tiny_clip'}",
        f"train.max_steps={args.bt_steps}", "train.save_every=0", "train.resume=never",
        f"log.eval_every={max(1, args.bt_steps // 3)}"])
    recipe_module("reward_bt").train(bt_cfg)
    evals = [r for r in _metrics(bt_dir) if "eval/pair_accuracy" in r]
    acc = {k: evals[-1][f"eval/pair_accuracy{k}"] for k in ("", "_lo", "_hi")}
    acc0, n_eval_pairs = evals[0]["eval/pair_accuracy"], int(evals[-1]["eval/pairs"])
    times["reward"] = time.perf_counter() - t
    reward_dir = bt_dir / "reward"

    # 4. policies: Flow-GRPO against the learned reward, offline DPO on the same pairs; one run per seed
    common = ["train.save_every=0", "train.resume=never", "log.sample_every=0"]
    runs: dict[str, dict[int, Path]] = {"flow_grpo": {}, "dpo": {}}
    t = time.perf_counter()
    for seed in args.seeds:
        d = out / f"flow_grpo_s{seed}"
        cfg = load_config(grpo_yaml, common + [
            f"seed={seed}", f"output_dir={d}", f"train.max_steps={args.grpo_steps}",
            f"reward.components={{learned_pref: {{weight: 1.0, weights: {reward_dir}}}}}",
            "log.judges={" + ", ".join(f"{j}: {{}}" for j in JUDGES) + "}",
            f"log.eval_every={max(1, args.grpo_steps // 3)}", f"log.eval_max_prompts={args.eval_prompts or 26}"])
        recipe_module("flow_grpo").train(cfg)
        runs["flow_grpo"][seed] = d
    times["flow_grpo"] = time.perf_counter() - t
    t = time.perf_counter()
    for seed in args.seeds:
        d = out / f"dpo_s{seed}"
        cfg = load_config(dpo_yaml, common + [f"seed={seed}", f"output_dir={d}", f"train.max_steps={args.dpo_steps}",
                                              f"data.preference_file={prefs}", "log.eval_every=0"])
        recipe_module("dpo").train(cfg)
        runs["dpo"][seed] = d
    times["dpo"] = time.perf_counter() - t

    # 5. the hidden preference on held-out prompts: every policy with the base model's noise
    t = time.perf_counter()
    ev = {"prompts": str(REPO / "assets/prompts/shapes_eval.txt"), "seed": 2000,
          "samples_per_prompt": args.eval_samples, "max_prompts": args.eval_prompts}
    base_report = run_eval(base_cfg, out=out / "eval_base", **ev)
    base_cov = _coverage(base_report)
    result: dict = {"base_coverage": statistics.fmean(base_cov), "base_background": _background(base_report),
                    "labels": labels, "reward_accuracy": acc, "reward_accuracy_untrained": acc0,
                    "reward_eval_pairs": n_eval_pairs, "runs": {}}
    for algo, per_seed in runs.items():
        yaml = grpo_yaml if algo == "flow_grpo" else dpo_yaml
        for seed, d in per_seed.items():
            extra = [] if algo == "flow_grpo" else [  # offline DPO's config has no reward: any one for run_eval
                f"data.preference_file={prefs}", "reward.components={jpeg_incompressibility: 1.0}"]
            cfg = load_config(yaml, [f"output_dir={d}", *SAMPLER, *extra])
            report = run_eval(cfg, d, out=d / "eval_hidden", **ev)
            cov = _coverage(report)
            row = {"win_rate": statistics.fmean(prefer(a, b) for a, b in zip(cov, base_cov)),
                   "coverage": statistics.fmean(cov), "background": _background(report)}
            if algo == "flow_grpo":
                m = _metrics(d)
                fired = [r for r in m if r.get("eval/hacking_alarm")]
                row["alarm_step"] = fired[0]["step"] if fired else None
                row["alarm_judges"] = [j for j in JUDGES if fired and judge_fell(fired[0], j)]
                row["reward_first"] = m[0]["reward/mean"]
                row["reward_last"] = m[-1]["reward/mean"]
            result["runs"].setdefault(algo, {})[seed] = row
    times["measure"] = time.perf_counter() - t
    result["times_s"] = {k: round(v, 1) for k, v in times.items()} | {"total": round(time.perf_counter() - t0, 1)}
    _print(result, args)
    (out / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def _print(r: dict, args) -> None:
    lab, acc = r["labels"], r["reward_accuracy"]
    n_eval = (args.eval_prompts or 26) * args.eval_samples
    print(f"\nhidden preference: more foreground (pixels > {TOL} from the prompt's background colour; tie below "
          f"{MARGIN}); labels: {lab['left'] + lab['right']} pairs + {lab['tie']} ties of "
          f"{lab['progress']['total']} items (base samples, k={args.k} per train prompt)")
    print(f"reward_bt ({args.bt_steps} steps): held-out pairwise accuracy {acc['']:.3f} (95% Wilson "
          f"{acc['_lo']:.3f}..{acc['_hi']:.3f}, {r['reward_eval_pairs']} pairs; untrained "
          f"{r['reward_accuracy_untrained']:.3f})")
    print(f"held-out: {n_eval} samples ({args.eval_samples} per prompt, the base model's noise, 8-step ODE); seeds "
          f"{args.seeds}; Flow-GRPO {args.grpo_steps} steps, DPO {args.dpo_steps}; background check: share of samples "
          f"where the GenEval-style check finds the prompt's background colour; alarm: log.judges "
          f"{', '.join(JUDGES)} on the learned reward (Flow-GRPO)\n")
    print("| policy | win rate vs base (hidden pref.) | foreground share | background check | per seed (win rate / "
          "foreground / background) | hacking alarm |")
    print("|---|---|---|---|---|---|")
    print(f"| base model | 0.5 | {r['base_coverage']:.3f} | {r['base_background']:.3f} | - | - |")
    for algo, per_seed in r["runs"].items():
        ms = {k: mean_std([v[k] for v in per_seed.values()]) for k in ("win_rate", "coverage", "background")}
        seeds = ", ".join(f"{s}: {v['win_rate']:.3f} / {v['coverage']:.3f} / {v['background']:.3f}"
                          for s, v in per_seed.items())
        alarm = "-" if algo != "flow_grpo" else ", ".join(
            f"{s}: " + (f"step {v['alarm_step']} ({' '.join(v['alarm_judges'])} fell)" if v["alarm_step"] is not None
                        else "quiet") for s, v in per_seed.items())
        print(f"| {algo} | " + " | ".join(f"{m:.3f} ± {sd:.3f}" for m, sd in ms.values()) + f" | {seeds} | {alarm} |")
    print(f"\nmean ± sample std over seeds; times (s): {r['times_s']}")


if __name__ == "__main__":
    main()
