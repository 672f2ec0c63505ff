"""One run per directory (`mmrl.run.lock`): real processes competing for a run directory, a lock file left by a
dead process, the lock released however a run ends, several processes of one run, and file systems without locks."""

import errno
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmrl.config import RunConfig, TrainConfig
from mmrl.run.directory import Run
from mmrl.run.files import RunError, list_checkpoints
from mmrl.run.lock import LOCK_NAME, RunLock
from mmrl.run.start import closes_runs
from mmrl.testing import child_env, metrics_rows, run_torchrun

ROOT = Path(__file__).resolve().parents[1]
FLOW = ROOT / "configs" / "diffusion" / "flow_grpo_tiny.yaml"
TINY = [f"model.path={ROOT / 'assets' / 'tiny_sd3_shapes'}",
        f"data.train_prompts={ROOT / 'assets' / 'prompts' / 'shapes_train.txt'}",
        f"data.eval_prompts={ROOT / 'assets' / 'prompts' / 'shapes_eval.txt'}",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "log.eval_every=0", "log.sample_every=0"]


def _mmrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "mmrl.cli", *args]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _wait_for(predicate, timeout: float = 120.0, what: str = "") -> None:
    end = time.time() + timeout
    while not predicate():
        if time.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.slow
def test_two_trainings_in_one_directory(tmp_path):
    """A second `mmrl train` started while the first runs exits with one line naming the holder's PID and host, and
    so does `train.resume=never train.overwrite=true`, even with the first run's lock file deleted: nothing of the
    running run is touched. After a `kill -9` of
    the first, the lock file it leaves is taken over with a note and the run resumes from its newest checkpoint;
    metrics.jsonl holds every step once."""
    out = tmp_path / "run"
    first = subprocess.Popen(_mmrl("train", str(FLOW), f"output_dir={out}", *TINY, "train.max_steps=1000",
                                   "train.save_every=1", "train.keep_last=0"),
                             cwd=tmp_path, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        _wait_for(lambda: len(list_checkpoints(out / "checkpoints")) >= 2, what="the first run's checkpoints")
        (out / LOCK_NAME).unlink()  # the directory's own lock stays; the first run writes the file again
        seconds = [subprocess.Popen(_mmrl("train", str(FLOW), f"output_dir={out}", *TINY, *extra), cwd=tmp_path,
                                    env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for extra in ([], ["train.resume=never", "train.overwrite=true"])]
        for second in seconds:
            _, stderr = second.communicate(timeout=240)
            err = [ln for ln in stderr.splitlines() if ln.startswith("mmrl: ")]
            assert second.returncode == 2 and len(err) == 1, stderr[-2000:]
            assert (f"output_dir {out} is in use by another run: PID {first.pid} on host {socket.gethostname()}"
                    in err[0]), err
            assert "Traceback" not in stderr
            assert first.poll() is None  # still training
        assert len(list_checkpoints(out / "checkpoints")) >= 2  # the refused overwrite discarded nothing
    finally:
        first.send_signal(signal.SIGKILL)  # no clean-up: the lock file stays, the flock goes with the process
        first.wait()
    assert (out / LOCK_NAME).is_file() and json.loads((out / LOCK_NAME).read_text())["pid"] == first.pid
    last = list_checkpoints(out / "checkpoints")[-1][0]
    third = subprocess.run(_mmrl("train", str(FLOW), f"output_dir={out}", *TINY, f"train.max_steps={last + 1}",
                                 "train.save_every=1", "train.keep_last=0"),
                           cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"took over the run lock of {out} left by PID {first.pid} on host {socket.gethostname()}" in third.stderr
    assert "which is no longer running" in third.stderr
    steps = [r["step"] for r in metrics_rows(out)]
    assert steps == list(range(1, last + 2))  # each step once: nothing logged twice
    assert not (out / LOCK_NAME).exists()  # released at the end


def _cfg(tmp_path, **train) -> RunConfig:
    return RunConfig(algorithm="toy", output_dir=str(tmp_path / "run"), train=TrainConfig(**train))


_HOLD = """
import sys, time
from mmrl.config import RunConfig, TrainConfig
from mmrl.run.directory import Run
run = Run(RunConfig(algorithm="toy", output_dir=sys.argv[1], train=TrainConfig()))
print("holding", flush=True)
time.sleep(120)
"""


def _holder(out: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], env=child_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


def test_a_run_of_another_process_is_refused_and_a_dead_ones_lock_taken_over(tmp_path, capsys):
    holder = _holder(tmp_path / "run")
    try:
        with pytest.raises(RunError, match=rf"is in use by another run: PID {holder.pid} on host "
                                           rf"{socket.gethostname()} .*holds .*{LOCK_NAME}; wait for it to finish"):
            Run(_cfg(tmp_path))
        # train.overwrite while another process holds the directory: refused before anything is discarded
        with pytest.raises(RunError, match="is in use by another run"):
            Run(_cfg(tmp_path, resume="never", overwrite=True))
    finally:
        holder.kill()
        holder.wait()
    # what a dead holder leaves: a lock file naming a PID that no longer runs
    dead = _dead_pid()
    info = {"pid": dead, "host": socket.gethostname(), "started": time.time() - 60, "argv": ["mmrl", "train", "x"]}
    (tmp_path / "run" / LOCK_NAME).write_text(json.dumps(info))
    capsys.readouterr()
    run = Run(_cfg(tmp_path))
    err = capsys.readouterr().err
    assert f"took over the run lock of {run.dir} left by PID {dead} on host {socket.gethostname()}" in err
    assert json.loads((run.dir / LOCK_NAME).read_text())["pid"] == os.getpid()
    run.finish()
    assert not (run.dir / LOCK_NAME).exists()


_WRITER = """
import sys, time
from mmrl.config import RunConfig, TrainConfig
from mmrl.run.directory import Run
run = Run(RunConfig(algorithm="toy", output_dir=sys.argv[1], train=TrainConfig()))
print("holding", flush=True)
for step in range(1, 100000):
    run.log(step, {"reward/mean": 0.5})
    time.sleep(0.02)
"""


def _steps(out: Path) -> list[int]:
    """The steps of the complete rows of a live run's metrics.jsonl."""
    path = out / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.is_file() else []  # (not a line being written)
    return [json.loads(line)["step"] for line in lines]


def test_a_deleted_lock_file_lets_no_second_run_in(tmp_path):
    """Deleting `.mmrl.lock` of a live run (its flock went with the file's name) let the next start lock a new file
    and rewrite the live run's metrics.jsonl. The run directory's own lock refuses it, naming the holder: from the
    kernel's lock table while the file is gone, from the file once the holder has written it again (at its next
    write, which it makes after saying so). The live run's rows stay, each step once."""
    out = tmp_path / "run"
    idle = _holder(out)  # writes nothing: its lock file stays gone
    try:
        (out / LOCK_NAME).unlink()
        with pytest.raises(RunError, match=rf"^output_dir {out} is in use by another run: PID {idle.pid} on host "
                                           rf"{socket.gethostname()} holds {out} \(its lock file {LOCK_NAME} was "
                                           rf"removed or replaced\); wait for it to finish"):
            Run(_cfg(tmp_path))
    finally:
        idle.kill()
        idle.wait()
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(out)], env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "holding"
        _wait_for(lambda: len(_steps(out)) >= 5, timeout=60, what="the first rows")
        (out / LOCK_NAME).unlink()
        for extra in ({}, {"resume": "never", "overwrite": True}):
            with pytest.raises(RunError, match=rf"is in use by another run: PID {writer.pid} on host "):
                Run(_cfg(tmp_path, **extra))
        _wait_for(lambda: (out / LOCK_NAME).is_file() and json.loads((out / LOCK_NAME).read_text() or "{}").get("pid")
                  == writer.pid, timeout=10, what="the lock file written again")
        with pytest.raises(RunError, match=rf"is in use by another run: PID {writer.pid} on host .*\(started "):
            Run(_cfg(tmp_path))
        rows = len(_steps(out))
        _wait_for(lambda: len(_steps(out)) > rows + 5, timeout=60, what="more rows")
    finally:
        writer.kill()
        _, err = writer.communicate()
    assert f"[mmrl] the run lock file {out / LOCK_NAME} was removed while this run held it; written again" in err
    steps = _steps(out)
    assert steps == list(range(1, len(steps) + 1))


def test_a_run_whose_lock_was_taken_stops_before_its_next_write(tmp_path, monkeypatch):
    """Where directories cannot be flocked (NFS), the lock file alone holds the directory: before every write a run
    checks it. A removed lock file is written again (and locked); one that another run has locked since, or a run
    directory replaced, stops the run with one line before it writes."""
    import fcntl
    import stat

    flock = fcntl.flock

    def no_directory_locks(fd, op):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", no_directory_locks)
    run = Run(_cfg(tmp_path))
    lock = run.dir / LOCK_NAME
    try:
        lock.unlink()
        run.log(1, {"reward/mean": 0.5})
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        refused = subprocess.run([sys.executable, "-c", _HOLD, str(run.dir)], env=child_env(), capture_output=True,
                                 text=True, timeout=60)  # (the child's directory flock works: the file refuses it)
        assert refused.returncode == 1 and f"is in use by another run: PID {os.getpid()}" in refused.stderr
        lock.unlink()
        holder = _holder(run.dir)  # a second start that found no lock file: it took a new one
        try:
            with pytest.raises(RunError, match=rf"^output_dir {run.dir}: its run lock {lock} was replaced while this "
                                               rf"run \(PID {os.getpid()}\) held it, and PID {holder.pid} on host "
                                               rf".* holds it now; this run stops so that two runs never write into "
                                               rf"one directory"):
                run.log(2, {"reward/mean": 0.5})
        finally:
            holder.kill()
            holder.wait()
        assert [r["step"] for r in run.read_metrics()] == [1]
    finally:
        run.close()
    run = Run(_cfg(tmp_path))
    try:
        run.dir.rename(tmp_path / "moved")
        run.dir.mkdir()
        with pytest.raises(RunError, match=rf"^output_dir {run.dir} was removed or replaced while this run \(PID "):
            run.log(1, {"reward/mean": 0.5})
        assert list(run.dir.iterdir()) == []
    finally:
        run.close()


def _lock_fds(under: Path) -> list[str]:
    """Open file descriptors of this process on a run lock file under `under`."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if LOCK_NAME in target and target.startswith(str(under)):
            fds.append(target)
    return fds


def test_the_lock_is_released_however_train_ends(tmp_path):
    """A recipe's train() (decorated with `closes_runs`) that fails after it wrote a step, or is interrupted by
    Ctrl-C, releases the lock: its file is gone and this process holds no descriptor of it."""

    @closes_runs
    def train(cfg):
        run = Run(cfg)
        assert (run.dir / LOCK_NAME).is_file() and _lock_fds(run.dir)
        run.log(1, {"reward/mean": 1.0})
        raise cfg.failure

    for failure in (ValueError("a reward failed"), KeyboardInterrupt()):
        cfg = _cfg(tmp_path, resume="never", overwrite=True)
        cfg.failure = failure
        with pytest.raises(type(failure)):
            train(cfg)
        assert not (tmp_path / "run" / LOCK_NAME).exists() and _lock_fds(tmp_path) == []
        assert [r["step"] for r in Run(_cfg(tmp_path)).read_metrics()] == [1]  # kept: the run had written a step


def test_a_newer_run_of_the_same_process_takes_the_lock_over(tmp_path):
    first = Run(_cfg(tmp_path))
    second = Run(_cfg(tmp_path))  # e.g. train() again in one Python session after the first failed
    assert second.lock is first.lock and second.lock.owner is second
    first.close()  # the older run no longer owns it: nothing is released
    assert (second.dir / LOCK_NAME).is_file()
    second.close()
    assert not (second.dir / LOCK_NAME).exists()
    # a Run dropped without close() releases its lock when it is garbage-collected, like a file object
    third = Run(_cfg(tmp_path))
    assert (third.dir / LOCK_NAME).is_file() and _lock_fds(tmp_path)
    del third
    gc.collect()
    assert not (tmp_path / "run" / LOCK_NAME).exists() and _lock_fds(tmp_path) == []


class _Owner:
    """Something that holds a lock (a Run, in the library)."""


def test_file_systems_without_locks_fall_back_to_the_pid(tmp_path, monkeypatch):
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        info = {"pid": sleeper.pid, "host": socket.gethostname(), "started": time.time(), "argv": ["mmrl"]}
        (run_dir / LOCK_NAME).write_text(json.dumps(info))
        with pytest.raises(RunError, match=rf"PID {sleeper.pid} .*no file locks on this file system: checked by PID"):
            RunLock.acquire(run_dir, owner=_Owner())
    finally:
        sleeper.kill()
        sleeper.wait()
    owner = _Owner()
    lock = RunLock.acquire(run_dir, owner=owner)  # that PID is gone now: a stale lock
    assert not lock.flocked and f"left by PID {sleeper.pid}" in lock.note
    lock.release(owner)
    assert not (run_dir / LOCK_NAME).exists()


@pytest.mark.slow
def test_several_processes_of_a_refused_run_all_stop(tmp_path):
    """Under torchrun only rank 0 takes the lock; when it is refused, every rank exits with the error at once (no
    rank waits at a collective for a rank 0 that gave up)."""
    holder = _holder(tmp_path / "run")
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    try:
        t0 = time.time()
        proc = run_torchrun(["-m", "mmrl.cli", "train", str(FLOW), f"output_dir={tmp_path / 'run'}", *TINY,
                             "dist.strategy=ddp", "dist.backend=gloo"], nproc=2, cwd=tmp_path, timeout=240)
        took = time.time() - t0
    finally:
        holder.kill()
        holder.wait()
    # each rank's error, wherever it starts: two processes share one stderr pipe, and a line of one rank (a warning,
    # torchrun's log) can be cut by the other's, which is the pipe's doing, not the run's
    lines = re.findall(r"mmrl: error: [^\n]*?(?=mmrl: error: |\n|$)", proc.stderr)
    assert proc.returncode != 0 and len(lines) == 2, proc.stderr[-3000:]
    assert any(f"is in use by another run: PID {holder.pid}" in ln and "rank 0" not in ln for ln in lines)
    assert any(ln.startswith(f"mmrl: error: rank 0 could not start the run: output_dir") for ln in lines)
    assert took < 200  # the process-group timeout (30 min) was never reached
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before  # the refused run wrote nothing
