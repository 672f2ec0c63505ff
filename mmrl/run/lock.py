"""One run per directory: the lock a training run holds on its output_dir, and what a run that failed to start
leaves behind (nothing).

The lock is `flock(LOCK_EX | LOCK_NB)` on the run directory itself and on `<output_dir>/.mmrl.lock`, a file that
names its holder (PID, host, start time, command). flock rather than an O_EXCL lock file + PID check, because the
kernel releases an flock when its holder exits for any reason (an exception, Ctrl-C, `kill -9`, an OOM kill): a lock
can never outlive its process, so "stale" needs no guessing from PIDs, which other hosts cannot check and which the
system reuses. A lock file left behind by a process that died holds no flock; the next run takes it over and says
whose it was. On Linux flock also works on NFS (emulated with fcntl record locks, which NLM shares between hosts).
On a file system without locks (flock fails with ENOLCK / EOPNOTSUPP) the lock falls back to the PID in the file: a
live process of that PID on this host is a holder; anything else is stale.

An flock belongs to a file, not to its name: deleting `.mmrl.lock` of a live run would let the next start create a
new file and lock that. The lock of the directory's own inode stays while the run lives, whatever happens to the
names in it, so the next start is refused (naming the holder from the lock file, or from /proc/locks when the file
is gone). Where directories cannot be flocked (NFS) the file's lock alone decides, and before every write into the
directory (`RunLock.check`: a metrics row, a checkpoint, samples, config.yaml) the holder checks that its lock file
is still the one it locked: a removed file is written again, a file another run has locked since stops this run
with one line naming that run, before it writes anything more.

Only the main process (rank 0) of a run takes the lock and writes into the directory; `mmrl.run.start_run`
shares rank 0's outcome with the other ranks, so a refused start ends every rank with the same one-line error.
A process holds at most one lock per directory: a newer `Run` on a directory this process already holds (a
second `train()` call in one Python session after the first failed) takes the lock over without a gap.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
import weakref
from pathlib import Path
from typing import Any

from mmrl.run.files import RunError

LOCK_NAME = ".mmrl.lock"
_HELD: dict[str, "RunLock"] = {}  # resolved run directory -> the lock this process holds on it


def _holder_text(info: dict) -> str:
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    argv = [str(a) for a in info.get("argv", [])]
    cmd = " ".join([Path(argv[0]).name, *argv[1:]]) if argv else ""
    cmd = cmd if len(cmd) <= 100 else cmd[:97] + "..."
    return f"PID {info.get('pid', '?')} on host {info.get('host', '?')} (started {when}" + (f": {cmd})" if cmd else ")")


def _read_info(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 65536).decode("utf-8", "replace")
        info = json.loads(text) if text.strip() else {}
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_info(fd: int, started: float) -> None:
    """Name this process as the holder in the lock file open as `fd`."""
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": started, "argv": sys.argv}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(mine).encode(), 0)


def _pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return isinstance(pid, int)  # a process of another user holds that PID
    return True


def _same_file(fd: int, path: Path) -> bool:
    """`path` names the file (or directory) open as `fd`."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev)


