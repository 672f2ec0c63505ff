"""PolicyStates' checkpoints: in-memory state dicts and the files of ``save`` / ``load``.

A mixin of :class:`mmrl.adapters.PolicyStates` (it uses the state bookkeeping the class sets up). The file layout
(peft's format per adapter, diffusers' pipeline format alongside, ``model.safetensors`` per full-mode state) is in
the ``mmrl.adapters`` docstring.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

from mmrl.adapters.sharding import _copy_full_into, _full, _is_dtensor, _main_rank, _reshard_fsdp

PEFT_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_CONFIG_NAME = "adapter_config.json"
DIFFUSERS_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
FULL_WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "policy_states.json"
SHARDED_KEY = "policy"  # top-level key of the policy-state tensors in a torch.distributed.checkpoint state dict
_PEFT_PREFIX = "base_model.model."


def sharded_weights_dir(directory: str | os.PathLike) -> Path | None:
    """The torch.distributed.checkpoint directory holding the full fine-tuning weights of a ``save(.., sharded_dir)``
    output `directory` (an ``adapters/`` dir), or None when its weights are whole files."""
    index = Path(directory) / INDEX_NAME
    if not index.is_file():
        return None
    info = json.loads(index.read_text())
    return Path(directory) / info["sharded_dir"] if info.get("weights") == "sharded" else None


def load_sharded_state(directory: str | os.PathLike, state: str) -> dict[str, torch.Tensor]:
    """One policy state of a sharded full fine-tuning checkpoint as whole CPU tensors ``{parameter name: tensor}``
    (what ``model.safetensors`` of a gathered checkpoint holds), read in this process from every rank's shards.
    Memory: that one state, nothing more."""
    from mmrl.distributed import dcp_load, dcp_tensor_metadata

    path = sharded_weights_dir(directory)
    if path is None:
        raise ValueError(f"{directory}: not a sharded checkpoint's adapters/ ({INDEX_NAME} says the weights are files)")
    written = json.loads((Path(directory) / INDEX_NAME).read_text()).get("written", [])
    if state not in written:
        raise FileNotFoundError(f"checkpoint {directory}: no policy state {state!r} (saved: {written})")
    prefix = f"{SHARDED_KEY}.{state}."
    tensors = {k[len(prefix):]: torch.empty(tuple(m.size), dtype=m.properties.dtype)
               for k, m in dcp_tensor_metadata(path).items() if k.startswith(prefix)}
    dcp_load({SHARDED_KEY: {state: tensors}}, path)
    return tensors


def _is_diffusers_model(model: nn.Module) -> bool:
    diffusers = sys.modules.get("diffusers")
    return diffusers is not None and isinstance(model, diffusers.ModelMixin)


def _config_json_dict(cfg) -> dict:
    d = cfg.to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in d.items()}


class _StateFiles:
    """Checkpoint methods of PolicyStates (state_dict / load_state_dict, save / load, NaN checks)."""

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

    def sharded_state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{state: {key: live tensor}}`` of every kept state (keys as in :meth:`state_dict`) for
        ``torch.distributed.checkpoint``: no gather, no copy -- under FSDP2 these are this rank's DTensor shards, so
        each rank writes only its own slice, and a load writes into them in place (:meth:`load` does that for a
        :meth:`save` made with ``sharded_dir``)."""
        return {name: dict(zip(self._keys(name), self._tensors(name))) for name in self._written_states()}

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

    def save(self, directory: str | os.PathLike, sharded_dir: str | None = None) -> None:
        """Write every kept state (layout: see the ``mmrl.adapters`` docstring). Weights holding NaN/inf are refused
        (ValueError naming the tensors) before anything is written.

        FSDP2-sharded model (after :meth:`refresh`): a collective -- every rank must call it (the shards are
        gathered into full tensors); only rank 0 writes, other ranks may pass ``directory=None``.

        sharded_dir (full fine-tuning): the weights are written by the caller with ``torch.distributed.checkpoint``
        (:meth:`sharded_state_dict` under the key ``SHARDED_KEY``) into ``sharded_dir``, a path relative to
        `directory`; nothing is gathered, no ``model.safetensors`` is written, and the index records where the
        weights are, so :meth:`load` reads them back on any number of ranks. LoRA adapters are small and are
        always written whole (`sharded_dir` is then ignored)."""
        from safetensors.torch import save_file

        if sharded_dir is not None and self.mode == "full":
            bad = self.nonfinite_tensors()  # this rank's shards (mmrl.training checks every rank's before saving)
            if bad:
                raise ValueError(f"PolicyStates.save: {len(bad)} tensor(s) hold NaN/inf (first: {bad[0]}); "
                                 f"nothing was written to {directory}")
            if _main_rank():
                self._write_index(Path(directory), [], sharded_dir)
            return
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
        self._write_index(directory, written)

    def _write_index(self, directory: Path, written: list[str], sharded_dir: str | None = None) -> None:
        index = {"mode": self.mode, "states": list(self.states), "written": written,
                 "ref": "base_model" if self._ref_is_base else ("adapter" if self.mode == "lora" else "snapshot")}
        if sharded_dir is not None:
            index.update(written=self._written_states(), weights="sharded", sharded_dir=str(sharded_dir))
        directory.mkdir(parents=True, exist_ok=True)
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
        index = json.loads(index_path.read_text()) if index_path.is_file() else {}
        if index and index.get("mode") != self.mode:
            raise ValueError(
                f"PolicyStates.load: {str(index_path)!r} has mode {index.get('mode')!r}, expected {self.mode!r}"
            )
        if index.get("weights") == "sharded":
            self._load_sharded(directory / index["sharded_dir"], list(index.get("written", [])), str(index_path))
            return
        for name in self._written_states():
            if self.mode == "lora":
                self._load_adapter_file(name, directory / name)
            else:
                from safetensors.torch import load_file

                path = directory / name / FULL_WEIGHTS_NAME
                if not path.is_file():
                    raise FileNotFoundError(f"PolicyStates.load: {str(path)!r} not found (state {name!r})")
                self._copy_into(name, load_file(str(path)), where=str(path))

    def _load_sharded(self, path: Path, written: list[str], where: str) -> None:
        """Read the full fine-tuning weights of a ``save(.., sharded_dir=..)`` back in place with
        torch.distributed.checkpoint (each rank reads the slices it holds, whatever the number of ranks that wrote
        them; a collective when a process group exists)."""
        from mmrl.distributed import dcp_load

        expected = self._written_states()
        if sorted(written) != sorted(expected):
            raise ValueError(f"PolicyStates.load: {where} holds states {sorted(written)}, this PolicyStates keeps "
                             f"{sorted(expected)} (old=/keep_ref_copy= differ from the run that wrote it)")
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(f"PolicyStates.load: {where} says the weights are sharded in {str(path)!r}, which "
                                    f"has no torch.distributed.checkpoint .metadata file")
        if self._sharded():
            _reshard_fsdp(self.model)
        with torch.no_grad():
            dcp_load({SHARDED_KEY: self.sharded_state_dict()}, path)

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

