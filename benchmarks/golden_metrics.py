"""Golden metrics: every tiny config's metrics.jsonl over 3 steps, recorded before a refactor and compared after it.

Not a speed benchmark: a behaviour record. A refactor that claims "behaviour unchanged" records the rows with the
old code, then compares the new code's rows with them, row by row and key by key (the wall-clock keys under
`mmrl.testing.TIMING_PREFIXES`, time/ and async/, and the machine keys of `mmrl.testing.MACHINE_KEYS` aside). Equality is exact: both runs take the same code
path on the same machine, so any difference is a change of behaviour.

Cases (`--list` prints them):
- every `configs/*/*tiny*.yaml`, 3 steps, a checkpoint every step;
- every diffusion model family (its first tiny case, `mmrl.diffusion.models.tiny_cases()`: checkpoints built once
  into OUT/models) x every diffusion recipe (flow_grpo, nft, awm, dpo online, dgpo), LoRA, 3 steps;
- asynchronous rollouts (`rollout.worker=process`, `rollout.max_staleness` 0 and 1) of flow_grpo and vlm_grpo;
- one 2-process DDP run (torchrun, gloo) of flow_grpo and of vlm_grpo.

    python benchmarks/golden_metrics.py record --out /tmp/golden/before      # old code
    python benchmarks/golden_metrics.py record --out /tmp/golden/after --models /tmp/golden/before/models
    python benchmarks/golden_metrics.py compare /tmp/golden/before /tmp/golden/after
    python benchmarks/golden_metrics.py resume /tmp/golden/before --out /tmp/golden/resumed   # new code

`resume` copies each recorded run and continues it for one more step with the current code: each must either
resume (exit 0, 4 rows) or be refused with a one-line error (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STEPS = 3
RECIPES = ("flow_grpo", "nft", "awm", "dpo", "dgpo")
PROMPTS = str(REPO / "assets" / "prompts" / "shapes_train.txt")
IMAGE_REWARD = {"jpeg_compressibility": 1.0}
VIDEO_REWARD = {"motion_amount": 1.0,
                "frames": {"reward": "video_frames", "image_reward": "jpeg_compressibility", "weight": 0.1}}
EDIT_REWARD = {"edit_region_color": 1.0, "edit_preservation": 0.5}


def family_cases() -> dict:
    """Pipeline class -> its family's first tiny case (builder and rollout settings: the smallest sizes its latent
    grid takes), declared in the family's file."""
    from mmrl.diffusion.models import tiny_cases

    out = {}
    for case in tiny_cases().values():
        out.setdefault(case.pipeline, case)
    return out


def family_reward(pipeline: str) -> dict:
    from mmrl.diffusion.models import MODEL_FAMILIES

    cls = MODEL_FAMILIES[pipeline]
    return EDIT_REWARD if cls.needs_source_image else VIDEO_REWARD if cls.is_video else IMAGE_REWARD


RECIPE_SETTINGS = {
    "flow_grpo": {"update": {"micro_batch_size": 4, "mini_batch_size": 2}, "algo": {"kl": {"coef": 0.01}, "ema": True},
                  "rollout": {"window_size": 2}},
    "nft": {"update": {"micro_batch_size": 4, "mini_batch_size": 2}, "algo": {"kl": {"coef": 0.1}}},
    "awm": {"update": {"micro_batch_size": 4}, "algo": {"num_train_timesteps": 2, "kl": {"coef": 0.1}}},
    "dpo": {"update": {"micro_batch_size": 2}, "algo": {"mode": "online", "beta": 100.0, "pairing": "all_pairs"}},
    "dgpo": {"update": {"micro_batch_size": 4},
             "algo": {"kl": {"coef": 0.1}, "trunc_steps": 1, "num_train_timesteps": 2}},
}
# tiny configs whose inputs a user makes first (`mmrl tiny runs/tiny`, `python -m mmrl.diffusion.dpo make-shapes-pairs`)
CONFIG_INPUTS = {"flow_grpo_wan_tiny": ["model.path={models}/WanPipeline"],
                 "dpo_tiny_offline": ["data.preference_file={models}/pairs/pairs.jsonl"]}
ASYNC = {"flow_grpo": "configs/diffusion/flow_grpo_tiny.yaml", "vlm_grpo": "configs/vlm/grpo_tiny_shapes.yaml"}
DDP = {**ASYNC, "janus_grpo": "configs/ar_image/janus_grpo_tiny.yaml"}  # recipes recorded on 2 processes too