def _flock_pid(fd: int) -> int | None:
    """The PID holding an flock on the file open as `fd`, from /proc/locks (Linux; None when it cannot be told)."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key and fields[4].isdigit():
                return int(fields[4])
    except OSError:
        pass
    return None


def _lock_directory(directory: Path) -> tuple[int, bool]:
    """(descriptor of `directory`, whether it is flocked now); RunError naming the holder when another process
    holds it. A file system whose directories cannot be flocked (NFS) gives (descriptor, False)."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return dfd, True
    except BlockingIOError:
        path = directory / LOCK_NAME
        info: dict = {}
        for _ in range(2):  # the holder writes a removed lock file again at its next write: give it a moment
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                info = _read_info(fd)
                os.close(fd)
            except OSError:
                pass
            if info:
                break
            time.sleep(0.2)
        pid = _flock_pid(dfd)
        os.close(dfd)
        if info and (pid is None or info.get("pid") == pid):
            holder = f"{_holder_text(info)} holds {path}"
        else:  # the lock file is gone (or is not the holder's): the kernel's lock table names the holder
            holder = (f"PID {pid if pid is not None else '?'} on host {socket.gethostname()} holds {directory} "
                      f"(its lock file {LOCK_NAME} was removed or replaced)")
        raise RunError(f"output_dir {directory} is in use by another run: {holder}; wait for it to finish (or stop "
                       f"it), or choose another output_dir") from None
    except OSError:  # no flock on directories here: the lock file alone decides
        return dfd, False
    except BaseException:
        os.close(dfd)
        raise


class RunLock:
    """The lock of one run directory (see the module docstring). `acquire` raises RunError naming the holder;
    `check` (before every write into the directory) raises RunError when another run has taken it."""

    def __init__(self, directory: Path, fd: int, owner: object, flocked: bool, note: str | None, dir_fd: int = -1,
                 dir_flocked: bool = False):
        self.directory, self.path, self.fd = directory, directory / LOCK_NAME, fd
        self.flocked, self.note = flocked, note
        self.dir_fd, self.dir_flocked = dir_fd, dir_flocked
        self._take(owner)

    def _take(self, owner: object) -> None:
        """`owner` holds the lock now; when it is garbage-collected without releasing it (a Run dropped without
        `close()`), the lock goes with it, as a file object's descriptor does."""
        self._owner = weakref.ref(owner)
        weakref.finalize(owner, self._release_if_orphaned)

    @property
    def owner(self) -> object | None:
        return self._owner()

    def _release_if_orphaned(self) -> None:
        if self._owner() is None:
            self._drop()

    @classmethod
    def acquire(cls, directory: str | Path, owner: object) -> "RunLock":
        directory = Path(directory)
        key = str(directory.resolve())
        held = _HELD.get(key)
        if held is not None and held.fd >= 0:  # this process already holds it: the newer run takes it over
            held._take(owner)
            held.note = None
            return held
        path = directory / LOCK_NAME
        dir_fd, dir_flocked = _lock_directory(directory)
        try:
            for _ in range(20):  # the holder may be removing the file as we open it: open again
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                try:
                    lock = cls._lock_fd(directory, path, fd, owner)
                except BaseException:
                    os.close(fd)
                    raise
                if lock is not None:
                    lock.dir_fd, lock.dir_flocked = dir_fd, dir_flocked
                    _HELD[key] = lock
                    return lock
                os.close(fd)
        except BaseException:
            os.close(dir_fd)
            raise
        os.close(dir_fd)
        raise RunError(f"output_dir {directory}: cannot take the run lock {path} (it keeps being replaced)")

    @classmethod
    def _lock_fd(cls, directory: Path, path: Path, fd: int, owner: object) -> "RunLock | None":
        flocked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _read_info(fd)
            if not info:  # the holder has just created the file: give it a moment to write its name
                time.sleep(0.2)
                info = _read_info(fd)
            raise RunError(f"output_dir {directory} is in use by another run: {_holder_text(info)} holds {path}; "
                           f"wait for it to finish (or stop it), or choose another output_dir") from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            flocked = False  # no locks on this file system: the PID in the file decides
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # locked a file its holder had just removed: try the new one
            return None
        info = _read_info(fd)
        note = None
        if info and info.get("pid") != os.getpid():
            here = info.get("host") == socket.gethostname()
            if not flocked and here and _pid_alive(info.get("pid")):
                raise RunError(f"output_dir {directory} is in use by another run: {_holder_text(info)} holds {path} "
                               f"(no file locks on this file system: checked by PID); wait for it to finish, or "
                               f"choose another output_dir")
            note = (f"took over the run lock of {directory} left by {_holder_text(info)}, which is no longer running"
                    + ("" if flocked or here else " (another host, no file locks: cannot check it; make sure)"))
        _write_info(fd, time.time())
        return cls(directory, fd, owner, flocked, note)

    def check(self) -> None:
        """Before a write into the directory: the run directory and the lock file are still the ones this lock
        holds. A removed (or unlocked, replaced) lock file is written again and locked; a lock file that another
        process has locked since, or a directory removed or replaced, raises RunError: this run stops before it
        writes into another run's directory."""
        if self.fd < 0:
            return
        if self.dir_fd >= 0 and not _same_file(self.dir_fd, self.directory):
            raise RunError(f"output_dir {self.directory} was removed or replaced while this run (PID {os.getpid()}) "
                           f"wrote into it; it stops here so that it writes nothing into another directory of that "
                           f"name")
        if _same_file(self.fd, self.path):
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise RunError(f"output_dir {self.directory}: its run lock {self.path} was removed while this run held "
                           f"it and cannot be written again ({exc})") from None
        try:
            if self.flocked:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _read_info(fd)
            os.close(fd)
            raise RunError(f"output_dir {self.directory}: its run lock {self.path} was replaced while this run (PID "
                           f"{os.getpid()}) held it, and {_holder_text(info)} holds it now; this run stops so that two "
                           f"runs never write into one directory (the rows and checkpoints it wrote are in "
                           f"{self.directory}, unless the other run has discarded them)") from None
        except BaseException:
            os.close(fd)
            raise
        started = _read_info(self.fd).get("started", time.time())
        _write_info(fd, started)
        os.close(self.fd)
        self.fd = fd
        print(f"[mmrl] the run lock file {self.path} was removed while this run held it; written again",
              file=sys.stderr, flush=True)

    def release(self, owner: object) -> None:
        """Remove the lock file and drop the lock, if `owner` (the Run that took it) still holds it."""
        if owner is self.owner:
            self._drop()

    def _drop(self) -> None:
        if self.fd < 0:
            return
        try:
            if os.fstat(self.fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)  # while still locked: nobody can lock this file afterwards
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1
        if self.dir_fd >= 0:  # last: a start waiting for the directory finds the lock file gone
            os.close(self.dir_fd)
            self.dir_fd = -1
        _HELD.pop(str(self.directory.resolve()), None)


