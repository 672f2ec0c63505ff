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
import math
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


def _parameters(name: str) -> dict[str, Any] | None:
    """{argument: inspect.Parameter} the reward registered under `name` is built with, or None when it takes any
    (`**kwargs`); unknown name -> ValueError listing the valid ones. Imports the reward's module, never a model."""
    import inspect

    if name not in _REGISTRY and name in _LAZY:
        importlib.import_module(_LAZY[name])
    if name not in _REGISTRY and name.startswith("python:"):
        return None  # a function given to mmrl.Trainer (registered while it runs): a run's config.yaml still loads
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward '{name}'; available: {available()}")
    obj = _REGISTRY[name]
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name: p for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                    inspect.Parameter.KEYWORD_ONLY)}


def reward_arguments(name: str) -> list[str] | None:
    """The keyword arguments the reward registered under `name` is built with (sorted), or None when it takes any
    (`**kwargs`); unknown name -> ValueError listing the valid ones. Imports the reward's module, never a model."""
    params = _parameters(name)
    return None if params is None else sorted(params)


# an argument annotated with one of these (or it `| None`) must get a value of that kind
_SCALARS = {"int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
            "float": ("a number", lambda v: (isinstance(v, (int, float)) and not isinstance(v, bool))
                      or (isinstance(v, str) and _is_float(v))),  # YAML reads `1e-3` (no dot) as a string
            "bool": ("true or false", lambda v: isinstance(v, bool))}


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _expected_scalar(param: Any, value: Any) -> str | None:
    """What `value` should have been for an argument annotated int / float / bool (None: it fits, or the argument
    takes other things too): a word for a number (`quality=abc`) is refused here, not deep inside the reward."""
    ann = param.annotation if isinstance(param.annotation, str) else getattr(param.annotation, "__name__", "")
    kinds = {a.strip() for a in str(ann).split("|")}
    if value is None and "None" in kinds:
        return None
    kinds.discard("None")
    if len(kinds) != 1 or next(iter(kinds)) not in _SCALARS:
        return None
    word, fits = _SCALARS[next(iter(kinds))]
    return None if fits(value) else word


def check_reward_arguments(name: str, kwargs: dict, where: str, sep: str = ".") -> None:
    """ValueError naming `where<sep><arg>` for an argument the reward `name` does not take (valid ones listed) or a
    value of the wrong kind for an int / float / bool argument, or `where` for an unknown reward: what
    `create(name, **kwargs)` would fail on, found before any model loads."""
    try:
        params = _parameters(name)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if params is None:
        return
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        raise ValueError(f"{where}{sep}{unknown[0]}: reward '{name}' has no argument '{unknown[0]}'; valid: "
                         f"{sorted(params)}")
    for key, value in kwargs.items():
        expected = _expected_scalar(params[key], value)
        if expected is not None:
            default = params[key].default
            shown = "" if default is params[key].empty else f" (default {default!r})"
            raise ValueError(f"{where}{sep}{key}: reward '{name}' takes {expected} for '{key}'{shown}, got {value!r}")


def check_reward_mapping(mapping: Any, where: str) -> None:
    """Check a weighted-composite spec `{name: weight}` / `{name: {weight: w, reward: registered name, <args>}}`
    (`mmrl.rewards.load(mapping)`): each component's reward exists, its weight is a number and its arguments are
    ones that reward takes. ValueError naming the key (`where.<component>[.<arg>]`)."""
    if not isinstance(mapping, dict):
        raise ValueError(f"{where}: expected a mapping name -> weight or name -> {{weight: w, <arguments>}}, "
                         f"got {mapping!r}")
    if "components" in mapping and isinstance(mapping["components"], dict):  # {components: {...}, normalize: ...}
        extra = sorted(set(mapping) - {"components", "normalize", "eps"})
        if extra:
            raise ValueError(f"{where}.{extra[0]}: unknown key of a composite spec; valid: components, normalize, eps")
        return check_reward_mapping(mapping["components"], f"{where}.components")
    for key, spec in mapping.items():
        at = f"{where}.{key}"
        if spec is None or (isinstance(spec, (int, float)) and not isinstance(spec, bool)):
            if spec is not None and not math.isfinite(spec):
                raise ValueError(f"{at}: expected a finite weight, got {spec!r}")
            check_reward_arguments(str(key), {}, at)
            continue
        if not isinstance(spec, dict):
            raise ValueError(f"{at}: expected a weight (number) or a mapping {{weight: w, <arguments>}}, got {spec!r}")
        args = dict(spec)
        weight = args.pop("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ValueError(f"{at}.weight: expected a number, got {weight!r}")
        if not math.isfinite(weight):  # a NaN weight makes every summed reward NaN
            raise ValueError(f"{at}.weight: expected a finite number, got {weight!r}")
        name = args.pop("reward", args.pop("name", key))
        check_reward_arguments(str(name), args, at)
