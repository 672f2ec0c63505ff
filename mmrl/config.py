"""Typed, strict configs: nested dataclasses <-> YAML, dotted command-line overrides.

Every recipe module defines ``@dataclass class Config(RunConfig)`` whose fields carry an attribute
docstring (a string literal on the line after the field) and a ``train(cfg) -> dict`` function.
YAML is strict: an unknown key is an error that names the key, its path and the valid keys. In Python a recipe's
config is also built directly (`mmrl.FlowGRPOConfig(...)`, `CONFIG_NAMES`), with sections as mappings and TRL's flat
names (`_RecipeConfigType`, `mmrl.trl_names`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import math
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

# algorithm name -> module that defines `Config` and `train(cfg)`
RECIPES: dict[str, str] = {
    "flow_grpo": "mmrl.diffusion.flow_grpo",
    "dpo": "mmrl.diffusion.dpo",
    "nft": "mmrl.diffusion.nft",
    "awm": "mmrl.diffusion.awm",
    "dgpo": "mmrl.diffusion.dgpo",
    "vlm_grpo": "mmrl.vlm.grpo",
    "vlm_multiturn": "mmrl.vlm.multiturn",
    "prompt_rewriter": "mmrl.joint.rewriter",
    "janus_grpo": "mmrl.ar_image.grpo",
    "reward_bt": "mmrl.reward_train.bt",
}

# the recipes' configs under their Python API names (`mmrl.FlowGRPOConfig` is mmrl.diffusion.flow_grpo.Config);
# GRPOConfig, TRL's name, is the VLM GRPO config (TRL's GRPO trains language models)
CONFIG_NAMES: dict[str, str] = {
    "FlowGRPOConfig": "flow_grpo", "NFTConfig": "nft", "AWMConfig": "awm", "DGPOConfig": "dgpo", "DPOConfig": "dpo",
    "VLMGRPOConfig": "vlm_grpo", "GRPOConfig": "vlm_grpo", "MultiTurnConfig": "vlm_multiturn",
    "PromptRewriterConfig": "prompt_rewriter", "JanusGRPOConfig": "janus_grpo"}


def config_name(algorithm: str) -> str:
    """The Python API name of a recipe's config (`flow_grpo` -> `FlowGRPOConfig`)."""
    return next((n for n, a in CONFIG_NAMES.items() if a == algorithm), f"{algorithm} Config")


class ConfigError(ValueError):
    """A config file or override does not fit the recipe's schema."""


# Numbers a config may hold. NaN and infinity never mean anything in a config (a NaN passes every `x < 0` check),
# and a float beyond float32's range turns into inf (or an overflow error) in the first tensor it scales: both are
# refused while the config is read, naming the key, rather than failing after the model load.
FLOAT_LIMIT = 3.4028234663852886e38  # torch.finfo(torch.float32).max
INT_LIMIT = 2**63


@dataclass
class TrainConfig:
    """Keys every recipe's `train:` section has; recipes subclass it to add their own."""

    max_steps: int = 100
    """Number of optimizer steps (RL steps) to run in total, counting resumed ones."""
    save_every: int = 50
    """Write a checkpoint every this many steps (0 = only at the end)."""
    resume: str = "auto"
    """`auto` (newest complete checkpoint in output_dir, if any), `never`, or a checkpoint directory."""
    keep_last: int = 2
    """Keep this many newest checkpoints; older ones are deleted after a new one is complete."""
    overwrite: bool = False
    """Allow a run that would discard what output_dir holds (resume=never into a directory with checkpoints or
    metrics, or resuming from a checkpoint older than the newest): without it such a start is refused."""


