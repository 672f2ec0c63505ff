"""Sharded checkpoints: the optimizer state and full fine-tuning weights written by every rank with
torch.distributed.checkpoint (DCP), nothing gathered.

A gathered checkpoint makes every rank hold the whole optimizer state (AdamW: two moments per trainable weight) and
every full fine-tuning state in full while rank 0 writes them: ~56 GB of CPU memory per rank for a 7B full fine-tune.
Here each rank writes only the shards it holds; DCP's ``.metadata`` records every tensor's global shape and chunks, so
a load reads back exactly the slices a rank needs, with any number of ranks and under any strategy (FSDP2 DTensor
shards, DDP or a single process with plain tensors). Inside ``checkpoints/step_N/`` (``mmrl.run.checkpoint``)::

    sharded/   .metadata, __<rank>_0.distcp   {"policy": {state: {param name: tensor}} (full fine-tuning only),
                                               "optimizer": {param name: {"exp_avg": .., "exp_avg_sq": .., "step": ..}}}
    adapters/  policy_states.json ("weights": "sharded"); LoRA adapters are small and stay whole peft/diffusers files
    state.pt   stateful["optimizer"] = {"sharded": "optimizer", "param_groups": [.. "params": [param names] ..],
               "scalars": non-tensor state}; everything else as in a gathered checkpoint

The MANIFEST / COMPLETE marker / atomic rename of ``Run.checkpoint`` cover the shard files too (rank 0 writes the
manifest after ``dcp.save`` has returned, i.e. after every rank has written). The optimizer state is keyed by
parameter name rather than through ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``, which
initialises a fresh optimizer's state by a zero-gradient ``step()``: a checkpoint written before any update, or
parameters that never had a gradient, must come back with no state, as the uninterrupted run has.
``python -m mmrl.run.consolidate`` writes the whole tensors (the gathered layout) from a sharded checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

SHARDED_DIR = "sharded"
OPTIMIZER_MARK = "sharded"  # key of a state.pt optimizer entry whose tensors are in the DCP directory


def _param_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in `model` for every parameter the optimizer holds (ValueError if one is not
    a parameter of `model`: names are what make the state independent of the number of ranks)."""
    reshard_fsdp(model)
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
    if missing:
        raise ValueError(f"sharded checkpoint: {len(missing)} optimizer parameter(s) are not parameters of the policy "
                         f"model, so they have no name to be saved under (shapes {[tuple(p.shape) for p in missing[:3]]}"
                         f"{' ...' if len(missing) > 3 else ''})")
    return names


def reshard_fsdp(model: nn.Module) -> None:
    """Put every FSDP2 module back in its sharded state. A module whose forward ran outside autograd (generation,
    evaluation: no backward hook reshards it) and that keeps its parameters after forward (the root, by FSDP2's
    default) has its unsharded parameters registered until its next forward; the optimizer holds the sharded ones."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def optimizer_sharded_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> tuple[dict, dict]:
    """(tensors, meta) of an optimizer: ``tensors = {param name: {state key: tensor}}`` with the live state
    tensors (under FSDP2 this rank's DTensor shards, no copy) for DCP, and ``meta`` for state.pt: the param
    groups with parameter names instead of indices, and any non-tensor per-parameter state."""
    names = _param_names(optimizer, model)
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for p, st in optimizer.state.items():
        n = names[id(p)]
        tensors[n] = {k: v for k, v in st.items() if torch.is_tensor(v)}
        other = {k: v for k, v in st.items() if not torch.is_tensor(v)}
        if other:
            scalars[n] = other
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return tensors, {OPTIMIZER_MARK: True, "param_groups": groups, "scalars": scalars}


def load_optimizer_sharded(optimizer: torch.optim.Optimizer, model: nn.Module, meta: dict, path: Path,
                           key: str) -> None:
    """Restore an optimizer from `meta` (state.pt) and the tensors under `key` of the DCP checkpoint at `path`.

    Destination tensors are allocated from the checkpoint's metadata: a state tensor shaped like its parameter
    is laid out like the parameter (``zeros_like``: this rank's shard under FSDP2), any other (AdamW's scalar
    ``step``) as a plain tensor; DCP then reads exactly those slices. Parameters without saved state get none."""
    from mmrl.distributed import dcp_load, dcp_tensor_metadata

    names = _param_names(optimizer, model)
    by_name = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
    saved_groups = meta["param_groups"]
    own = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    if [g["params"] for g in saved_groups] != own:
        diff = sorted(set(sum(own, [])) ^ set(sum((g["params"] for g in saved_groups), [])))[:3]
        raise ValueError(f"checkpoint {path.parent}: the optimizer was saved over other parameters than this run "
                         f"trains (first differences: {diff}); was it written by another recipe or model.* setting?")
    md = dcp_tensor_metadata(path)
    prefix = f"{key}."
    dest: dict[str, dict[str, torch.Tensor]] = {}
    for flat, item in md.items():
        if not flat.startswith(prefix):
            continue
        name, _, skey = flat[len(prefix):].rpartition(".")
        if name not in by_name:
            raise ValueError(f"checkpoint {path.parent}: optimizer state for {name!r}, which this run does not train")
        p = by_name[name]
        dtype = item.properties.dtype
        if tuple(item.size) == tuple(p.shape):
            t = torch.zeros_like(p.detach(), dtype=dtype)
        else:
            t = torch.zeros(tuple(item.size), dtype=dtype)
        dest.setdefault(name, {})[skey] = t
    if dest:
        dcp_load({key: dest}, path)
    for name, other in meta.get("scalars", {}).items():
        dest.setdefault(name, {}).update(other)
    index = {n: i for i, n in enumerate(sum(own, []))}
    state = {index[n]: st for n, st in dest.items()}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in saved_groups]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