def _cases(models: Path, edit_file: Path | None) -> list[dict]:
    """[{name, config (path or dict), overrides, nproc}] in a fixed order."""
    out = []
    for cfg in sorted(REPO.glob("configs/*/*tiny*.yaml")):
        overrides = [o.format(models=models) for o in CONFIG_INPUTS.get(cfg.stem, [])]
        out.append({"name": f"config/{cfg.stem}", "config": str(cfg.relative_to(REPO)), "overrides": overrides,
                    "nproc": 1})
    for family, case in family_cases().items():
        rollout, reward = case.rollout, family_reward(family)
        for recipe in RECIPES:
            d = {"algorithm": recipe, "seed": 11, "device": "cpu",
                 "model": {"path": str(models / family), "max_sequence_length": 16, "lora": {"rank": 4, "alpha": 8}},
                 "data": {"train_prompts": str(edit_file) if reward is EDIT_REWARD else PROMPTS},
                 "rollout": {"prompts_per_step": 2, "num_steps": 2, "group_size": 2, "eval_num_steps": 2, **rollout},
                 "optim": {"lr": 1e-3}, "reward": {"components": reward}, "log": {"sample_every": 1}}
            for key, section in RECIPE_SETTINGS[recipe].items():
                d[key] = {**d.get(key, {}), **section}
            out.append({"name": f"family/{family}/{recipe}", "config": d, "overrides": [], "nproc": 1})
    for recipe, cfg in ASYNC.items():
        for k in (0, 1):
            out.append({"name": f"async/{recipe}/staleness_{k}", "config": cfg, "nproc": 1,
                        "overrides": ["rollout.worker=process", f"rollout.max_staleness={k}"]})
    for recipe, cfg in DDP.items():
        out.append({"name": f"ddp/{recipe}", "config": cfg, "nproc": 2,
                    "overrides": ["dist.strategy=ddp", "dist.backend=gloo"]})
    return out


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               MMRL_NO_PROGRESS="1", TOKENIZERS_PARALLELISM="false")
    return env


def _train(case: dict, run_dir: Path, steps: int, extra: list[str] | None = None) -> subprocess.CompletedProcess:
    import yaml

    config = case["config"]
    if isinstance(config, dict):
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        path = run_dir.parent / f"{run_dir.name}.yaml"
        path.write_text(yaml.safe_dump(config))
        config = str(path)
    args = ["-m", "mmrl.cli", "train", config, f"output_dir={run_dir}", f"train.max_steps={steps}",
            "train.save_every=1", *case["overrides"], *(extra or [])]
    if case["nproc"] > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(case["nproc"]),
               *args]
    else:
        cmd = [sys.executable, *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=1800)


def _build_models(models: Path) -> Path:
    """Tiny checkpoints of every family and the edit rows, built once and shared by the record runs."""
    from mmrl.diffusion.dpo import make_shapes_preference_file
    from mmrl.pipelines.edits import make_shapes_edit_file

    models.mkdir(parents=True, exist_ok=True)
    for family, case in family_cases().items():
        if not (models / family / "model_index.json").is_file():
            case.build_at(models / family)
    if not (models / "pairs" / "pairs.jsonl").is_file():
        make_shapes_preference_file(models / "pairs", 32)
    edit_file = models / "edits" / "edits.jsonl"
    if not edit_file.is_file():
        made = make_shapes_edit_file(models / "edits", n=8, seed=1)
        if Path(made) != edit_file:
            edit_file = Path(made)
    return edit_file


def _edit_file(models: Path) -> Path:
    found = sorted((models / "edits").glob("*.jsonl"))
    return found[0] if found else models / "edits" / "edits.jsonl"


def record(out: Path, models: Path | None, only: str | None) -> int:
    models = models or out / "models"
    _build_models(models)
    failed = 0
    for case in _cases(models, _edit_file(models)):
        if only and only not in case["name"]:
            continue
        run_dir = out / "runs" / case["name"]
        if (run_dir / "DONE").is_file():
            continue
        if run_dir.exists():
            shutil.rmtree(run_dir)
        t = time.perf_counter()
        proc = _train(case, run_dir, STEPS)
        ok = proc.returncode == 0
        failed += not ok
        print(f"{case['name']:<55} {'ok' if ok else 'FAILED rc=' + str(proc.returncode)} "
              f"{time.perf_counter() - t:6.1f} s", flush=True)
        if ok:
            (run_dir / "DONE").write_text("")
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "FAILED.log").write_text(proc.stdout[-20000:] + "\n" + proc.stderr[-20000:])
    return 1 if failed else 0


