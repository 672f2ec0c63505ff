"""The `mmrl eval` subcommand (registered by `mmrl.cli.build_parser`):

    mmrl eval CONFIG.yaml [--checkpoint DIR] [--state default|old] [--prompts FILE] [--out DIR] [k=v ...]
    mmrl eval RUN_OR_CHECKPOINT_OR_EXPORT [--config CONFIG.yaml] [--out DIR] [--max-prompts N] [k=v ...]

A diffusion config is scored by `mmrl.eval.harness.run_eval`, a VLM one (vlm_grpo, vlm_multiturn) by
`mmrl.eval.vlm.run_vlm_eval`; what the first argument names is resolved by `mmrl.eval.target.resolve_target`.
"""

from __future__ import annotations

import argparse
import json

__all__ = ["add_eval_subparser", "cmd_eval"]

DIFFUSION_ONLY = ("prompts", "seed", "samples_per_prompt")  # options a VLM evaluation has no use for


class _OverridesAnywhereParser(argparse.ArgumentParser):
    """`mmrl eval CONFIG --checkpoint DIR k=v`: argparse leaves `key=value` words that follow an option
    unrecognized (the `overrides` positional was already matched, empty); they are overrides too."""

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        extra = [a for a in rest if "=" in a and not a.startswith("-")]
        ns.overrides = [*(getattr(ns, "overrides", None) or []), *extra]
        return ns, [a for a in rest if a not in extra]


def cmd_eval(args: argparse.Namespace) -> int:
    from mmrl.eval.harness import run_eval
    from mmrl.eval.target import resolve_target

    target = resolve_target(args.target, config=args.config, checkpoint=args.checkpoint, overrides=args.overrides)
    cfg = target.cfg
    if target.family == "vlm":
        from mmrl.eval.vlm import run_vlm_eval

        given = [f"--{k.replace('_', '-')}" for k in DIFFUSION_ONLY if getattr(args, k) is not None]
        if given:
            raise ValueError(f"mmrl eval: {given[0]} is an option of the diffusion evaluation; a {cfg.algorithm} "
                             f"evaluation uses the run's own eval set (change it with key=value overrides, e.g. "
                             f"data.eval_size=N)")
        report = run_vlm_eval(target, state=args.state, out=args.out, max_prompts=args.max_prompts or 0,
                              batch_size=args.batch_size or 0, overrides=args.overrides)
        keys = ("out_dir", "policy", "num_evaluated", "metrics", "reward", "components", "return")
        print(json.dumps({k: report[k] for k in keys if k in report}, indent=2, default=str))
        return 0
    given = {k: getattr(args, k) for k in ("prompts", "seed", "samples_per_prompt", "max_prompts", "batch_size")
             if getattr(args, k) is not None}
    report = run_eval(cfg, target.checkpoint, state=args.state, out=args.out, config_file=str(target.config_file),
                      overrides=args.overrides, **given)
    keys = ("out_dir", "policy", "reward", "components")
    summary = {**{k: report[k] for k in keys}, "compositional": report["compositional"]["accuracy"]}
    print(json.dumps(summary, indent=2, default=str))
    return 0


def add_eval_subparser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    ev = sub.add_parser("eval", help="score a checkpoint: a diffusion one on held-out prompts (every reward + a "
                                     "GenEval-style shapes check), a VLM one by greedy answers on its eval set "
                                     "(accuracy, every reward, answers.jsonl) -> eval_report.json")
    ev.__class__ = _OverridesAnywhereParser  # k=v overrides may also follow the options
    ev.add_argument("target", metavar="CONFIG_OR_RUN",
                    help="a recipe config (the one the checkpoint was trained with; with --checkpoint, or alone: the "
                         "base model), or a run directory (its newest checkpoint), checkpoints/step_N/ or its "
                         "adapters/ (with the config.yaml it was trained with), or a VLM export (mmrl export "
                         "--format transformers|peft)")
    ev.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.eval_num_steps=20 data.eval_size=32")
    ev.add_argument("--checkpoint", help="with a config: a run directory (its newest checkpoint), checkpoints/step_N/ "
                                         "or its adapters/; omitted: the base model")
    ev.add_argument("--config", help="with a run, checkpoint or export directory: the config it was trained with "
                                     "(default: the checkpoint's own config.yaml)")
    ev.add_argument("--state", default="default", choices=["default", "old"],
                    help="policy state of the checkpoint (old = the EMA / old policy, when the run kept one)")
    ev.add_argument("--prompts", help="diffusion: prompt file (.txt / .jsonl); default: the config's "
                                      "data.eval_prompts")
    ev.add_argument("--out", help="output directory; default: <run>/eval/<step_N>[_old] in the checkpoint's run "
                                  "directory (the base model: <output_dir>/eval/base; an export: "
                                  "<output_dir>/eval/export_<name>)")
    ev.add_argument("--seed", type=int, help="diffusion: noise seed (default: the config's seed)")
    ev.add_argument("--samples-per-prompt", type=int, help="diffusion: images per prompt (default 1)")
    ev.add_argument("--max-prompts", type=int, help="only the first N prompts / eval questions (default: all)")
    ev.add_argument("--batch-size", type=int,
                    help="diffusion: images per sampler / reward call (default 8); VLM: prompts generated together "
                         "(default: rollout.micro_batch_size, the run's own batches)")
    ev.set_defaults(func=cmd_eval)
    return ev
