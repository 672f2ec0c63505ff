"""`mmrl reward ...` subcommands (wired into the main `mmrl` CLI by `add_reward_subparsers`).

    mmrl reward list
    mmrl reward score NAME_OR_YAML [--weights P] [--kw k=v ...] --images DIR_OR_FILES... \
                      [--prompts FILE] [--out scores.csv|scores.jsonl|DIR] [--on-error skip|raise] \
                      [--batch-size N] [--max-pixels N] [--device auto]
    mmrl reward score geo3k --prompts answers.jsonl                # text rewards: rows with a 'completion'
    mmrl reward serve NAME_OR_YAML [--weights P] [--kw k=v ...] [--host 127.0.0.1] --port P [--max-batch N] \
                      [--max-pixels N] [--max-request-pixels N] [--read-timeout S] [--token T] \
                      [--parent-pid PID] [--quiet]
    mmrl reward env create NAME [--packages "pkgA==1 pkgB"] [--reuse-site-packages]  # mmrl/rewards/envs.py
    mmrl reward env list
    mmrl reward train CONFIG.yaml [key=value ...]   # a reward_bt config: `mmrl train` (mmrl/reward_train/bt.py)

Both name the reward the same way, first: a registered name, a YAML file (a weighted composite) or
``module:function`` (a plain function, or a RewardModel class or instance, importable where the command runs: e.g. a
module installed in a reward env).

`--prompts` is a text file (one prompt per line; blank lines skipped) or a ``.jsonl`` file whose rows hold
``prompt`` and optionally ``metadata`` (an object; without it, the row's other keys are the metadata) and
``completion`` (scored by text rewards). `--kw` values are parsed as YAML scalars (``tol=1e-3``,
``threshold=0.5``, ``normalize=batch``). Errors (missing files, count mismatch, bad options) print one
line to stderr and exit with code 2.

`score` writes each chunk of rows as soon as it is scored (flushed, in input order), so an interrupted run
keeps what was scored. `--out` ending in ``.jsonl`` writes one JSON object per sample (non-finite scores as
``null``), anything else CSV; an existing directory (or a path ending in ``/``) gets ``DIR/scores.csv``. An
image that cannot be read (truncated, not an image, more pixels than `--max-pixels`: width * height read from
the file's header before anything is decoded) is skipped with one warning line and counted in the final summary (`--on-error skip`, the default) or stops the run with exit code 2 naming the
file (`--on-error raise`; rows already written are kept).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from mmrl.rewards.registry import check_reward_arguments, lookup
from mmrl.rewards.remote_server import DEFAULT_MAX_PIXELS, DEFAULT_MAX_REQUEST_PIXELS, TOKEN_ENV
from mmrl.rewards.score_files import CLIError, collect_images, read_prompts, resolve_out_path, score_to
from mmrl.rewards.score_files import fail as _fail


def add_reward_subparsers(subparsers: argparse._SubParsersAction, train: Any = None) -> argparse.ArgumentParser:
    """Add ``reward {list,score,serve,env}`` to the main CLI's subparsers; each sets ``func=``. `train`: the main
    CLI's `mmrl train` command, which ``reward train`` runs for a `reward_bt` config."""
    reward = subparsers.add_parser("reward", help="list, score with, serve or train reward models",
                                   description="Reward-model zoo: list, score images, serve over HTTP, train on "
                                               "preference pairs.")
    sub = reward.add_subparsers(dest="reward_command",
                                metavar="{list,score,serve,env,train}" if train else "{list,score,serve,env}")
    sub.required = True

    p = sub.add_parser("list", help="print the available rewards with a one-line description")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("score", help="score images (and prompts) with a reward, write a CSV")
    p.add_argument("reward", nargs="?", help="registered name, a YAML file with a {name: weight} mapping, or "
                                             "module:function")
    _add_load_args(p)
    p.add_argument("--images", nargs="+", metavar="DIR_OR_FILE",
                   help="image files and/or directories (their images, sorted by name); "
                        "omit for text rewards scoring --prompts .jsonl completions")
    p.add_argument("--prompts", help="prompts: .txt (one per line) or .jsonl (prompt, metadata, completion)")
    p.add_argument("--out", help="file to write: CSV (path,prompt,score + per-sample detail columns), or JSONL if "
                                 "it ends in .jsonl; an existing directory gets DIR/scores.csv; default: CSV "
                                 "on stdout. Rows are written as they are scored")
    p.add_argument("--on-error", choices=["skip", "raise"], default="skip",
                   help="an unreadable image: skip it with a warning (default) or stop with exit code 2 "
                        "(rows scored so far are kept)")
    p.add_argument("--batch-size", type=int, default=16, help="images per reward call (default 16)")
    p.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS,
                   help="skip (with a warning) an image larger than this (width*height, read from its header "
                        "before decoding), as the server refuses it (default 4096*4096 = 16777216)")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda[:i] (passed to the reward as device=)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=cmd_score)

    p = sub.add_parser("serve", help="serve a reward over HTTP/JSON (POST /score, GET /health)")
    p.add_argument("reward", help="registered name, a YAML file with a {name: weight} mapping, or module:function")
    _add_load_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-batch", type=int, default=64, help="largest batch per request and per model call")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="how long to wait to merge concurrent requests")
    p.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS,
                   help="largest image (width*height, read from its header before decoding) a request may "
                        "hold; larger ones get HTTP 413 (default 4096*4096 = 16777216)")
    p.add_argument("--max-request-pixels", type=int, default=DEFAULT_MAX_REQUEST_PIXELS,
                   help="most pixels all images of one request may hold together (headers read before decoding); "
                        "more get HTTP 413 (default 4*4096*4096 = 67108864: 64 images of 1024x1024, 0.8 GB as "
                        "float32); the mmrl client splits its batches to fit")
    p.add_argument("--token", default=None,
                   help=f"shared token every request must send as 'Authorization: Bearer TOKEN' (401 otherwise); "
                        f"default ${TOKEN_ENV} (preferred: a command line is visible to other users); unset = no "
                        f"check. The client reads ${TOKEN_ENV}")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a connection may stay silent (stalled body, idle keep-alive) before the "
                        "server drops it (default 30)")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda[:i] (passed to the reward as device=)")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="exit when the process with this PID ends (a run that starts the server passes its own)")
    p.add_argument("--quiet", action="store_true", help="do not log each request")
    p.set_defaults(func=cmd_serve)

    from mmrl.rewards.envs import add_env_subparsers

    add_env_subparsers(sub, _exit_on_error)

    if train is not None:
        p = sub.add_parser("train", help="fit a reward model to preference pairs (Bradley-Terry): mmrl reward train "
                                         "CONFIG.yaml [key=value ...]")
        p.add_argument("config", help="YAML file with `algorithm: reward_bt`")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=10 optim.lr=1e-5")
        p.set_defaults(func=_reward_train(train))
    return reward