def _rows(run_dir: Path, ignore: tuple[str, ...] = ()) -> list[dict]:
    from mmrl.testing import without_time

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [without_time(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(ignore)} for r in rows]


def compare(before: Path, after: Path, ignore: tuple[str, ...] = ()) -> int:
    names = sorted({str(p.parent.relative_to(before / "runs")) for p in (before / "runs").rglob("DONE")})
    bad = 0
    for name in names:
        a, b = _rows(before / "runs" / name, ignore), _rows(after / "runs" / name, ignore)
        if a == b and a:
            print(f"{name:<55} identical ({len(a)} rows)")
            continue
        bad += 1
        if not b:
            print(f"{name:<55} MISSING in {after}")
            continue
        diffs = []
        for ra, rb in zip(a, b):
            for key in sorted(set(ra) | set(rb)):
                if ra.get(key, "<absent>") != rb.get(key, "<absent>"):
                    diffs.append(f"step {ra.get('step')}: {key} {ra.get(key, '<absent>')} -> {rb.get(key, '<absent>')}")
        if len(a) != len(b):
            diffs.append(f"{len(a)} rows -> {len(b)} rows")
        print(f"{name:<55} DIFFERENT: " + "; ".join(diffs[:6]) + (f" (+{len(diffs) - 6} more)" if len(diffs) > 6 else ""))
    print(f"{len(names) - bad} of {len(names)} cases identical" + (f" (keys starting {list(ignore)} left out)"
                                                                   if ignore else ""))
    return 1 if bad else 0


def resume(before: Path, out: Path, only: str | None) -> int:
    models = before / "models"
    bad = 0
    for case in _cases(models, _edit_file(models)):
        src = before / "runs" / case["name"]
        if (only and only not in case["name"]) or not (src / "DONE").is_file():
            continue
        dst = out / "runs" / case["name"]
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(src, dst)
        recorded = src.parent / f"{src.name}.yaml"  # a generated case: the config file the record ran with
        if isinstance(case["config"], dict) and recorded.is_file():
            case = {**case, "config": str(recorded)}
        proc = _train(case, dst, STEPS + 1)
        rows = _rows(dst)
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("mmrl: error:")]
        steps = [r["step"] for r in rows if r["step"] > 0]  # (a step-0 row: an evaluation before training)
        if proc.returncode == 0 and steps == list(range(1, STEPS + 2)):
            verdict = "resumed"
        elif proc.returncode == 2 and len(lines) == 1:
            verdict = "refused: " + lines[0]
        else:
            verdict = f"FAILED rc={proc.returncode}: {proc.stderr.strip()[-300:]}"
            bad += 1
        print(f"{case['name']:<55} {verdict}", flush=True)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="run every case for 3 steps into OUT/runs")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--models", type=Path, default=None, help="tiny family checkpoints (default OUT/models)")
    rec.add_argument("--only", default=None, help="only the cases whose name contains this text")
    cmp_ = sub.add_parser("compare", help="compare two records row by row")
    cmp_.add_argument("before", type=Path)
    cmp_.add_argument("after", type=Path)
    cmp_.add_argument("--ignore", nargs="*", default=[], help="leave out keys starting with these (a deliberate "
                      "behaviour change confined to them)")
    res = sub.add_parser("resume", help="continue each recorded run for one step with the current code")
    res.add_argument("before", type=Path)
    res.add_argument("--out", type=Path, required=True)
    res.add_argument("--only", default=None)
    lst = sub.add_parser("list", help="print the cases")
    lst.add_argument("--models", type=Path, default=Path("MODELS"))
    args = parser.parse_args(argv)
    if args.cmd == "record":
        return record(args.out.resolve(), args.models.resolve() if args.models else None, args.only)
    if args.cmd == "compare":
        return compare(args.before.resolve(), args.after.resolve(), tuple(args.ignore))
    if args.cmd == "resume":
        return resume(args.before.resolve(), args.out.resolve(), args.only)
    for case in _cases(args.models, args.models / "edits" / "edits.jsonl"):
        print(f"{case['name']:<55} nproc={case['nproc']} {' '.join(case['overrides'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