class _RecipeConfigType(type):
    """Building a recipe config in Python (`mmrl.FlowGRPOConfig(...)`): a section may be given as a mapping (checked
    and filled with the section's defaults, as a YAML section is); TRL's flat keyword names (`learning_rate=...`,
    `num_generations=...`) set the keys they mean (`mmrl.trl_names`); one positional argument is `output_dir`, as
    in transformers' TrainingArguments. Without any of these it is the dataclass constructor (from_dict, copies)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if args:
            if len(args) > 1 or "output_dir" in kwargs:
                raise ConfigError(f"{config_name(cls().algorithm)}: one positional argument (output_dir) at most; give the others "
                                  f"as keywords")
            kwargs["output_dir"] = args[0]
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        flat = {k: kwargs.pop(k) for k in list(kwargs) if k not in fields}
        hints = typing.get_type_hints(cls) if any(isinstance(v, dict) for v in kwargs.values()) else {}
        for name, value in kwargs.items():
            tp = hints.get(name)
            if isinstance(value, dict) and dataclasses.is_dataclass(tp):
                default = fields[name].default_factory
                kwargs[name] = from_dict(tp, value, path=name,
                                         defaults=default() if default is not dataclasses.MISSING else None)
        cfg = super().__call__(**kwargs)
        if flat:
            from mmrl import trl_names

            def set_keys(obj: Any, values: dict) -> None:
                apply_overrides(obj, [f"{k}={json.dumps(v)}" for k, v in values.items()])

            try:
                cfg.__dict__["trainer_args"] = trl_names.apply(cfg, flat, set_keys)
            except ValueError as exc:
                raise ConfigError(f"{config_name(cfg.algorithm)}: {exc}") from None
        return cfg


@dataclass
class RunConfig(metaclass=_RecipeConfigType):
    """Keys every recipe has at the top level. Also readable under the TRL names that map to keys
    (`cfg.learning_rate` is `cfg.optim.lr`; `mmrl.trl_names.read`)."""

    algorithm: str = ""
    """Recipe name: a key of `mmrl.config.RECIPES` (`mmrl config dump ALGO` prints its keys)."""
    output_dir: str = "runs/default"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, samples/, plots/."""
    seed: int = 0
    """Global random seed (python, numpy, torch)."""
    device: str = "auto"
    """`auto` (cuda if available, else cpu), `cpu`, `cuda` or `cuda:N`."""
    dtype: str = "float32"
    """Compute dtype of the frozen model weights: float32, bfloat16 or float16 (trainable weights stay fp32)."""
    num_threads: int = 0
    """torch intra-op CPU threads (0 = torch's default). 1 is fastest for tiny models on a shared 2-core CPU."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training-loop keys."""

    def __getattr__(self, name: str) -> Any:  # only for names that are not attributes: the TRL names
        if name.startswith("_"):
            raise AttributeError(name)
        from mmrl import trl_names

        return trl_names.read(self, name)


