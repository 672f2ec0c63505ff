"""vlm_grpo with its rollouts in a rollout process (`rollout.worker: process`; mmrl.training.async_rollout): with
`max_staleness: 0` the run's metrics equal the synchronous run's exactly (DAPO rounds and the format warm start
included); with `max_staleness: 2` batch t is generated with the weights after update t-3 (staleness 0, 1, 2, 2, ...),
pi_old is recomputed with TIS weights pi_old / pi_rollout (decoupled PPO), and a run stopped at a checkpoint then
extended resumes exactly (the two in-flight batches are saved in the checkpoint); under torchrun each rank has its
rollout process (bypass: the default with stale batches)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mmrl.config import ConfigError
from mmrl.testing import RESUMED_RUN, assert_overlap_metrics, assert_same_path, metrics_rows, without_time
from mmrl.vlm import grpo

sys.path.insert(0, str(Path(__file__).parent))
from test_grpo import _cfg, tiny_path  # noqa: E402,F401  (the tiny Qwen2-VL fixture)

ASYNC_KEYS = ("rollout/staleness/", "rollout/policy_version")
SAME_ROLLOUT = ("the rollout process runs the synchronous loop's rollout code with the same weights, random state and "
                "thread count; only the OS process differs")
# full fine-tuning after a 10-step format warm start of lm_head (pushed to the rollout process at start): 1 in 4
# answers right, groups differ, updates happen
LEARNS = ("warm_start.steps=10", "log.sample_every=0")


def _rows(out, drop=("time/", "eval/")):
    return [{k: v for k, v in without_time(r).items() if not k.startswith(drop)} for r in metrics_rows(out)]


@pytest.mark.slow
def test_max_staleness_zero_equals_the_synchronous_run(tiny_path, tmp_path):  # noqa: F811
    opts = ("train.max_steps=3", "algo.dynamic_sampling=true", "algo.max_gen_batches=2", *LEARNS)
    grpo.train(_cfg(tiny_path, tmp_path / "sync", *opts))
    summary = grpo.train(_cfg(tiny_path, tmp_path / "async", *opts, "rollout.worker=process",
                              "rollout.max_staleness=0"))
    sync, rows = _rows(tmp_path / "sync", ("time/",)), _rows(tmp_path / "async", ("time/",))
    assert_same_path([{k: v for k, v in r.items() if not k.startswith(ASYNC_KEYS)} for r in rows], sync,
                     why=SAME_ROLLOUT)
    assert [r["rollout/staleness/max"] for r in rows] == [0.0, 0.0, 0.0]
    assert [r["rollout/policy_version"] for r in rows] == [0.0, 1.0, 2.0]
    assert all(r["policy/grad_norm"] > 0 for r in sync)  # the weights moved: versions differ
    assert max(r["rollout/dynamic/rounds"] for r in sync) == 2  # a DAPO round more, in the rollout process
    assert_overlap_metrics(metrics_rows(tmp_path / "async"), summary, max_staleness=0)
    timing = metrics_rows(tmp_path / "async")[-1]
    assert {"time/async/queue_length", "time/async/wait_s", "time/async/weight_push_s", "time/rollout_s",
            "time/reward_s"} <= set(timing)


@pytest.mark.slow
def test_stale_batches_resume_exactly_with_in_flight_batches_saved(tiny_path, tmp_path):  # noqa: F811
    opts = ("train.save_every=2", "rollout.worker=process", "rollout.max_staleness=2", "algo.old_logprobs=recompute",
            "algo.rollout_correction.is_level=token", *LEARNS)
    summary = grpo.train(_cfg(tiny_path, tmp_path / "full", "train.max_steps=5", *opts))
    assert_overlap_metrics(metrics_rows(tmp_path / "full"), summary, max_staleness=2)
    grpo.train(_cfg(tiny_path, tmp_path / "part", "train.max_steps=2", *opts))
    grpo.train(_cfg(tiny_path, tmp_path / "part", "train.max_steps=5", *opts))  # resume=auto from step_2
    # (perf/ too: the interrupted run evaluates at its last step 2, and a step's FLOPs count its evaluation)
    drop = ("time/", "eval/", "perf/")
    full, part = _rows(tmp_path / "full", drop), _rows(tmp_path / "part", drop)
    assert [r["step"] for r in part] == [1, 2, 3, 4, 5]
    assert_same_path(part, full, why=RESUMED_RUN + "; the in-flight batches come from the checkpoint")
    assert [r["rollout/staleness/max"] for r in full] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert [r["rollout/policy_version"] for r in full] == [0.0, 0.0, 0.0, 1.0, 2.0]
    # the recomputed pi_old of a stale batch differs from the rollout's log-probs once the weights have moved: the
    # TIS weights pi_old / pi_rollout move away from 1 (exactly 1 on the fresh first batch)
    assert full[0]["diag/logprob_drift"] < 1e-4 and max(r["diag/logprob_drift"] for r in full[3:]) > 1e-3
    dev = [abs(r["rollout/correction/rollout_is_mean"] - 1.0) for r in full]
    assert dev[0] < 1e-5 and max(dev[3:]) > 1e-3, dev
    with pytest.raises(ConfigError, match=r"rollout.max_staleness: 2 -> 1"):  # the checkpoint holds 2 batches
        grpo.train(_cfg(tiny_path, tmp_path / "part", "train.max_steps=6", *opts, "rollout.max_staleness=1"))


@pytest.mark.slow
def test_torchrun_ddp_each_rank_with_its_rollout_process(tmp_path):
    """`torchrun --nproc_per_node 2 -m mmrl.cli train ... dist.strategy=ddp rollout.worker=process`: every trainer rank
    starts its own rollout process, which generates that rank's share. max_staleness=0 equals the synchronous DDP run;
    with max_staleness=1 the checkpoint holds both ranks' in-flight batches, and a resume on one process is refused
    in one line."""
    from mmrl.run.files import load_state_file
    from mmrl.testing import child_env, run_torchrun

    root = Path(__file__).resolve().parents[2]
    args = ["-m", "mmrl.cli", "train", str(root / "configs/vlm/grpo_tiny_shapes.yaml"),
            f"model.path={tmp_path / 'tiny'}", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "warm_start.steps=20", "warm_start.batch_size=8", "data.eval_size=4", "log.sample_every=0",
            "log.eval_every=0", "train.max_steps=2", "train.save_every=2", "dist.strategy=ddp"]
    env = child_env()
    for name, extra in (("sync", []), ("async0", ["rollout.worker=process"]),
                        ("async1", ["rollout.worker=process", "rollout.max_staleness=1"])):
        proc = run_torchrun([*args, f"output_dir={tmp_path / name}", *extra], cwd=root, env=env, timeout=600)
        assert proc.returncode == 0, f"{name}: torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    sync, rows = _rows(tmp_path / "sync", ("time/",)), _rows(tmp_path / "async0", ("time/",))
    assert_same_path([{k: v for k, v in r.items() if not k.startswith(ASYNC_KEYS)} for r in rows], sync,
                     why=SAME_ROLLOUT)
    assert any(r.get("policy/grad_norm", 0) > 0 for r in sync)
    assert [r["rollout/staleness/max"] for r in _rows(tmp_path / "async1")] == [0.0, 1.0]
    assert_overlap_metrics(metrics_rows(tmp_path / "async1"), None, max_staleness=1)  # rank 0's (one row per step)
    state = load_state_file(tmp_path / "async1" / "checkpoints" / "step_2" / "state.pt")
    ranks = state["stateful"]["async_rollout"]["ranks"]
    assert len(ranks) == 2 and all(sorted(r["ready"]) == [3] for r in ranks)  # step 3's batch of each rank
    proc = subprocess.run([sys.executable, *args, f"output_dir={tmp_path / 'async1'}", "train.max_steps=3",
                           "rollout.worker=process", "rollout.max_staleness=1", "dist.strategy=none"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "resume with the same number of processes (2), not 1" in proc.stderr.strip().splitlines()[-1]
