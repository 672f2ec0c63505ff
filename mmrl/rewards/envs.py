"""Reward environments: a venv per reward whose packages may conflict with the trainer's, served from there.

    mmrl reward env create NAME [--packages "pkgA==1 pkgB"] [--python PY] [--dir runs/reward-envs]
                                [--reuse-site-packages] [--source CHECKOUT_OR_WHEEL]
    mmrl reward env list [--dir runs/reward-envs]

`create` makes the venv ``DIR/NAME`` (``python -m venv``, with pip), installs into it what ``mmrl reward serve``
imports (torch, numpy, pillow, pyyaml, tqdm: `SERVE_REQUIREMENTS`, with the bounds of mmrl's own dependency list)
together with ``--packages`` in one pip call (one resolver decides), then mmrl itself without its dependencies
(``--no-deps``: an editable install of the checkout the running mmrl comes from, or ``--source`` a checkout or a
wheel), checks that the server's modules import there, and writes ``DIR/NAME/mmrl-reward-env.json`` (the manifest:
python, packages, source, ``pip freeze --local``). diffusers, transformers, peft... are installed only when named in
``--packages`` (a learned reward needs its own: e.g. ``transformers==4.45.2``). pip's own settings apply
(``PIP_INDEX_URL``, ``PIP_EXTRA_INDEX_URL`` for a CPU torch, ``PIP_NO_INDEX``, pip.conf).

``--reuse-site-packages``: the env's site-packages gets a ``.pth`` line naming the trainer's site-packages, placed
after the env's own: what the env installs wins (its versions of ``--packages``), everything else (torch, pip,
setuptools...) is the trainer's, not downloaded again (pip never uninstalls a package outside the env it runs in).
The trainer's python version is then required (``--python`` must match it).

A failed step removes the half-made directory and raises `RewardEnvError` (a ValueError: one line) with the tail
of pip's output. `resolve_env` turns a run's ``env: NAME`` (a name under ``--dir`` / ``$MMRL_REWARD_ENV_DIR`` /
``runs/reward-envs``, or a path) into the env's directory, or one line saying what is missing.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["RewardEnvError", "create_env", "list_envs", "resolve_env", "read_manifest", "env_root", "clean_environ",
           "add_env_subparsers", "MANIFEST", "SERVE_REQUIREMENTS", "ENV_DIR_VAR"]

MANIFEST = "mmrl-reward-env.json"
ENV_DIR_VAR = "MMRL_REWARD_ENV_DIR"
DEFAULT_ROOT = "runs/reward-envs"
SERVE_REQUIREMENTS = ("torch", "numpy", "pillow", "pyyaml", "tqdm")
"""What `mmrl reward serve` imports (tests/rewards/test_reward_env.py checks that the serve path imports no more)."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class RewardEnvError(ValueError):
    """A reward env cannot be created, found or used; the message is one line naming the problem and the fix."""


def env_root(root: str | os.PathLike | None = None) -> Path:
    """Where named reward envs live: `root`, else $MMRL_REWARD_ENV_DIR, else runs/reward-envs."""
    return Path(root or os.environ.get(ENV_DIR_VAR) or DEFAULT_ROOT)


