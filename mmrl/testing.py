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

Comparing two results (tensors, numbers, metrics rows, nested dicts/lists of them) is always one of two choices:

    assert_same_path(resumed_rows, full_rows, why="resume replays the same ops on the same shapes, same process")
    assert_close_across_paths(pos_loss, neg_loss)   # float32 tolerance: two formulas / kernels / batchings

Bit-identity holds only when both sides run the same sequence of torch operations on tensors of the same shapes
in the same process configuration (threads, CPU). Two forwards (with and without autograd), two batchings, two
formulas that are equal in exact arithmetic, or two processes are different paths: their float32 results may
differ in the last bits on another CPU (AVX2 vs AVX-512/AMX kernels), so they get a tolerance.
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
from typing import Any

__all__ = ["FLOAT32_ATOL", "FLOAT32_RTOL", "RESUMED_RUN", "assert_close_across_paths", "assert_overlap_metrics",
           "assert_same_path", "child_env", "child_processes", "environment_report", "metrics_rows",
           "png_claiming_size", "process_ended", "run_torchrun", "signal_death", "spawn_ranks", "without_time"]

# float32 has a 2^-24 ~ 6e-8 relative rounding step; through a tiny model's forward and a loss the results of two
# paths drift apart by up to ~1e-6 relative (measured: NFT pos/neg loss 1.8e-8, 2 ranks vs 1 process ~1e-7), far
# below any difference a bug makes in these tests (>= 1e-3)
FLOAT32_RTOL = 1e-5
FLOAT32_ATOL = 1e-6

# the `why` of the commonest bit-identity check: a resumed run against the uninterrupted one
RESUMED_RUN = ("resumed vs uninterrupted run in one process and thread setting: the checkpoint restores weights, "
               "optimizer, RNG and data position exactly, and every step runs the same ops on the same shapes")

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


def assert_overlap_metrics(rows: list[dict], summary: dict | None, max_staleness: int) -> None:
    """The overlap metrics of an async run (`mmrl.training.overlap`): every row has them, fractions in [0, 1], the
    ideal speed-up in [1, 2] and equal to (R + T) / max(R, T) of the row, the achieved one (R + T) / W; every
    batch at most `max_staleness` versions behind, one batch per step; the summary (unless None) holds their
    means."""
    import pytest

    from mmrl.training.overlap import OVERLAP_KEYS

    assert rows
    for r in rows:
        missing = [k for k in OVERLAP_KEYS if k not in r]
        assert not missing, f"step {r['step']}: no {missing}"
        assert 0 <= r["async/trainer_idle_frac"] <= 1 and 0 <= r["async/rollout_idle_frac"] <= 1, r
        R, T = r["async/rollout_s"], r["async/trainer_s"]
        assert R > 0 and T > 0 and r["time/step_s"] >= T, r
        assert 1 <= r["async/ideal_speedup"] <= 2 and r["async/ideal_speedup"] == pytest.approx((R + T) / max(R, T))
        assert r["async/achieved_speedup"] == pytest.approx((R + T) / r["time/step_s"])
        counts = [r[f"rollout/staleness/count_{s}"] for s in range(max_staleness + 1)]
        assert sum(counts) == 1 and r["rollout/staleness/max"] <= max_staleness, r
        assert r["rollout/staleness/max"] == max(s for s, c in enumerate(counts) if c)
    if summary is None:
        return
    steps = rows[1:] or rows
    for key in OVERLAP_KEYS:
        assert summary[key.replace("/", "_")] == pytest.approx(sum(r[key] for r in steps) / len(steps)), key
    assert summary["async_staleness_max"] == max(r["rollout/staleness/max"] for r in rows)


def process_ended(pid: int) -> bool:
    """Process `pid` has ended (Linux /proc): gone, or a zombie that no parent has reaped yet (a container's PID 1
    may never reap the orphans it inherits)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def child_processes(pid: int) -> dict[int, str]:
    """{PID: command line} of the running children of process `pid` (Linux /proc)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            if ppid == pid and not process_ended(int(entry.name)):
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
    return out


# measurements of the machine rather than of the training (mmrl.perf.meter): throughput and memory
MACHINE_KEYS = ("perf/tflops_per_s", "perf/mfu", "perf/peak_memory_gib")


TIMING_PREFIXES = ("time/", "async/")  # wall-clock keys: timings, and a rollout process's overlap metrics


def without_time(row: dict) -> dict:
    """A metrics row without its wall-clock and machine keys (``TIMING_PREFIXES``, ``MACHINE_KEYS``): what two equal
    runs must agree on (``perf/tflops_per_step`` stays: it is a function of the work done)."""
    return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES) and k not in MACHINE_KEYS}


# the CPU features that decide which float kernels torch (and oneDNN / MKL) run: AVX2 vs AVX-512 vs AMX round
# differently, which is why the suite compares results of different code paths with a tolerance
_KERNEL_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                 "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")


