"""flow_grpo with its rollouts in a rollout process (`rollout.worker: process`; mmrl.training.async_rollout): with
`max_staleness: 0` the metrics equal the synchronous run's exactly (the rollout noise and the trainer's shuffles come
from one random stream, as in the synchronous loop); with `max_staleness: 1`, pi_old recomputed and TIS between
pi_old and the stale rollout (decoupled PPO), batch t is generated with the weights after update t-2 and a run
stopped at a checkpoint resumes exactly (the in-flight batch is saved)."""

from __future__ import annotations

import pytest

from mmrl.diffusion.flow_grpo import train
from mmrl.testing import RESUMED_RUN, assert_overlap_metrics, assert_same_path, metrics_rows, without_time

from .test_flow_grpo import _cfg

ASYNC_KEYS = ("rollout/staleness/", "rollout/policy_version")
SAME_ROLLOUT = ("the rollout process runs the synchronous loop's rollout code with the same weights, random state and "
                "thread count; only the OS process differs")
COMMON = dict(algo={"kl": {"coef": 0.02}, "ema": True}, update={"epochs": 2}, rollout={"guidance_scale": 2.0},
              reward={"history": 4})


def _rows(out, drop=("time/",)):
    return [{k: v for k, v in without_time(r).items() if not k.startswith(drop)} for r in metrics_rows(out)]


@pytest.mark.slow
def test_max_staleness_zero_equals_the_synchronous_run(tmp_path, tiny_sd3_path, check_metric_names):
    train(_cfg(tmp_path / "sync", tiny_sd3_path, ["train.max_steps=3"], **COMMON))
    train(_cfg(tmp_path / "async", tiny_sd3_path, ["train.max_steps=3", "rollout.worker=process"], **COMMON))
    sync, rows = _rows(tmp_path / "sync"), _rows(tmp_path / "async")
    assert_same_path([{k: v for k, v in r.items() if not k.startswith(ASYNC_KEYS)} for r in rows], sync,
                     why=SAME_ROLLOUT)
    assert [r["rollout/policy_version"] for r in rows] == [0.0, 1.0, 2.0]
    assert all(r["policy/grad_norm"] > 0 for r in sync)
    check_metric_names(metrics_rows(tmp_path / "async"))


@pytest.mark.slow
def test_stale_batches_with_decoupled_ppo_resume_exactly(tmp_path, tiny_sd3_path):
    opts = ["rollout.worker=process", "rollout.max_staleness=1", "algo.old_logprobs=recompute",
            "algo.rollout_correction.is_level=token", "train.save_every=2", "optim.lr=1e-2"]
    summary = train(_cfg(tmp_path / "full", tiny_sd3_path, ["train.max_steps=4", *opts], **COMMON))
    assert_overlap_metrics(metrics_rows(tmp_path / "full"), summary, max_staleness=1)
    train(_cfg(tmp_path / "part", tiny_sd3_path, ["train.max_steps=2", *opts], **COMMON))
    train(_cfg(tmp_path / "part", tiny_sd3_path, ["train.max_steps=4", *opts], **COMMON))  # resumes from step_2
    full, part = _rows(tmp_path / "full", ("time/", "eval/")), _rows(tmp_path / "part", ("time/", "eval/"))
    assert [r["step"] for r in part] == [1, 2, 3, 4]
    assert_same_path(part, full, why=RESUMED_RUN + "; the in-flight batch comes from the checkpoint")
    assert [r["rollout/staleness/max"] for r in full] == [0.0, 1.0, 1.0, 1.0]
    assert [r["rollout/policy_version"] for r in full] == [0.0, 0.0, 1.0, 2.0]
    # TIS weights pi_old / pi_rollout: 1 on the fresh first batch, away from 1 on the stale ones
    dev = [abs(r["rollout/correction/rollout_is_mean"] - 1.0) for r in full]
    assert dev[0] < 1e-6 and min(dev[1:]) > 10 * max(dev[0], 1e-7), dev