# --------------------------------------------------------------------------------------------
# field docs


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (and its bases): {field name: doc}."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            src = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(src).body[0].body  # type: ignore[attr-defined]
        for stmt, nxt in zip(body, body[1:] + [None]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if (
                    isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                ):
                    docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


# --------------------------------------------------------------------------------------------
# dict -> dataclass (strict, typed)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against annotation `tp`, converting only the safe cases (int -> float, str -> Path)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: expected one of {list(args)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping (section {tp.__name__}), got {value!r}")
        return from_dict(tp, value, path=where)
    if origin in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        out = [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
        return out if origin is list else tuple(out)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        kt, vt = args if args else (Any, Any)
        return {_coerce(k, kt, where): _coerce(v, vt, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if not -INT_LIMIT <= value < INT_LIMIT:  # a torch.long / numpy int64 cannot hold it
                raise ConfigError(f"{where}: expected an integer within +-2**63, got {value!r}")
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) < 1e309 else math.inf  # int -> float overflows past 1.8e308
        elif isinstance(value, str):  # YAML reads "1e-4" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(number) or abs(number) > FLOAT_LIMIT:
            raise ConfigError(f"{where}: expected a finite number within float32 range (|x| <= {FLOAT_LIMIT:.3g}), "
                              f"got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def from_dict(cls: type, data: dict, path: str = "", defaults: Any = None) -> Any:
    """Build dataclass `cls` from a nested dict; unknown keys and wrong types raise ConfigError. Keys the dict does
    not give keep the defaults of the enclosing field (a section declared with `default_factory=lambda:
    OptimConfig(lr=1e-6)` keeps lr=1e-6 when the YAML sets only other keys of it), or of `defaults`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        full = f"{path}.{key}" if path else key
        raise ConfigError(
            f"unknown config key '{full}' (in section '{path or '<top>'}'); valid keys: {sorted(fields)}"
        )
    kwargs = {}
    if defaults is not None:  # the enclosing field's default instance: its values for the keys not given
        kwargs = {f: getattr(defaults, f) for f in fields if f not in data}
    for name, value in data.items():
        where = f"{path}.{name}" if path else name
        tp = hints[name]
        f = fields[name]
        if dataclasses.is_dataclass(tp) and isinstance(value, dict) and f.default_factory is not dataclasses.MISSING:
            kwargs[name] = from_dict(tp, value, path=where, defaults=f.default_factory())
        else:
            kwargs[name] = _coerce(value, tp, where)
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict:
    """Dataclass -> plain nested dict (YAML-safe)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any, comments: bool = True) -> str:
    """YAML text of a config; with `comments`, every key is preceded by its docstring."""
    if not comments:
        return yaml.safe_dump(to_dict(cfg), sort_keys=False)
    lines: list[str] = []

    def emit(obj: Any, indent: int) -> None:
        docs = field_docs(type(obj))
        pad = "  " * indent
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.name in docs:
                for chunk in textwrap.wrap(docs[f.name], 96 - len(pad)):
                    lines.append(f"{pad}# {chunk}")
            if dataclasses.is_dataclass(value):
                lines.append(f"{pad}{f.name}:")
                emit(value, indent + 1)
            else:
                if isinstance(value, dict) and value:
                    dumped = yaml.safe_dump({f.name: value}, sort_keys=False, default_flow_style=False).rstrip()
                else:  # scalars and lists on one line
                    inline = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
                    dumped = f"{f.name}: {inline.removesuffix('...').strip()}"
                lines.extend(pad + line for line in dumped.splitlines())

    emit(cfg, 0)
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# overrides


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line saying what is wrong in a YAML text: the parser's problem and where (PyYAML's message spans lines)."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else str(problem)


def _parse_value(item: str, raw: str) -> Any:
    """The value of an override `key=raw`, read as YAML; malformed YAML and tags that build Python objects
    (`!!python/...`: safe_load refuses them) are a ConfigError naming the override."""
    if not raw.strip():
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        if "!!python/" in raw or "tag:yaml.org,2002:python/" in str(exc):
            raise ConfigError(f"override '{item}': YAML tags that build Python objects (!!python/...) are not "
                              f"allowed; give a plain value") from None
        raise ConfigError(f"override '{item}': the value is not valid YAML: {_yaml_problem(exc)}; quote it as a "
                          f"string or complete it (e.g. key=[1, 2])") from None


def _set_in_mapping(mapping: dict, keys: list[str], value: Any, where: str, shorthand: str | None) -> dict:
    """A copy of `mapping` with `value` at the nested `keys` (missing levels are created). An entry given as a plain
    number becomes `{shorthand: number}` when the field declares such a shorthand (a reward component's weight)."""
    out = dict(mapping)
    node = out
    for depth, k in enumerate(keys[:-1]):
        cur = node.get(k)
        if cur is None:
            cur = {}
        elif isinstance(cur, dict):
            cur = dict(cur)
        elif depth == 0 and shorthand and isinstance(cur, (int, float)) and not isinstance(cur, bool):
            cur = {shorthand: cur}
        else:
            path = ".".join([where, *keys[:depth + 1]])
            raise ConfigError(f"override '{path}.{'.'.join(keys[depth + 1:])}': '{path}' is {cur!r}, not a mapping")
        node[k] = cur
        node = cur
    node[keys[-1]] = value
    return out


def apply_overrides(cfg: Any, overrides: typing.Iterable[str]) -> Any:
    """Apply `a.b.c=value` overrides in place (value parsed as YAML, then type-checked); returns cfg.

    A key may reach into a mapping-valued field (`reward.components.pickscore.weights=/ckpt`, `env.tasks.grid.size=5`):
    the entry is set (created when missing) and the whole mapping is checked as if the YAML had held it.
    Each value is type-checked as it is set; the checks of the sections (`__post_init__`) run once all overrides are
    applied, on every section an override reached or passed through, innermost first: a check across keys
    (`rollout.max_staleness=1` needs `rollout.worker=process`) or across nested sections (`algo` checking
    `algo.rollout_correction`) sees the final values, whatever the order of the overrides."""
    touched: dict[int, tuple[int, Any]] = {}  # id -> (depth, section) of the sections on overridden paths
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form dotted.key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        obj = cfg
        for i, part in enumerate(parts):
            names = [f.name for f in dataclasses.fields(obj)]
            if part not in names:
                where = ".".join(parts[:i]) or "<top>"
                raise ConfigError(f"unknown config key '{key}' (in section '{where}'); valid keys: {sorted(names)}")
            hint = typing.get_type_hints(type(obj))[part]
            child = getattr(obj, part)
            if i == len(parts) - 1:
                value = _parse_value(item, raw)
                if hint is str and not isinstance(value, str):
                    value = raw  # keep e.g. `name=007` as written
                setattr(obj, part, _coerce(value, hint, key))
                break
            if dataclasses.is_dataclass(child):
                if i > 0:
                    touched[id(obj)] = (i, obj)
                obj = child
                continue
            field_key = ".".join(parts[:i + 1])
            if typing.get_origin(hint) is dict and isinstance(child, dict):  # the rest of the key: mapping entries
                shorthand = getattr(type(obj), "MAPPING_SHORTHAND", {}).get(part)
                mapping = _set_in_mapping(child, parts[i + 1:], _parse_value(item, raw), field_key, shorthand)
                setattr(obj, part, _coerce(mapping, hint, field_key))
                break
            raise ConfigError(f"override '{key}': '{field_key}' is a value ({child!r}), not a section or mapping")
        touched[id(obj)] = (i, obj)  # the section the override landed in
    for _, section in sorted(touched.values(), key=lambda d_s: -d_s[0]):
        if hasattr(section, "__post_init__"):
            section.__post_init__()
    return cfg


# --------------------------------------------------------------------------------------------
# recipes


def recipe_module(algorithm: str) -> types.ModuleType:
    """Import the module implementing `algorithm` (clear error for unknown names)."""
    if algorithm not in RECIPES:
        raise ConfigError(f"unknown algorithm '{algorithm}'; valid: {sorted(RECIPES)}")
    return importlib.import_module(RECIPES[algorithm])


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {_yaml_problem(exc)}") from None
    if data is None:
        raise ConfigError(f"{path}: the file is empty; expected a mapping with at least 'algorithm:'")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def load_config(source: str | Path | dict, overrides: typing.Iterable[str] = ()) -> RunConfig:
    """YAML path or dict -> the recipe's Config (chosen by `algorithm:`), with overrides applied."""
    data = dict(source) if isinstance(source, dict) else load_yaml(source)
    where = "" if isinstance(source, dict) else f"{source}: "
    overrides = list(overrides)
    algorithm = data.get("algorithm")
    for item in overrides:  # allow `algorithm=...` on the command line
        if item.startswith("algorithm="):
            algorithm = item.split("=", 1)[1]
    if not algorithm:
        raise ConfigError(f"{where}missing top-level key 'algorithm'; valid: {sorted(RECIPES)}")
    data["algorithm"] = algorithm
    try:
        module = recipe_module(algorithm)
    except ConfigError as exc:
        raise ConfigError(f"{where}{exc}") from None
    try:
        cfg = from_dict(module.Config, data)
    except ConfigError as exc:
        raise ConfigError(f"{where}{exc}") from None
    return apply_overrides(cfg, [o for o in overrides if not o.startswith("algorithm=")])


def default_config(algorithm: str) -> RunConfig:
    """The recipe's defaults (what `mmrl config dump ALGO` prints)."""
    cfg = recipe_module(algorithm).Config()
    cfg.algorithm = algorithm
    return cfg
