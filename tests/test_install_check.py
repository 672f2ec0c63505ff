"""The install check (`python -m mmrl.install_check`, run by `make install`): torchvision's torch pairing, the device
build from a version label, one line for each way torch / torchvision / diffusers / transformers / peft fail to import
together (fed fake modules and exceptions), the real check in this venv, and the Makefile's pins agreeing with it."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

from mmrl import install_check as ic

ROOT = Path(__file__).resolve().parents[1]
PIP_FIX = '.venv/bin/pip install "torch==2.14.1" "torchvision==0.29.1"'


def test_paired_torchvision_follows_torchvisions_table():
    assert [ic.paired_torchvision(v) for v in ("2.14.1", "2.13.0+cpu", "2.9.1", "2.0.0", "1.13.1", "nightly")] == [
        "0.29", "0.28", "0.24", "0.15", None, None]
    assert ic.series("0.29.1+cu130") == "0.29" and ic.series("2.13.0") == "2.13"


def test_build_of_a_version_label():
    assert [ic.build_of(v) for v in ("2.13.0+cpu", "0.28.0+cu130", "2.9.1+cu128", "0.19.0+cu118", "2.5.1+rocm6.2",
                                     "2.14.1", "1.0+local")] == [
        "CPU", "CUDA 13.0", "CUDA 12.8", "CUDA 11.8", "ROCm 6.2", None, None]


def fake_torch(version: str, cuda: str | None = None, nms: bool = True, gpus: int = 0):
    ops = types.SimpleNamespace(torchvision=types.SimpleNamespace(**({"nms": object()} if nms else {})))
    return types.SimpleNamespace(__version__=version, version=types.SimpleNamespace(cuda=cuda, hip=None), ops=ops,
                                 cuda=types.SimpleNamespace(device_count=lambda: gpus))


def run_check(modules: dict, versions: dict | None = None) -> ic.Outcome:
    """`check` on fake packages: `modules` maps a name to a module or to the exception its import raises."""
    found = {"diffusers": "0.42.1", "transformers": "5.24.0", "peft": "0.21.2",
             **{k: getattr(m, "__version__", None) for k, m in modules.items() if k == "torch"}, **(versions or {})}
    fine = {name: types.SimpleNamespace() for name in ic.PACKAGES}

    def import_module(name):
        mod = {**fine, **modules}[name]
        if isinstance(mod, BaseException):
            raise mod
        return mod

    return ic.check(import_module=import_module, version_of=found.get)


@pytest.fixture(autouse=True)
def _venv_pip(monkeypatch):
    monkeypatch.setattr(ic, "pip_command", lambda: ".venv/bin/pip")


def test_cpu_torch_beside_pypis_cuda_torchvision_is_named_with_its_fix():
    """The newcomer's install: torch 2.13.0+cpu from find-links, PyPI's torchvision 0.28.0 (a CUDA build)."""
    out = run_check({"torch": fake_torch("2.13.0+cpu", nms=False),
                     "torchvision": RuntimeError("operator torchvision::nms does not exist")},
                    {"torchvision": "0.28.0+cu130"})
    assert not out.ok and out.line == (
        "mmrl: install check failed: torchvision 0.28.0+cu130 (a CUDA 13.0 build) does not match torch 2.13.0+cpu "
        f"(a CPU build) (torchvision::nms missing); fix: rm -rf .venv && make install TORCH=cpu, or {PIP_FIX}")


def test_torchvision_of_another_torch_release():
    out = run_check({"torch": fake_torch("2.14.1+cu130", cuda="13.0")}, {"torchvision": "0.28.0+cu130"})
    assert out.line == ("mmrl: install check failed: torchvision 0.28.0+cu130 does not pair with torch 2.14.1+cu130 "
                        f"(torch 2.14 goes with torchvision 0.29); fix: rm -rf .venv && make install, or {PIP_FIX}")


def test_torchvision_of_another_cuda_major_version():
    out = run_check({"torch": fake_torch("2.14.1+cu130", cuda="13.0"),
                     "torchvision": RuntimeError("Detected that PyTorch and torchvision were compiled with different "
                                                 "CUDA major versions.\nPyTorch has CUDA Version=13.0 ...")},
                    {"torchvision": "0.29.1+cu128"})
    assert out.line == (
        "mmrl: install check failed: torchvision 0.29.1+cu128 (a CUDA 12.8 build) does not match torch 2.14.1+cu130 "
        "(a CUDA 13.0 build) (RuntimeError: Detected that PyTorch and torchvision were compiled with different CUDA "
        f"major versions.); fix: rm -rf .venv && make install, or {PIP_FIX}")


def test_torchvision_operators_missing_without_build_labels():
    """Versions without a build label (a macOS or source build): the import succeeds, the operators are missing."""
    out = run_check({"torch": fake_torch("2.14.1", nms=False)}, {"torchvision": "0.29.1"})
    assert out.line == ("mmrl: install check failed: torchvision 0.29.1 does not work beside torch 2.14.1 (a CPU "
                        "build) (torchvision::nms missing); fix: rm -rf .venv && make install TORCH=cpu, or "
                        f"{PIP_FIX}")


def test_torch_or_torchvision_that_does_not_import_or_is_missing():
    lib = ImportError("libcudart.so.13: cannot open shared object file: No such file or directory")
    assert run_check({"torch": lib}, {"torch": "2.14.1+cu130"}).line == (
        "mmrl: install check failed: cannot import torch 2.14.1+cu130 (ImportError: libcudart.so.13: cannot open "
        f"shared object file: No such file or directory); fix: rm -rf .venv && make install, or {PIP_FIX}")
    assert run_check({}, {"torch": None}).line == (
        "mmrl: install check failed: torch is not installed; fix: make install, or .venv/bin/pip install -e .")
    assert run_check({"torch": fake_torch("2.13.0+cpu")}, {"torchvision": None}).line == (
        "mmrl: install check failed: torchvision is not installed (torch 2.13.0+cpu is); "
        f"fix: rm -rf .venv && make install TORCH=cpu, or {PIP_FIX}")


def test_a_library_that_fails_on_torchvision_names_the_operator():
    """transformers / diffusers wrap the torchvision failure of their lazy imports in an error of their own."""
    try:
        try:
            raise RuntimeError("operator torchvision::nms does not exist")
        except RuntimeError as inner:
            raise RuntimeError("Failed to import transformers.models.qwen2_vl because of the following error "
                               "(look up to see its traceback):") from inner
    except RuntimeError as exc:
        wrapped = exc
    out = run_check({"torch": fake_torch("2.14.1+cu130", cuda="13.0"), "transformers": wrapped},
                    {"torchvision": "0.29.1+cu130"})
    assert out.line == ("mmrl: install check failed: cannot import transformers 5.24.0 beside torch 2.14.1+cu130 "
                        "(torchvision::nms missing); fix: rm -rf .venv && make install")
    assert run_check({"torch": fake_torch("2.14.1+cu130", cuda="13.0")},
                     {"torchvision": "0.29.1+cu130", "peft": None}).line == (
        "mmrl: install check failed: peft is not installed; fix: make install, or .venv/bin/pip install -e .")


def test_success_line_names_versions_and_the_device_build(capsys, monkeypatch):
    cuda = run_check({"torch": fake_torch("2.14.1+cu130", cuda="13.0")}, {"torchvision": "0.29.1+cu130"})
    assert cuda.ok and cuda.line == ("torch 2.14.1+cu130 (CUDA 13.0 build, no GPU visible), torchvision 0.29.1+cu130, "
                                     "diffusers 0.42.1, transformers 5.24.0, peft 0.21.2")
    two = run_check({"torch": fake_torch("2.14.1+cu130", cuda="13.0", gpus=2)}, {"torchvision": "0.29.1+cu130"})
    assert two.line.startswith("torch 2.14.1+cu130 (CUDA 13.0 build, 2 GPUs visible), ")
    cpu = run_check({"torch": fake_torch("2.14.1+cpu")}, {"torchvision": "0.29.1+cpu"})
    assert cpu.ok and cpu.line.startswith("torch 2.14.1+cpu (CPU build), torchvision 0.29.1+cpu, ")

    monkeypatch.setattr(ic, "check", lambda: cuda)
    assert ic.main() == 0
    assert capsys.readouterr().out == (f"mmrl: install check passed: {cuda.line}; no GPU: the CPU build is smaller "
                                       "(rm -rf .venv && make install TORCH=cpu)\n")
    monkeypatch.setattr(ic, "check", lambda: ic.Outcome(False, "mmrl: install check failed: x; fix: y"))
    assert ic.main() == 1
    assert capsys.readouterr() == ("", "mmrl: install check failed: x; fix: y\n")


def test_installed_version_reads_the_build_label_without_importing(tmp_path, monkeypatch):
    pkg = tmp_path / "broken_vision"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    (pkg / "version.py").write_text("__version__ = '0.28.0+cu130'\ngit_version = 'abc'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert ic.installed_version("broken_vision") == "0.28.0+cu130" and "broken_vision" not in sys.modules
    assert ic.installed_version("no_such_package_mmrl") is None
    import torchvision

    assert ic.installed_version("torchvision") == torchvision.__version__


def test_this_venv_passes_the_real_check():
    proc = subprocess.run([sys.executable, "-m", "mmrl.install_check"], capture_output=True, text=True, cwd=ROOT)
    import torch

    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mmrl: install check passed: torch {torch.__version__} ("), lines


def test_the_pinned_pair_is_the_makefiles_and_pyprojects():
    """`make install TORCH=cpu` installs the pair the check's fix names, the newest pyproject.toml admits."""
    make = (ROOT / "Makefile").read_text()
    pins = dict(re.findall(r"^(TORCH_VERSION|TORCHVISION_VERSION) \?= (\S+)$", make, re.M))
    assert (pins["TORCH_VERSION"], pins["TORCHVISION_VERSION"]) == ic.TORCH_PAIR
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert {d for d in deps if d.startswith("torch")} == {"torch>=2.4,<=" + ic.TORCH_PAIR[0],
                                                           "torchvision>=0.19,<=" + ic.TORCH_PAIR[1]}
    assert ic.paired_torchvision(ic.TORCH_PAIR[0]) == ic.series(ic.TORCH_PAIR[1])
