"""vlm_grpo with a rollout rank apart from the trainer rank in one torch.distributed world (`rollout.worker: ranks`,
`dist.rollout_ranks: 1`; mmrl.training.rank_rollout), on 2 CPU ranks over gloo: max_staleness 0 equals the
synchronous one-process run; max_staleness 1 stopped at a checkpoint and extended equals the uninterrupted run (the
in-flight batch comes from the checkpoint); a kill -9 of either rank ends the other within seconds with one line,
the last complete checkpoint intact. Unsupported combinations are refused in one line."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmrl.config import load_config
from mmrl.run.files import list_checkpoints, verify_checkpoint
from mmrl.testing import (RESUMED_RUN, _free_port, assert_same_path, child_env, metrics_rows, process_ended,
                          run_torchrun, without_time)

ROOT = Path(__file__).resolve().parents[2]
ASYNC_KEYS = ("rollout/staleness/", "rollout/policy_version")
RANKS = ["rollout.worker=ranks", "dist.rollout_ranks=1"]


def _args(model: Path) -> list[str]:
    return [str(ROOT / "configs/vlm/grpo_tiny_shapes.yaml"), f"model.path={model}", "warm_start.steps=10",
            "rollout.prompts_per_step=2", "rollout.group_size=4", "log.eval_every=0", "log.sample_every=0",
            "algo.entropy_coef=0.01"]  # (a gradient even when a group's rewards tie: the weights move every step)


def _rows(out, drop=("time/",)):
    return [{k: v for k, v in without_time(r).items() if not k.startswith(drop)} for r in metrics_rows(out)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from mmrl.tiny import build_tiny_qwen2_vl

    # built once before the ranks start: both ranks load it (neither builds it while the other reads)
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "qwen2_vl", seed=0)


def _torchrun(model, out, *extra):
    proc = run_torchrun(["-m", "mmrl.cli", "train", *_args(model), f"output_dir={out}", *RANKS, *extra], cwd=ROOT,
                        timeout=600)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.mark.slow
def test_max_staleness_zero_on_a_rollout_rank_equals_the_synchronous_run(model, tmp_path):
    sync = subprocess.run([sys.executable, "-m", "mmrl.cli", "train", *_args(model), "train.max_steps=3",
                           f"output_dir={tmp_path / 'sync'}"], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=600)
    assert sync.returncode == 0, sync.stderr[-3000:]
    _torchrun(model, tmp_path / "ranks", "train.max_steps=3")
    sync_rows, rows = _rows(tmp_path / "sync"), _rows(tmp_path / "ranks")
    assert_same_path([{k: v for k, v in r.items() if not k.startswith(ASYNC_KEYS)} for r in rows], sync_rows,
                     why="the rollout rank runs the synchronous loop's rollout code with the same weights (sent "
                         "over gloo), random state and thread count; only the process differs")
    assert any(r["policy/grad_norm"] > 0 for r in sync_rows)  # the weights moved: versions differ
    assert [r["rollout/policy_version"] for r in rows] == [0.0, 1.0, 2.0]


@pytest.mark.slow
def test_stale_batches_on_a_rollout_rank_resume_exactly(model, tmp_path):
    opts = ("rollout.max_staleness=1", "train.save_every=2")
    _torchrun(model, tmp_path / "full", "train.max_steps=4", *opts)
    _torchrun(model, tmp_path / "part", "train.max_steps=2", *opts)
    _torchrun(model, tmp_path / "part", "train.max_steps=4", *opts)  # resume=auto from step_2
    drop = ("time/", "eval/", "perf/")  # (the interrupted run evaluates at its last step: FLOPs and eval differ)
    full, part = _rows(tmp_path / "full", drop), _rows(tmp_path / "part", drop)
    assert [r["step"] for r in part] == [1, 2, 3, 4]
    assert_same_path(part, full, why=RESUMED_RUN + "; the in-flight batch comes from the checkpoint")
    assert [r["rollout/policy_version"] for r in full] == [0.0, 0.0, 1.0, 2.0]


def _rank(rank: int, port: int, args: list[str], err: Path) -> subprocess.Popen:
    env = child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port))
    with open(err, "w") as stderr:
        return subprocess.Popen([sys.executable, "-m", "mmrl.cli", "train", *args], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=stderr)


def _past_a_checkpoint(out: Path) -> bool:
    try:
        return bool(list_checkpoints(out / "checkpoints")) and len(metrics_rows(out)) >= 3
    except (FileNotFoundError, ValueError):  # (a row being written)
        return False


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_kill_9_of_either_rank_ends_the_other_within_seconds(model, tmp_path, victim):
    """The ranks started as torchrun starts them (its environment), so that each one's own end is seen (torchrun
    itself would also stop the survivor)."""
    out, port = tmp_path / "run", _free_port()
    args = [*_args(model), *RANKS, "rollout.max_staleness=1", "train.max_steps=1000", "train.save_every=2",
            f"output_dir={out}"]
    errs = [tmp_path / "rank0.txt", tmp_path / "rank1.txt"]
    procs = [_rank(r, port, args, errs[r]) for r in (0, 1)]
    try:
        end = time.time() + 300
        while not _past_a_checkpoint(out) and all(p.poll() is None for p in procs) and time.time() < end:
            time.sleep(0.1)
        assert all(p.poll() is None for p in procs), errs[0].read_text()[-3000:] + errs[1].read_text()[-3000:]
        t0 = time.time()
        procs[victim].kill()
        survivor = procs[1 - victim]
        survivor.wait(timeout=60)
        took = time.time() - t0
    finally:
        for p in procs:
            if not process_ended(p.pid):
                p.kill()
            p.wait()
    text = errs[1 - victim].read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("mmrl: ")]
    ckpts = list_checkpoints(out / "checkpoints")
    verify_checkpoint(ckpts[-1][1])  # the last complete checkpoint is whole
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    if victim == 1:
        assert survivor.returncode == 2
        assert re.fullmatch(
            r"mmrl: error: rollout rank 1 of the torchrun world is gone \(connection (closed|reset) by peer\) while the "
            rf"trainer waited for .*; nothing of the failed step was saved; rerun the same command to resume from "
            rf"step {ckpts[-1][0]} \({re.escape(str(ckpts[-1][1]))}\)  \(MMRL_DEBUG=1 shows the traceback\)",
            lines[0]), lines[0]
    else:
        assert survivor.returncode == 1
        assert re.fullmatch(r"mmrl: rollout rank 1: its trainer rank 0 is gone \(connection (closed|reset) by peer\); "
                            r"exiting", lines[0]), lines[0]
    assert took < 10, f"{took:.1f} s"


@pytest.mark.parametrize("overrides, world, match", [
    (["rollout.worker=ranks"], 2, r"rollout.worker=ranks needs dist.rollout_ranks=1"),
    (["dist.rollout_ranks=1"], 2, r"dist.rollout_ranks=1 needs rollout.worker=ranks, got rollout.worker=inline"),
    (RANKS, 3, r"dist.rollout_ranks=1 with 3 launched process\(es\): supported is 1 rollout rank beside 1 trainer"),
    (["rollout.worker=ranks", "dist.rollout_ranks=2"], 3, r"dist.rollout_ranks=2 with 3 launched process\(es\)"),
    ([*RANKS, "rollout.engine=vllm"], 2, r"rollout.worker=ranks with rollout.engine=vllm is not supported"),
])
def test_unsupported_rank_settings_are_refused_in_one_line(overrides, world, match):
    from mmrl.training.rank_rollout import check_rollout_ranks

    cfg = load_config(str(ROOT / "configs/vlm/grpo_tiny_shapes.yaml"), overrides)
    with pytest.raises(ValueError, match=match):
        check_rollout_ranks(cfg, world=world)


def test_rollout_ranks_is_checked_when_the_config_loads():
    with pytest.raises(ValueError, match=r"dist.rollout_ranks: expected >= 0 \(0 = every rank trains\), got -1"):
        load_config(str(ROOT / "configs/vlm/grpo_tiny_shapes.yaml"), ["dist.rollout_ranks=-1"])
    load_config(str(ROOT / "configs/vlm/grpo_tiny_shapes.yaml"), [*RANKS, "rollout.max_staleness=2"])  # accepted
