"""Data-parallel training on torch.distributed: one process per GPU (or CPU process), launched by
``torchrun`` or ``accelerate launch`` (both set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT).

    ctx = DistContext.init(cfg.dist.backend)          # a 1-process context when WORLD_SIZE is unset
    items = ctx.shard(sampler.next(global_batch))     # every rank draws the same global batch, keeps its slice
    rewards_all, gids_all = ctx.gather_group_rewards(rewards, gids)   # advantages on global statistics
    adv = ctx.local_slice(group_advantages(rewards_all, gids_all))
    model = ctx.wrap_model(model, cfg.dist.strategy)  # DDP / FSDP2 (torch's own), "none" = unchanged
    with ctx.no_sync(model, sync=last_micro_batch):   # gradient accumulation: all-reduce once
        (loss * ctx.loss_scale(n_local)).backward()

Nothing here re-implements a collective: gathers, reductions and gradient averaging are
``torch.distributed``, ``DistributedDataParallel`` and ``torch.distributed.fsdp.fully_shard``. Every
method also works in a single process (world size 1), where it is the identity, so a recipe can call
them unconditionally.

Rules that make results independent of the number of ranks (documented once, here):

* **Data.** Every rank runs the same seeded sampler, draws the *global* batch of the step and keeps
  its contiguous slice (:meth:`DistContext.shard`). The sampler position saved in a checkpoint is
  therefore global; resuming with a different world size continues with the same prompts.
* **Gradients.** DDP averages gradients over ranks. A loss that is a mean over the *global* batch needs
  each rank's local mean weighted by ``world * n_local / n_global`` (:meth:`DistContext.loss_scale`);
  with equal local sizes the factor is 1. Token-mean losses pass token counts.
* **Random numbers.** Rollout noise must differ between ranks. Instead of saving per-rank RNG states
  (which would tie a checkpoint to one world size), reseed at the start of every step with
  :func:`rank_seed` ``(seed, rank, step)``. The checkpoint then holds only adapters + optimizer +
  global data position (+ trackers), written by rank 0 (:meth:`DistContext.checkpoint`); any number of
  ranks can resume from it. A resumed run with a different world size draws different noise than the
  uninterrupted run would have (same distribution, not the same numbers).
* **Checkpoints.** Gathered format: only rank 0 writes; the other ranks wait at a barrier so nobody reads a
  half-written directory (with FSDP gather first: :meth:`DistContext.full_state_dict`, a collective). Sharded
  format (``dist.checkpoint``, default under FSDP): every rank writes its own shards with
  torch.distributed.checkpoint (:func:`dcp_save`) into the temp dir rank 0 made (``DistContext.checkpoint(..,
  all_ranks=True)``); loads read whichever slices the new layout needs (:func:`dcp_load`).

What is simplified away: no tensor/pipeline parallelism, no mixed-precision policy for FSDP (the
trainable LoRA weights stay float32, as PolicyStates keeps them), no multi-node launcher config
(torchrun's own ``--nnodes/--rdzv-*`` flags work unchanged).

Modules: ``context.py`` (DistContext, DistConfig, rank_seed), ``sharded.py`` (FSDP2 tensors: gather, clipping,
optimizer state), ``lockstep.py`` (LockstepForwards), ``launch.py`` (launcher environment, process exit),
``sequence.py`` (`dist.sequence_parallel`: groups of processes splitting each diffusion-transformer forward over the
tokens, on diffusers' context parallelism);
``python -m mmrl.distributed`` runs the self-check in ``__main__.py``.
"""

from mmrl.distributed.context import BACKENDS, STRATEGIES, DistConfig, DistContext, merge_rank_lists, rank_seed
from mmrl.distributed.launch import exit_launched_process
from mmrl.distributed.lockstep import LockstepForwards
from mmrl.distributed.sharded import (clip_grad_norm, dcp_load, dcp_save, dcp_tensor_metadata,
                                      full_optimizer_state_dict, full_tensor, load_full_optimizer_state_dict)

__all__ = ["DistConfig", "DistContext", "merge_rank_lists", "rank_seed", "STRATEGIES", "BACKENDS", "full_optimizer_state_dict",
           "load_full_optimizer_state_dict", "LockstepForwards", "full_tensor", "clip_grad_norm",
           "exit_launched_process", "dcp_save", "dcp_load", "dcp_tensor_metadata"]
