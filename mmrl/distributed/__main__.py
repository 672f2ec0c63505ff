"""Self-check of the collectives on whatever the launcher started: ``torchrun --nproc_per_node 2 -m mmrl.distributed``
prints one ``MMRL_DIST_CHECK {json}`` line from rank 0 (tests/test_distributed.py checks it)."""

from __future__ import annotations

import torch
from torch import nn

from mmrl.distributed.context import DistContext
from mmrl.distributed.launch import exit_launched_process
from mmrl.distributed.lockstep import LockstepForwards
from mmrl.distributed.sharded import clip_grad_norm, full_tensor


def _self_check() -> dict:
    """Collectives on whatever the launcher started: `torchrun --nproc_per_node 2 -m mmrl.distributed`."""
    ctx = DistContext.init("auto")
    n = ctx.rank + 1  # uneven sizes: rank r holds r + 1 rows
    local = torch.full((n, 2), float(ctx.rank))
    gathered = ctx.all_gather_tensor(local)
    back = ctx.local_slice(gathered)
    objs = ctx.all_gather_object({"rank": ctx.rank})
    mean = float(ctx.all_reduce_mean(torch.tensor(float(ctx.rank))))
    out = {"rank": ctx.rank, "world_size": ctx.world_size, "local_rank": ctx.local_rank, "device": str(ctx.device),
           "backend": ctx.backend, "gather_sizes": ctx.last_gather_sizes, "gather_rows": gathered[:, 0].tolist(),
           "local_slice_ok": bool(torch.equal(back, local)), "objects": objs, "rank_mean": mean,
           "shard": ctx.shard(list(range(2 * ctx.world_size)))}
    # LockstepForwards: rank r runs 2r + 1 real forwards of an FSDP2-sharded model; the others pair them with dummies
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    with torch.no_grad():
        want = net(x)
    if ctx.enabled:
        net = ctx.wrap_model(net, "fsdp", fsdp_block_types=["Linear"])
    with torch.no_grad(), LockstepForwards(ctx, net, dummy=lambda: net(torch.zeros(1, 4))) as ls:
        outs = [net(x) for _ in range(2 * ctx.rank + 1)]
    out.update(lockstep_real=ls.real, lockstep_dummies=ls.dummies,
               lockstep_equal=all(bool(torch.allclose(o, want, atol=1e-6)) for o in outs))
    out["lockstep_all"] = ctx.all_gather_object([ls.real, ls.dummies, out["lockstep_equal"]])
    # full_tensor (plain all_gather) on uneven Shard(0) layouts, and clip_grad_norm on FSDP2 gradients, against
    # the same computation on a plain copy (every rank sees the same batch, so FSDP's averaged gradient equals it)
    if ctx.enabled:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (ctx.world_size,))
        g = torch.Generator().manual_seed(5)
        full = [torch.randn(shape, generator=g) for shape in ((5, 3), (1, 4), (3,), (4, 2, 2))]
        out["full_tensor_exact"] = all(
            torch.equal(full_tensor(distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)), t) for t in full)
    torch.manual_seed(1)
    plain = nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 3))
    sharded = nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 3))
    sharded.load_state_dict(plain.state_dict())
    if ctx.enabled:
        sharded = ctx.wrap_model(sharded, "fsdp", fsdp_block_types=["Linear"])
    xb = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    for m in (plain, sharded):
        m(xb).square().sum().backward()
    want = float(torch.nn.utils.clip_grad_norm_(list(plain.parameters()), 0.5))
    got = clip_grad_norm(list(sharded.parameters()), 0.5)
    clipped = [full_tensor(p.grad) for p in sharded.parameters()]
    out["clip_norm"] = [got, want]
    out["clip_grads_close"] = all(bool(torch.allclose(a, p.grad, rtol=1e-5, atol=1e-7))
                                  for a, p in zip(clipped, plain.parameters()))
    ctx.barrier()
    ctx.close()
    return out


if __name__ == "__main__":  # pragma: no cover - exercised through torchrun in tests/test_distributed.py
    import json

    result = _self_check()
    if result["rank"] == 0:
        print("MMRL_DIST_CHECK " + json.dumps(result), flush=True)
    exit_launched_process(0)
