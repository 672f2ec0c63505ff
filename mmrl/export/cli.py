"""The `mmrl export` subcommand (registered by `mmrl.cli.build_parser`):

    mmrl export RUN_OR_CHECKPOINT --format FORMAT --out DIR [--state default|old] [--config CONFIG.yaml]
                [--base PATH] [--dtype auto|float32|bfloat16|float16] [--overwrite]
"""

from __future__ import annotations

import argparse
import json

__all__ = ["add_export_subparser", "cmd_export"]


def cmd_export(args: argparse.Namespace) -> int:
    from mmrl.export import export

    meta = export(args.checkpoint, args.format, args.out, state=args.state, config=args.config, base=args.base,
                  dtype=args.dtype, overwrite=args.overwrite)
    print(json.dumps({k: meta[k] for k in ("format", "out", "base_model", "loaded_by", "source") if k in meta}, indent=2))
    return 0


def add_export_subparser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from mmrl.export import FORMATS

    formats = "; ".join(f"{name}: {help_}" for name, (_, _, help_) in FORMATS.items())
    ex = sub.add_parser("export", help="write a checkpoint as a diffusers LoRA / merged pipeline / kohya file, or a "
                                       "merged transformers model / peft adapter",
                        description=f"Formats: {formats}.")
    ex.add_argument("checkpoint", help="a run directory (its newest complete checkpoint), checkpoints/step_N/ or its "
                                       "adapters/")
    ex.add_argument("--format", required=True, choices=sorted(FORMATS), help="the output format (see above)")
    ex.add_argument("--out", required=True, help="output directory (new or empty; written atomically); never the run "
                                                 "or checkpoint being exported, nor inside it")
    ex.add_argument("--state", default="default", choices=["default", "old"],
                    help="policy state (old = the EMA / old policy, when the run kept one)")
    ex.add_argument("--config", help="the config the checkpoint was trained with (default: its own config.yaml)")
    ex.add_argument("--base", help="the base model directory (default: the config's model.path)")
    ex.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="weights dtype of the merged formats (auto: the base model's stored dtype)")
    ex.add_argument("--overwrite", action="store_true",
                    help="replace an earlier export in --out (a directory holding mmrl_export.json); a run, a "
                         "checkpoint or other files are never replaced")
    ex.set_defaults(func=cmd_export)
    return ex
