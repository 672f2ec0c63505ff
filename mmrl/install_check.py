"""Do torch, torchvision, diffusers, transformers and peft import together? `python -m mmrl.install_check`.

`make install` (and so `make demo` / `make test`) runs it after pip and writes its stamp only when it passes:
pip can pair builds that install fine and fail at the first model load, e.g. a CPU torch beside PyPI's
torchvision (a CUDA build, whose C++ operators then do not load: "operator torchvision::nms does not exist"), or a
torchvision of another torch release. The check imports the packages in that order and turns the first failure into
one line naming the pair and the fix (exit code 1); on success one line of versions and the device build.
`mmrl --version` prints the same report. Only the standard library is imported at module level: the checked
packages are imported by :func:`check`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import re
import sys
import warnings
from pathlib import Path

PACKAGES = ("torch", "torchvision", "diffusers", "transformers", "peft")
# the pair `make install TORCH=cpu` installs (the Makefile's TORCH_VERSION / TORCHVISION_VERSION, as `+cpu` builds)
# and the pip fix names: the newest pair pyproject.toml admits
TORCH_PAIR = ("2.14.1", "0.29.1")
FAILED = "mmrl: install check failed: "
PASSED = "mmrl: install check passed: "


def paired_torchvision(torch_version: str) -> str | None:
    """The torchvision series (`"0.29"`) built for `torch_version` (`"2.14.1+cpu"`), after torchvision's documented
    table: torch 2.N pairs with torchvision 0.(N+15) (2.0 <-> 0.15, 2.9 <-> 0.24, 2.13 <-> 0.28, 2.14 <-> 0.29).
    None for a version the table does not cover (torch 1.x or an unparsable string): then no pairing is checked."""
    m = re.match(r"(\d+)\.(\d+)", torch_version)
    if not m or m.group(1) != "2":
        return None
    return f"0.{int(m.group(2)) + 15}"


def series(version: str) -> str:
    """`"0.29.1+cu130"` -> `"0.29"`."""
    return ".".join(version.partition("+")[0].split(".")[:2])


def build_of(version: str) -> str | None:
    """The device build a version's local label names: `+cpu` -> CPU, `+cu130` -> CUDA 13.0, `+cu128` -> CUDA 12.8,
    `+rocm6.4` -> ROCm 6.4; None when the version has no such label."""
    label = version.partition("+")[2]
    if label == "cpu":
        return "CPU"
    if m := re.fullmatch(r"cu(\d+)(\d)", label):
        return f"CUDA {m.group(1)}.{m.group(2)}"
    if m := re.fullmatch(r"rocm(\d+(?:\.\d+)*)", label):
        return f"ROCm {m.group(1)}"
    return None


def torch_build(torch) -> str:
    """The device build of an imported torch: `CUDA 13.0`, `ROCm 6.4` or `CPU`."""
    version = getattr(torch, "version", None)
    if getattr(version, "cuda", None):
        return f"CUDA {version.cuda}"
    if getattr(version, "hip", None):
        return f"ROCm {version.hip}"
    return "CPU"


def _builds_work_together(a: str, b: str) -> bool:
    # torchvision refuses a torch of another CUDA major version; a CUDA build never loads beside a CPU torch
    kind_a, kind_b = a.split(".")[0], b.split(".")[0]  # "CUDA 13", "CPU", "ROCm 6"
    return kind_a == kind_b


def pair_problem(torch_version: str, torch_build_: str, tv_version: str) -> str | None:
    """What is wrong with a torch / torchvision pair, judged from the versions alone (before torchvision is
    imported), or None: a torchvision of another torch release, or one built for another device."""
    want = paired_torchvision(torch_version)
    if want and series(tv_version) != want:
        return (f"torchvision {tv_version} does not pair with torch {torch_version} (torch {series(torch_version)} "
                f"goes with torchvision {want})")
    tv_build = build_of(tv_version)
    if tv_build and not _builds_work_together(tv_build, torch_build_):
        return (f"torchvision {tv_version} (a {tv_build} build) does not match torch {torch_version} "
                f"(a {torch_build_} build)")
    return None


def symptom(exc: BaseException) -> str:
    """An import failure in a few words: `torchvision::nms missing` for torchvision's C++ operators (also when
    wrapped by transformers' / diffusers' lazy imports), else the exception's type and first line."""
    seen = exc
    while seen is not None:
        if m := re.search(r"operator (torchvision::\w+) does not exist", str(seen)):
            return f"{m.group(1)} missing"
        seen = seen.__cause__ or seen.__context__
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first[:200] + ('...' if len(first) > 200 else '')}".rstrip(": ")


