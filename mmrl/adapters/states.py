"""PolicyStates: named policy states on one model -- construction, switching (``use``), copy / EMA.

The two modes live in their own modules (``lora.py``: peft adapters; ``full.py``: parameter snapshots) and the
checkpoint methods in ``files.py``; this class ties them together. See the ``mmrl.adapters`` docstring.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

from mmrl.adapters.files import _StateFiles
from mmrl.adapters.full import _FullStates
from mmrl.adapters.lora import _LoraStates
from mmrl.adapters.sharding import _is_dtensor, _locals, _reshard_fsdp

STATE_NAMES = ("default", "old", "ref")


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class PolicyStates(_LoraStates, _FullStates, _StateFiles):
    """Named policy states ("default", "old", "ref") on one model; see the ``mmrl.adapters`` docstring.

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

    def _sharded(self) -> bool:
        return any(_is_dtensor(p) for p in self._all_params)

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
