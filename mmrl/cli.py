"""`mmrl` command line.

    mmrl train CONFIG.yaml [dotted.key=value ...]   run the recipe named by the YAML's `algorithm:`
    mmrl config dump ALGO                            a recipe's defaults as commented YAML
    mmrl config check CONFIG.yaml [k=v ...]          validate a config and print it resolved
    mmrl reward list | score | serve                 the reward zoo without a trainer
    mmrl tiny DIR                                    build the tiny real-architecture models into DIR
    mmrl demo [vlm|diffusion|all]                    the CPU demos `make demo` runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mmrl.config import RECIPES, ConfigError, default_config, load_config, recipe_module, to_yaml

# errors a user can fix from the message alone: printed without a traceback (MMRL_DEBUG=1 shows it)
USER_ERRORS = (ConfigError, FileNotFoundError, ValueError)
DEMO_CONFIGS = {
    "diffusion": "configs/diffusion/flow_grpo_tiny.yaml",
    "vlm": "configs/vlm/grpo_tiny_shapes.yaml",
}


def _package_root() -> Path:
    return Path(__file__).resolve().parent.parent


def cmd_train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    summary = recipe_module(cfg.algorithm).train(cfg)
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
    out = tiny.build_all(args.dir)
    print(json.dumps(out, indent=2, default=str))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    which = ["diffusion", "vlm"] if args.which == "all" else [args.which]
    root = _package_root()
    if not (root / "assets").is_dir():
        raise FileNotFoundError(f"the demo runs from a source checkout (configs/ and assets/ beside mmrl/); not found under {root}")
    os.chdir(root)  # the demo configs name assets/ and runs/ relative to the checkout
    results = {}
    for name in which:
        path = root / DEMO_CONFIGS[name]
        if not path.is_file():
            raise FileNotFoundError(f"demo config missing: {path}")
        overrides = [f"output_dir=runs/demo_{name}", *args.overrides]
        cfg = load_config(path, overrides)
        print(f"== mmrl demo: {name} ({path.relative_to(root)}) -> {cfg.output_dir}", flush=True)
        results[name] = recipe_module(cfg.algorithm).train(cfg)
    print(json.dumps(results, indent=2, default=str))
    for name, summary in results.items():
        first, last = summary.get("reward_first"), summary.get("reward_last")
        if first is not None and last is not None:
            print(f"== {name}: reward first 5 steps {first:.4f} -> last 5 steps {last:.4f}; "
                  f"run dir {summary.get('output_dir')} (samples/, plots/reward_curve.png, metrics.jsonl)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmrl", description="RL fine-tuning of generative multimodal models.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train with a recipe config: mmrl train CONFIG.yaml [key=value ...]")
    t.add_argument("config", help="YAML file with a top-level `algorithm:` key")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=10 train.lr=1e-4")
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

    try:
        from mmrl.rewards.cli import add_reward_subparsers
    except ImportError:  # pragma: no cover - the zoo CLI ships with the package
        add_reward_subparsers = None
    if add_reward_subparsers is not None:
        add_reward_subparsers(sub)

    tb = sub.add_parser("tiny", help="build tiny random real-architecture models (SD3, FLUX, Qwen-VL, CLIP) into DIR")
    tb.add_argument("dir")
    tb.set_defaults(func=cmd_tiny)

    dm = sub.add_parser("demo", help="run the CPU demos (what `make demo` runs)")
    dm.add_argument("which", nargs="?", default="all", choices=["all", "diffusion", "vlm"])
    dm.add_argument("overrides", nargs="*", help="dotted overrides applied to the demo configs")
    dm.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as exc:
        if os.environ.get("MMRL_DEBUG") == "1":
            raise
        print(f"mmrl: error: {exc}  (MMRL_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mmrl: interrupted (the newest complete checkpoint is kept; rerun to resume)", file=sys.stderr)
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