def pip_command() -> str:
    """How to call this environment's pip, as a user would type it (`.venv/bin/pip` under `make`)."""
    exe = Path(sys.executable)
    pip = exe.parent / "pip"
    shown = pip if pip.exists() else exe
    try:
        shown = shown.relative_to(Path.cwd())
    except ValueError:
        pass
    return str(shown) if pip.exists() else f"{shown} -m pip"


def torch_fix(torch_build_: str | None) -> str:
    """The fix for a torch / torchvision problem: a fresh `.venv` of the same kind, or the matching pair from PyPI."""
    make = "rm -rf .venv && make install" + (" TORCH=cpu" if torch_build_ == "CPU" else "")
    return f'{make}, or {pip_command()} install "torch=={TORCH_PAIR[0]}" "torchvision=={TORCH_PAIR[1]}"'


@dataclasses.dataclass
class Outcome:
    ok: bool
    """True when every package imported and torch / torchvision pair."""
    line: str
    """The one line to print: `mmrl: install check failed: ...; fix: ...`, or the versions and the device build."""
    build: str | None = None
    """torch's device build (`CPU`, `CUDA 13.0`), None when torch did not import."""
    gpus: int = 0
    """How many CUDA / ROCm devices torch sees."""


def installed_version(name: str) -> str | None:
    """`name`'s version without importing it (a broken package cannot fail this): its `version.py`
    (`__version__ = '0.28.0+cu130'`, with the build label pip's metadata may lack), else its distribution's
    metadata; None when it is not installed."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None
    for location in spec.submodule_search_locations or ():
        path = Path(location) / "version.py"
        if path.is_file():
            if m := re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", path.read_text(), re.M):
                return m.group(1)
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def check(import_module=importlib.import_module, version_of=installed_version) -> Outcome:
    """Import :data:`PACKAGES` in order and stop at the first failure. `import_module` and `version_of` (a
    package's version without importing it) are parameters so tests can feed fake modules and exceptions."""
    missing_fix = f'make install, or {pip_command()} install -e .'
    torch_version = version_of("torch")
    if torch_version is None:
        return Outcome(False, f"{FAILED}torch is not installed; fix: {missing_fix}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch = import_module("torch")
    except Exception as exc:  # noqa: BLE001 - any failure is the report
        return Outcome(False, f"{FAILED}cannot import torch {torch_version} ({symptom(exc)}); "
                              f"fix: {torch_fix(build_of(torch_version))}")
    torch_version, build = str(getattr(torch, "__version__", torch_version)), torch_build(torch)

    tv_version = version_of("torchvision")
    if tv_version is None:
        return Outcome(False, f"{FAILED}torchvision is not installed (torch {torch_version} is); "
                              f"fix: {torch_fix(build)}", build)
    problem, failure = pair_problem(torch_version, build, tv_version), None
    try:  # imported also when the pair is wrong: what it then fails with is named beside the cause
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import_module("torchvision")
    except Exception as exc:  # noqa: BLE001
        failure = symptom(exc)
    else:
        try:  # its C++ operators: some releases only warn when they did not load
            torch.ops.torchvision.nms
        except Exception:  # noqa: BLE001 - torch raises AttributeError or RuntimeError for a missing operator
            failure = "torchvision::nms missing"
    if problem or failure:
        if problem is None:
            tv_build = build_of(tv_version)
            problem = (f"torchvision {tv_version}{f' (a {tv_build} build)' if tv_build else ''} does not work "
                       f"beside torch {torch_version} (a {build} build)")
        return Outcome(False, f"{FAILED}{problem}{f' ({failure})' if failure else ''}; fix: {torch_fix(build)}",
                       build)

    versions = [f"torch {torch_version}", f"torchvision {tv_version}"]
    for name in PACKAGES[2:]:
        version = version_of(name)
        if version is None:
            return Outcome(False, f"{FAILED}{name} is not installed; fix: {missing_fix}", build)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                import_module(name)
        except Exception as exc:  # noqa: BLE001
            return Outcome(False, f"{FAILED}cannot import {name} {version} beside torch {torch_version} "
                                  f"({symptom(exc)}); fix: rm -rf .venv && make install", build)
        versions.append(f"{name} {version}")

    gpus = 0
    if build != "CPU":
        try:
            gpus = int(torch.cuda.device_count())
        except Exception:  # noqa: BLE001 - no driver: no GPU
            gpus = 0
    seen = f", {gpus} GPU{'s' * (gpus > 1)} visible" if gpus else (", no GPU visible" if build != "CPU" else "")
    versions[0] += f" ({build} build{seen})"
    return Outcome(True, ", ".join(versions), build, gpus)


def main() -> int:
    outcome = check()
    if not outcome.ok:
        print(outcome.line, file=sys.stderr)
        return 1
    hint = ("; no GPU: the CPU build is smaller (rm -rf .venv && make install TORCH=cpu)"
            if outcome.build != "CPU" and not outcome.gpus else "")
    print(f"{PASSED}{outcome.line}{hint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
