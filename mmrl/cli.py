"""`mmrl` command line.

    mmrl train CONFIG.yaml [dotted.key=value ...]   run the recipe named by the YAML's `algorithm:`
    mmrl config dump ALGO                            a recipe's defaults as commented YAML
    mmrl config check CONFIG.yaml [k=v ...]          validate a config and print it resolved
    mmrl eval CONFIG.yaml [--checkpoint DIR] [k=v]   score a diffusion checkpoint: rewards + shapes check
    mmrl export RUN --format F --out DIR             a checkpoint as diffusers / kohya / transformers / peft files
    mmrl reward list | score | serve                 the reward zoo without a trainer
    mmrl reward train CONFIG.yaml [k=v ...]          fit a reward model to preference pairs (reward_bt)
    mmrl label SOURCE --out FILE                     a local page to label preference pairs by hand
    mmrl tiny DIR [--head-dim N]                     build the tiny real-architecture models into DIR
    mmrl demo [vlm|diffusion|all]                    the CPU demos `make demo` runs
    mmrl --version                                   mmrl's version, the torch stack's and torch's device build
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mmrl.config import RECIPES, ConfigError, default_config, load_config, recipe_module, to_yaml
from mmrl.rewards.remote import RemoteRewardError
from mmrl.run.directory import started_run_dir
from mmrl.run.files import RunError, list_checkpoints

# errors a user can fix from the message alone: printed without a traceback (MMRL_DEBUG=1 shows it)
USER_ERRORS = (ConfigError, FileNotFoundError, ValueError, RunError, RemoteRewardError)
DEMO_CONFIGS = {
    "diffusion": "configs/diffusion/flow_grpo_tiny.yaml",
    "vlm": "configs/vlm/grpo_tiny_shapes.yaml",
}


def _package_root() -> Path:
    return Path(__file__).resolve().parent.parent


def resume_hint(output_dir: str | Path) -> str:
    """Where a failed run stands: the newest complete checkpoint a rerun resumes from (or that none exists)."""
    ckpts = list_checkpoints(Path(output_dir) / "checkpoints")
    if not ckpts:
        return f"no checkpoint was written in {output_dir}: a rerun starts from step 0"
    step, path = ckpts[-1]
    return f"nothing of the failed step was saved; rerun the same command to resume from step {step} ({path})"


def cmd_train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    try:
        summary = recipe_module(cfg.algorithm).train(cfg)
    except (Exception, KeyboardInterrupt) as exc:
        from mmrl.distributed.launch import lost_rank_message

        lost = lost_rank_message(exc)  # (a collective broken by another rank's death: one line, not gloo's)
        err = RunError(lost) if lost else exc
        if started_run_dir() == Path(cfg.output_dir).resolve():  # the run had started: say where it can go on from
            err.add_note(resume_hint(cfg.output_dir))
        if err is not exc:
            raise err from exc
        raise
    if summary:  # non-main ranks of a multi-process run return nothing to report
        print(json.dumps(summary, indent=2, default=str))
    return 0


def cmd_config_dump(args: argparse.Namespace) -> int:
    sys.stdout.write(to_yaml(default_config(args.algorithm)))
    return 0


def cmd_config_check(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    sys.stdout.write(to_yaml(cfg, comments=False))
    return 0



def cmd_tiny(args: argparse.Namespace) -> int:
    from mmrl import tiny

    if Path(args.dir).exists() and not Path(args.dir).is_dir():
        raise ValueError(f"mmrl tiny: {args.dir} exists and is not a directory; give a (new or existing) directory")
    out = tiny.build_all(args.dir, vlm_head_dim=args.head_dim)
    print(json.dumps(out, indent=2, default=str))
    return 0


# config keys of the demo recipes that name files or folders: made absolute by `demo_config`
DEMO_PATH_KEYS = ("model.path", "data.train_prompts", "data.eval_prompts", "data.preference_file", "data.image_root",
                  "data.path", "data.val_path")


def demo_config(name: str, output_dir: str | Path, overrides: list[str] | tuple = ()):
    """The config of demo `name` with every path absolute, so it runs from any current directory.

    The demo YAMLs name shipped files relative to the checkout (`assets/...`: resolved against the package root)
    and what the demo writes under `runs/` (run dirs, the tiny VLM it builds on first use: put under
    `output_dir` instead, `runs/x` -> `output_dir/x`); the run dir is `output_dir/demo_<name>`. User `overrides`
    come last and keep their usual meaning (relative paths from the current directory)."""
    from mmrl.config import apply_overrides

    root = _package_root()
    if not (root / "assets").is_dir():
        raise FileNotFoundError(f"the demo needs the source checkout's configs/ and assets/ beside mmrl/; "
                                f"not found under {root}")
    path = root / DEMO_CONFIGS[name]
    if not path.is_file():
        raise FileNotFoundError(f"demo config missing: {path}")
    out = Path(output_dir).resolve()
    cfg = load_config(path)
    cfg.output_dir = str(out / f"demo_{name}")
    for key in DEMO_PATH_KEYS:
        section, field = key.split(".")
        obj = getattr(cfg, section, None)
        value = getattr(obj, field, None)
        if isinstance(value, str) and value and not Path(value).is_absolute():
            parts = Path(value).parts
            setattr(obj, field, str(out.joinpath(*parts[1:]) if parts[0] == "runs" else root / value))
    return apply_overrides(cfg, overrides)


def cmd_demo(args: argparse.Namespace) -> int:
    which = ["diffusion", "vlm"] if args.which == "all" else [args.which]
    configs = {name: demo_config(name, args.output_dir, args.overrides) for name in which}  # all checked first
    results = {}
    for name, cfg in configs.items():
        print(f"== mmrl demo: {name} ({DEMO_CONFIGS[name]}) -> {cfg.output_dir}", flush=True)
        results[name] = recipe_module(cfg.algorithm).train(cfg)
    print(json.dumps(results, indent=2, default=str))
    for name, summary in results.items():
        print(f"== {name}: {demo_result_line(name, summary, configs[name])}; run dir {configs[name].output_dir} "
              f"(samples/, plots/reward_curve.png, metrics.jsonl)")
    return 0


# the demos' own checks (what docs/index.md reports), not verdicts on every run
DEMO_MIN_RISE_STD = 2.0


def demo_result_line(name: str, summary: dict, cfg) -> str:
    """What a demo's result means, in words that cannot be mistaken for another number: the VLM demo's greedy eval
    accuracy (the training reward is of sampled responses), the diffusion demo's reward rise and its check."""
    from mmrl.training.summary import reward_axis

    unit = reward_axis(cfg)["unit"]
    first, last = summary.get("reward_first5", summary.get("reward_first")), summary.get("reward_last5",
                                                                                         summary.get("reward_last"))
    train = (f"train reward ({unit}, sampled rollouts) first 5 steps {first:.4g} -> last 5 steps {last:.4g}"
             if None not in (first, last) else "no training steps logged")
    acc_first, acc_last = summary.get("eval_accuracy_first"), summary.get("eval_accuracy_last")
    if acc_first is not None and acc_last is not None:
        return f"greedy eval accuracy {acc_first:.3f} -> {acc_last:.3f}; {train}"
    if acc_last is not None:  # a run resumed from a checkpoint that does not keep the accuracy before RL
        return f"greedy eval accuracy {acc_last:.3f} (last evaluation); {train}"
    rise = summary.get("reward_rise_in_std")
    if rise is not None:
        verdict = "met" if rise > DEMO_MIN_RISE_STD else "not met"
        return (f"{train} = {rise:+.1f} std of the first steps (the demo expects > {DEMO_MIN_RISE_STD:g}: "
                f"{verdict})")
    return train


