"""DistContext (rank, world size, device, the collectives and model wrapping a recipe needs), the `dist:` config
section and per-(rank, step) seeds. The rules that make results independent of the number of ranks are in the
``mmrl.distributed`` docstring."""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from mmrl.distributed.launch import _env_int
from mmrl.distributed.sharded import clip_grad_norm, full_tensor

STRATEGIES = ("auto", "none", "ddp", "fsdp")
BACKENDS = ("auto", "gloo", "nccl")
CHECKPOINT_FORMATS = ("auto", "sharded", "full")


@dataclass
class DistConfig:
    """The `dist:` section recipes embed (`dist: DistConfig = field(default_factory=DistConfig)`)."""

    strategy: str = "auto"
    """Gradient synchronisation across processes: `auto` (`ddp` when a launcher started several processes, `none`
    in one process; the start-up log says which), `none` (no wrapping: several processes are then refused), `ddp`
    (torch DistributedDataParallel: every rank holds the whole model, LoRA gradients are all-reduced) or
    `fsdp` (torch FSDP2 `fully_shard`: weights sharded per transformer block; for models that do not fit
    one GPU). Processes come from `torchrun` / `accelerate launch`; with one process every strategy is a no-op."""
    backend: str = "auto"
    """torch.distributed backend: `auto` (nccl on CUDA, gloo on CPU), `nccl` or `gloo`."""
    find_unused_parameters: bool = False
    """DDP only: set true when some trainable parameters get no gradient in a step (e.g. a vision-tower LoRA
    on a text-only batch); costs an extra graph traversal per backward."""
    checkpoint: str = "auto"
    """How checkpoints hold the optimizer state and full fine-tuning weights: `sharded` (every rank writes its own
    shards with torch.distributed.checkpoint into `checkpoints/step_N/sharded/`; nothing is gathered, so no rank
    ever holds the whole model or optimizer), `full` (gathered into whole tensors and written by rank 0, as one
    process writes them) or `auto` (sharded under FSDP with several processes, full otherwise). Either format
    resumes on any number of processes and under any strategy; LoRA adapters are always written whole (peft and
    diffusers files). `python -m mmrl.run.consolidate` turns a sharded checkpoint into the full one."""
    sequence_parallel: int = 1
    """Sequence parallelism (diffusion transformers of families with a split plan: Wan, Qwen-Image, FLUX.1): each
    group of N processes runs one transformer forward together, every process on 1/N of the tokens, attention
    exchanged over the heads (Ulysses all-to-all, diffusers' context parallelism); the groups are data-parallel.
    The number of processes must be divisible by N and the attention heads too. 1 = off."""

    rollout_ranks: int = 0
    """How many ranks of the torchrun world generate and score instead of training (with `rollout.worker: ranks`;
    `mmrl.training.rank_rollout`): the last K of a world of M + K (M a multiple of K), rank M + j generating the
    shares of trainer ranks j*M/K to (j+1)*M/K - 1 with one model; the first M train together (DDP) in a process
    group of their own. 0 = every rank trains."""

    def __post_init__(self) -> None:
        if self.rollout_ranks < 0:
            raise ValueError(f"dist.rollout_ranks: expected >= 0 (0 = every rank trains), got {self.rollout_ranks}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"dist.strategy: expected one of {list(STRATEGIES)}, got {self.strategy!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"dist.backend: expected one of {list(BACKENDS)}, got {self.backend!r}")
        if self.checkpoint not in CHECKPOINT_FORMATS:
            raise ValueError(f"dist.checkpoint: expected one of {list(CHECKPOINT_FORMATS)}, got {self.checkpoint!r}")
        if not isinstance(self.sequence_parallel, int) or self.sequence_parallel < 1:
            raise ValueError(f"dist.sequence_parallel: expected an integer >= 1, got {self.sequence_parallel!r}")

    def sharded_checkpoints(self, world_size: int) -> bool:
        """True when checkpoints are written sharded (torch.distributed.checkpoint) with `world_size` processes."""
        return self.checkpoint == "sharded" or (self.checkpoint == "auto" and self.strategy == "fsdp"
                                                 and world_size > 1)


def rank_seed(seed: int, rank: int = 0, step: int = 0) -> int:
    """A seed for (global seed, rank, step): deterministic, and distinct for distinct triples with
    0 <= rank < 1_000_003 and 0 <= step < 998_244_353 (and seeds below 9e3).

    Reseeding every step with it makes rank-local randomness a pure function of the step, so no per-rank
    RNG state has to be checkpointed (see the module docstring)."""
    # mixing constants: two large primes, result kept in [0, 2**63)
    return ((int(seed) * 1_000_003 + int(rank)) * 998_244_353 + int(step)) % (2**63)


class _DDP(nn.parallel.DistributedDataParallel):
    """torch's DistributedDataParallel that also answers attribute look-ups from the wrapped module
    (`transformer.config`, `model.generation_config`, ...), so recipes can use the wrapped model where they
    used the plain one."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)


class DistContext:
    """Rank, world size, device and the collectives a recipe needs. Build it with :meth:`init`."""

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0,
                 device: torch.device | None = None, backend: str | None = None):
        self.rank, self.world_size, self.local_rank = int(rank), int(world_size), int(local_rank)
        self.device = device if device is not None else torch.device("cpu")
        self.backend = backend
        self.last_gather_sizes: list[int] | None = None
        # sequence parallelism (`mmrl.distributed.sequence.data_parallel_view`): rank / world_size are then the
        # data-parallel coordinates, collectives run in `group`, and `sp` processes share one forward
        self.group: Any = None
        self.sp, self.sp_mesh = 1, None
        self.global_rank, self.processes = self.rank, self.world_size

    # ------------------------------------------------------------------ construction
    @classmethod
    def init(cls, backend: str = "auto", timeout_s: float = 1800.0, device: str | None = None, *,
             store: Any = None, rank: int | None = None, world: int | None = None) -> "DistContext":
        """Join the process group described by the launcher's environment variables.

        Without WORLD_SIZE (plain `python ...`) or with WORLD_SIZE=1 and no existing group: a single-process
        context on `device` (default: cuda if available else cpu) and no process group. If a group already
        exists (e.g. created by accelerate) it is reused. backend: auto | gloo | nccl.
        `store`, `rank`, `world`: make the default group `world` processes of the launcher's world meeting on
        `store` instead (the trainer ranks of a world with rollout ranks: `mmrl.training.rank_rollout`), so that
        every collective, DDP, FSDP and checkpoint of the recipe involves them only.
        """
        if backend not in BACKENDS:
            raise ValueError(f"dist.backend: expected one of {list(BACKENDS)}, got {backend!r}")
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
            local = _env_int("LOCAL_RANK")
            local = rank if local is None else local
            used = dist.get_backend()
            return cls(rank, world, local, cls._rank_device(used, local, device), used)
        local = _env_int("LOCAL_RANK")
        if store is None:
            world = _env_int("WORLD_SIZE") or 1
            if world == 1:
                dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
                return cls(0, 1, 0, dev, None)
            rank = _env_int("RANK")
            if rank is None:
                raise ValueError("WORLD_SIZE is set but RANK is not: launch with `torchrun` or `accelerate launch`")
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
            if missing:
                raise ValueError(f"distributed launch: environment variables {missing} are not set "
                                 "(torchrun / accelerate launch set them)")
        elif rank is None or world is None:
            raise ValueError("DistContext.init(store=...): give the process's rank and the group's size (world) too")
        local = rank if local is None else local
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() and (device is None or "cuda" in str(device)) else "gloo"
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("dist.backend=nccl needs CUDA; this machine has none (use gloo or auto)")
        dev = cls._rank_device(backend, local, device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        kw: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
        if dev.type == "cuda":
            kw["device_id"] = dev  # lets NCCL bind eagerly to this rank's GPU
        if store is not None:
            kw["store"] = store
        dist.init_process_group(backend=backend, rank=rank, world_size=world, **kw)
        return cls(rank, world, local, dev, backend)

    @staticmethod
    def _rank_device(backend: str, local_rank: int, device: str | None) -> torch.device:
        if device:
            dev = torch.device(device)
            if dev.type == "cuda" and dev.index is None:
                dev = torch.device("cuda", local_rank)
            return dev
        if backend == "nccl" or (torch.cuda.is_available() and backend != "gloo"):
            return torch.device("cuda", local_rank)
        return torch.device("cpu")

    def close(self) -> None:
        """Destroy the process group (if this context has one)."""
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ basics
    @property
    def enabled(self) -> bool:
        """True when there is more than one process."""
        return self.processes > 1

    @property
    def is_main(self) -> bool:
        return self.global_rank == 0

    def __repr__(self) -> str:
        return (f"DistContext(rank={self.rank}, world_size={self.world_size}, local_rank={self.local_rank}, "
                f"device={self.device}, backend={self.backend})")

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Rank 0 runs the body first (e.g. building a tiny model, downloading nothing twice), then the rest."""
        if not self.is_main:
            self.barrier()
        try:
            yield
        finally:
            if self.is_main:
                self.barrier()

    def rank_seed(self, seed: int, step: int = 0) -> int:
        """:func:`rank_seed` for this rank."""
        return rank_seed(seed, self.rank, step)

    # ------------------------------------------------------------------ collectives
    def _comm(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor on the device the backend communicates from (NCCL: this rank's GPU)."""
        if self.backend == "nccl" and t.device.type != "cuda":
            return t.to(self.device)
        if self.backend == "gloo" and t.device.type != "cpu":
            return t.cpu()
        return t

    def all_gather_object(self, obj: Any) -> list[Any]:
        """[obj of rank 0, obj of rank 1, ...] (pickled; for small Python objects such as prompt lists)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """`obj` of rank `src`, on every rank (every process: under sequence parallelism `src` is a process rank)."""
        if not self.enabled:
            return obj
        box = [obj if self.global_rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `t` along dim 0, rank order; first-dim sizes may differ between ranks.

        Sizes are gathered first, each tensor is padded to the largest size, gathered, and the padding is
        cut away. Trailing shape and dtype must agree (ValueError naming both otherwise). The sizes are
        kept in ``self.last_gather_sizes`` for :meth:`local_slice`. Result on `t`'s device."""
        if t.dim() == 0:
            raise ValueError("all_gather_tensor: expected a tensor with a first (batch) dimension, got a scalar")
        if not self.enabled:
            self.last_gather_sizes = [int(t.shape[0])]
            return t
        meta = self.all_gather_object((tuple(t.shape), str(t.dtype)))
        for r, (shape, dtype) in enumerate(meta):
            if tuple(shape[1:]) != tuple(t.shape[1:]) or dtype != str(t.dtype):
                raise ValueError(f"all_gather_tensor: rank {r} has shape {tuple(shape)} dtype {dtype}, rank "
                                 f"{self.rank} has shape {tuple(t.shape)} dtype {t.dtype}: only dim 0 may differ")
        sizes = [int(shape[0]) for shape, _ in meta]
        n_max = max(sizes)
        x = self._comm(t.detach().contiguous())
        if x.shape[0] < n_max:
            x = torch.cat([x, x.new_zeros((n_max - x.shape[0], *x.shape[1:]))])
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        self.last_gather_sizes = sizes
        return torch.cat([p[:n] for p, n in zip(parts, sizes)]).to(t.device)

    def all_reduce_sum(self, t: torch.Tensor | float) -> torch.Tensor:
        """Sum over ranks (a new tensor; numbers become float64 tensors)."""
        x = torch.as_tensor(t, dtype=torch.float64) if not isinstance(t, torch.Tensor) else t.detach().clone()
        if not self.enabled:
            return x
        y = self._comm(x)  # x is already a fresh tensor: reducing in place is safe
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return y.to(x.device)

    def all_reduce_mean(self, t: torch.Tensor | float) -> torch.Tensor:
        """Mean over ranks (a new tensor), e.g. for logging a metric of the whole batch."""
        return self.all_reduce_sum(t) / self.world_size

    def max_int(self, n: int) -> int:
        """Largest `n` over ranks: agree on loop counts (micro-batches, updates) so collectives stay paired."""
        return int(max(self.all_gather_object(int(n))))

    def any_rank(self, flag: bool) -> bool:
        """True if `flag` is true on any rank (a global decision, e.g. "some rank has nothing to train on")."""
        return any(self.all_gather_object(bool(flag)))

    def loss_scale(self, n_local: int | float | torch.Tensor) -> float:
        """Factor for a rank's local-mean loss so that DDP's gradient average equals the gradient of the mean
        over the global batch: ``world * n_local / sum_r n_r`` (1.0 when all ranks hold equal counts).

        `n_local`: samples (sequence-mean losses) or valid tokens (token-mean) in this rank's share of one
        optimizer update. A collective: every rank must call it. Under sequence parallelism the factor is also
        multiplied by `sp`: each of a group's processes holds the gradient of its share of the tokens, and DDP's
        average over all processes must be their sum averaged over the groups."""
        total = float(self.all_reduce_sum(float(n_local)))
        if total <= 0:
            return 0.0
        return self.sp * self.world_size * float(n_local) / total

    # ------------------------------------------------------------------ data
    def shard(self, items: Sequence[Any], pad: bool = False) -> list[Any] | tuple[list[Any], list[bool]]:
        """This rank's contiguous slice of a global list (same order on every rank -> deterministic).

        pad=False: len(items) must be divisible by world_size (ValueError otherwise); rank r gets
        items[r*k:(r+1)*k] with k = len/world. pad=True: every rank gets ceil(len/world) items, the
        missing tail filled with copies of the last item, and a mask list (False = padding) is returned as
        well: ``(items, mask)``; give padded samples zero loss weight and drop them before gathering."""
        items = list(items)
        n, w = len(items), self.world_size
        if not pad:
            if n % w:
                raise ValueError(f"shard: {n} items cannot be split evenly over {w} ranks; make the global batch "
                                 f"a multiple of the world size or call shard(items, pad=True)")
            k = n // w
            return items[self.rank * k:(self.rank + 1) * k]
        if n == 0:
            raise ValueError("shard(pad=True): nothing to pad from (empty list)")
        k = -(-n // w)
        idx = range(self.rank * k, (self.rank + 1) * k)
        return [items[min(i, n - 1)] for i in idx], [i < n for i in idx]

    def gather_group_rewards(self, rewards: torch.Tensor, group_ids: torch.Tensor,
                             scope: str = "global") -> tuple[torch.Tensor, torch.Tensor]:
        """(rewards_all[N], group_ids_all[N]) over all ranks, rank order, for advantage normalisation on
        global statistics; map results back with :meth:`local_slice`.

        scope="global": ids already mean the same group on every rank (a global prompt index or a prompt
        hash), so a group may be spread over ranks. scope="rank": ids are local (0..k on each rank);
        they are made distinct per rank as ``rank * stride + id`` with stride = 1 + max id over ranks."""
        if rewards.dim() != 1 or group_ids.shape != rewards.shape:
            raise ValueError(f"gather_group_rewards: expected rewards[B] and group_ids[B], got "
                             f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}")
        if scope not in ("global", "rank"):
            raise ValueError(f"gather_group_rewards: scope must be 'global' or 'rank', got {scope!r}")
        gids = group_ids.long()
        if scope == "rank":
            if gids.numel() and int(gids.min()) < 0:
                raise ValueError("gather_group_rewards(scope='rank'): group ids must be >= 0")
            local_max = int(gids.max()) if gids.numel() else -1
            stride = int(max(self.all_gather_object(local_max))) + 1
            gids = gids + self.rank * stride
        g_all = self.all_gather_tensor(gids)
        r_all = self.all_gather_tensor(rewards)
        return r_all, g_all

    def local_slice(self, x_all: torch.Tensor, sizes: Sequence[int] | None = None) -> torch.Tensor:
        """This rank's rows of a tensor laid out like the last :meth:`all_gather_tensor` result (or `sizes`)."""
        sizes = list(sizes) if sizes is not None else self.last_gather_sizes
        if sizes is None:
            raise ValueError("local_slice: no sizes given and no all_gather_tensor/gather_group_rewards call before")
        if len(sizes) != self.world_size or x_all.shape[0] != sum(sizes):
            raise ValueError(f"local_slice: expected {self.world_size} sizes summing to dim 0 = {x_all.shape[0]}, "
                             f"got {sizes}")
        start = sum(sizes[:self.rank])
        return x_all[start:start + sizes[self.rank]]

    # ------------------------------------------------------------------ models
    def resolve_strategy(self, strategy: str) -> str:
        """`auto` -> `ddp` when several processes were launched, else `none`; any other strategy unchanged."""
        if strategy == "auto":
            return "ddp" if self.enabled else "none"
        return strategy

    def wrap_model(self, module: nn.Module, strategy: str = "ddp", *, find_unused_parameters: bool = False,
                   fsdp_block_types: Sequence[str] | None = None, **kwargs: Any) -> nn.Module:
        """Wrap for gradient synchronisation.

        - "none" (or one process): `module` unchanged.
        - "ddp": ``DistributedDataParallel`` (attribute look-ups fall through to `module`). Only parameters
          with requires_grad (the "default" LoRA of PolicyStates) are in DDP's reducer, so only they are
          all-reduced. Call the wrapped model for the training forward (DDP hooks into it); generation and
          no-grad passes may use the plain module.
        - "fsdp": FSDP2 ``fully_shard`` (the API torch recommends; the older ``FullyShardedDataParallel``
          would need use_orig_params=True for LoRA's mixed requires_grad). Each sub-module whose class name is
          in `fsdp_block_types` (default: the model's ``_no_split_modules``, i.e. its transformer blocks) is
          sharded, then the root. The module is changed in place (same object, same attributes), but its
          parameters are replaced by sharded DTensor parameters: call ``PolicyStates.refresh()`` after wrapping
          so copy/ema/save and state switches follow the sharded parameters (LoRA or full fine-tuning), then build
          the optimizer from ``states.trainable_parameters()``. Drop gradients through those references
          (``optimizer.zero_grad``): after a forward FSDP2 leaves the root unit's parameters unsharded, so
          ``module.parameters()`` / ``module.zero_grad()`` then miss the sharded ones that hold the gradients.
        kwargs go to DistributedDataParallel / fully_shard."""
        if strategy not in STRATEGIES:
            raise ValueError(f"dist.strategy: expected one of {list(STRATEGIES)}, got {strategy!r}")
        strategy = self.resolve_strategy(strategy)
        if strategy == "none" or not self.enabled:
            return module
        if strategy == "ddp":
            if not any(p.requires_grad for p in module.parameters()):
                raise ValueError("wrap_model(ddp): the module has no parameter with requires_grad=True")
            ids = [self.device.index] if self.device.type == "cuda" else None
            # No buffer sync in forward: buffers (rope tables, pos-embeds) are never trained here, and syncing them
            # would make every forward a collective, so ranks with different micro-batch counts would hang.
            # (torch >= 2.14 spells it forward_sync_buffers; older versions broadcast_buffers.)
            if not any(k in kwargs for k in ("broadcast_buffers", "forward_sync_buffers")):
                if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters:
                    kwargs["forward_sync_buffers"] = False
                else:
                    kwargs["broadcast_buffers"] = False
            return _DDP(module.to(self.device), device_ids=ids, find_unused_parameters=find_unused_parameters,
                        **kwargs)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self.processes,))
        if fsdp_block_types is None:
            fsdp_block_types = getattr(module, "_no_split_modules", None) or []
        names = set(fsdp_block_types)
        module = module.to(self.device)
        blocks = [m for m in module.modules() if type(m).__name__ in names and m is not module]
        for block in blocks:
            fully_shard(block, mesh=mesh, **kwargs)
        fully_shard(module, mesh=mesh, **kwargs)
        return module

    @staticmethod
    def unwrap(module: nn.Module) -> nn.Module:
        """The plain module inside a DDP wrapper (FSDP2 modules are already the plain object)."""
        return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module

    @contextlib.contextmanager
    def no_sync(self, module: nn.Module, sync: bool = False) -> Iterator[None]:
        """Gradient accumulation: inside, backward passes do not all-reduce (DDP ``no_sync``, FSDP2
        ``set_requires_gradient_sync(False)``); the backward of the last micro-batch must run with
        sync=True (then this is a no-op context)."""
        if sync or not self.enabled:
            yield
            return
        if isinstance(module, nn.parallel.DistributedDataParallel):
            with module.no_sync():
                yield
            return
        if hasattr(module, "set_requires_gradient_sync"):  # FSDP2 module
            module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                module.set_requires_gradient_sync(True)
            return
        yield

    @staticmethod
    def clip_grad_norm_(parameters: Sequence[torch.Tensor], max_norm: float) -> float:
        """:func:`clip_grad_norm` (torch's formula; FSDP2 DTensor gradients handled with plain c10d)."""
        return clip_grad_norm(list(parameters), max_norm)

    def full_state_dict(self, module: nn.Module, trainable_only: bool = True) -> dict[str, torch.Tensor]:
        """Unsharded CPU copy of the (trainable) parameters of a DDP/FSDP/plain module, names as in the
        plain module. Under FSDP this is a collective: every rank must call it."""
        inner = self.unwrap(module)
        out = {}
        for name, p in inner.named_parameters():
            if trainable_only and not p.requires_grad:
                continue
            out[name] = full_tensor(p.detach()).cpu().clone()
        return out

    # ------------------------------------------------------------------ checkpoints
    @contextlib.contextmanager
    def checkpoint(self, run: Any, step: int, all_ranks: bool = False) -> Iterator[Any]:
        """Rank 0 gets ``run.checkpoint(step)``'s temp dir to write into (manifest, COMPLETE marker and atomic
        rename on exit); the other ranks get None and wait at a barrier until it is complete.

        all_ranks=True (sharded checkpoints): every rank gets the same temp dir (rank 0 creates it and broadcasts
        its path; the run directory must be on a file system every rank sees) to write its own shards into. The
        body must end in a collective that returns only once every rank has written (``dcp.save`` does), so rank 0
        lists every file in the manifest."""
        try:
            if self.is_main:
                with run.checkpoint(step) as d:
                    if all_ranks:
                        self.broadcast_object(str(d))
                    yield d
            else:
                yield Path(self.broadcast_object(None)) if all_ranks else None
        finally:
            self.barrier()


def merge_rank_lists(ctx: Any, lists: dict[str, list]) -> dict[str, list]:
    """{key: values of rank 0 + values of rank 1 + ...} (all-gathered; a rank may lack a key). One process:
    `lists` unchanged. A collective: every rank must call it."""
    if not ctx.enabled:
        return lists
    merged: dict[str, list] = defaultdict(list)
    for part in ctx.all_gather_object(dict(lists)):
        for k, v in part.items():
            merged[k] += list(v)
    return merged
