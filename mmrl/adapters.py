"""Policy states on one model: trainable "default", frozen "old", and the reference "ref".

RL fine-tuning needs up to three versions of the policy: the one being trained ("default"), a frozen
copy for importance ratios or as an EMA target ("old"), and the starting point for KL penalties
("ref"). Keeping three models in memory costs 3x the weights; with LoRA the three states can share
the base weights and differ only in small adapters:

- "default": a trainable peft LoRA adapter. Its parameters are the only ones that require grad.
- "old":     a second, frozen adapter with the same config (only when ``old=True``), initialised
             equal to "default" and updated only by :meth:`PolicyStates.copy` / :meth:`PolicyStates.ema`.
- "ref":     all adapters disabled, i.e. exactly the base model (bitwise). When training starts from
             an existing LoRA (``ref_adapter_path``) "ref" is instead a frozen adapter loaded from that
             path, and "default"/"old" start equal to it.

Mechanism: ``peft.inject_adapter_in_model`` + the ``BaseTunerLayer`` switches, which work on any
``nn.Module`` (diffusers transformers, transformers VLMs, plain torch). Switching through peft's
``set_adapter`` silently flips ``requires_grad`` (the activated adapter becomes trainable), so
:meth:`PolicyStates.use` snapshots every parameter's ``requires_grad`` on entry, restores it right
after switching and again on exit (also on exceptions). Inside and outside ``use`` bodies only
"default"'s LoRA parameters require grad.

Full fine-tuning (``lora_config=None``): the trainable parameters are the model's parameters that
require grad when ``PolicyStates`` is built (normally all of them). There is nothing to switch cheaply,
so "old" and "ref" exist only when asked for, as parameter snapshots:

- ``old=True`` keeps one copy of the trainable parameters (+100% of their memory, on
  ``snapshot_device``; a CPU snapshot saves accelerator memory but every switch then copies).
- ``keep_ref_copy=True`` keeps a copy of the initial trainable parameters as "ref" (+100% again).
- Without them ``use("old")`` / ``use("ref")`` raise a ValueError saying how to enable them.
  Switching swaps ``param.data`` pointers (no copy when the snapshot lives on the parameter's device).

Files (``save(dir)``): one directory per adapter, ``dir/<name>/adapter_model.safetensors`` +
``adapter_config.json`` in peft's own format (keys ``base_model.model.<module>.lora_A.weight``, as
``PeftModel.save_pretrained`` writes them), loadable with ``PeftModel.from_pretrained(base, dir/<name>)``
or ``set_peft_model_state_dict``. For diffusers models the same weights are also written as
``dir/<name>/pytorch_lora_weights.safetensors`` in diffusers' pipeline format (keys prefixed
``transformer.``, or ``unet.`` for UNets; LoRA config in the safetensors metadata), so
``pipe.load_lora_weights(dir/<name>)`` works; diffusers picks that file by name, peft picks
``adapter_model.safetensors``. A "ref" that is the base model is not written. Full fine-tuning writes
``dir/<name>/model.safetensors`` (parameter names as in ``model.named_parameters()``) per state.

FSDP2 (``DistContext.wrap_model(model, "fsdp")`` / ``fully_shard``) replaces every parameter by a DTensor
shard: call :meth:`PolicyStates.refresh` right after wrapping (and build the optimizer after it). Then
``copy``/``ema`` run on the local shards (all states are sharded identically; asserted), ``save`` and
``state_dict`` gather full tensors (collectives: every rank calls them; only rank 0 writes files, the files are
the same as one process writes) and ``load``/``load_state_dict`` take full tensors and keep each rank's slice.
Full fine-tuning under FSDP2: ``refresh`` re-lays the "old"/"ref" snapshots (built before wrapping, full on every
rank) out like their parameters (each rank keeps its slice, so the snapshots shrink to 1/world), and a state switch
copies values into the parameter shards instead of swapping pointers (FSDP all-gathers from its own shard storage).
Every in-place change of a sharded state first reshards the FSDP units (FSDP2 keeps the root unit's parameters
unsharded after a no-grad forward; without this the next forward would not see the change).

Cost (benchmarks/adapter_states.py, d=256 CPU models, r=8): "old" + a "ref" adapter add 2-3% of the
base parameter memory (deep copies: 200%); a ``use`` switch costs ~0.5-1.5 ms (it walks every LoRA
layer through peft's public switches), ``copy("default", "old")`` ~0.1 ms.

Usage::

    states = PolicyStates(transformer, LoraConfig(r=32, lora_alpha=64, target_modules=[...]), old=True)
    opt = torch.optim.AdamW(states.trainable_parameters(), lr=1e-4)
    with torch.no_grad(), states.use("ref"):
        ref_out = transformer(**batch)             # base model, bitwise
    loss = f(transformer(**batch), ref_out)          # "default" is active outside `use`
    loss.backward(); opt.step()                      # never step inside use("old"/"ref")
    states.ema("default", "old", decay=0.99)
"""

