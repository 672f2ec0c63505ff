"""What a launcher (``torchrun`` / ``accelerate launch``) hands a process: its environment variables, and a clean
exit for the processes it started."""

from __future__ import annotations

import os
import re


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}: expected an integer, got {value!r}") from None


def exit_launched_process(code: int) -> None:
    """End a process that a launcher started (WORLD_SIZE > 1) with `code`, skipping interpreter finalization.

    On gloo/CPU a rank sometimes aborted *after* its work was done and its process group destroyed ("terminate
    called without an active exception", no Python frame: C++ teardown during interpreter finalization), which
    torchrun reports as a failed job. Output is flushed first; files written by the recipes are already closed
    (checkpoints are renamed into place, metrics are appended and closed per row). Does nothing (returns) for a
    process that no launcher started."""
    if (_env_int("WORLD_SIZE") or 1) <= 1:
        return
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not keep the process alive
            pass
    os._exit(code)


def peer_gone(exc: BaseException) -> str | None:
    """"connection closed by peer" / "connection reset by peer" when `exc` is gloo's error for a peer whose process
    ended (its socket closed), else None."""
    m = re.search(r"Connection \w+ by peer", str(exc))
    return m.group(0).lower() if m else None


def lost_rank_message(exc: BaseException) -> str | None:
    """The one-line message for a rank of a launched world (WORLD_SIZE > 1) whose collective failed because another
    rank's process ended (a kill, the OOM killer, an error that ended it first); None for any other exception. gloo
    notices at once; NCCL only reports it after its timeout."""
    reason = peer_gone(exc) if isinstance(exc, RuntimeError) else None  # (gloo's errors are RuntimeErrors)
    if reason is None or (_env_int("WORLD_SIZE") or 1) <= 1:
        return None
    return (f"another rank of the torchrun world is gone ({reason}) while rank {_env_int('RANK')} was in a "
            f"collective with it; its own output says why")
