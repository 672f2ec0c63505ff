"""FSDP2 DTensor values gathered and used with plain, synchronous c10d collectives: whole tensors, gradient
clipping over sharded gradients, and optimizer states written and read as full tensors (so a checkpoint does not
depend on the strategy or the number of ranks); and torch.distributed.checkpoint calls for sharded checkpoints."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of an FSDP2 DTensor (a collective: every rank of its mesh calls it); plain tensors as they are.

    For the 1-D ``Shard(d)`` / ``Replicate`` layouts FSDP2 uses, the shards are gathered with a plain, synchronous
    ``torch.distributed.all_gather`` (shards padded to the torch.chunk size, then trimmed), not with
    ``DTensor.full_tensor()``, whose asynchronous functional collectives crashed the process on gloo/CPU here
    ("malloc(): unaligned tcache chunk detected" inside ``full_tensor`` during a checkpoint save). Other layouts
    fall back to ``full_tensor()``."""
    if not (hasattr(t, "device_mesh") and hasattr(t, "to_local")):
        return t
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(t.placements)
    local = t.to_local()
    if t.device_mesh.ndim != 1 or not isinstance(placements[0], (Shard, Replicate)):
        return t.full_tensor()
    if isinstance(placements[0], Replicate):
        return local
    d, n = placements[0].dim, t.shape[placements[0].dim]
    group = t.device_mesh.get_group()
    world = dist.get_world_size(group)
    chunk = -(-n // world)  # torch.chunk: ceil(n / world) rows per rank, the last ranks get fewer or none
    if t.numel() == 0:  # (gloo cannot all_gather empty tensors)
        return local.new_zeros(t.shape)
    sizes = [max(0, min(chunk, n - r * chunk)) for r in range(world)]
    shape = list(local.shape)
    shape[d] = chunk
    buf = local.new_zeros(shape)
    buf.narrow(d, 0, local.shape[d]).copy_(local)
    parts = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(parts, buf, group=group)
    return torch.cat([p.narrow(d, 0, k) for p, k in zip(parts, sizes)], dim=d)


def clip_grad_norm(parameters: Sequence[torch.Tensor], max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` (2-norm, the same formula: per-tensor norms, their norm, coefficient
    ``max_norm / (total + 1e-6)`` clamped to 1) that also takes FSDP2 DTensor gradients and returns a float.

    Sharded gradients: each rank sums the squares of its local shards per tensor, one ``all_reduce`` adds them up
    (plain c10d, no DTensor dispatch), and every rank scales its own shards. Plain (unsharded) gradients are the
    same on every rank and counted once."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    grads = [p.grad for p in params]
    sharded = [hasattr(g, "device_mesh") for g in grads]
    if not any(sharded):
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    group = next(g for g, s in zip(grads, sharded) if s).device_mesh.get_group()
    first = dist.get_rank(group) == 0
    locals_ = [g.to_local() if s else g for g, s in zip(grads, sharded)]
    sq = torch.stack([l.detach().float().pow(2).sum() if (s or first) else torch.zeros((), device=l.device)
                      for l, s in zip(locals_, sharded)])
    dist.all_reduce(sq, group=group)
    total = float(torch.linalg.vector_norm(sq.sqrt(), 2))
    coef = min(1.0, float(max_norm) / (total + 1e-6))
    if coef < 1.0:
        with torch.no_grad():
            for l in locals_:
                l.mul_(coef)
    return total


# ---------------------------------------------------------------------------------------------- optimizer state


def full_optimizer_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with every FSDP2 DTensor state tensor (Adam moments) gathered into a full CPU
    tensor, so the file is the one a single process or DDP writes. A collective under FSDP: every rank must call
    it. Plain tensors are returned as they are (no copy)."""
    sd = optimizer.state_dict()
    state = {i: {k: (full_tensor(v).cpu() if hasattr(v, "device_mesh") else v) for k, v in st.items()}
             for i, st in sd["state"].items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def load_full_optimizer_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Load a full-tensor optimizer state (written by any strategy) into an optimizer over FSDP2 DTensor
    parameters: each state tensor shaped like its parameter is replaced by this rank's shard. For plain
    parameters this is ``optimizer.load_state_dict``."""
    optimizer.load_state_dict(state_dict)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not hasattr(p, "device_mesh"):
                continue
            st = optimizer.state.get(p, {})
            for k, v in list(st.items()):
                if torch.is_tensor(v) and not hasattr(v, "device_mesh") and tuple(v.shape) == tuple(p.shape):
                    from torch.distributed.tensor import distribute_tensor

                    st[k] = distribute_tensor(v.to(p.device, p.dtype), p.device_mesh, p.placements,
                                              src_data_rank=None)


# ---------------------------------------------------------------------------------------------- sharded checkpoints


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every call without a process group that it assumes one process, which is what is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def dcp_save(state_dict: dict, path: str | Path) -> None:
    """``torch.distributed.checkpoint.save`` into directory `path`: every rank writes the shards it holds (plain
    tensors held alike by several ranks are written once); one process without a process group works too."""
    import torch.distributed.checkpoint as dcp

    with _single_process_quiet():
        dcp.save(state_dict, checkpoint_id=str(path))


def dcp_load(state_dict: dict, path: str | Path) -> None:
    """``torch.distributed.checkpoint.load`` from directory `path` in place into the tensors of `state_dict` (each
    rank reads the slices its tensors hold, whatever the number of ranks that wrote them)."""
    import torch.distributed.checkpoint as dcp

    with _single_process_quiet():
        dcp.load(state_dict, checkpoint_id=str(path))


def dcp_tensor_metadata(path: str | Path) -> dict:
    """{flattened key ("a.b.c"): TensorStorageMetadata (global size, dtype, chunks)} of a DCP checkpoint directory."""
    import torch.distributed.checkpoint as dcp

    return dict(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
