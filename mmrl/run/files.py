"""Checkpoint files that can be trusted: a manifest (size + crc32 per file) written after the files and checked
before a resume, `torch.load(weights_only=True)` with only what an RNG state needs allowed, and telling a full disk
from other write failures."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import zipfile
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

COMPLETE_MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "MANIFEST.json"  # {relative path: [size in bytes, crc32]} of every file of a checkpoint


class NonFiniteError(ValueError):
    """A reward, loss, gradient or weight is NaN/inf where the run cannot go on with it."""


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
    written (sizes and crc32 from its MANIFEST.json; checkpoints of older mmrl versions without one pass that
    check), or a state.pt that `load_state_file` refuses or cannot read."""
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
    if (path / "state.pt").is_file():  # its pickle, tensors only mapped: a refused or damaged state.pt counts too
        try:
            load_state_file(path / "state.pt", mmap=True)
        except RunError as exc:
            raise RunError(f"checkpoint {path} is unusable: {exc}") from None


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


def refuse_foreign_output(out_dir: str | Path, marker: str, who: str, hint: str = "") -> Path:
    """`out_dir` as a Path; FileExistsError when it is a non-empty directory without `marker` (an earlier output of
    the same writer holds it, so only such a directory or an empty / new one is overwritten)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / marker).is_file():
        raise FileExistsError(f"{who}: output directory '{out_dir}' is not empty and holds no {marker}; refusing to "
                              f"overwrite it{f' ({hint})' if hint else ''}")
    return out_dir


def probe_writable(directory: str | Path) -> None:
    """Create `directory` (with its parents) and write and delete an empty file in it: the OSError a writer would
    meet there later (a read-only file system, no permission, a file in the way) raised now, before the work."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)  # passes on a read-only mount when the directory exists
    probe = directory / f".mmrl-write-test-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()


def _numpy_safe_globals() -> list:
    """What a numpy array (numpy's RNG state) needs to unpickle: its reconstructor, ndarray, dtype and dtype classes."""
    core = getattr(np, "_core", None) or np.core
    allowed: list = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    allowed += [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.uint8, np.int32, np.float32, np.bool_)]
    return allowed


def _looks_like_pickle(path: Path) -> bool:
    """A torch.save archive (zip) or a bare pickle stream (PROTO opcode 0x80 first): not random bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(1) == b"\x80" or zipfile.is_zipfile(path)
    except OSError:
        return False


def pickle_refusal(exc: BaseException, path: str | Path | None = None) -> str | None:
    """What `torch.load(weights_only=True)` refused, if `exc` (or an exception it was raised from) is that refusal:
    the global or pickle opcode it met ("argparse.Namespace", "posix.system", "pickle opcode 149"); None otherwise,
    also when the file `path` is not a pickle at all (torch reads any non-zip file as a legacy pickle, so damaged
    bytes fail like a refused opcode)."""
    if path is not None and not _looks_like_pickle(Path(path)):
        return None
    seen = 0
    while exc is not None and seen < 10:
        text = str(exc)
        if isinstance(exc, __import__("pickle").UnpicklingError) and "Weights only load failed" in text:
            found = re.search(r"GLOBAL (\S+)", text) or re.search(r"Unsupported operand (\d+)", text)
            if found is None:
                return "an object outside the allowed types"
            return found.group(1) if "GLOBAL" in found.group(0) else f"pickle opcode {found.group(1)}"
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def load_state_file(path: str | Path, mmap: bool = False) -> Any:
    """torch.load(path, weights_only=True) with numpy arrays allowed; a clear RunError naming the file when it is
    refused (a pickle that would build other objects, possibly run code: nothing of it runs) or corrupt. `mmap`:
    map the tensors instead of reading them (a cheap check of a large file's pickle)."""
    path = Path(path)
    try:
        is_zip = zipfile.is_zipfile(path)
        with open(path, "rb") as f:
            head = f.read(1)
    except OSError as exc:
        raise RunError(f"{path} cannot be read ({exc.strerror or exc})") from None
    if not is_zip:  # torch.save writes zip archives; a bare pickle stream starts with the PROTO opcode 0x80
        if head == b"\x80":
            raise RunError(f"{path} was refused for safety: it is a bare pickle, not a torch.save archive (mmrl "
                           f"writes only those), and unpickling it could run code; nothing of it ran") from None
        raise RunError(f"{path} is corrupt or truncated (not a torch.save archive)")
    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except __import__("pickle").UnpicklingError as exc:
        what = pickle_refusal(exc)
        if what is None:  # a damaged pickle stream
            raise RunError(f"{path} is corrupt or truncated (not a readable torch.save file)") from None
        raise RunError(f"{path} was refused for safety: it holds {what}, which torch.load(weights_only=True) does not "
                       f"load (it could run code; nothing of it ran); a checkpoint written by mmrl holds only "
                       f"tensors, numbers and containers") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise RunError(f"{path} is corrupt or truncated ({type(exc).__name__}: {str(exc)[:160]})") from None


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def refused_pickle_file(directory: str | Path) -> Path | None:
    """The first pickle weight file under `directory` that `torch.load(weights_only=True)` refuses (tensors only
    mapped, nothing of it runs), or None."""
    root = Path(directory)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in PICKLE_SUFFIXES)
    for f in files:
        try:  # a legacy (non-zip) torch.save file cannot be mapped: read it whole
            torch.load(f, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(f))
        except Exception as exc:  # noqa: BLE001 - only the refusal matters here
            if pickle_refusal(exc, f) is not None:
                return f
    return None


@contextmanager
def refusing_pickled_weights(what: str, directory: str | Path) -> Iterator[None]:
    """Turn a weights_only refusal raised while loading model weights from `directory` (diffusers and transformers
    load `.bin` files with `torch.load(weights_only=True)`; their error is a 40-line UnpicklingError that names no
    file, or an OSError raised from it) into one RunError naming the file and why it was refused."""
    try:
        yield
    except Exception as exc:
        refused = pickle_refusal(exc)
        if refused is None:
            raise
        culprit = refused_pickle_file(directory) or Path(directory)
        raise RunError(f"{what}: {culprit} was refused for safety: it is a pickle holding {refused}, which "
                       f"torch.load(weights_only=True) does not load (unpickling it could run code; nothing of it "
                       f"ran); use the model's .safetensors weights, or, if you trust the file's source, convert it "
                       f"to safetensors yourself") from None


def list_checkpoints(ckpt_root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (those with the COMPLETE marker) under `ckpt_root`, oldest first."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and (child / COMPLETE_MARKER).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def checkpoint_step(path: str | Path) -> int:
    """Step number of a checkpoint directory (checks that it is complete)."""
    path = Path(path)
    m = _STEP_DIR.match(path.name)
    if not path.is_dir() or not m:
        raise FileNotFoundError(f"not a checkpoint directory (expected .../step_<N>/): {path}")
    if not (path / COMPLETE_MARKER).is_file():
        raise FileNotFoundError(f"checkpoint {path} is incomplete (no {COMPLETE_MARKER} marker): it was interrupted while being written")
    return int(m.group(1))


def last_checkpoint(run: Any) -> str:
    """The newest complete checkpoint of `run` (a path), or a sentence saying there is none."""
    if run is None:
        return "unknown"
    ckpts = list_checkpoints(run.ckpt_dir)
    return str(ckpts[-1][1]) if ckpts else f"none in {run.ckpt_dir}"
