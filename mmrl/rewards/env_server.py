"""The reward server a run starts in a reward env (`mmrl.rewards.envs`) and stops when it ends.

``load("remote", env=NAME, serve={"name": REWARD, "kw": {...}})`` (a recipe's ``reward.components.<key>: {reward:
remote, env: NAME, serve: {...}}``) builds an `EnvServer`: it runs ``ENV/bin/mmrl reward serve REWARD --host
127.0.0.1 --port 0 --parent-pid <this PID> --quiet`` in its own process group, with a fresh random token in its
environment ($MMRL_REWARD_TOKEN: not on the command line) and without PYTHONPATH (the env imports its own
packages), reads the URL the server prints once it listens (port 0: no race for a free port), and the remote client
scores through it. Its output goes to ``ENV/logs/serve-*.log`` (removed when the server stops cleanly).

It stops (SIGTERM to its process group, SIGKILL after 5 s) when the run ends however it ends (`closes_runs`, via
`close_on_failure(..., on_return=True)`), when the client is closed or collected, and at interpreter exit; a run
killed with SIGKILL leaves no server either: ``--parent-pid`` makes the server exit once its parent is gone.
A server that does not start (an import error in the env, a bad argument) fails the load with one line naming the
env, how the process ended and the last lines of its output; one that dies mid-run fails the next request the same
way (`RemoteRewardError`, no retries against a dead process).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

from mmrl.rewards.envs import RewardEnvError, clean_environ, resolve_env
from mmrl.run.start import close_on_failure
from mmrl.runtime import how_process_ended

__all__ = ["EnvServer", "check_serve_spec", "SERVE_KEYS"]

SERVE_KEYS = {"name": "the reward to serve: a registered name, a YAML file or module:function (required)",
              "kw": "its load arguments (a mapping; `mmrl reward serve --kw`)",
              "weights": "its weights path (`--weights`)",
              "device": "where it loads (`--device`; default: the run's device)",
              "max_batch": "largest batch per model call (`--max-batch`)",
              "startup_timeout": "seconds to wait for the server to listen (default 600: a large model loads)"}
_LISTENING = re.compile(r"serving reward .* on (http://\S+) \(POST /score")
_OPEN: "weakref.WeakSet[EnvServer]" = weakref.WeakSet()  # servers of this process not yet stopped


def check_serve_spec(serve: Any, where: str = "serve") -> dict:
    """The `serve` mapping checked (keys, kinds), with defaults; ValueError naming the key otherwise."""
    if isinstance(serve, str):
        serve = {"name": serve}
    if not isinstance(serve, dict):
        raise ValueError(f"{where}: expected a mapping {{name: REWARD, kw: {{...}}}}, got {serve!r}")
    unknown = sorted(set(serve) - set(SERVE_KEYS))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: unknown key; valid: " +
                         "; ".join(f"{k} ({v})" for k, v in SERVE_KEYS.items()))
    spec = {"kw": {}, "weights": None, "device": None, "max_batch": None, "startup_timeout": 600.0, **serve}
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ValueError(f"{where}.name: expected the reward to serve (a registered name, a YAML file or "
                         f"module:function), got {spec.get('name')!r}")
    if not isinstance(spec["kw"], dict):
        raise ValueError(f"{where}.kw: expected a mapping of load arguments, got {spec['kw']!r}")
    timeout = spec["startup_timeout"]
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"{where}.startup_timeout: expected seconds > 0, got {timeout!r}")
    mb = spec["max_batch"]
    if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or mb < 1):
        raise ValueError(f"{where}.max_batch: expected an integer >= 1, got {mb!r}")
    return spec


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL if it is still there after 5 s."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def open_servers() -> set[int]:
    """Ids of this process's running `EnvServer`s (for `close_servers`)."""
    return {id(s) for s in _OPEN}


def close_servers(since: set[int]) -> None:
    """Stop every server started after `open_servers()` returned `since` (the servers a run started)."""
    for server in list(_OPEN):
        if id(server) not in since:
            server.close()


close_on_failure(open_servers, close_servers, set(), on_return=True)  # a run's servers end with it


class EnvServer:
    """`ENV/bin/mmrl reward serve` in reward env `env` (module docstring); `.url`, `.token`, `.close()`."""

    def __init__(self, env: str, serve: Any, env_dir: str | None = None, device: Any = None):
        spec = check_serve_spec(serve)
        self.env = resolve_env(env, env_dir)
        self.token = secrets.token_urlsafe(24)
        cmd = [str(self.env / "bin" / "mmrl"), "reward", "serve", spec["name"], "--host", "127.0.0.1", "--port", "0",
               "--parent-pid", str(os.getpid()), "--quiet"]
        if spec["weights"] is not None:
            cmd += ["--weights", str(spec["weights"])]
        if spec["kw"]:  # JSON is YAML: the server's --kw parser reads every value back as it was
            cmd += ["--kw", *[f"{k}={json.dumps(v)}" for k, v in spec["kw"].items()]]
        if spec["device"] is not None or device is not None:
            cmd += ["--device", str(spec["device"] if spec["device"] is not None else device)]
        if spec["max_batch"] is not None:
            cmd += ["--max-batch", str(spec["max_batch"])]
        (self.env / "logs").mkdir(exist_ok=True)
        fd, log = tempfile.mkstemp(prefix="serve-", suffix=".log", dir=self.env / "logs")
        self.log = Path(log)
        self.what = f"reward server '{spec['name']}' in env {self.env}"
        with os.fdopen(fd, "w") as out:
            try:
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True, cwd=self.env,
                                             env=clean_environ({"MMRL_REWARD_TOKEN": self.token,
                                                                "PYTHONUNBUFFERED": "1"}))
            except OSError as exc:
                raise RewardEnvError(f"{self.what}: cannot start {cmd[0]}: {exc.strerror or exc}") from None
        self._finalizer = weakref.finalize(self, _stop, self.proc)
        _OPEN.add(self)
        try:
            self.url = self._wait_listening(float(spec["startup_timeout"]))
        except BaseException:
            self.close(keep_log=True)
            raise

    def _wait_listening(self, timeout: float) -> str:
        end = time.monotonic() + timeout
        while True:
            found = _LISTENING.search(self._output())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                raise RewardEnvError(f"{self.what} {how_process_ended(self.proc.returncode)} before it listened: "
                                     f"{self.tail()} (full output: {self.log})")
            if time.monotonic() > end:
                raise RewardEnvError(f"{self.what} did not listen within {timeout:g} s (serve.startup_timeout); "
                                     f"its last output: {self.tail() or '(none)'} (full output: {self.log})")
            time.sleep(0.05)

    def _output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 3) -> str:
        """The server's last non-empty output lines, joined with ' | ' (one line)."""
        out = [x.strip() for x in self._output().splitlines() if x.strip()]
        return " | ".join(out[-lines:])[-600:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def death(self) -> str | None:
        """None while the server runs; else one line: how it ended and its last output."""
        if self.alive():
            return None
        return (f"{self.what} (PID {self.proc.pid}) {how_process_ended(self.proc.returncode)}; its last output: "
                f"{self.tail() or '(none)'} (full output: {self.log})")

    def close(self, keep_log: bool = False) -> None:
        """Stop the server (idempotent); its log is removed unless it failed (or `keep_log`)."""
        if not self._finalizer.alive:
            return
        failed = keep_log or not self.alive()
        self._finalizer()
        _OPEN.discard(self)
        if not failed:
            self.log.unlink(missing_ok=True)
