"""Reward names -> the classes / factories that build them.

    @register("my_reward", "alias")                    # in the module that defines the reward
    register_lazy("mmrl.rewards.image.ocr", "ocr")      # imported on first use (heavy dependencies)
    create("ocr", device="cuda")                       # what `mmrl.rewards.load("ocr", ...)` calls

This module imports nothing from mmrl, so every reward module (and `base.py`, which re-exports these names)
can import it without an import circle. `mmrl.rewards.load` (in base.py) turns a spec - a name, a mapping
(weighted composite, built through the registered name "composite") or a RewardModel - into a model.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

_REGISTRY: dict[str, Callable[..., Any]] = {}
# name -> module that registers it when imported (so heavy models load only on use)
_LAZY: dict[str, str] = {}


def register(name: str, *aliases: str):
    """Decorator registering a RewardModel class (or factory) under `name` (and aliases)."""

    def deco(obj):
        for n in (name, *aliases):
            _REGISTRY[n] = obj
        return obj

    return deco


def register_lazy(module: str, *names: str) -> None:
    """`names` are registered by importing `module`, which happens on the first `create` of one of them."""
    for n in names:
        _LAZY.setdefault(n, module)


def available() -> list[str]:
    """Names `load` accepts."""
    return sorted(set(_REGISTRY) | set(_LAZY))


def lookup(name: str) -> Any:
    """The class (or factory) registered under `name`, importing its module on first use; None when unknown."""
    if name not in _REGISTRY and name in _LAZY:
        importlib.import_module(_LAZY[name])
    return _REGISTRY.get(name)


def create(name: str, **kwargs: Any) -> Any:
    """The reward registered under `name`, built with `kwargs`; unknown name -> ValueError listing the valid ones."""
    if name not in _REGISTRY and name in _LAZY:
        importlib.import_module(_LAZY[name])
    if name not in _REGISTRY and name.startswith("python:"):
        raise ValueError(f"reward '{name}' was a Python function passed to mmrl.Trainer; it exists only while that "
                         f"Trainer runs: train or evaluate through mmrl.Trainer with the function, or name a zoo reward "
                         f"({available()})")
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward '{name}'; available: {available()}")
    return _REGISTRY[name](**kwargs)