def _reward_train(train: Any):
    """`mmrl train` for a config whose algorithm is reward_bt (errors: the main CLI's one line)."""

    def cmd_reward_train(args: argparse.Namespace) -> int:
        from mmrl.config import load_config

        algorithm = load_config(args.config, args.overrides).algorithm
        if algorithm != "reward_bt":
            raise ValueError(f"mmrl reward train: {args.config} has algorithm: {algorithm}, expected reward_bt (train "
                             f"other recipes with mmrl train)")
        return train(args)

    return cmd_reward_train


def _add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", help="local weights path (passed to the reward as weights=)")
    p.add_argument("--kw", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="extra keyword arguments for the reward (values parsed as YAML scalars)")


# ----------------------------------------------------------------------------------- helpers


def _exit_on_error(fn):
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (CLIError, FileNotFoundError, ValueError) as exc:
            print(f"mmrl reward: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


def parse_kw(items: Sequence[str]) -> dict[str, Any]:
    """["a=1", "b=x", "c=[1, 2]"] -> {"a": 1, "b": "x", "c": [1, 2]} (YAML scalars)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            _fail(f"--kw expects KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError:
            out[key.strip()] = value
    return out


def _device(name: str) -> str:
    from mmrl.runtime import resolve_device

    return str(resolve_device(name))


def load_reward_from_args(spec: str, weights: str | None, kw_items: Sequence[str], device: str | None):
    """A registered name, or a YAML file holding a mapping (-> composite); `--weights` / `--kw` / device
    become load kwargs (device only if the reward accepts it)."""
    from mmrl.rewards import available, load

    kwargs = parse_kw(kw_items)
    if weights is not None:
        if not Path(weights).exists():
            _fail(f"--weights path not found: {weights!r}")
        kwargs["weights"] = weights
    target: Any = spec
    if spec.endswith((".yaml", ".yml")) or (Path(spec).is_file() and spec not in available()):
        import yaml

        if not Path(spec).is_file():
            _fail(f"reward YAML not found: {spec!r}")
        try:
            target = yaml.safe_load(Path(spec).read_text())
        except yaml.YAMLError as exc:
            _fail(f"reward YAML {spec!r} is not valid YAML: {exc}")
        if not isinstance(target, dict):
            _fail(f"reward YAML {spec!r} must hold a mapping (name -> weight), got {type(target).__name__}")
    elif spec not in available() and _MODULE_ATTR.match(spec):
        target = _import_reward(spec)
    elif spec not in available():
        _fail(f"unknown reward {spec!r}; run `mmrl reward list` (available: {', '.join(available())})")
    else:  # `--kw` names and values checked against the reward's arguments before it is built
        check_reward_arguments(spec, {k: v for k, v in kwargs.items() if k != "weights"}, "--kw", sep=" ")
        _refuse_latents(spec, lookup(spec))  # before a (slow) load
    if not isinstance(target, (str, dict)):  # `module:attr` named an object
        return _refuse_latents(spec, _from_object(spec, target, kwargs, device))
    if device is not None:
        try:
            return _refuse_latents(spec, load(target, **{"device": device, **kwargs}))
        except TypeError as exc:
            if "device" not in str(exc):
                raise CLIError(f"cannot build reward {spec!r}: {exc}") from None
    try:
        return _refuse_latents(spec, load(target, **kwargs))
    except TypeError as exc:
        raise CLIError(f"cannot build reward {spec!r} with {sorted(kwargs)}: {exc}") from None


_MODULE_ATTR = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _import_reward(spec: str) -> Any:
    """The object `module:attr` names (imported where this command runs), or one line saying what is missing."""
    module, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        _fail(f"reward {spec!r}: cannot import {module!r} ({type(exc).__name__}: {exc}); install it where "
              f"`mmrl reward` runs (e.g. into the reward env with pip)")
    if not hasattr(mod, attr):
        _fail(f"reward {spec!r}: module {module!r} ({getattr(mod, '__file__', '?')}) has no {attr!r}")
    obj = getattr(mod, attr)
    if not callable(obj):
        _fail(f"reward {spec!r}: expected a function or a RewardModel, got {type(obj).__name__}")
    return obj


def _from_object(spec: str, obj: Any, kwargs: dict, device: str | None) -> Any:
    """The reward `module:attr` names: a RewardModel class built with the load arguments (and `device` when it
    takes it), a RewardModel instance, or a plain function (`mmrl.rewards.from_callable`)."""
    import inspect

    from mmrl.rewards import RewardModel, from_callable

    if isinstance(obj, type) and issubclass(obj, RewardModel):
        takes = inspect.signature(obj).parameters
        if device is not None and ("device" in takes or any(p.kind is p.VAR_KEYWORD for p in takes.values())):
            kwargs = {"device": device, **kwargs}
        try:
            return obj(**kwargs)
        except TypeError as exc:
            raise CLIError(f"cannot build reward {spec!r} with {sorted(kwargs)}: {exc}") from None
    if kwargs:
        _fail(f"reward {spec!r} is a {'RewardModel' if isinstance(obj, RewardModel) else 'function'}, not a class: "
              f"it takes no --weights / --kw (got {sorted(kwargs)})")
    return obj if isinstance(obj, RewardModel) else from_callable(obj)


def _exit_with_parent(pid: int) -> None:
    """A thread of `serve --parent-pid`: end this server once the process that started it is gone (a killed run
    leaves no server behind): it is then handed to another parent."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(0.5)
        print(f"mmrl reward: the process that started this server (PID {pid}) is gone; exiting", file=sys.stderr,
              flush=True)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
def _refuse_latents(spec: str, reward: Any) -> Any:
    """A latent or audio reward (its class or a loaded reward with such a component): one line, the CLI and the server
    take image files; anything else is returned."""
    from mmrl.rewards.audio import AudioRewardModel, takes_audio
    from mmrl.rewards.latent import LatentRewardModel, takes_latents

    if (isinstance(reward, type) and issubclass(reward, AudioRewardModel)) or (
            not isinstance(reward, type) and takes_audio(reward)):
        _fail(f"reward {spec!r} scores sound, not images: `mmrl reward score|serve` take image files only; call it "
              f"from Python (load(...)(audio=..., sample_rate=...)) or name it in a recipe's reward.components")

    if (isinstance(reward, type) and issubclass(reward, LatentRewardModel)) or (
            not isinstance(reward, type) and takes_latents(reward)):
        _fail(f"reward {spec!r} scores a diffusion model's latents, not images: `mmrl reward score|serve` take image "
              f"files only; call it from Python (load(...)(latents=..., prompts=...)) or name it in a recipe's "
              f"reward.components")
    return reward


# ----------------------------------------------------------------------------------- commands


def _describe(obj: Any) -> str:
    """First line of the registered object's docstring, else of its module's."""
    doc = (getattr(obj, "__doc__", None) or "").strip()
    if not doc:
        doc = (getattr(sys.modules.get(getattr(obj, "__module__", "")), "__doc__", None) or "").strip()
    return doc.splitlines()[0].strip() if doc else ""


@_exit_on_error
def cmd_list(args: argparse.Namespace) -> int:
    """Print every registered reward name with the first line of its docstring."""
    from mmrl.rewards import available
    from mmrl.rewards import base

    names = available()
    width = max(len(n) for n in names) if names else 0
    for name in names:
        if name not in base._REGISTRY and name in base._LAZY:
            try:
                importlib.import_module(base._LAZY[name])
            except Exception as exc:  # noqa: BLE001 - an optional dependency may be missing
                print(f"{name:<{width}}  (unavailable: {type(exc).__name__}: {exc})")
                continue
        print(f"{name:<{width}}  {_describe(base._REGISTRY.get(name))}")
    return 0


@_exit_on_error
def cmd_score(args: argparse.Namespace) -> int:
    """Score images (or, for text rewards, the .jsonl completions) and write path,prompt,score(,details) rows."""
    if not args.reward:
        _fail("which reward? mmrl reward score NAME_OR_YAML --images ... (mmrl reward list shows the names)")
    paths = collect_images(args.images) if args.images else None
    prompts = metadata = completions = None
    if args.prompts:
        prompts, metadata, completions = read_prompts(args.prompts)
        if paths is not None and len(prompts) != len(paths):
            _fail(f"{len(paths)} images but {len(prompts)} prompts in {args.prompts!r}; give one prompt per image "
                  "(images are sorted by file name)")
    if args.batch_size < 1:
        _fail(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_pixels < 1:
        _fail(f"--max-pixels must be >= 1, got {args.max_pixels}")
    if paths is None and completions is None:
        _fail("pass --images DIR_OR_FILES (image rewards) or --prompts FILE.jsonl with 'completion' rows (text rewards)")
    out_path = resolve_out_path(args.out) if args.out else None  # checked before the reward loads
    reward = load_reward_from_args(args.reward, args.weights, args.kw, _device(args.device))
    if getattr(reward, "needs_prompts", False) and prompts is None:
        _fail(f"reward {args.reward!r} needs prompts: pass --prompts FILE")
    if reward.kind == "text" and completions is None:
        _fail(f"reward {args.reward!r} scores text: pass --prompts FILE.jsonl whose rows hold a 'completion'")
    if reward.kind != "text" and paths is None:
        _fail(f"reward {args.reward!r} scores images: pass --images DIR_OR_FILES")

    if out_path is None:
        return score_to(sys.stdout, "csv", args, reward, paths, prompts, metadata, completions)
    try:
        f = open(out_path, "w", newline="", encoding="utf-8")
    except OSError as exc:
        _fail(f"cannot write --out {str(out_path)!r}: {exc.strerror or exc}")
    with f:
        return score_to(f, "jsonl" if out_path.suffix.lower() == ".jsonl" else "csv", args, reward, paths, prompts,
                         metadata, completions, out_path)


@_exit_on_error
def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a reward over HTTP until Ctrl-C."""
    from mmrl.rewards.remote import check_server_options, serve, token_from_env

    if not 0 <= args.port <= 65535:
        _fail(f"--port must be in 0..65535 (0 = any free port), got {args.port}")
    token = token_from_env(args.token)
    check_server_options(max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, max_pixels=args.max_pixels,
                         max_request_pixels=args.max_request_pixels, read_timeout=args.read_timeout, token=token,
                         flags=True)  # before the (slow) reward load
    if args.parent_pid is not None:
        if os.getppid() != args.parent_pid:
            _fail(f"--parent-pid {args.parent_pid} is not this server's parent process ({os.getppid()})")
        _exit_with_parent(args.parent_pid)
    reward = load_reward_from_args(args.reward, args.weights, args.kw, _device(args.device))
    try:
        serve(reward, host=args.host, port=args.port, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
              max_pixels=args.max_pixels, max_request_pixels=args.max_request_pixels,
              read_timeout=args.read_timeout, token=token, quiet=args.quiet)
    except (OSError, OverflowError) as exc:
        _fail(f"cannot serve on {args.host}:{args.port}: {exc}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry (`python -m mmrl.rewards.cli reward ...`) for when the main CLI is not available."""
    parser = argparse.ArgumentParser(prog="mmrl")
    add_reward_subparsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
