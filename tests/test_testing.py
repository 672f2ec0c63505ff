"""mmrl.testing: torchrun launches are retried once only when a rank died from a fatal signal (real 2-process runs)."""

import textwrap
from pathlib import Path

import pytest

from mmrl.testing import child_env, metrics_rows, run_torchrun, signal_death

pytestmark = pytest.mark.slow

# aborts (SIGABRT) on rank 0 the first time it runs in a directory, succeeds the second time
ABORT_ONCE = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    mark = Path(sys.argv[1]) / f"seen_{os.environ['RANK']}"
    first = not mark.exists()
    mark.touch()
    if first and os.environ["RANK"] == "0":
        os.abort()
    print("ok", os.environ["RANK"])
""")


def test_signal_death_reads_torchrun_report():
    report = "rank      : 0 (local_rank: 0)\n  exitcode  : -6 (pid: 17647)\n  exitcode  : -15 (pid: 17648)"
    assert signal_death(report) == 6
    assert signal_death("  exitcode  : -15 (pid: 1)") is None  # SIGTERM: torchrun stopping the other ranks
    assert signal_death("  exitcode  : 1 (pid: 1)") is None


def test_run_torchrun_retries_an_abort_once(tmp_path):
    script = tmp_path / "abort_once.py"
    script.write_text(ABORT_ONCE)
    with pytest.warns(RuntimeWarning, match="died from signal 6") as caught:
        proc = run_torchrun([str(script), str(tmp_path)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = Path(str(caught[0].message).split("Full output: ", 1)[1].split("\n", 1)[0])
    assert "Fatal Python error: Aborted" in log.read_text()  # the first attempt's output, with Python's stack
    log.unlink()
    assert sorted(p.name for p in tmp_path.glob("seen_*")) == ["seen_0", "seen_1"]
    # retries=0: the abort is reported, not hidden
    for p in tmp_path.glob("seen_*"):
        p.unlink()
    proc = run_torchrun([str(script), str(tmp_path)], timeout=120, retries=0)
    assert proc.returncode != 0 and signal_death(proc.stderr) == 6


def test_run_torchrun_does_not_retry_an_ordinary_failure(tmp_path, recwarn):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nopen(sys.argv[1] + '/runs_' + os.environ['RANK'], 'a').write('x')\nsys.exit(3)\n")
    proc = run_torchrun([str(script), str(tmp_path)], timeout=120)
    assert proc.returncode != 0
    assert (tmp_path / "runs_0").read_text() == "x"  # ran once
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_child_env_and_metrics_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    env = child_env(FOO="1")
    assert "WORLD_SIZE" not in env and env["FOO"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["PYTHONFAULTHANDLER"] == "1" and env["OMP_NUM_THREADS"] == "1"
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n\n{"step": 2}\n')
    assert [r["step"] for r in metrics_rows(tmp_path)] == [1, 2]


def test_exit_launched_process(tmp_path, monkeypatch):
    """Under a launcher the process ends at once with the given code (its output flushed); outside one it returns."""
    from mmrl.distributed import exit_launched_process

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert exit_launched_process(0) is None  # not launched: nothing happens
    script = tmp_path / "exit_code.py"
    script.write_text("import os, sys\nfrom mmrl.distributed import exit_launched_process\n"
                      "print('rank', os.environ['RANK'], 'done')\nexit_launched_process(int(sys.argv[1]))\n"
                      "print('not reached')\n")
    ok = run_torchrun([str(script), "0"], timeout=120)
    assert ok.returncode == 0 and ok.stdout.count("done") == 2 and "not reached" not in ok.stdout
    bad = run_torchrun([str(script), "3"], timeout=120)
    assert bad.returncode != 0 and "exitcode  : 3" in bad.stderr and signal_death(bad.stderr) is None