class VersionAction(argparse.Action):
    """`mmrl --version`: mmrl's version, then the install check's line (torch, torchvision, diffusers, transformers,
    peft and torch's device build; or what does not import together and the fix: exit code 1)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        import platform

        import mmrl
        from mmrl import install_check

        print(f"mmrl {mmrl.__version__} (Python {platform.python_version()}, {Path(mmrl.__file__).parent})", flush=True)
        outcome = install_check.check()
        print(outcome.line, file=sys.stdout if outcome.ok else sys.stderr)
        parser.exit(0 if outcome.ok else 1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmrl", description="RL fine-tuning of generative multimodal models.")
    p.add_argument("--version", action=VersionAction,
                   help="print mmrl's version, the versions of torch, torchvision, diffusers, transformers and peft "
                        "and torch's device build (CPU / CUDA), then exit")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train with a recipe config: mmrl train CONFIG.yaml [key=value ...]")
    t.add_argument("config", help="YAML file with a top-level `algorithm:` key")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=10 optim.lr=1e-4")
    t.set_defaults(func=cmd_train)

    c = sub.add_parser("config", help="show or check configs")
    csub = c.add_subparsers(dest="config_command", required=True)
    d = csub.add_parser("dump", help="print a recipe's default config as commented YAML")
    d.add_argument("algorithm", choices=sorted(RECIPES))
    d.set_defaults(func=cmd_config_dump)
    ck = csub.add_parser("check", help="validate a config (with overrides) and print it resolved")
    ck.add_argument("config")
    ck.add_argument("overrides", nargs="*")
    ck.set_defaults(func=cmd_config_check)

    from mmrl.eval.cli import add_eval_subparser

    add_eval_subparser(sub)  # mmrl eval CONFIG [--checkpoint DIR] ...
    from mmrl.export.cli import add_export_subparser

    add_export_subparser(sub)  # mmrl export RUN_OR_CHECKPOINT --format F --out DIR
    from mmrl.label.cli import add_label_subparser

    add_label_subparser(sub)  # mmrl label SOURCE --out preferences.jsonl

    try:
        from mmrl.rewards.cli import add_reward_subparsers
    except ImportError:  # pragma: no cover - the zoo CLI ships with the package
        add_reward_subparsers = None
    if add_reward_subparsers is not None:
        add_reward_subparsers(sub, train=cmd_train)  # + `mmrl reward train` (a reward_bt config)

    tb = sub.add_parser("tiny", help="build tiny random real-architecture models (SD3, FLUX.1/2, Z-Image, Wan, "
                                      "Qwen-VL, CLIP) into DIR")
    tb.add_argument("dir")
    tb.add_argument("--head-dim", type=int, default=16, metavar="N",
                    help="head size of the VLM text decoders (Qwen2-VL / 2.5-VL, GLM-4.1V, InternVL; default 16; "
                         "vLLM's CPU backend needs 32, 64, ...)")
    tb.set_defaults(func=cmd_tiny)

    dm = sub.add_parser("demo", help="run the CPU demos (what `make demo` runs)")
    dm.add_argument("which", nargs="?", default="all", choices=["all", "diffusion", "vlm"])
    dm.add_argument("--output-dir", default="runs", metavar="DIR",
                    help="where the run dirs (DIR/demo_diffusion, DIR/demo_vlm) and the tiny VLM the demo builds go "
                         "(default: ./runs under the current directory)")
    dm.add_argument("overrides", nargs="*", help="dotted overrides applied to the demo configs")
    dm.set_defaults(func=cmd_demo)
    return p


def _close_progress_bars() -> None:
    """Close the bars a failure left open: their last line ends with a newline, so the error starts a line of its
    own (a run that fails inside step 1 would otherwise print 'dpo:   0%|...|mmrl: error: ...')."""
    tqdm = sys.modules.get("tqdm.std")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # `mmrl demo vlm --output-dir D k=v`: argparse stops taking positionals after an option
        overrides = getattr(args, "overrides", None)
        if isinstance(overrides, list) and all("=" in e and not e.startswith("-") for e in extra):
            overrides += extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from mmrl.run.start import hide_hf_progress_bars

    # MMRL_NO_PROGRESS=1 (or `reward score --no-progress`): also the bars of the models a command loads
    hide_hf_progress_bars(force=bool(getattr(args, "no_progress", False)))
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as exc:
        if os.environ.get("MMRL_DEBUG") == "1":
            raise
        notes = "".join(f"; {n}" for n in getattr(exc, "__notes__", ()))
        _close_progress_bars()
        print(f"mmrl: error: {exc}{notes}  (MMRL_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        notes = "; ".join(getattr(exc, "__notes__", ())) or "the newest complete checkpoint is kept; rerun to resume"
        print(f"mmrl: interrupted ({notes})", file=sys.stderr)
        return 130


def entry() -> None:
    """The `mmrl` console script and `python -m mmrl.cli`: :func:`main`, then exit. A process started by a launcher
    (torchrun / accelerate launch) exits without interpreter finalization (`mmrl.distributed.exit_launched_process`)."""
    code = main()
    from mmrl.distributed import exit_launched_process

    exit_launched_process(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
