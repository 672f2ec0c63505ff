"""Checkpoint files that can be trusted: a manifest (size + crc32 per file) written after the files and checked
before a resume, `torch.load(weights_only=True)` with only what an RNG state needs allowed, and telling a full disk
from other write failures."""

from __future__ import annotations

import errno
import json
import re
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

COMPLETE_MARKER = "COMPLETE"
MANIFEST = "MANIFEST.json"  # {relative path: [size in bytes, crc32]} of every file of a checkpoint


class RunError(RuntimeError):
    """A run cannot start or go on for a reason outside the config (disk full, a corrupt checkpoint, a run
    directory that holds another run): the message names the file and what to do."""


def _file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(directory: str | Path) -> dict:
    """Record [size, crc32] of every file under `directory` in MANIFEST.json (read back from disk, so a write the
    file system lost is caught now rather than at resume)."""
    directory = Path(directory)
    files = {str(p.relative_to(directory)): [p.stat().st_size, _file_crc(p)]
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name not in (MANIFEST, COMPLETE_MARKER)}
    (directory / MANIFEST).write_text(json.dumps(files, indent=0))
    return files


def verify_checkpoint(path: str | Path) -> None:
    """Raise RunError naming the first file of checkpoint `path` that is missing, truncated or changed since it was
    written (sizes and crc32 from its MANIFEST.json). Checkpoints of older mmrl versions (no manifest) pass."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        return
    try:
        files = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        raise RunError(f"checkpoint {path} is corrupt: {manifest} is unreadable ({exc})") from None
    for rel, (size, crc) in files.items():
        f = path / rel
        if not f.is_file():
            raise RunError(f"checkpoint {path} is corrupt: {f} is missing")
        got = f.stat().st_size
        if got != size:
            raise RunError(f"checkpoint {path} is corrupt: {f} has {got} bytes, {size} were written (truncated?)")
        if _file_crc(f) != crc:
            raise RunError(f"checkpoint {path} is corrupt: {f} changed since it was written (crc32 mismatch)")


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return -1


def disk_full(exc: BaseException, where: Path) -> bool:
    """Did `exc` (raised while writing under `where`) come from a full disk? Writers report it differently: OSError
    ENOSPC/EDQUOT, safetensors "No space left on device (os error 28)", torch.save an unrelated-looking
    RuntimeError; so a failed write on a device with less than 16 MiB free counts too."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left" in str(exc) or "os error 28" in str(exc):
        return True
    return 0 <= _free_bytes(where) < (16 << 20)


def _numpy_safe_globals() -> list:
    """What a numpy array (numpy's RNG state) needs to unpickle: its reconstructor, ndarray, dtype and dtype classes."""
    core = getattr(np, "_core", None) or np.core
    allowed: list = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    allowed += [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.uint8, np.int32, np.float32, np.bool_)]
    return allowed


def load_state_file(path: str | Path) -> Any:
    """torch.load(path, weights_only=True) with numpy arrays allowed; a clear RunError naming the file when it is
    corrupt or holds objects outside that allow-list."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except __import__("pickle").UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        if found is None:  # not a torch.save zip archive, or a damaged pickle stream
            raise RunError(f"{path} is corrupt or truncated (not a readable torch.save file)") from None
        raise RunError(f"{path}: refusing to load objects that are not plain state (weights_only=True found "
                       f"{found.group(1)}); a checkpoint written by mmrl holds only tensors, numbers and "
                       f"containers") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise RunError(f"{path} is corrupt or truncated ({type(exc).__name__}: {str(exc)[:160]})") from None
