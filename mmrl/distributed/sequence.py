"""Sequence parallelism for diffusion transformers (`dist.sequence_parallel: N`), on diffusers' own context
parallelism: the model class's split plan (`_cp_plan`: which inputs are split along the tokens, where the output is
gathered) and its Ulysses attention (an all-to-all from "my tokens, all heads" to "all tokens, my heads" and back,
with its own backward), run by the `native` attention backend (torch SDPA) on CPU/gloo and GPU/NCCL alike.

What this module adds: the process layout (a `(dp, ring, ulysses)` device mesh of torch: groups of N consecutive
ranks share one forward, the groups are data-parallel), the checks that make a wrong setting one line (processes,
heads, tokens not divisible by N; a family without a split plan), and attaching the plan to a transformer that
already holds its LoRA layers. diffusers' `ModelMixin.enable_parallelism` does the same attaching but picks the
device from `torch.accelerator`, which has no device on a CPU-only machine (a ZeroDivisionError), so the three
steps it takes are taken here with the mesh given.

Gradients: the gather at the output returns each process the gradient of its own tokens, so each parameter's
gradient on a process is its tokens' share; DDP (or FSDP2, sharding over all processes) averages over all processes,
and `DistContext.loss_scale` multiplies the loss by N so that the average is the groups' sums averaged over groups
(the data-parallel mean).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# families whose transformer's sequence split is checked against one process in tests/test_sequence_parallel.py
FAMILIES = ("wan", "qwen_image", "flux")
# recipes whose step under sequence parallelism is checked against one process (the other diffusion recipes share
# the loop but are not checked yet)
RECIPES = ("flow_grpo",)


def check_layout(sp: int, processes: int) -> None:
    """One line when `processes` cannot be cut into groups of `sp`."""
    if sp > 1 and processes % sp:
        raise ValueError(f"dist.sequence_parallel={sp}: the number of processes ({processes}) must be divisible by it "
                         f"(groups of {sp} processes share one forward)")


def check_recipe(cfg: Any, processes: int) -> None:
    """One line for a recipe setting sequence parallelism cannot serve: a layout that does not divide, a rollout
    process (it has no process group to split over), a recipe not in RECIPES."""
    sp = cfg.dist.sequence_parallel
    check_layout(sp, processes)
    worker = getattr(getattr(cfg, "rollout", None), "worker", "inline")
    if sp > 1 and worker in ("process", "ranks"):  # ranks: the rollout rank is outside the trainer's groups
        raise ValueError(f"dist.sequence_parallel={sp} with rollout.worker={worker} is not supported: the rollout "
                         f"{'process' if worker == 'process' else 'rank'} has no process group to split over; use "
                         f"rollout.worker=inline")
    if cfg.algorithm not in RECIPES:
        raise ValueError(f"dist.sequence_parallel={sp}: recipe {cfg.algorithm!r} is not supported (supported: "
                         f"{', '.join(RECIPES)}); set dist.sequence_parallel=1")


def data_parallel_view(ctx: Any, sp: int) -> Any:
    """`ctx` (a DistContext of every process) seen by a recipe under sequence parallelism `sp`: `rank` and
    `world_size` become the data-parallel group's index and count (processes of one group draw the same prompts and
    noise), collectives run among processes with the same position in their group, `is_main` stays process 0, and
    `ctx.sp_mesh` is the `(dp, ring, ulysses)` mesh. sp=1: `ctx` unchanged."""
    if sp == 1:
        return ctx
    check_layout(sp, ctx.world_size)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size // sp, 1, sp),
                            mesh_dim_names=("dp", "ring", "ulysses"))
    view = type(ctx)(ctx.rank // sp, ctx.world_size // sp, ctx.local_rank, ctx.device, ctx.backend)
    view.group, view.sp = mesh["dp"].get_group(), sp
    view.global_rank, view.processes = ctx.rank, ctx.world_size
    view.sp_mesh = mesh
    return view


def _planned(transformer: nn.Module) -> list[nn.Module]:
    """The diffusers transformers inside `transformer` (itself, or the experts of a wrapper) that carry a split plan."""
    found = [m for m in transformer.modules() if getattr(type(m), "_cp_plan", None)]
    return [m for m in found if not any(o is not m and any(c is m for c in o.modules()) for o in found)]


def check_model(transformer: nn.Module, sp: int, family: str) -> None:
    """One line when `family`'s transformer cannot be split `sp` ways: not a checked family, no split plan in
    diffusers, or a head count not divisible by `sp` (Ulysses gives each process heads / sp heads)."""
    if family not in FAMILIES:
        raise ValueError(f"dist.sequence_parallel={sp}: family {family!r} is not supported (supported: "
                         f"{', '.join(FAMILIES)}); set dist.sequence_parallel=1")
    models = _planned(transformer)
    if not models:
        raise ValueError(f"dist.sequence_parallel={sp}: {type(transformer).__name__} of family {family!r} has no "
                         f"sequence split plan (_cp_plan) in this diffusers version; set dist.sequence_parallel=1")
    for m in models:
        heads = int(m.config.num_attention_heads)
        if heads % sp:
            raise ValueError(f"dist.sequence_parallel={sp}: {family}'s transformer has {heads} attention heads, not "
                             f"divisible by {sp} (each process takes heads / {sp}); use a divisor of {heads}")


def _pad_text(sp: int, texts: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-Image's text tokens (their length is the batch's longest prompt) padded to a multiple of `sp`, the padding
    masked out: attention never reads it and no image token changes (the text RoPE of the real tokens is the same)."""
    n = texts.shape[1]
    extra = -n % sp
    if mask is None:
        mask = torch.ones(texts.shape[:2], dtype=torch.long, device=texts.device)
    texts = torch.cat([texts, texts.new_zeros(texts.shape[0], extra, *texts.shape[2:])], dim=1)
    return texts, torch.cat([mask, mask.new_zeros(mask.shape[0], extra)], dim=1)


