"""A sharded checkpoint (`dist.checkpoint: sharded`) rewritten as the gathered layout, in one process:

    python -m mmrl.run.consolidate runs/x/checkpoints/step_40 runs/x-full/step_40 [--weights-only]

The output is what a run with `dist.checkpoint: full` writes: `adapters/<state>/model.safetensors` per full fine-tuning
state (parameter names as in the model: loadable into the diffusers / transformers model, see docs/scaling.md),
the LoRA files as they were, and `state.pt` with the whole AdamW state, plus config.yaml, MANIFEST.json and COMPLETE.
It resumes like any checkpoint (`train.resume=OUT`; name OUT `step_<N>`). `--weights-only` skips the optimizer (it
writes only adapters/ and config.yaml, not a resumable checkpoint): memory is then one policy state at a time, and
the optimizer's two moments per weight are never read. The output appears atomically (temp dir, then rename).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from mmrl.run.sharded import OPTIMIZER_MARK, SHARDED_DIR


def _full_optimizer(meta: dict, path: Path, key: str) -> dict:
    """A sharded checkpoint's optimizer entry as `optimizer.state_dict()` (parameter indices, whole tensors)."""
    from mmrl.distributed import dcp_load, dcp_tensor_metadata

    prefix = f"{key}."
    state: dict[str, dict] = {}
    for flat, m in dcp_tensor_metadata(path).items():
        if flat.startswith(prefix):
            name, _, skey = flat[len(prefix):].rpartition(".")
            state.setdefault(name, {})[skey] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    if state:
        dcp_load({key: state}, path)
    for name, other in meta.get("scalars", {}).items():
        state.setdefault(name, {}).update(other)
    index = {n: i for i, n in enumerate(n for g in meta["param_groups"] for n in g["params"])}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in meta["param_groups"]]
    return {"state": {index[n]: st for n, st in state.items()}, "param_groups": groups}


def checkpoint_optimizer_state(ckpt: str | Path, key: str = "optimizer") -> dict:
    """The optimizer state of checkpoint `ckpt` (either format) as `optimizer.state_dict()` with whole tensors."""
    from mmrl.run.files import load_state_file

    saved = load_state_file(Path(ckpt) / "state.pt")["stateful"][key]
    return _full_optimizer(saved, Path(ckpt) / SHARDED_DIR, key) if saved.get(OPTIMIZER_MARK) else saved


def checkpoint_weights(ckpt: str | Path, state: str = "default") -> dict[str, torch.Tensor]:
    """The full fine-tuning weights of policy state `state` of checkpoint `ckpt` (either format), whole tensors
    by parameter name (what `adapters/<state>/model.safetensors` of the gathered format holds)."""
    from safetensors.torch import load_file

    from mmrl.adapters import FULL_WEIGHTS_NAME, load_sharded_state, sharded_weights_dir

    adapters = Path(ckpt) / "adapters"
    if sharded_weights_dir(adapters) is not None:
        return load_sharded_state(adapters, state)
    return load_file(str(adapters / state / FULL_WEIGHTS_NAME))


def consolidate_checkpoint(ckpt: str | Path, out: str | Path, weights_only: bool = False) -> Path:
    """Write the gathered form of sharded checkpoint `ckpt` to `out` (see the module docstring); returns `out`."""
    from safetensors.torch import save_file

    from mmrl.adapters import FULL_WEIGHTS_NAME, INDEX_NAME, load_sharded_state, sharded_weights_dir
    from mmrl.run.files import COMPLETE_MARKER, checkpoint_step, load_state_file, verify_checkpoint, write_manifest

    ckpt, out = Path(ckpt), Path(out)
    checkpoint_step(ckpt)  # a complete step_<N> directory
    verify_checkpoint(ckpt)
    state = load_state_file(ckpt / "state.pt")
    if "sharded" not in state:
        raise ValueError(f"{ckpt} is not a sharded checkpoint (no 'sharded' entry in its state.pt): it already has "
                         f"the gathered layout")
    if out.exists():
        raise FileExistsError(f"{out} exists: choose a new output directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(ckpt / "adapters", tmp / "adapters")
        shutil.copy2(ckpt / "config.yaml", tmp / "config.yaml")
        index_path = tmp / "adapters" / INDEX_NAME
        index = json.loads(index_path.read_text())
        if sharded_weights_dir(ckpt / "adapters") is not None:
            for name in index["written"]:  # one state in memory at a time
                sub = tmp / "adapters" / name
                sub.mkdir(parents=True, exist_ok=True)
                save_file({k: v.contiguous() for k, v in load_sharded_state(ckpt / "adapters", name).items()},
                          str(sub / FULL_WEIGHTS_NAME), metadata={"format": "pt"})
            index.pop("weights")
            index.pop("sharded_dir")
            index_path.write_text(json.dumps(index, indent=2) + "\n")
        if not weights_only:
            stateful = dict(state["stateful"])
            for key, meta in stateful.items():
                if isinstance(meta, dict) and meta.get(OPTIMIZER_MARK):
                    stateful[key] = _full_optimizer(meta, ckpt / SHARDED_DIR, key)
            torch.save({**{k: v for k, v in state.items() if k != "sharded"}, "stateful": stateful}, tmp / "state.pt")
            write_manifest(tmp)
            (tmp / COMPLETE_MARKER).write_text((ckpt / COMPLETE_MARKER).read_text())
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmrl.run.consolidate",
                                 description="Rewrite a sharded mmrl checkpoint as whole tensors (the gathered layout).")
    ap.add_argument("checkpoint", help="a complete checkpoints/step_<N>/ directory written with dist.checkpoint=sharded")
    ap.add_argument("out", help="new directory to write (name it step_<N> to resume from it)")
    ap.add_argument("--weights-only", action="store_true",
                    help="only the policy weights (adapters/ + config.yaml); the optimizer state is not read")
    args = ap.parse_args(argv)
    try:
        out = consolidate_checkpoint(args.checkpoint, args.out, weights_only=args.weights_only)
    except (ValueError, OSError, RuntimeError) as exc:  # RunError (a corrupt checkpoint) is a RuntimeError
        print(f"consolidate: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(out), "weights_only": args.weights_only}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
