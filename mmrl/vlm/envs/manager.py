"""EnvManager: many episodes reset and stepped concurrently, in threads or spawned worker processes.

Environments are built by name from the registry. A worker process imports this module, which first runs the
``mmrl.vlm.envs`` package (importing the example environments, so they are registered there too), then the
modules the user lists.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

from mmrl.vlm.envs.base import Env, EnvError, Observation, StepResult, make_env

logger = logging.getLogger("mmrl.vlm.envs")  # the package's name: what log filters and handlers address


def _short_traceback(exc: BaseException, frames: int = 3) -> str:
    tb = traceback.extract_tb(exc.__traceback__)[-frames:]
    where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name}" for f in reversed(tb))
    return f"{type(exc).__name__}: {exc} (at {where})" if where else f"{type(exc).__name__}: {exc}"


def _run_command(envs: dict, cmd: str, slot: int, payload: Any) -> tuple:
    """Execute one command on the env in `slot` of `envs`; returns ("ok", value) or ("error", msg, tb)."""
    try:
        if cmd == "reset":
            name, env_kwargs, seed, task = payload
            old = envs.pop(slot, None)
            if old is not None:
                old.close()
            env = make_env(name, **env_kwargs)
            envs[slot] = env
            obs = env.reset(seed, **task)
            _check_observation(obs, name, "reset")
            return ("ok", (obs, env.stop_strings, env.max_turns))
        if cmd == "step":
            if slot not in envs:
                raise RuntimeError(f"episode {slot} has no live environment (never reset, or its worker died)")
            out = envs[slot].step(payload)
            if not (isinstance(out, tuple) and len(out) == 4):
                raise TypeError(f"step() must return (Observation, reward, done, info), got {type(out).__name__}")
            obs, reward, done, info = out
            _check_observation(obs, type(envs[slot]).__name__, "step")
            return ("ok", (obs, float(reward), bool(done), dict(info or {})))
        if cmd == "close":
            env = envs.pop(slot, None)
            if env is not None:
                env.close()
            return ("ok", None)
        raise ValueError(f"unknown command {cmd!r}")
    except Exception as exc:  # noqa: BLE001 - reported to the caller with the episode index
        return ("error", f"{type(exc).__name__}: {exc}", _short_traceback(exc))


def _check_observation(obs: Any, name: str, phase: str) -> None:
    if not isinstance(obs, Observation):
        raise TypeError(f"{name}.{phase}() must return an Observation, got {type(obs).__name__}")


def _worker_main(conn, modules: Sequence[str]) -> None:
    """Worker process: holds the environments of its slots and serves commands until "quit"."""
    import importlib

    for m in modules:  # user environments register themselves on import
        importlib.import_module(m)
    envs: dict[int, Env] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, KeyboardInterrupt):
            break
        if msg[0] == "quit":
            break
        conn.send(_run_command(envs, *msg))
    for env in envs.values():
        try:
            env.close()
        except Exception:  # noqa: BLE001
            pass


class _Worker:
    def __init__(self, ctx, modules: Sequence[str]):
        self.ctx, self.modules = ctx, list(modules)
        self.lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker_main, args=(child, self.modules), daemon=True)
        self.proc.start()
        child.close()

    def call(self, cmd: str, slot: int, payload: Any) -> tuple:
        with self.lock:
            try:
                self.conn.send((cmd, slot, payload))
                return self.conn.recv()
            except (EOFError, BrokenPipeError, ConnectionResetError, OSError) as exc:
                code = self.proc.exitcode
                self.proc.join(timeout=1)
                self._start()  # its environments are gone; later steps on them report errors
                return ("error", f"worker process died (exit code {code}): {type(exc).__name__}", "")

    def close(self) -> None:
        with self.lock:
            try:
                self.conn.send(("quit",))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.terminate()


class EnvManager:
    """Reset and step many episodes concurrently; each episode index owns one environment.

    ``backend="thread"``: environments live in this process, calls run in a thread pool of
    `max_workers` (good for I/O-bound or GIL-releasing environments). ``backend="process"``: `max_workers`
    worker processes (spawned); episode i lives in worker ``i % max_workers`` and its calls run there, so
    CPU-bound Python environments run in parallel. Environments are built by name from the registry
    (``register_env``); with the process backend, modules listed in `modules` are imported in each worker
    first so custom environments are registered there too.

    Errors: an exception in ``reset``/``step`` (or a dead worker) gives that episode
    ``StepResult(Observation(""), 0.0, done=True, info={"error": ..., "index": i, "task": name})``,
    appends an :class:`EnvError` to ``self.errors`` and logs a warning; other episodes continue.
    """

    def __init__(self, max_workers: int = 4, backend: str = "thread", modules: Sequence[str] = ()):
        if backend not in ("thread", "process"):
            raise ValueError(f"EnvManager backend: expected 'thread' or 'process', got {backend!r}")
        if max_workers < 1:
            raise ValueError(f"EnvManager max_workers: expected >= 1, got {max_workers}")
        self.backend, self.max_workers = backend, int(max_workers)
        self._pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="mmrl-env")
        self._local: dict[int, Env] = {}
        self._workers: list[_Worker] = []
        if backend == "process":
            ctx = mp.get_context("spawn")  # fork after torch/threads start is unsafe
            self._workers = [_Worker(ctx, modules) for _ in range(self.max_workers)]
        self._tasks: dict[int, str] = {}
        self.stop_strings: dict[int, tuple[str, ...]] = {}
        self.max_turns: dict[int, int] = {}
        self.errors: list[EnvError] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ one call
    def _call(self, cmd: str, slot: int, payload: Any) -> tuple:
        if self.backend == "process":
            return self._workers[slot % self.max_workers].call(cmd, slot, payload)
        return _run_command(self._local, cmd, slot, payload)

    def _finish(self, cmd: str, slot: int, reply: tuple) -> StepResult:
        if reply[0] == "ok":
            if cmd == "reset":
                obs, stops, max_turns = reply[1]
                self.stop_strings[slot], self.max_turns[slot] = tuple(stops), int(max_turns)
                return StepResult(obs)
            obs, reward, done, info = reply[1]
            return StepResult(obs, reward, done, info)
        _, message, tb = reply
        task = self._tasks.get(slot, "?")
        err = EnvError(index=slot, task=task, phase=cmd, message=message, traceback=tb)
        with self._lock:
            self.errors.append(err)
        logger.warning("environment error in episode %d (task %s, %s): %s", slot, task, cmd, tb or message)
        if cmd == "reset":
            self.stop_strings.setdefault(slot, ())
            self.max_turns.setdefault(slot, 0)
        return StepResult(Observation(""), 0.0, True, {"error": message, "traceback": tb, "index": slot, "task": task})

    def _submit(self, cmd: str, slot: int, payload: Any) -> Future:
        def job() -> StepResult:
            return self._finish(cmd, slot, self._call(cmd, slot, payload))

        return self._pool.submit(job)

    # ------------------------------------------------------------------ public API
    def submit_reset(self, index: int, task: str, seed: int, env_kwargs: dict | None = None,
                     task_kwargs: dict | None = None) -> Future:
        """Start resetting episode `index` with a new `task` environment; Future[StepResult]."""
        self._tasks[index] = task
        return self._submit("reset", index, (task, dict(env_kwargs or {}), int(seed), dict(task_kwargs or {})))

    def submit_step(self, index: int, action_text: str) -> Future:
        """Start stepping episode `index` with `action_text`; Future[StepResult]."""
        return self._submit("step", index, str(action_text))

    def reset(self, specs: Sequence[dict]) -> list[StepResult]:
        """Reset episodes 0..N-1 concurrently. Each spec: {"task": name, "seed": int, "env_kwargs": {...},
        "task_kwargs": {...}} (the last two optional). Returns one StepResult per spec, in order."""
        futs = []
        for i, spec in enumerate(specs):
            if "task" not in spec or "seed" not in spec:
                raise ValueError(f"EnvManager.reset: spec {i} needs keys 'task' and 'seed', got {sorted(spec)}")
            futs.append(self.submit_reset(i, spec["task"], spec["seed"], spec.get("env_kwargs"),
                                          spec.get("task_kwargs")))
        return [f.result() for f in futs]

    def step(self, indices: Sequence[int], actions: Sequence[str]) -> list[StepResult]:
        """Step the given episodes concurrently; results in the order of `indices`."""
        if len(indices) != len(actions):
            raise ValueError(f"EnvManager.step: {len(indices)} indices but {len(actions)} actions")
        futs = [self.submit_step(i, a) for i, a in zip(indices, actions)]
        return [f.result() for f in futs]

    def close(self) -> None:
        for slot in list(self._local):
            _run_command(self._local, "close", slot, None)
        for w in self._workers:
            w.close()
        self._workers = []
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "EnvManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
