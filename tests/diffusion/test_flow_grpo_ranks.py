"""flow_grpo with a rollout rank apart from the trainer rank (`rollout.worker: ranks`, `dist.rollout_ranks: 1`;
mmrl.training.rank_rollout), on 2 CPU ranks over gloo: max_staleness 0 equals the synchronous one-process run;
max_staleness 1 stopped at a checkpoint and extended equals the uninterrupted run (the in-flight batch comes from the
checkpoint). (Kill -9 of either rank: tests/vlm/test_grpo_ranks.py, the same channel.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mmrl.testing import RESUMED_RUN, assert_same_path, child_env, metrics_rows, run_torchrun, without_time

ROOT = Path(__file__).resolve().parents[2]
ASYNC_KEYS = ("rollout/staleness/", "rollout/policy_version")
ARGS = [str(ROOT / "configs/diffusion/flow_grpo_tiny.yaml"), f"model.path={ROOT / 'assets' / 'tiny_sd3_shapes'}",
        f"data.train_prompts={ROOT / 'assets' / 'prompts' / 'shapes_train.txt'}",
        f"data.eval_prompts={ROOT / 'assets' / 'prompts' / 'shapes_eval.txt'}", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "rollout.num_steps=4", "log.eval_every=0", "log.sample_every=0"]
RANKS = ["rollout.worker=ranks", "dist.rollout_ranks=1"]


def _rows(out, drop=("time/",)):
    return [{k: v for k, v in without_time(r).items() if not k.startswith(drop)} for r in metrics_rows(out)]


def _torchrun(out, *extra):
    proc = run_torchrun(["-m", "mmrl.cli", "train", *ARGS, f"output_dir={out}", *RANKS, *extra], cwd=ROOT,
                        timeout=600)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.mark.slow
def test_max_staleness_zero_on_a_rollout_rank_equals_the_synchronous_run(tmp_path):
    sync = subprocess.run([sys.executable, "-m", "mmrl.cli", "train", *ARGS, "train.max_steps=2",
                           f"output_dir={tmp_path / 'sync'}"], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=600)
    assert sync.returncode == 0, sync.stderr[-3000:]
    _torchrun(tmp_path / "ranks", "train.max_steps=2")
    sync_rows, rows = _rows(tmp_path / "sync"), _rows(tmp_path / "ranks")
    assert_same_path([{k: v for k, v in r.items() if not k.startswith(ASYNC_KEYS)} for r in rows], sync_rows,
                     why="the rollout rank runs the synchronous loop's rollout code with the same weights (sent "
                         "over gloo), random state and thread count; only the process differs")
    assert all(r["policy/grad_norm"] > 0 for r in sync_rows)  # the weights moved: versions differ
    assert [r["rollout/policy_version"] for r in rows] == [0.0, 1.0]


@pytest.mark.slow
def test_stale_batches_on_a_rollout_rank_resume_exactly(tmp_path):
    opts = ("rollout.max_staleness=1", "train.save_every=2")
    _torchrun(tmp_path / "full", "train.max_steps=3", *opts)
    _torchrun(tmp_path / "part", "train.max_steps=2", *opts)
    _torchrun(tmp_path / "part", "train.max_steps=3", *opts)  # resume=auto from step_2
    drop = ("time/", "eval/", "perf/")  # (the interrupted run evaluates at its last step: FLOPs and eval differ)
    full, part = _rows(tmp_path / "full", drop), _rows(tmp_path / "part", drop)
    assert [r["step"] for r in part] == [1, 2, 3]
    assert_same_path(part, full, why=RESUMED_RUN + "; the in-flight batch comes from the checkpoint")
    assert [r["rollout/policy_version"] for r in full] == [0.0, 0.0, 1.0]
