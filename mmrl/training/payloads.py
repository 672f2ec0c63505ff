"""Payloads of the rollout process, in transit and in checkpoints: plain state and packed weights.

- `to_plain(obj)` / `from_plain(obj)`: a rollout batch (dataclasses and dict subclasses of mmrl, PIL images, numpy
  arrays, tensors, containers) as tensors, numbers, strings and containers only, which is what a checkpoint loads
  with ``weights_only=True`` (`mmrl.run.files.load_state_file`) and what crosses processes through
  torch.multiprocessing queues (tensors in shared memory). Only classes of mmrl modules are rebuilt: a foreign
  checkpoint cannot make this process import anything else.
- `encode(plain)` / `decode(data)`: plain state as pickle bytes (tensors by value) and back: how batches cross from
  the rollout process. One copy through the queue's pipe beats sharing every tensor of a batch through shared
  memory, where the receiver fetches each tensor's file descriptor from the sender in a round trip that waits for
  the sender's Python thread (measured on a loaded 2-core machine: ~1 s per VLM batch of ~30 tensors); and C pickle
  is several times faster than torch.load's weights_only unpickler, which checkpoints use.
- `pack_tensors(named)` / `unpack_tensors(packed)`: named weights as one flat buffer per dtype (one shared-memory
  segment each), and back as views.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pickle
from typing import Any

import numpy as np
import torch

__all__ = ["to_plain", "from_plain", "encode", "decode", "pack_tensors", "unpack_tensors"]


def pack_tensors(named: dict[str, torch.Tensor]) -> dict:
    """Copy `named` into one flat CPU buffer per dtype (one shared-memory segment each when sent through a
    torch.multiprocessing queue): {"names", "shapes", "dtypes", "flat": {dtype name: 1-D tensor}}."""
    groups: dict[str, list[torch.Tensor]] = {}
    names, shapes, dtypes = [], [], []
    for name, t in named.items():
        t = t.detach()
        key = str(t.dtype).replace("torch.", "")
        groups.setdefault(key, []).append(t.reshape(-1).cpu())
        names.append(name), shapes.append(list(t.shape)), dtypes.append(key)
    flat = {k: torch.cat(v) if len(v) > 1 else v[0].clone() for k, v in groups.items()}
    return {"names": names, "shapes": shapes, "dtypes": dtypes, "flat": flat}


def unpack_tensors(packed: dict) -> dict[str, torch.Tensor]:
    """The inverse of `pack_tensors`: {name: view into the flat buffer}."""
    offsets = {k: 0 for k in packed["flat"]}
    out = {}
    for name, shape, key in zip(packed["names"], packed["shapes"], packed["dtypes"]):
        n = int(np.prod(shape)) if shape else 1
        out[name] = packed["flat"][key][offsets[key]:offsets[key] + n].view(shape)
        offsets[key] += n
    return out


# ------------------------------------------------------------------------------------------ payloads as plain state

_DATACLASS, _DICT, _IMAGE, _ARRAY = "__mmrl_dataclass__", "__mmrl_dict__", "__mmrl_pil__", "__mmrl_ndarray__"


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}:{type(obj).__qualname__}"


@functools.lru_cache(maxsize=None)
def _resolve(name: str) -> type:
    """An mmrl class named by `_class_name` (only classes of mmrl modules: a checkpoint never imports others)."""
    module, _, qual = name.partition(":")
    if not (module == "mmrl" or module.startswith("mmrl.")):
        raise ValueError(f"rollout payload: refusing to rebuild {name!r} (only mmrl classes)")
    try:
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise ValueError(f"rollout payload: class {name!r} cannot be found by name") from None
    if not isinstance(obj, type):
        raise ValueError(f"rollout payload: {name!r} is not a class")
    return obj


_ATOMS = (bool, int, float, str, type(None))


def to_plain(obj: Any) -> Any:
    """`obj` as tensors (CPU), numbers, strings and containers only: what a checkpoint loads with
    ``weights_only=True`` and what crosses processes cheaply. Dataclasses and dict subclasses of mmrl, PIL images
    and numpy arrays are marked and rebuilt by `from_plain`; anything else is a TypeError naming its type. An object
    reached twice (e.g. the pixel values every sample of a prompt shares) is converted once and stays shared."""
    return _walk_shared(obj, _to_plain_one)


def _walk_shared(obj: Any, one: Any) -> Any:
    """`one(o, conv)` applied through `obj`'s containers by `one` itself (calling `conv` on its children); atoms
    returned as they are; an object reached twice converted once, so what was shared stays shared."""
    memo: dict[int, Any] = {}

    def conv(o: Any) -> Any:
        if type(o) in _ATOMS:
            return o
        key = id(o)
        if key not in memo:
            memo[key] = one(o, conv)
        return memo[key]

    return conv(obj)


def _to_plain_one(obj: Any, conv: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, _ATOMS):  # subclasses of the atoms (e.g. IntEnum) as their plain value
        return obj
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return {_ARRAY: torch.from_numpy(np.ascontiguousarray(obj))}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        _resolve(_class_name(obj))  # only mmrl classes can be rebuilt: refuse the others before they travel
        return {_DATACLASS: _class_name(obj),
                "fields": {f.name: conv(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, (str, int))]
        if bad:
            raise TypeError(f"rollout payload: dict keys must be str or int, got {type(bad[0]).__name__}")
        items = {k: conv(v) for k, v in obj.items()}
        if type(obj) is dict:
            return items
        _resolve(_class_name(obj))
        return {_DICT: _class_name(obj), "items": items}
    if isinstance(obj, list):
        return list(obj) if all(type(v) in _ATOMS for v in obj) else [conv(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(conv(v) for v in obj)
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency
        Image = None
    if Image is not None and isinstance(obj, Image.Image):
        return {_IMAGE: torch.from_numpy(np.array(obj)), "mode": obj.mode}
    raise TypeError(f"rollout payload: cannot send or checkpoint a {type(obj).__module__}.{type(obj).__qualname__} "
                    f"(use tensors, numbers, strings, lists, dicts, PIL images or mmrl dataclasses)")


def from_plain(obj: Any, device: torch.device | str | None = None) -> Any:
    """Rebuild what `to_plain` wrote; tensors moved to `device` (None: left on the CPU). What was shared stays
    shared."""
    return _walk_shared(obj, lambda o, conv: _from_plain_one(o, conv, device))


def _from_plain_one(obj: Any, conv: Any, device: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj if device is None else obj.to(device)
    if isinstance(obj, list):
        return obj if all(type(v) in _ATOMS for v in obj) else [conv(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(conv(v) for v in obj)
    if not isinstance(obj, dict):
        return obj
    if _DATACLASS in obj:
        cls = _resolve(obj[_DATACLASS])
        if not dataclasses.is_dataclass(cls):
            raise ValueError(f"rollout payload: {obj[_DATACLASS]!r} is not a dataclass")
        inst = cls.__new__(cls)  # fields set as they were: no __init__ / __post_init__ side effects
        for k, v in obj["fields"].items():
            object.__setattr__(inst, k, conv(v))
        return inst
    if _DICT in obj:
        cls = _resolve(obj[_DICT])
        if not issubclass(cls, dict):
            raise ValueError(f"rollout payload: {obj[_DICT]!r} is not a dict class")
        return cls({k: conv(v) for k, v in obj["items"].items()})
    if _IMAGE in obj:
        from PIL import Image

        return Image.fromarray(obj[_IMAGE].numpy(), mode=obj["mode"])
    if _ARRAY in obj:
        return obj[_ARRAY].numpy()
    return {k: conv(v) for k, v in obj.items()}


def encode(plain: Any) -> bytes:
    """Plain state (`to_plain` output, RNG states) as bytes for the queue from the rollout process: pickle, tensors by
    value (not torch.multiprocessing's shared-memory reductions)."""
    return pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    """`encode`'s input back. Only for bytes from this run's own rollout process (checkpoints, which may come from
    elsewhere, are read with ``weights_only=True``: `mmrl.run.files.load_state_file`)."""
    return pickle.loads(data)
