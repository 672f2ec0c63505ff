"""What a training process sets up at run time: the device and dtype, seeds and the RNG state (saved in every
checkpoint), glibc malloc tuning and the phase timer. The run directory, checkpoints and resume: `mmrl.run`."""

from __future__ import annotations

import os
import random
import sys
import time
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def how_process_ended(exitcode: int | None) -> str:
    """'died from signal 9 (SIGKILL: e.g. the OOM killer, or kill -9)' / 'exited with code 3' of an exit code
    (multiprocessing's and subprocess's: a negative code is the signal that ended the process)."""
    import signal

    if exitcode is None or exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = "unknown signal"
    hint = ": e.g. the OOM killer, or kill -9" if -exitcode == signal.SIGKILL else ""
    return f"died from signal {-exitcode} ({name}{hint})"


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` -> cuda when available, else cpu. Asking for cuda on a machine without it is an error."""
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: unknown device {name!r}; expected auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{name}' requested but CUDA is not available on this machine; use device=cpu or auto")
    return dev


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = str(name).lower().replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype '{name}'; valid: {sorted(_DTYPES)}")
    return _DTYPES[key]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def get_rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# glibc malloc tuning (tune_malloc): parameter ids of mallopt (<malloc.h>) and the values set
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MALLOC_MMAP_THRESHOLD = 256 << 20
"""Allocations below this come from the heap instead of a fresh mmap (glibc: 128 KiB, adapting up to 32 MiB)."""
MALLOC_TRIM_THRESHOLD = 1 << 30
"""Free memory at the top of the heap is returned to the system only above this (glibc: 128 KiB, adapting)."""


def tune_malloc() -> bool:
    """Keep large CPU buffers (convolution / matmul workspaces, activations) in the process heap between calls.

    With glibc's defaults a buffer above the mmap threshold (128 KiB, raised as large blocks are freed, but never
    past 32 MiB) is a fresh ``mmap`` on every allocation and an ``munmap`` on every free, and heap memory above the
    trim threshold is handed back on every free: each call of a model then page-faults (and the kernel zeroes)
    its buffers again. ``mallopt`` with a 256 MiB mmap threshold and a 1 GiB trim threshold lets freed buffers be
    reused. Only where memory comes from changes, never a value: the numbers a run computes stay bit-identical
    (tests/test_malloc.py). The cost: up to the run's peak CPU allocations stay mapped after they are freed.

    Linux with glibc only; a no-op elsewhere (musl, macOS, Windows) and when ``MMRL_NO_MALLOC_TUNING=1``. Never
    raises. Returns True when both settings were applied (``mallopt`` said yes). Called once at run start
    (``mmrl.run.start_run``); calling it again is harmless."""
    if os.environ.get("MMRL_NO_MALLOC_TUNING", "").strip().lower() not in ("", "0", "false", "no"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        import platform

        if platform.libc_ver()[0] != "glibc":
            return False
        mallopt = ctypes.CDLL("libc.so.6").mallopt
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        ok_mmap = mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD) == 1
        ok_trim = mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD) == 1
        return ok_mmap and ok_trim
    except Exception:  # no libc.so.6, no mallopt symbol, a sandbox without ctypes: keep the defaults
        return False


class Timer:
    """Accumulates wall time per named phase: `with timer("rollout"): ...`; `timer.pop()` -> metrics."""

    def __init__(self, sync_cuda: bool = False):
        self.times: dict[str, float] = {}
        self.sync = sync_cuda and torch.cuda.is_available()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t

    def pop(self, prefix: str = "time/") -> dict[str, float]:
        out = {f"{prefix}{k}_s": v for k, v in self.times.items()}
        self.times = {}
        return out
