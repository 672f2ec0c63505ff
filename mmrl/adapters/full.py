"""PolicyStates in full fine-tuning mode: "old" / "ref" as parameter snapshots, switched by pointer swaps.

A mixin of :class:`mmrl.adapters.PolicyStates`; see the ``mmrl.adapters`` docstring for the costs and the FSDP2
behaviour (snapshots laid out like their parameters, switches copy into the shards).
"""

from __future__ import annotations

import torch

from mmrl.adapters.sharding import _is_dtensor, _reshard_fsdp


class _FullStates:
    """Full-mode construction, snapshots and state loading of PolicyStates."""

    def _init_full(self, keep_ref_copy: bool, snapshot_device) -> None:
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("PolicyStates: full fine-tuning needs parameters with requires_grad=True; none found")
        self._full_names = [n for n, _ in named]
        self._full_params = [p for _, p in named]
        self._snapshot_device = None if snapshot_device is None else torch.device(snapshot_device)
        self._ref_is_base = False
        self._loaded = "default"  # whose tensors the parameters currently hold
        self._store: dict[str, list[torch.Tensor]] = {}
        with torch.no_grad():
            if keep_ref_copy:
                self._store["ref"] = [self._snapshot_of(p) for p in self._full_params]
            if self.has_old:
                self._store["old"] = [self._snapshot_of(p) for p in self._full_params]

    def _snapshot_of(self, p: torch.Tensor) -> torch.Tensor:
        dev = self._snapshot_device or p.device
        return p.detach().to(dev, copy=True)

    def _shard_like(self, snap: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """A full-mode snapshot laid out like parameter `p`: p's sharding (this rank's slice of the full
        snapshot, no communication: every rank holds the same full snapshot) or, unsharded, `snap` itself."""
        if _is_dtensor(snap):
            if not _is_dtensor(p) or snap.device_mesh != p.device_mesh or tuple(snap.placements) != tuple(p.placements):
                raise ValueError("PolicyStates.refresh: a snapshot is sharded differently from its parameter")
            return snap
        if not _is_dtensor(p):
            return snap
        if self._snapshot_device is not None and self._snapshot_device != p.device:
            raise ValueError(f"PolicyStates: snapshot_device={self._snapshot_device} is not supported with FSDP-sharded "
                             f"parameters (on {p.device}): the shards of the snapshots stay with the parameters")
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(snap.detach().to(p.device, p.dtype), p.device_mesh, p.placements,
                                 src_data_rank=None)

    def _full_load(self, name: str) -> None:
        """Make the parameters hold state ``name``'s tensors (pointer swap when on the same device; FSDP2 shards:
        copies into the shards, whose storage FSDP all-gathers from)."""
        cur = self._loaded
        if cur == name:
            return
        params = self._full_params
        if self._sharded():
            _reshard_fsdp(self.model)
            with torch.no_grad():
                if cur == "default":  # DTensor clones: "default" stays usable by copy/ema while another is loaded
                    self._store["default"] = [p.detach().clone() for p in params]
                else:  # keep changes made while `cur` was loaded
                    for s, p in zip(self._store[cur], params):
                        s.to_local().copy_(p.detach().to_local())
                src = self._store.pop("default") if name == "default" else self._store[name]
                for p, s in zip(params, src):
                    p.detach().to_local().copy_(s.to_local())
            self._loaded = name
            return
        if cur == "default":
            self._store["default"] = [p.data for p in params]
        else:
            with torch.no_grad():
                for s, p in zip(self._store[cur], params):
                    if s.data_ptr() != p.data_ptr():  # offloaded snapshot: keep changes made while loaded
                        s.copy_(p.data)
        if name == "default":
            for p, d in zip(params, self._store.pop("default")):
                p.data = d
        else:
            for p, s in zip(params, self._store[name]):
                p.data = s if (s.device == p.device and s.dtype == p.dtype) else s.to(p.device, p.dtype)
        self._loaded = name
