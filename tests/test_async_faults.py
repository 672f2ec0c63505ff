"""`kill -9` of either side of a run with its rollouts in a rollout process (`rollout.worker: process`), what the OOM
killer does on a real node, on real `mmrl train` runs of vlm_grpo and flow_grpo: a dead rollout process stops the
trainer within seconds with one line naming the process and its signal, and the last complete checkpoint stays; a
rollout process whose trainer died ends within seconds. No process of the run is left behind either way."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmrl.run.files import verify_checkpoint
from mmrl.run.files import list_checkpoints
from mmrl.testing import child_env, child_processes, metrics_rows, process_ended

ROOT = Path(__file__).resolve().parents[1]
ASYNC = ["rollout.worker=process", "rollout.max_staleness=1", "train.max_steps=1000", "train.save_every=2",
         "log.eval_every=0", "log.sample_every=0"]
RECIPES = {
    "vlm_grpo": lambda tmp: [str(ROOT / "configs" / "vlm" / "grpo_tiny_shapes.yaml"), f"model.path={tmp / 'qwen2_vl'}",
                             "warm_start.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=4"],
    "flow_grpo": lambda tmp: [str(ROOT / "configs" / "diffusion" / "flow_grpo_tiny.yaml"),
                              f"model.path={ROOT / 'assets' / 'tiny_sd3_shapes'}",
                              f"data.train_prompts={ROOT / 'assets' / 'prompts' / 'shapes_train.txt'}",
                              f"data.eval_prompts={ROOT / 'assets' / 'prompts' / 'shapes_eval.txt'}",
                              "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.num_steps=4",
                              "algo.old_logprobs=recompute", "algo.rollout_correction.is_level=token"],
}


def _wait_for(predicate, what: str, timeout: float) -> None:
    end = time.time() + timeout
    while not predicate():
        if time.time() > end:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _past_a_checkpoint(out: Path) -> bool:
    try:
        return bool(list_checkpoints(out / "checkpoints")) and len(metrics_rows(out)) >= 3
    except (FileNotFoundError, ValueError):  # (a row being written)
        return False


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("victim", ["rollout", "trainer"])
def test_kill_9_of_either_side_ends_the_other_within_seconds(tmp_path, recipe, victim):
    out, err = tmp_path / "run", tmp_path / "stderr.txt"
    with open(err, "w") as stderr:
        trainer = subprocess.Popen([sys.executable, "-m", "mmrl.cli", "train", *RECIPES[recipe](tmp_path), *ASYNC,
                                    f"output_dir={out}"], cwd=tmp_path, env=child_env(), stdout=subprocess.DEVNULL,
                                   stderr=stderr)
    children: dict[int, str] = {}
    try:
        _wait_for(lambda: _past_a_checkpoint(out) or trainer.poll() is not None, "a checkpoint and 3 steps", 300)
        assert trainer.poll() is None, err.read_text()[-3000:]
        children = child_processes(trainer.pid)  # the rollout process, multiprocessing's resource tracker
        rollout = [pid for pid, cmd in children.items() if "spawn_main" in cmd]
        assert len(rollout) == 1, children
        t0 = time.time()
        if victim == "rollout":
            _kill(rollout[0])
            trainer.wait(timeout=60)
        else:
            _kill(trainer.pid)
            trainer.wait()
        _wait_for(lambda: all(process_ended(pid) for pid in children), "the run's other processes to end", 60)
        took = time.time() - t0
    finally:
        for pid in [trainer.pid, *children]:
            if not process_ended(pid):
                _kill(pid)
        trainer.wait()
    text = err.read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("mmrl: ")]
    ckpts = list_checkpoints(out / "checkpoints")
    verify_checkpoint(ckpts[-1][1])  # the last complete checkpoint is whole
    if victim == "rollout":
        assert trainer.returncode == 2 and len(lines) == 1, text[-3000:]
        assert re.fullmatch(
            rf"mmrl: error: rollout process \(PID {rollout[0]}, rank 0\) died from signal 9 \(SIGKILL: e\.g\. the OOM "
            rf"killer, or kill -9\) while the trainer waited for .*; nothing of the failed step was saved; rerun the "
            rf"same command to resume from step {ckpts[-1][0]} \({re.escape(str(ckpts[-1][1]))}\)  "
            rf"\(MMRL_DEBUG=1 shows the traceback\)", lines[0]), lines[0]
        assert "Traceback" not in text and "leaked" not in text, text[-3000:]
    else:
        assert lines == [f"mmrl: rollout process (PID {rollout[0]}, rank 0): its trainer process (PID {trainer.pid}) "
                         f"is gone; exiting"], text[-3000:]
    assert took < 10, f"{took:.1f} s"

