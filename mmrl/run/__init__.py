"""The run layer: one place to read how a run is started, saved, resumed and refused.

- `start.py`: `start_run` (the process group and the run directory), `closes_runs` (whatever ends train()).
- `directory.py`: `Run`, the run directory: config.yaml, metrics.jsonl, samples, the reward curve, atomic checkpoints.
- `lock.py`: one run per directory (an flock the kernel drops with its holder).
- `resume.py`: what a start may do with what the directory holds (resume, refuse, overwrite; changed config keys).
- `checkpoint.py`: the one checkpoint layout (policy states, optimizer, RNG, data position, trackers), written and
  read the same way under one process, DDP and FSDP; `sharded.py`: torch.distributed.checkpoint shards;
  `consolidate.py`: sharded -> whole (`python -m mmrl.run.consolidate`).
- `files.py`: manifests, the refusal of files that would run code, full disks, `RunError`.
- `trackers.py` (TensorBoard, W&B), `plots.py` (sample grids, the reward curve).

Names are imported from their modules (`from mmrl.run.directory import Run`); the most used are also here, loaded
on first use so that importing one module of the layer (e.g. `mmrl.run.files` from a model loader) stays light.
"""

_NAMES = {
    "Run": "directory", "RunError": "files", "NonFiniteError": "files", "start_run": "start",
    "closes_runs": "start", "save_checkpoint": "checkpoint", "restore_checkpoint": "checkpoint",
    "checkpoint_due": "checkpoint", "FullOptimizerState": "checkpoint",
}


def __getattr__(name: str):
    if name in _NAMES:
        import importlib

        return getattr(importlib.import_module(f"mmrl.run.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'mmrl.run' has no attribute {name!r}")