class StartRecord:
    """What a run's start added to its directory, so that a run failing before it wrote anything (a metrics row, a
    checkpoint, a sample grid) leaves nothing behind. `paths` (the run directory first) are recorded before the run
    creates them."""

    def __init__(self, paths: list[Path], config: Path):
        self.created = [p for p in paths if not p.exists()]
        self.config, self.config_before = config, config.read_text() if config.is_file() else None
        self.wrote = False

    def note(self, *paths: Path) -> None:
        """`paths` are about to be created by the run's start (tracker folders): undo them too if it fails."""
        self.created += [p for p in paths if not p.exists() and p not in self.created]

    def undo(self, run_dir: Path) -> None:
        """A run directory this start created goes as a whole (nobody else could write into it: the run held its
        lock); in a directory that existed, the files and folders the start created go (folders only when empty,
        tracker folders with what the trackers wrote at start) and a config.yaml it replaced is restored."""
        if run_dir in self.created:
            shutil.rmtree(run_dir, ignore_errors=True)
            return
        if self.config_before is None:
            self.config.unlink(missing_ok=True)
        elif self.config.is_file() and self.config.read_text() != self.config_before:
            self.config.write_text(self.config_before)
        for p in reversed(self.created):
            try:
                if p.is_dir() and p.name in ("tensorboard", "wandb"):
                    shutil.rmtree(p)
                elif p.is_dir():
                    p.rmdir()  # only when empty: never anything a user put there
                else:
                    p.unlink(missing_ok=True)
            except OSError:
                pass
