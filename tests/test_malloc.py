"""`mmrl.runtime.tune_malloc`: applies on Linux/glibc, opts out with MMRL_NO_MALLOC_TUNING=1, never raises, and
changes no number of a run (a 2-step Flow-GRPO tiny run with and without it writes identical metrics)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from mmrl.runtime import tune_malloc
from mmrl.testing import assert_same_path, child_env, metrics_rows, without_time

REPO = Path(__file__).resolve().parents[1]
linux_glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or __import__("platform").libc_ver()[0] != "glibc",
                                 reason="mallopt tuning is Linux/glibc only")


@linux_glibc
def test_tune_malloc_applies_on_glibc_and_the_env_var_opts_out(monkeypatch):
    monkeypatch.delenv("MMRL_NO_MALLOC_TUNING", raising=False)
    assert tune_malloc() is True
    assert tune_malloc() is True  # again: harmless
    monkeypatch.setenv("MMRL_NO_MALLOC_TUNING", "1")
    assert tune_malloc() is False


def test_tune_malloc_is_a_no_op_off_glibc_and_never_raises(monkeypatch):
    import ctypes
    import platform

    monkeypatch.delenv("MMRL_NO_MALLOC_TUNING", raising=False)
    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("", ""))  # musl
    assert tune_malloc() is False
    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("glibc", "2.36"))

    def no_libc(*a, **k):
        raise OSError("libc.so.6: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert tune_malloc() is False
    monkeypatch.setattr(sys, "platform", "darwin")
    assert tune_malloc() is False


_CHILD = """
import json, sys
from mmrl.config import load_config
from mmrl.diffusion.flow_grpo import train
from mmrl.runtime import tune_malloc
applied = tune_malloc()  # what start_run does first (again there: harmless)
train(load_config("configs/diffusion/flow_grpo_tiny.yaml", sys.argv[1:]))
print(json.dumps({"applied": applied}))
"""


@pytest.mark.slow  # two child processes: ~12 s CPU each, 55 s wall on a loaded 2-core machine
@linux_glibc
def test_flow_grpo_run_is_bit_identical_with_and_without_malloc_tuning(tmp_path):
    """Two fresh processes (the tuning cannot be undone in one): the shipped tiny recipe, 2 steps, every metric
    but wall-clock times equal, exactly."""
    procs = {}
    for name, env in (("tuned", {}), ("default", {"MMRL_NO_MALLOC_TUNING": "1"})):
        args = [f"output_dir={tmp_path / name}", "train.max_steps=2", "train.save_every=2", "log.eval_every=0",
                "log.sample_every=0", "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.num_steps=4"]
        procs[name] = subprocess.Popen([sys.executable, "-c", _CHILD, *args], cwd=REPO, env=child_env(**env),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    assert out == {"tuned": {"applied": True}, "default": {"applied": False}}
    rows = {name: [without_time(r) for r in metrics_rows(tmp_path / name)] for name in procs}
    assert len(rows["tuned"]) == 2
    # (PyTorch's CPU allocator aligns tensor data to 64 bytes whatever glibc's settings: the same kernels run)
    same = "two fresh processes, one thread each, same recipe; only glibc's malloc settings differ"
    assert_same_path(rows["tuned"], rows["default"], why=same)
    for f in ("adapter_model.safetensors", "pytorch_lora_weights.safetensors"):  # the trained weights
        a, b = (load_file(tmp_path / name / "checkpoints/step_2/adapters/default" / f) for name in procs)
        assert_same_path(a, b, why=same)