def clean_environ(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without what would make another venv's python import the trainer's packages
    (PYTHONPATH, PYTHONHOME, VIRTUAL_ENV), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(extra or {})
    return env


def read_manifest(path: Path) -> dict | None:
    """The env's manifest, or None when `path` holds none (or an unreadable one)."""
    try:
        data = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("mmrl_reward_env") == 1 else None


def resolve_env(env: str | os.PathLike, root: str | os.PathLike | None = None) -> Path:
    """The directory of reward env `env` (a NAME under `env_root(root)`, or a path: it holds a '/'), checked to be a
    finished reward env with bin/mmrl; RewardEnvError (one line) otherwise."""
    text = str(env)
    path = Path(text) if ("/" in text or text.startswith(".")) else env_root(root) / text
    if not path.is_dir():
        raise RewardEnvError(f"reward env {text!r} not found: no directory {path}; create it with `mmrl reward env "
                             f"create {path.name}` (--dir {path.parent}), or `mmrl reward env list` to see the envs")
    if read_manifest(path) is None:
        raise RewardEnvError(f"{path} is not an mmrl reward env (no readable {MANIFEST}: made by `mmrl reward env "
                             f"create`, which may not have finished); remove it and create the env again")
    if not (path / "bin" / "mmrl").is_file():
        raise RewardEnvError(f"reward env {path} has no bin/mmrl (mmrl is not installed there); remove it and create "
                             "the env again")
    return path


def _mmrl_checkout() -> Path | None:
    """The source checkout the running mmrl comes from (the directory holding pyproject.toml), or None."""
    root = Path(__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and re.search(r'(?m)^name\s*=\s*"mmrl"', pyproject.read_text()):
        return root
    return None


def _requirements_of(source: Path) -> list[str]:
    """mmrl's dependency list (requirement strings) from a checkout's pyproject.toml or a wheel's METADATA."""
    if source.is_dir():
        import tomllib

        return list(tomllib.loads((source / "pyproject.toml").read_text())["project"]["dependencies"])
    import zipfile
    from email.parser import Parser

    with zipfile.ZipFile(source) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return [r for r in Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or [] if ";" not in r]


def serve_requirements(source: Path) -> list[str]:
    """`SERVE_REQUIREMENTS` with the version bounds mmrl's dependency list gives them."""
    by_name = {re.split(r"[<>=!~\[ ;]", r, 1)[0].strip().lower(): r.split("#")[0].strip()
               for r in _requirements_of(source)}
    return [by_name.get(name, name) for name in SERVE_REQUIREMENTS]


def _run(cmd: Sequence[str], what: str, log: Callable[[str], None], cwd: Path | None = None) -> list[str]:
    """Run `cmd` (output streamed to `log`); the lines it printed. RewardEnvError with its last lines if it fails."""
    tail: collections.deque[str] = collections.deque(maxlen=400)
    try:
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=clean_environ({"PYTHONUNBUFFERED": "1"}), cwd=cwd)
    except OSError as exc:
        raise RewardEnvError(f"{what} failed: cannot run {cmd[0]}: {exc.strerror or exc}") from None
    for line in proc.stdout:
        tail.append(line.rstrip("\n"))
        log(line.rstrip("\n"))
    if proc.wait():
        last = " | ".join(x.strip() for x in list(tail)[-3:] if x.strip())[-600:]
        raise RewardEnvError(f"{what} failed (exit code {proc.returncode}): {last}")
    return list(tail)


def create_env(name: str, packages: Sequence[str] = (), python: str | None = None,
               root: str | os.PathLike | None = None, reuse_site_packages: bool = False,
               source: str | os.PathLike | None = None, log: Callable[[str], None] = print) -> Path:
    """Create reward env `name` under `env_root(root)` (module docstring); its directory."""
    if not _NAME.match(name or ""):
        raise RewardEnvError(f"reward env name {name!r}: use letters, digits, '.', '_', '-' (it names a directory)")
    path = env_root(root) / name
    if path.exists():
        if read_manifest(path) is not None:
            raise RewardEnvError(f"reward env {name!r} already exists at {path}; remove that directory to create it "
                                 "again, or pick another NAME")
        if not path.is_dir() or any(path.iterdir()):
            raise RewardEnvError(f"{path} exists and is not an mmrl reward env (no {MANIFEST}); pick another NAME "
                                 "or --dir, or remove it")
    src = Path(source).resolve() if source is not None else _mmrl_checkout()
    if src is None:
        raise RewardEnvError("this mmrl is not a source checkout: pass --source with an mmrl checkout or wheel")
    if not ((src / "pyproject.toml").is_file() if src.is_dir() else (src.suffix == ".whl" and src.is_file())):
        raise RewardEnvError(f"--source {src}: expected an mmrl checkout (a directory with pyproject.toml) or a .whl "
                             "file")
    python = python or sys.executable
    try:
        probe = subprocess.run([python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"], text=True,
                               capture_output=True, env=clean_environ(), timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RewardEnvError(f"--python {python}: cannot run it ({exc})") from None
    version = probe.stdout.strip()
    if probe.returncode or not re.fullmatch(r"\d+\.\d+\.\d+", version):
        said = (probe.stderr or probe.stdout).strip()[-200:]
        raise RewardEnvError(f"--python {python}: not a working python ({said})")
    if tuple(map(int, version.split(".")))[:2] < (3, 11):
        raise RewardEnvError(f"--python {python} is python {version}; mmrl needs >= 3.11")
    ours = "%d.%d" % sys.version_info[:2]
    if reuse_site_packages and version.rsplit(".", 1)[0] != ours:
        raise RewardEnvError(f"--reuse-site-packages needs the trainer's python version ({ours}: its packages are "
                             f"built for it), but --python {python} is {version}")

    created = not path.exists()
    try:
        # reusing: no pip of its own (the trainer's runs there, seen through the .pth), so nothing of the env's
        # shadows the trainer's pip and setuptools
        _run([python, "-m", "venv", *(["--without-pip"] if reuse_site_packages else []), str(path)],
             "creating the venv", log)
        env_py = path / "bin" / "python"
        purelib = Path(subprocess.run([str(env_py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                      text=True, capture_output=True, env=clean_environ(), check=True).stdout.strip())
        reused = [p for p in site.getsitepackages() if Path(p).is_dir()] if reuse_site_packages else []
        if reused:  # after the env's own site-packages on sys.path: what the env installs wins
            (purelib / "_mmrl_reuse_site_packages.pth").write_text("".join(f"{p}\n" for p in reused))
        pip = [str(env_py), "-m", "pip", "install", "--disable-pip-version-check"]
        build = ["setuptools>=77"] if src.is_dir() else []  # the checkout's build backend (pyproject.toml)
        _run(pip + serve_requirements(src) + build + list(packages), "installing the packages", log)
        _run(pip + ["--no-deps"] + (["--no-build-isolation", "-e", str(src)] if src.is_dir() else [str(src)]),
             f"installing mmrl from {src}", log)
        _run([str(env_py), "-c", "import mmrl.rewards.cli, mmrl.rewards.remote_server"],
             "importing the reward server in the env", log, cwd=path)
        freeze = _run([str(env_py), "-m", "pip", "freeze", "--local", "--disable-pip-version-check"],
                      "pip freeze", lambda line: None)
        manifest = {"mmrl_reward_env": 1, "name": name, "python": version, "base_python": python,
                    "packages": list(packages), "source": str(src), "reuse_site_packages": reused,
                    "created": datetime.datetime.now().isoformat(timespec="seconds"), "freeze": freeze}
        (path / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    except BaseException:
        if created:  # nothing half-made is left to be mistaken for an env
            shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def list_envs(root: str | os.PathLike | None = None) -> list[tuple[Path, dict]]:
    """(directory, manifest) of every reward env under `env_root(root)`, by name."""
    base = env_root(root)
    if not base.is_dir():
        return []
    return [(p, m) for p in sorted(base.iterdir()) if p.is_dir() and (m := read_manifest(p)) is not None]


# ----------------------------------------------------------------------------------- CLI


def add_env_subparsers(sub: argparse._SubParsersAction, exit_on_error: Callable) -> None:
    """`mmrl reward env {create,list}` under the reward CLI's subparsers."""
    env = sub.add_parser("env", help="create or list reward environments (a venv per reward, served from there)",
                         description="A venv per reward whose packages conflict with the trainer's; a run serves "
                                     "the reward from it (reward.components.<key>: {reward: remote, env: NAME, "
                                     "serve: {name: REWARD}}).")
    envsub = env.add_subparsers(dest="env_command", metavar="{create,list}")
    envsub.required = True
    p = envsub.add_parser("create", help="make a venv with mmrl's server and the reward's packages")
    p.add_argument("name", help="the env's name (a directory under --dir)")
    p.add_argument("--packages", default="", help='the reward\'s pip requirements, one string: "pkgA==1 pkgB>=2"')
    p.add_argument("--python", default=None, help="python to make the venv with (default: the one running mmrl)")
    p.add_argument("--dir", default=None, help=f"where envs live (default ${ENV_DIR_VAR} or {DEFAULT_ROOT})")
    p.add_argument("--reuse-site-packages", action="store_true",
                   help="see the trainer's installed packages (torch...) behind the env's own: a light env that "
                        "installs only what differs")
    p.add_argument("--source", default=None, help="an mmrl checkout or wheel to install (default: this checkout)")
    p.set_defaults(func=exit_on_error(cmd_env_create))
    p = envsub.add_parser("list", help="print the reward envs: name, python, packages, directory")
    p.add_argument("--dir", default=None, help=f"where envs live (default ${ENV_DIR_VAR} or {DEFAULT_ROOT})")
    p.set_defaults(func=exit_on_error(cmd_env_list))


def cmd_env_create(args: argparse.Namespace) -> int:
    try:
        packages = shlex.split(args.packages)
    except ValueError as exc:
        raise RewardEnvError(f"--packages {args.packages!r}: {exc}") from None
    path = create_env(args.name, packages, python=args.python, root=args.dir,
                      reuse_site_packages=args.reuse_site_packages, source=args.source,
                      log=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"reward env {args.name!r} ready at {path}: serve with {path / 'bin' / 'mmrl'} reward serve NAME --port P, "
          f"or name it in a run: reward.components.<key>: {{reward: remote, env: {args.name}, serve: {{name: NAME}}}}")
    return 0


def cmd_env_list(args: argparse.Namespace) -> int:
    envs = list_envs(args.dir)
    if not envs:
        print(f"no reward envs under {env_root(args.dir)} (create one with `mmrl reward env create NAME`)")
    for path, m in envs:
        reuse = " (reuses the trainer's site-packages)" if m.get("reuse_site_packages") else ""
        packages = " ".join(m.get("packages") or []) or "-"
        print(f"{m.get('name', path.name)}  python {m.get('python')}  packages: {packages}{reuse}  {path}")
    return 0
