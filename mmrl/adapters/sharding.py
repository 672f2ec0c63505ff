"""FSDP2 (DTensor) helpers of PolicyStates: gather, local shards, copies into shards, resharding.

Every state of a sharded model is sharded alike (asserted), so elementwise updates run on local shards; full
tensors are gathered with ``mmrl.distributed.full_tensor`` (plain c10d). See the ``mmrl.adapters`` docstring.
"""

from __future__ import annotations

import torch
from torch import nn


def _is_dtensor(t) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "full_tensor")


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 (DTensor) shard -- a collective: every rank must call it; plain tensors
    unchanged (``mmrl.distributed.full_tensor``: plain c10d all_gather)."""
    from mmrl.distributed import full_tensor

    return full_tensor(t.detach())


def _locals(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Local shards of two tensors for elementwise updates (a plain tensor pair is returned unchanged).
    Elementwise on local shards is exact only when both are sharded identically: asserted."""
    da, db = _is_dtensor(a), _is_dtensor(b)
    if not (da or db):
        return a, b
    if not (da and db) or a.device_mesh != b.device_mesh or tuple(a.placements) != tuple(b.placements) \
            or a.shape != b.shape:
        raise ValueError("PolicyStates: copy/ema between tensors that are not sharded identically "
                         f"(dst {type(a).__name__} {getattr(a, 'placements', None)}, src {type(b).__name__} "
                         f"{getattr(b, 'placements', None)})")
    return a.to_local(), b.to_local()


def _copy_full_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src where src is a full (unsharded) tensor and dst a plain tensor or an FSDP2 DTensor shard
    (this rank's slice, no communication)."""
    if _is_dtensor(dst):
        from torch.distributed.tensor import distribute_tensor

        src = src.to(device=dst.device, dtype=dst.dtype)
        dst.to_local().copy_(distribute_tensor(src, dst.device_mesh, dst.placements, src_data_rank=None).to_local())
    else:
        dst.copy_(src)


def _reshard_fsdp(model: nn.Module) -> None:
    """Free every FSDP2 unit's unsharded parameters so the next forward all-gathers the shards again.

    After a no-grad forward FSDP2 leaves the root unit's parameters unsharded (it expects a backward); an in-place
    change of the shards (copy/ema/load, a full-mode state switch) would then not reach that forward. A no-op for
    modules that are not sharded."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _main_rank() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