def environment_report() -> str:
    """What a test run's float results depend on, as lines of text: CPU model, core count, the SIMD / matrix
    flags that select kernels (and every flag), torch's CPU capability and thread count, Python and the versions
    of torch, diffusers, transformers, peft. `.ci/run` prints it before the tests."""
    import importlib
    import os
    import platform
    from importlib import metadata

    model, flags = platform.processor() or platform.machine(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = value.split()
    except OSError:  # not Linux: the model from platform, no flags
        pass
    lines = [f"cpu: {model} ({os.cpu_count()} logical cores, {platform.machine()})",
             f"cpu kernel flags: {' '.join(f for f in _KERNEL_FLAGS if f in flags) or 'unknown'}"]
    if flags:
        lines.append(f"cpu all flags ({len(flags)}): {' '.join(flags)}")
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
        lines.append(f"torch cpu capability: {capability}; intra-op threads {torch.get_num_threads()} "
                     f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})")
    except Exception as exc:  # noqa: BLE001 - a report, never a failure
        lines.append(f"torch cpu capability: unavailable ({type(exc).__name__})")
    versions = [f"python {platform.python_version()}"]
    for dist in ("torch", "diffusers", "transformers", "peft", "accelerate", "numpy"):
        try:  # the imported module's own version string (torch's carries its build, e.g. +cpu)
            versions.append(f"{dist} {importlib.import_module(dist).__version__}")
        except Exception:  # noqa: BLE001 - not installed or broken: say so, the report goes on
            try:
                versions.append(f"{dist} {metadata.version(dist)} (import failed)")
            except metadata.PackageNotFoundError:
                versions.append(f"{dist} not installed")
    lines.append("versions: " + ", ".join(versions))
    return "\n".join(lines)


def chat_completions_server(handle: Any) -> tuple[Any, str]:
    """A local OpenAI-compatible chat-completions endpoint on 127.0.0.1 (a free port) for tests of the VLM judges:
    every POST body (JSON) goes to ``handle(request, headers) -> (status, text)``; status 200 answers a chat
    completion whose message content is `text`, any other status an ``{"error": {"message": text}}``. Returns
    ``(server, base_url)`` with base_url ending in ``/v1``; stop it with ``server.shutdown(); server.server_close()``."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status, text = handle(req, self.headers) if self.path == "/v1/chat/completions" else (404, self.path)
            body = json.dumps({"id": "x", "object": "chat.completion", "model": req.get("model"),
                               "choices": [{"index": 0, "finish_reason": "stop",
                                            "message": {"role": "assistant", "content": text}}]}
                              if status == 200 else {"error": {"message": text}}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


def png_claiming_size(width: int, height: int) -> bytes:
    """A 55-byte PNG whose header says `width` x `height` (8-bit RGB) followed by 10 bytes of broken pixel data:
    PIL reads its size, decoding it fails ("broken data stream"). For testing size limits that must act on the
    header alone: a refusal by size proves nothing was decoded (a decode attempt reports the broken data)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"x\x9c" + bytes(8))


def assert_same_path(a: Any, b: Any, *, why: str) -> None:
    """`a` and `b` are equal bit for bit: tensors (same shape and dtype, NaN equal to NaN), numbers, strings, None,
    and dicts / lists / tuples of them (e.g. metrics rows). For results of the SAME code path in the same process
    configuration only (a resumed run vs an uninterrupted one, a repeated call, weights saved and loaded); `why`
    says why both sides take the same path and is part of the failure message."""
    if not why.strip():
        raise ValueError("assert_same_path: say why both sides take the same code path (why=...)")
    _compare(a, b, None, f"bit-identical expected ({why})", "")


def assert_close_across_paths(a: Any, b: Any, *, rtol: float = FLOAT32_RTOL, atol: float = FLOAT32_ATOL,
                              what: str = "") -> None:
    """`a` and `b` agree to a float tolerance (|a - b| <= atol + rtol |b| per element): for results of DIFFERENT
    computation paths (formulas equal only in exact arithmetic, forwards with and without autograd, batchings,
    kernels, dtypes, thread counts, processes). Structure (keys, lengths, shapes), integers, booleans, strings and
    None must still match exactly; NaN matches NaN."""
    _compare(a, b, (rtol, atol), f"equal within rtol={rtol}, atol={atol} expected" + (f" ({what})" if what else ""),
             "")


def _compare(a: Any, b: Any, tol: tuple[float, float] | None, msg: str, where: str) -> None:
    import math

    import torch

    at = where or "value"
    if isinstance(a, dict) or isinstance(b, dict):
        if not (isinstance(a, dict) and isinstance(b, dict)):
            raise AssertionError(f"{msg}: {at}: {_short(a)} vs {_short(b)}")
        if set(a) != set(b):
            raise AssertionError(f"{msg}: {at}: keys in only one side {sorted(set(a) ^ set(b), key=str)}")
        for k in a:
            _compare(a[k], b[k], tol, msg, f"{where}[{k!r}]")
        return
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))) or len(a) != len(b):
            raise AssertionError(f"{msg}: {at}: {_short(a)} vs {_short(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            _compare(x, y, tol, msg, f"{where}[{i}]")
        return
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            raise AssertionError(f"{msg}: {at}: {_short(a)} vs {_short(b)}")
        if a.shape != b.shape or a.dtype != b.dtype:
            raise AssertionError(f"{msg}: {at}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
        rtol, atol = tol if tol is not None and (a.is_floating_point() or a.is_complex()) else (0.0, 0.0)
        try:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as exc:
            raise AssertionError(f"{msg}: {at}: {exc}") from None
        return
    floats = isinstance(a, float) or isinstance(b, float)
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    if not (floats and numbers):  # ints, bools, strings, None: always exact
        if a != b or type(a) is not type(b):
            raise AssertionError(f"{msg}: {at}: {_short(a)} != {_short(b)}")
        return
    x, y = float(a), float(b)
    if x == y or math.isnan(x) and math.isnan(y):
        return
    if tol is None or not (math.isfinite(x) and math.isfinite(y)) or abs(x - y) > tol[1] + tol[0] * abs(y):
        raise AssertionError(f"{msg}: {at}: {x!r} vs {y!r} (difference {x - y:.3g})")


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."