def _token_check(sp: int, family: str, patch: tuple[int, ...] | None):
    """A forward pre-hook: one line when this call's tokens cannot be cut into `sp` equal parts (diffusers asserts);
    Qwen-Image's text is padded instead (`_pad_text`)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        x = kwargs.get("hidden_states", args[0] if args else None)
        if x is None:
            return None
        n = int(x.shape[1]) if x.dim() == 3 else int(torch.tensor(
            [s // p for s, p in zip(x.shape[2:], patch or (1,) * (x.dim() - 2))]).prod())
        texts = kwargs.get("encoder_hidden_states")
        lengths = {"image/video tokens": n}
        if family == "qwen_image" and texts is not None and texts.shape[1] % sp:
            kwargs["encoder_hidden_states"], kwargs["encoder_hidden_states_mask"] = _pad_text(
                sp, texts, kwargs.get("encoder_hidden_states_mask"))
        if family == "flux" and texts is not None:  # its plan splits the text tokens too (no mask to pad with)
            lengths["text tokens"] = int(texts.shape[1])
        for what, k in lengths.items():
            if k % sp:
                raise ValueError(f"dist.sequence_parallel={sp}: this {family} forward has {k} {what}, not divisible "
                                 f"by {sp}; choose rollout.height/width/num_frames (or model.max_sequence_length) "
                                 f"so that it is")
        return args, kwargs

    return hook


def apply(transformer: nn.Module, ctx: Any, family: str) -> nn.Module:
    """Attach diffusers' context parallelism (Ulysses over `ctx.sp` processes) to every planned transformer inside
    `transformer`, after its LoRA layers exist (the plan gathers at `proj_out`: a LoRA wrapper must be the module
    the gather follows). Checks first (`check_model`). Returns `transformer` (changed in place)."""
    sp = ctx.sp
    if sp == 1:
        return transformer
    check_model(transformer, sp, family)
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    for model in _planned(transformer):
        cp = ContextParallelConfig(ulysses_degree=sp, mesh=ctx.sp_mesh)
        config = ParallelConfig(context_parallel_config=cp)
        config.setup(ctx.global_rank, ctx.processes, ctx.device, mesh=ctx.sp_mesh)
        model._parallel_config = config
        for module in model.modules():
            processor = getattr(module, "processor", None)
            if processor is None or not hasattr(processor, "_parallel_config"):
                continue
            backend = AttentionBackendName(getattr(processor, "_attention_backend", None)
                                           or _AttentionBackendRegistry.get_active_backend()[0])
            if not _AttentionBackendRegistry._is_context_parallel_available(backend):
                raise ValueError(f"dist.sequence_parallel={sp}: attention backend {backend.value!r} cannot be split "
                                 f"by diffusers; use 'native'")
            processor._parallel_config = config
        patch = tuple(model.config.patch_size) if isinstance(getattr(model.config, "patch_size", None),
                                                             (list, tuple)) else None
        model.register_forward_pre_hook(_token_check(sp, family, patch), with_kwargs=True)
        apply_context_parallel(model, cp, type(model)._cp_plan)
    return transformer