from __future__ import annotations

import contextlib
import copy as _copy
import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

STATE_NAMES = ("default", "old", "ref")
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_CONFIG_NAME = "adapter_config.json"
DIFFUSERS_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
FULL_WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "policy_states.json"
_PEFT_PREFIX = "base_model.model."

__all__ = ["PolicyStates", "STATE_NAMES"]


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _is_diffusers_model(model: nn.Module) -> bool:
    diffusers = sys.modules.get("diffusers")
    return diffusers is not None and isinstance(model, diffusers.ModelMixin)


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


def _config_json_dict(cfg) -> dict:
    d = cfg.to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in d.items()}


class PolicyStates:
    """Named policy states ("default", "old", "ref") on one model; see the module docstring.

    Args:
        model: any ``nn.Module`` (e.g. ``SD3Transformer2DModel``, ``FluxTransformer2DModel``,
            ``Qwen2VLForConditionalGeneration``). Adapters are injected in place; ``states.model`` is
            the same object.
        lora_config: a ``peft.LoraConfig`` for "default" (and "old"), or None for full fine-tuning.
            With ``ref_adapter_path`` it may be None (the saved adapter's config is used) or must
            match that config's shape-relevant fields.
        old: keep a frozen "old" state initialised equal to "default".
        ref_adapter_path: directory with ``adapter_config.json`` + ``adapter_model.safetensors``
            (peft format) of a LoRA to start from: it becomes the frozen "ref" adapter and the
            initial value of "default" and "old".
        keep_ref_copy: full fine-tuning only: keep a snapshot of the initial weights as "ref".
        snapshot_device: full fine-tuning only: where "old"/"ref" snapshots live (default: with
            each parameter).
        autocast_adapter_dtype: LoRA only: keep adapter weights in float32 when the base is
            fp16/bf16 (what ``PeftModel`` does by default; peft casts activations around them).
    """

    def __init__(
        self,
        model: nn.Module,
        lora_config=None,
        old: bool = False,
        ref_adapter_path: str | os.PathLike | None = None,
        *,
        keep_ref_copy: bool = False,
        snapshot_device: str | torch.device | None = None,
        autocast_adapter_dtype: bool = True,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"PolicyStates: model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.has_old = bool(old)
        self._all_params: list[nn.Parameter] = []  # every model parameter, cached for cheap switching
        self._active = "default"
        if lora_config is None and ref_adapter_path is None:
            self.mode = "full"
            self._init_full(keep_ref_copy, snapshot_device)
        else:
            if keep_ref_copy or snapshot_device is not None:
                raise ValueError(
                    "PolicyStates: keep_ref_copy/snapshot_device apply to full fine-tuning (lora_config=None) "
                    "only; with LoRA, 'ref' is the base model (adapters disabled) or the ref adapter"
                )
            self.mode = "lora"
            self._init_lora(lora_config, ref_adapter_path, autocast_adapter_dtype)
        self._all_params = list(self.model.parameters())

    # ------------------------------------------------------------------ construction
    def _init_lora(self, lora_config, ref_adapter_path, autocast_adapter_dtype: bool) -> None:
        from peft import LoraConfig, inject_adapter_in_model
        from peft.functional import cast_adapter_dtype
        from peft.tuners.tuners_utils import BaseTunerLayer

        if any(isinstance(m, BaseTunerLayer) for m in self.model.modules()):
            raise ValueError(
                "PolicyStates: the model already contains peft adapter layers; pass the plain base model "
                "and give an existing LoRA as ref_adapter_path"
            )
        ref_config = None
        if ref_adapter_path is not None:
            ref_dir = Path(ref_adapter_path)
            for fname in (PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME):
                if not (ref_dir / fname).is_file():
                    raise FileNotFoundError(
                        f"PolicyStates: ref_adapter_path {str(ref_dir)!r} must hold {PEFT_CONFIG_NAME} and "
                        f"{PEFT_WEIGHTS_NAME} (peft format); {fname} not found"
                    )
            ref_config = LoraConfig.from_pretrained(str(ref_dir))
            if lora_config is None:
                lora_config = ref_config
            else:
                self._check_same_shape_config(lora_config, ref_config, ref_dir)
        if not isinstance(lora_config, LoraConfig):
            raise TypeError(
                f"PolicyStates: lora_config must be a peft.LoraConfig or None, got {type(lora_config).__name__}"
            )
        for cfg in (lora_config, ref_config):
            if cfg is None:
                continue
            if cfg.bias != "none":
                raise ValueError(
                    f"PolicyStates: LoraConfig.bias must be 'none' (got {cfg.bias!r}): trained base biases "
                    "would be shared by default/old/ref"
                )
            if cfg.modules_to_save or getattr(cfg, "trainable_token_indices", None):
                raise ValueError(
                    "PolicyStates: LoraConfig.modules_to_save / trainable_token_indices are not supported "
                    "(they train full base modules, not adapter states)"
                )

        self._configs: dict[str, object] = {}
        names = ["default"] + (["old"] if self.has_old else []) + (["ref"] if ref_config is not None else [])
        with warnings.catch_warnings():
            # peft warns on every injection after the first ("multiple adapters"): that is the point here.
            warnings.filterwarnings("ignore", message=".*peft_config.*")
            for name in names:
                cfg = _copy.deepcopy(ref_config if name == "ref" else lora_config)
                inject_adapter_in_model(cfg, self.model, adapter_name=name)
                cast_adapter_dtype(self.model, name, autocast_adapter_dtype=autocast_adapter_dtype)
                self._configs[name] = self.model.peft_config[name]
        self._layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        if not self._layers:
            raise ValueError(
                f"PolicyStates: LoraConfig.target_modules={lora_config.target_modules!r} matched no module of "
                f"{type(self.model).__name__}"
            )
        self._adapters = names
        self._ref_is_base = ref_config is None
        names_by_id = {id(p): n for n, p in self.model.named_parameters()}
        self._params: dict[str, dict[str, nn.Parameter]] = {}
        self._param_names: dict[str, list[str]] = {}
        for name in names:
            params = self._collect_adapter_params(name)
            self._params[name] = params
            self._param_names[name] = [names_by_id[id(p)] for p in params.values()]
        for name in names[1:]:
            self._check_same_keys("default", name)

        # Only default's LoRA weights train; base weights (frozen by peft already) and other adapters do not.
        for p in self.model.parameters():
            p.requires_grad_(False)
        for p in self._params["default"].values():
            p.requires_grad_(True)
        self._switch("default")

        if ref_config is not None:
            self._load_adapter_file("ref", Path(ref_adapter_path))
            self.copy("ref", "default")
        if self.has_old:
            self.copy("default", "old")

    @staticmethod
    def _check_same_shape_config(cfg, ref_cfg, ref_dir: Path) -> None:
        def norm(c):
            tm = c.target_modules
            tm = sorted(tm) if isinstance(tm, (list, set, tuple)) else tm
            return {"r": c.r, "lora_alpha": c.lora_alpha, "target_modules": tm, "use_rslora": c.use_rslora,
                    "use_dora": c.use_dora, "rank_pattern": dict(c.rank_pattern or {}),
                    "alpha_pattern": dict(c.alpha_pattern or {})}
        a, b = norm(cfg), norm(ref_cfg)
        diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
        if diff:
            details = ", ".join(f"{k}: given {x!r}, file {y!r}" for k, (x, y) in diff.items())
            raise ValueError(
                f"PolicyStates: lora_config does not match {str(ref_dir / PEFT_CONFIG_NAME)!r} ({details}); "
                "pass lora_config=None to use the saved config"
            )

    def _collect_adapter_params(self, adapter: str) -> dict[str, nn.Parameter]:
        """Adapter tensors keyed like peft's saved keys (adapter name removed): ``<module>.lora_A.weight``."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        out: dict[str, nn.Parameter] = {}
        for mod_name, mod in self.model.named_modules():
            if not isinstance(mod, BaseTunerLayer):
                continue
            for layer_name in mod.adapter_layer_names:
                container = getattr(mod, layer_name, None)
                if not isinstance(container, (nn.ModuleDict, nn.ParameterDict)) or adapter not in container:
                    continue
                prefix = f"{mod_name}.{layer_name}" if mod_name else layer_name
                item = container[adapter]
                if isinstance(item, nn.Parameter):
                    out[prefix] = item
                else:
                    for pn, p in item.named_parameters():
                        out[f"{prefix}.{pn}"] = p
        return out

    def _check_same_keys(self, a: str, b: str) -> None:
        pa, pb = self._params[a], self._params[b]
        if list(pa) != list(pb) or any(pa[k].shape != pb[k].shape for k in pa):
            raise ValueError(f"PolicyStates: adapters {a!r} and {b!r} do not have the same tensors/shapes")

    def refresh(self) -> None:
        """Re-collect every state's parameter references by name from ``self.model``.

        Call it after something replaced the model's parameter objects, e.g. FSDP2 ``fully_shard``
        (``DistContext.wrap_model(model, "fsdp")``), which swaps every parameter for a DTensor shard. Then
        build the optimizer from :meth:`trainable_parameters`. Under FSDP2: ``copy``/``ema`` work on the local
        shards (all states are sharded identically), ``save``/``state_dict`` gather full tensors (collective:
        every rank calls them; only rank 0 writes files), ``load``/``load_state_dict`` take full tensors and
        keep this rank's slice. Full fine-tuning: "old"/"ref" snapshots are re-laid out like their parameters
        (each rank keeps its slice of the full snapshot it built before wrapping)."""
        named = dict(self.model.named_parameters())
        if self.mode == "lora":
            for name, pnames in self._param_names.items():
                missing = [n for n in pnames if n not in named]
                if missing:
                    raise ValueError(f"PolicyStates.refresh: parameters of state {name!r} not found in the model: "
                                     f"{missing[:5]} ({len(missing)})")
                self._params[name] = {k: named[n] for k, n in zip(self._params[name], pnames)}
        else:
            if self._loaded != "default":
                raise ValueError(f"PolicyStates.refresh: called inside use({self._loaded!r}); call it with "
                                 f"'default' active")
            missing = [n for n in self._full_names if n not in named]
            if missing:
                raise ValueError(f"PolicyStates.refresh: parameters not found in the model: {missing[:5]}")
            self._full_params = [named[n] for n in self._full_names]
            if self._store:  # "old"/"ref" snapshots follow the sharding: this rank keeps its slice, as a DTensor
                self._store = {name: [self._shard_like(s, p) for s, p in zip(snaps, self._full_params)]
                               for name, snaps in self._store.items()}
        self._all_params = list(self.model.parameters())

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

    def _sharded(self) -> bool:
        return any(_is_dtensor(p) for p in self._all_params)

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

    # ------------------------------------------------------------------ introspection
    @property
    def states(self) -> tuple[str, ...]:
        """Names usable with :meth:`use`."""
        if self.mode == "lora":
            return ("default",) + (("old",) if self.has_old else ()) + ("ref",)
        return ("default",) + tuple(n for n in ("old", "ref") if n in self._store)

    @property
    def active(self) -> str:
        """The state the model currently computes with."""
        return self._active

    def _check_state(self, name: str, *, writable: bool = False) -> None:
        if name not in STATE_NAMES:
            raise ValueError(f"PolicyStates: unknown state {name!r}; expected one of {list(STATE_NAMES)}")
        if name not in self.states:
            if name == "old":
                hint = "build PolicyStates(..., old=True)"
            else:
                hint = ("build PolicyStates(model, None, keep_ref_copy=True) "
                        "(costs one more copy of the trainable weights)")
            raise ValueError(f"PolicyStates: state {name!r} is not kept ({self.mode} mode); {hint}")
        if writable and self.mode == "lora" and name == "ref" and self._ref_is_base:
            raise ValueError("PolicyStates: 'ref' is the base model (adapters disabled) and cannot be written")

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters the optimizer should hold: "default"'s LoRA weights (full mode: the model's)."""
        if self.mode == "lora":
            return list(self._params["default"].values())
        return list(self._full_params)

    def named_trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(name as in model.named_parameters(), parameter)`` for :meth:`trainable_parameters`."""
        if self.mode == "lora":
            return list(zip(self._param_names["default"], self._params["default"].values()))
        return list(zip(self._full_names, self._full_params))

    def state_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The live tensors of one state, keyed state-independently (LoRA: ``<module>.lora_A.weight``;
        full: parameter name). Writing into them changes the state; use :meth:`copy`/:meth:`ema`."""
        self._check_state(name)
        if self.mode == "lora":
            if name == "ref" and self._ref_is_base:
                return {}
            return dict(self._params[name])
        return dict(zip(self._full_names, self._tensors(name)))

    def parameter_memory(self) -> dict[str, int]:
        """Bytes held: ``base`` = model parameters that are not adapter tensors; then, per state, the
        bytes it adds on top (LoRA: its adapter; "ref" as base model: 0; full mode: "default" 0, "old"/"ref"
        their snapshots); ``total`` = sum."""
        out: dict[str, int] = {}
        if self.mode == "lora":
            adapter_ids = {id(p) for params in self._params.values() for p in params.values()}
            out["base"] = _tensor_bytes(p for p in self.model.parameters() if id(p) not in adapter_ids)
            for name in self.states:
                out[name] = 0 if (name == "ref" and self._ref_is_base) else _tensor_bytes(self._params[name].values())
        else:
            out["base"] = _tensor_bytes(self.model.parameters())
            out["default"] = 0
            for name in ("old", "ref"):
                if name in self._store:
                    out[name] = _tensor_bytes(self._store[name])
        out["total"] = sum(out.values())
        return out

    def __repr__(self) -> str:
        mem = self.parameter_memory()
        parts = ", ".join(f"{k}={v / 2**20:.2f}MiB" for k, v in mem.items())
        return f"PolicyStates(mode={self.mode}, states={list(self.states)}, active={self._active!r}, {parts})"

    # ------------------------------------------------------------------ switching
    def _switch(self, name: str) -> None:
        if self.mode == "lora":
            if name == "ref" and self._ref_is_base:
                for layer in self._layers:
                    layer.enable_adapters(False)
            else:
                for layer in self._layers:
                    if layer.disable_adapters:
                        layer.enable_adapters(True)
                    layer.set_adapter(name)
        else:
            self._full_load(name)
        self._active = name

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

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[nn.Module]:
        """Compute with state ``name`` inside the block; yields ``self.model``.

        On exit (also on exceptions) the previous state and every parameter's ``requires_grad`` are
        restored exactly. Nested ``use`` works. Inside the block ``requires_grad`` is as outside:
        only "default"'s weights require grad, so gradients never reach "old"/"ref".
        """
        self._check_state(name)
        flags = [(p, p.requires_grad) for p in self._all_params]
        prev = self._active
        try:
            self._switch(name)
            for p, f in flags:
                p.requires_grad_(f)
            yield self.model
        finally:
            self._switch(prev)
            for p, f in flags:
                p.requires_grad_(f)

    # ------------------------------------------------------------------ copy / EMA
    def _tensors(self, name: str) -> list[torch.Tensor]:
        if self.mode == "lora":
            return list(self._params[name].values())
        if name == self._loaded:
            return [p.data for p in self._full_params]
        return self._store[name]

    def _pair(self, src: str, dst: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        self._check_state(src)
        self._check_state(dst, writable=True)
        if src == dst:
            raise ValueError(f"PolicyStates: src and dst are both {src!r}")
        if self.mode == "lora" and src == "ref" and self._ref_is_base:
            raise ValueError(
                "PolicyStates: 'ref' is the base model (adapters disabled) and has no adapter tensors to copy"
            )
        return self._tensors(src), self._tensors(dst)

    @torch.no_grad()
    def copy(self, src: str = "default", dst: str = "old") -> None:
        """``dst <- src`` exactly (in place)."""
        s, d = self._pair(src, dst)
        if self._sharded():
            _reshard_fsdp(self.model)
        for a, b in zip(d, s):
            a, b = _locals(a, b)
            a.copy_(b)

    @torch.no_grad()
    def ema(self, src: str, dst: str, decay: float) -> None:
        """``dst <- decay * dst + (1 - decay) * src`` in place (computed as ``dst.mul_(decay).add_(src,
        alpha=1 - decay)``). decay=1 keeps dst, decay=0 copies src."""
        decay = float(decay)
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"PolicyStates.ema: decay must be in [0, 1], got {decay}")
        s, d = self._pair(src, dst)
        if self._sharded():
            _reshard_fsdp(self.model)
        if any(_is_dtensor(a) or _is_dtensor(b) for a, b in zip(d, s)):  # FSDP2: local shards
            pairs = [_locals(a, b) for a, b in zip(d, s)]
            d, s = [a for a, _ in pairs], [b for _, b in pairs]
        if all(a.device == b.device for a, b in zip(d, s)):
            torch._foreach_mul_(d, decay)
            torch._foreach_add_(d, s, alpha=1.0 - decay)
        else:
            for a, b in zip(d, s):
                a.mul_(decay).add_(b.to(a.device), alpha=1.0 - decay)

    # ------------------------------------------------------------------ in-memory checkpoints
    def state_dict(self) -> dict:
        """Clones of every kept state's tensors: ``{"mode", "states": {name: {key: tensor}}}``.
        ("ref" as base model has no tensors and is not included.) Full mode clones whole weights."""
        out = {}
        for name in self._written_states():
            out[name] = {k: _full(t).clone() for k, t in zip(self._keys(name), self._tensors(name))}
        return {"mode": self.mode, "states": out}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Copy tensors from :meth:`state_dict` output into every kept state (exact)."""
        if not isinstance(state_dict, dict) or "states" not in state_dict:
            raise ValueError(
                "PolicyStates.load_state_dict: expected a dict from PolicyStates.state_dict() with key 'states'"
            )
        if state_dict.get("mode") != self.mode:
            raise ValueError(
                f"PolicyStates.load_state_dict: mode mismatch, expected {self.mode!r}, got {state_dict.get('mode')!r}"
            )
        got = state_dict["states"]
        expected = self._written_states()
        if sorted(got) != sorted(expected):
            raise ValueError(f"PolicyStates.load_state_dict: states expected {sorted(expected)}, got {sorted(got)}")
        for name in expected:
            self._copy_into(name, got[name], where=f"state_dict['states'][{name!r}]")

    def _written_states(self) -> list[str]:
        if self.mode == "lora":
            return list(self._adapters)
        return list(self.states)

    def _keys(self, name: str) -> list[str]:
        return list(self._params[name]) if self.mode == "lora" else list(self._full_names)

    def _copy_into(self, name: str, tensors: dict[str, torch.Tensor], where: str) -> None:
        keys = self._keys(name)
        missing = [k for k in keys if k not in tensors]
        unexpected = [k for k in tensors if k not in set(keys)]
        if missing or unexpected:
            raise ValueError(
                f"PolicyStates: {where}: keys do not match state {name!r}: missing {missing[:5]} "
                f"({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})"
            )
        dst = self._tensors(name)
        for k, t in zip(keys, dst):
            if tensors[k].shape != t.shape:
                raise ValueError(
                    f"PolicyStates: {where}: {k} expected shape {tuple(t.shape)}, got {tuple(tensors[k].shape)}"
                )
        if self._sharded():
            _reshard_fsdp(self.model)
        with torch.no_grad():
            for k, t in zip(keys, dst):
                _copy_full_into(t, tensors[k])

    # ------------------------------------------------------------------ files
    def nonfinite_tensors(self) -> list[str]:
        """``"<state>:<key>"`` of every kept state's tensor holding NaN/inf (this rank's shards under FSDP2)."""
        bad = []
        for name in self._written_states():
            for k, t in zip(self._keys(name), self._tensors(name)):
                local = t.to_local() if _is_dtensor(t) else t
                if not bool(torch.isfinite(local.detach()).all()):
                    bad.append(f"{name}:{k}")
        return bad

    def save(self, directory: str | os.PathLike) -> None:
        """Write every kept state (see module docstring for the layout). Weights holding NaN/inf are refused
        (ValueError naming the tensors) before anything is written.

        FSDP2-sharded model (after :meth:`refresh`): a collective -- every rank must call it (the shards are
        gathered into full tensors); only rank 0 writes, other ranks may pass ``directory=None``."""
        from safetensors.torch import save_file

        if self._sharded():
            gathered = {name: {k: _full(t).to("cpu").contiguous()
                               for k, t in zip(self._keys(name), self._tensors(name))}
                        for name in self._written_states()}
            bad = [f"{name}:{k}" for name, sd in gathered.items() for k, t in sd.items()
                   if not bool(torch.isfinite(t).all())]  # full tensors: every rank decides alike
        else:
            gathered = None
            bad = self.nonfinite_tensors()
        if bad:
            raise ValueError(f"PolicyStates.save: {len(bad)} tensor(s) hold NaN/inf (first: {bad[0]}); "
                             f"nothing was written to {directory}")
        if gathered is not None and not _main_rank():
            return
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        written = self._written_states()
        for name in written:
            sub = directory / name
            sub.mkdir(parents=True, exist_ok=True)
            if self.mode == "lora":
                sd = gathered[name] if gathered is not None else self._peft_state_dict(name)
                save_file({_PEFT_PREFIX + k: v for k, v in sd.items()}, str(sub / PEFT_WEIGHTS_NAME),
                          metadata={"format": "pt"})
                self._configs[name].save_pretrained(str(sub))
                if _is_diffusers_model(self.model):
                    # diffusers' pipeline loaders keep only keys under the component's name
                    pre = "unet." if "UNet" in type(self.model).__name__ else "transformer."
                    meta = {pre + k: v for k, v in _config_json_dict(self._configs[name]).items()}
                    save_file({pre + k: v for k, v in sd.items()}, str(sub / DIFFUSERS_WEIGHTS_NAME),
                              metadata={"format": "pt", "lora_adapter_metadata": json.dumps(meta, sort_keys=True)})
            else:
                tensors = gathered[name] if gathered is not None else \
                    {k: t.detach().to("cpu").contiguous() for k, t in zip(self._full_names, self._tensors(name))}
                save_file(tensors, str(sub / FULL_WEIGHTS_NAME), metadata={"format": "pt"})
        index = {"mode": self.mode, "states": list(self.states), "written": written,
                 "ref": "base_model" if self._ref_is_base else ("adapter" if self.mode == "lora" else "snapshot")}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")

    def _peft_state_dict(self, name: str) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        sd = get_peft_model_state_dict(self.model, adapter_name=name, save_embedding_layers=False)
        return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}

    def load(self, directory: str | os.PathLike) -> None:
        """Restore every kept state from :meth:`save` output (exact)."""
        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"PolicyStates.load: directory {str(directory)!r} not found")
        index_path = directory / INDEX_NAME
        if index_path.is_file():
            index = json.loads(index_path.read_text())
            if index.get("mode") != self.mode:
                raise ValueError(
                    f"PolicyStates.load: {str(index_path)!r} has mode {index.get('mode')!r}, expected {self.mode!r}"
                )
        for name in self._written_states():
            if self.mode == "lora":
                self._load_adapter_file(name, directory / name)
            else:
                from safetensors.torch import load_file

                path = directory / name / FULL_WEIGHTS_NAME
                if not path.is_file():
                    raise FileNotFoundError(f"PolicyStates.load: {str(path)!r} not found (state {name!r})")
                self._copy_into(name, load_file(str(path)), where=str(path))

    def _load_adapter_file(self, name: str, sub: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = sub / PEFT_WEIGHTS_NAME
        if not path.is_file():
            raise FileNotFoundError(f"PolicyStates: {str(path)!r} not found (adapter {name!r})")
        sd = load_file(str(path))
        if self._sharded():  # FSDP2: full tensors from the file, this rank's slice into each shard
            tensors = {k[len(_PEFT_PREFIX):] if k.startswith(_PEFT_PREFIX) else k: v for k, v in sd.items()}
            self._copy_into(name, tensors, where=str(path))
            return
        flags = [(p, p.requires_grad) for p in self.model.parameters()]
        try:
            result = set_peft_model_state_dict(self.model, sd, adapter_name=name)
        except RuntimeError as e:  # size mismatch from load_state_dict
            raise ValueError(f"PolicyStates: {str(path)!r} does not fit adapter {name!r}: {e}") from e
        finally:
            for p, f in flags:
                p.requires_grad_(f)
        expected = set(self._param_names[name])
        missing = [k for k in result.missing_keys if k in expected]
        unexpected = list(result.unexpected_keys)
        if missing or unexpected:
            raise ValueError(
                f"PolicyStates: {str(path)!r} does not match adapter {name!r}: missing {missing[:5]} "
                f"({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})"
            )

