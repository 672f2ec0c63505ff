"""The `mmrl eval` subcommand (registered by `mmrl.cli.build_parser`):

    mmrl eval CONFIG.yaml [--checkpoint DIR] [--state default|old] [--prompts FILE] [--out DIR] [k=v ...]
"""

from __future__ import annotations

import argparse
import json

__all__ = ["add_eval_subparser", "cmd_eval"]


class _OverridesAnywhereParser(argparse.ArgumentParser):
    """`mmrl eval CONFIG --checkpoint DIR k=v`: argparse leaves `key=value` words that follow an option
    unrecognized (the `overrides` positional was already matched, empty); they are overrides too."""

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        extra = [a for a in rest if "=" in a and not a.startswith("-")]
        ns.overrides = [*(getattr(ns, "overrides", None) or []), *extra]
        return ns, [a for a in rest if a not in extra]


def cmd_eval(args: argparse.Namespace) -> int:
    from mmrl.config import load_config
    from mmrl.eval.harness import run_eval

    cfg = load_config(args.config, args.overrides)
    report = run_eval(cfg, args.checkpoint, state=args.state, prompts=args.prompts, out=args.out, seed=args.seed,
                      samples_per_prompt=args.samples_per_prompt, max_prompts=args.max_prompts,
                      batch_size=args.batch_size, config_file=args.config, overrides=args.overrides)
    keys = ("out_dir", "policy", "reward", "components")
    summary = {**{k: report[k] for k in keys}, "compositional": report["compositional"]["accuracy"]}
    print(json.dumps(summary, indent=2, default=str))
    return 0


def add_eval_subparser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    ev = sub.add_parser("eval", help="score a diffusion checkpoint (or the base model) on held-out prompts: every "
                                     "configured reward + a GenEval-style shapes check -> eval_report.json")
    ev.__class__ = _OverridesAnywhereParser  # k=v overrides may also follow the options
    ev.add_argument("config", help="the diffusion recipe config (the one the checkpoint was trained with)")
    ev.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.eval_num_steps=20")
    ev.add_argument("--checkpoint", help="a run directory (its newest checkpoint), checkpoints/step_N/ or its "
                                         "adapters/; omitted: the base model")
    ev.add_argument("--state", default="default", choices=["default", "old"],
                    help="policy state of the checkpoint (old = the EMA / old policy, when the run kept one)")
    ev.add_argument("--prompts", help="prompt file (.txt / .jsonl); default: the config's data.eval_prompts")
    ev.add_argument("--out", help="output directory; default: <run>/eval/<step_N>[_old] in the checkpoint's run "
                                  "directory (the base model: <output_dir>/eval/base)")
    ev.add_argument("--seed", type=int, help="noise seed (default: the config's seed)")
    ev.add_argument("--samples-per-prompt", type=int, default=1, help="images per prompt (default 1)")
    ev.add_argument("--max-prompts", type=int, default=0, help="only the first N prompts (default 0 = all)")
    ev.add_argument("--batch-size", type=int, default=8, help="images per sampler / reward call (default 8)")
    ev.set_defaults(func=cmd_eval)
    return ev
