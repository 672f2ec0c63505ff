"""Helpers for testing recipes end to end: launching ``torchrun`` jobs and reading a run directory.

Used by mmrl's own test suite and usable by anyone testing a recipe of their own::

    from mmrl.testing import run_torchrun, metrics_rows
    proc = run_torchrun(["-m", "mmrl.cli", "train", "my.yaml", "dist.strategy=ddp"], nproc=2, cwd=repo)
    assert proc.returncode == 0
    rows = metrics_rows(out_dir)

``run_torchrun`` retries a launch once when a rank was killed by a signal from inside the C++ runtime
(SIGABRT/SIGSEGV: e.g. gloo on a loaded CPU host aborting with "terminate called without an active exception",
seen once in CI) and says so with a warning; an ordinary failure (exit code, Python exception, timeout) is never
retried, so tests that expect an error still see it. The children run with ``PYTHONFAULTHANDLER=1``, so an abort
prints every thread's Python stack.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

__all__ = ["child_env", "metrics_rows", "run_torchrun", "signal_death", "spawn_ranks", "without_time"]

# torchrun's failure report names each rank's fate: "exitcode  : -6 (pid: 17647)" / "Signal 6 (SIGABRT) received"
_SIGNAL_EXIT = re.compile(r"exitcode\s*:\s*-(\d+)")
_RETRY_SIGNALS = {6, 7, 11}  # SIGABRT, SIGBUS, SIGSEGV (SIGTERM is torchrun stopping the other ranks)


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a child process: this repo importable, 1 intra-op thread, hub offline, no progress bars,
    Python stacks on fatal signals. ``extra`` overrides. ``WORLD_SIZE`` & co. of an enclosing launch are dropped."""
    root = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    path = [root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update(PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", MMRL_NO_PROGRESS="1",
               PYTHONFAULTHANDLER="1")
    env.update(extra)
    return env


def signal_death(stderr: str) -> int | None:
    """The first fatal signal number (SIGABRT, SIGBUS, SIGSEGV) a rank died from, per torchrun's report."""
    for m in _SIGNAL_EXIT.finditer(stderr):
        if int(m.group(1)) in _RETRY_SIGNALS:
            return int(m.group(1))
    return None


def run_torchrun(args: list[str], nproc: int = 2, *, cwd: str | Path | None = None, env: dict | None = None,
                 timeout: float = 300, retries: int = 1) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc_per_node NPROC ARGS`` with output captured.

    Retried (at most ``retries`` times) only when a rank died from SIGABRT/SIGBUS/SIGSEGV; a warning carries the
    first attempt's stderr tail. Recipes resume from their newest complete checkpoint, so a retried training run
    neither loses nor repeats a step."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    env = child_env() if env is None else env
    attempt = 0
    while True:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        sig = signal_death(proc.stderr) if proc.returncode != 0 else None
        if sig is None or attempt >= retries:
            return proc
        attempt += 1
        log = Path(tempfile.gettempdir()) / f"mmrl_torchrun_signal_{os.getpid()}_{time.time_ns()}.log"
        log.write_text(f"$ {' '.join(cmd)}\n\nSTDOUT\n{proc.stdout}\n\nSTDERR\n{proc.stderr}")
        warnings.warn(f"torchrun: a rank died from signal {sig} (attempt {attempt}); retrying. Full output: {log}\n"
                      f"{_crash_excerpt(proc.stderr)}", RuntimeWarning, stacklevel=2)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), MMRL_NO_PROGRESS="1", HF_HUB_OFFLINE="1")
    import torch

    from mmrl.distributed import DistContext

    torch.set_num_threads(1)
    ctx = DistContext.init("gloo")
    fn(ctx, *args)
    ctx.barrier()
    ctx.close()


def spawn_ranks(fn, *args, world: int = 2) -> None:
    """Run ``fn(ctx, *args)`` in `world` local processes (``torch.multiprocessing.spawn``), each with a gloo
    ``DistContext`` on a free port, one intra-op thread and the hub offline; returns when all have finished (a
    failing rank raises here). `fn` must be importable by the children: a module-level function (of ``__main__``
    when called from a script's ``if __name__ == "__main__"`` block)."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(world, _free_port(), fn, args), nprocs=world, join=True)


def _crash_excerpt(stderr: str, limit: int = 4000) -> str:
    """The part of a crashed launch's stderr that says where: from the first fatal-error marker on."""
    marks = [stderr.find(m) for m in ("terminate called", "Fatal Python error", "Segmentation fault") if m in stderr]
    start = min(marks) if marks else max(0, len(stderr) - limit)
    return stderr[start:start + limit]


def metrics_rows(out_dir: str | Path) -> list[dict]:
    """The rows of ``OUT_DIR/metrics.jsonl``."""
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# measurements of the machine rather than of the training (mmrl.perf.meter): throughput and memory
MACHINE_KEYS = ("perf/tflops_per_s", "perf/mfu", "perf/peak_memory_gib")


def without_time(row: dict) -> dict:
    """A metrics row without its wall-clock and machine keys (``time/...``, ``MACHINE_KEYS``): what two equal runs
    must agree on (``perf/tflops_per_step`` stays: it is a function of the work done)."""
    return {k: v for k, v in row.items() if not k.startswith("time/") and k not in MACHINE_KEYS}
