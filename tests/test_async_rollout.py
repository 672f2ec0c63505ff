"""Rollouts in their own process (`rollout.worker: process`, mmrl.training.async_rollout).

Pure parts by hand: the payload codec (plain state that `weights_only=True` loads, every mmrl class rebuilt, nothing
else imported), packed weights, the config checks. End to end on the tiny models (a real spawned rollout process
each): `max_staleness: 0` gives the synchronous run's metrics exactly (vlm_grpo and flow_grpo); with
`max_staleness: k > 0` every batch is generated with the weights of update step-1-k (staleness min(k, step-1)) and a
run stopped at a checkpoint resumes exactly (in-flight batches saved); a failing rollout process stops the trainer
with its error.
"""

from __future__ import annotations

import dataclasses
import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.config import ConfigError, load_config
from mmrl.testing import assert_same_path, metrics_rows, process_ended
from mmrl.training.payloads import from_plain, pack_tensors, to_plain, unpack_tensors

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------ pure parts


def test_plain_payload_roundtrip_through_a_weights_only_checkpoint(tmp_path):
    from mmrl.diffusion.models.base import PromptEmbeds
    from mmrl.pipelines.data import VQAItem
    from mmrl.vlm.rollout import RolloutResult

    img = Image.fromarray(np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3), mode="RGB")
    res = RolloutResult(request_index=1, sample_index=0, prompt_ids=[5, 6], response_ids=[7], response_logprobs=[-0.5],
                        sampling_logprobs=None, finish_reason="stop", stop_reason=7, text="red",
                        mm={"pixel_values": torch.randn(4, 6)}, metadata={"answer": "red", "choices": ["red", "blue"]})
    payload = {"results": [res], "items": [VQAItem("q <image>", [img], "red", {"kind": "color"})],
               "embeds": PromptEmbeds({"prompt_embeds": torch.ones(2, 3)}), "scores": torch.tensor([1.0, 0.0]),
               "pair": (1, "a"), "array": np.array([1.5, 2.5]), "n": np.int64(3)}
    plain = to_plain(payload)
    path = tmp_path / "state.pt"
    torch.save({"payload": plain}, path)
    from mmrl.run.files import load_state_file

    back = from_plain(load_state_file(path)["payload"])  # weights_only=True: plain state only
    r = back["results"][0]
    assert type(r) is RolloutResult and r.response_ids == [7] and r.stop_reason == 7 and r.sampling_logprobs is None
    assert torch.equal(r.mm["pixel_values"], res.mm["pixel_values"]) and r.metadata == res.metadata
    item = back["items"][0]
    assert type(item) is VQAItem and item.images[0].mode == "RGB"
    assert np.array_equal(np.array(item.images[0]), np.array(img))
    assert type(back["embeds"]) is PromptEmbeds and len(back["embeds"]) == 2
    assert back["pair"] == (1, "a") and back["n"] == 3 and back["array"].tolist() == [1.5, 2.5]
    # what the samples of a prompt share (their pixel values) is sent once and stays shared
    twins = from_plain(to_plain([res, dataclasses.replace(res, sample_index=1)]))
    assert twins[0].mm is twins[1].mm and twins[1].sample_index == 1


def test_plain_payload_refuses_foreign_types_and_classes():
    @dataclasses.dataclass
    class Foreign:  # defined outside mmrl: may be sent nowhere
        x: int = 1

    with pytest.raises(TypeError, match="cannot send or checkpoint a .*BytesIO"):
        to_plain({"f": io.BytesIO()})
    with pytest.raises(ValueError, match="refusing to rebuild .*Foreign.*only mmrl classes"):
        to_plain(Foreign())
    with pytest.raises(ValueError, match="refusing to rebuild 'os:system'"):
        from_plain({"__mmrl_dataclass__": "os:system", "fields": {}})


def test_packed_weights_are_one_buffer_per_dtype_and_exact():
    named = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64), "c": torch.randn(2),
             "d": torch.randn(()), "e": torch.randn(2, 2).to(torch.bfloat16)}
    packed = pack_tensors(named)
    assert sorted(packed["flat"]) == ["bfloat16", "float32", "int64"]
    assert packed["flat"]["float32"].numel() == 12 + 2 + 1
    back = unpack_tensors(packed)
    assert list(back) == list(named)
    for k in named:
        assert back[k].dtype == named[k].dtype and torch.equal(back[k], named[k])
    named["a"].add_(1.0)  # the packed copy does not follow later updates
    assert not torch.equal(back["a"], named["a"])


@pytest.mark.parametrize("override, match", [
    ("rollout.max_staleness=-1", r"rollout.max_staleness: expected >= 0 \(0 = synchronous\), got -1"),
    ("rollout.max_staleness=2", r"rollout.max_staleness=2 needs rollout.worker=process"),
    ("rollout.worker=thread", r"rollout.worker"),
    ("rollout.worker_threads=-1", r"rollout.worker_threads: expected >= 0"),
])
def test_bad_async_settings_fail_when_the_config_loads(override, match):
    for cfg_file in ("configs/vlm/grpo_tiny_shapes.yaml", "configs/diffusion/flow_grpo_tiny.yaml"):
        with pytest.raises((ValueError, ConfigError), match=match):
            load_config(str(REPO / cfg_file), [override])


def test_incompatible_combinations_are_refused_in_one_line(monkeypatch):
    from mmrl.training.async_rollout import check_async_rollout

    cfg = load_config(str(REPO / "configs/vlm/grpo_tiny_shapes.yaml"), ["rollout.worker=process", "dist.strategy=fsdp"])
    with pytest.raises(ValueError, match="rollout.worker=process with dist.strategy=fsdp is not supported"):
        check_async_rollout(cfg)
    cfg = load_config(str(REPO / "configs/vlm/grpo_tiny_shapes.yaml"),
                      ["rollout.worker=process", "dist.strategy=ddp", "algo.dynamic_sampling=true"])
    check_async_rollout(cfg, multi_process=False)  # one process: fine
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="several processes and algo.dynamic_sampling=true is not supported"):
        check_async_rollout(cfg)


@pytest.mark.parametrize("cfg_file, override", [("configs/vlm/grpo_tiny_shapes.yaml", "update.epochs=2"),
                                                ("configs/vlm/grpo_tiny_shapes.yaml", "algo.old_logprobs=recompute"),
                                                ("configs/diffusion/flow_grpo_tiny.yaml", "algo.old_logprobs=recompute")])
def test_stale_batches_with_recomputed_pi_old_need_the_correction_weights(cfg_file, override):
    """Decoupled PPO trains stale samples with pi_old from the trainer, so it needs the weights pi_old / pi_rollout
    (algo.rollout_correction); without them the tiny VLM recipe's policy went uniform within 15 steps. Bypass (the
    rollout's log-probs as pi_old) and k = 0 need nothing."""
    from mmrl.diffusion import flow_grpo  # noqa: F401  (the recipes' checks)
    from mmrl.vlm.grpo_checks import check_config, recompute_old_logprobs

    def check(*overrides):
        cfg = load_config(str(REPO / cfg_file), ["rollout.worker=process", override, *overrides])
        if cfg.algorithm == "vlm_grpo":
            return check_config(cfg)
        from mmrl.training.async_rollout import check_async_rollout

        return check_async_rollout(cfg, recomputes_old=cfg.algo.old_logprobs == "recompute")

    with pytest.raises(ValueError, match=r"rollout.max_staleness=1 with pi_old recomputed by the trainer \(algo."
                                         r"old_logprobs=(auto|recompute)\) needs algo.rollout_correction"):
        check("rollout.max_staleness=1")
    check("rollout.max_staleness=1", "algo.rollout_correction.is_level=token")
    check("rollout.max_staleness=0")
    vlm = load_config(str(REPO / "configs/vlm/grpo_tiny_shapes.yaml"), ["rollout.worker=process",
                                                                         "rollout.max_staleness=1"])
    assert not recompute_old_logprobs(vlm)  # auto with one update per batch: bypass
    check_config(vlm)


_SHARER_PEER_DIES = """
import os, socket, sys, time
from multiprocessing import resource_sharer
if sys.argv[1] == "quiet":
    from mmrl.training.async_worker import quiet_resource_sharer
    quiet_resource_sharer()
resource_sharer.DupFd(os.open(os.devnull, os.O_RDONLY))  # starts the sharer's listener thread, as a shared tensor does
for _ in range(3):  # a peer that connects and dies mid-handshake, the listener's challenge unread
    peer = socket.socket(socket.AF_UNIX)
    peer.connect(resource_sharer._resource_sharer._address)
    time.sleep(0.1)
    peer.close()
time.sleep(1.0)
raise ValueError("other errors still print")
"""


@pytest.mark.parametrize("mode", ["quiet", "loud"])
def test_a_peer_dying_in_the_resource_sharers_handshake_prints_no_traceback(mode):
    """The resource-sharer thread reports its own connection errors through `sys.excepthook` (a rollout process
    killed while it fetched a weight tensor's file descriptor printed ConnectionResetError's traceback beside the
    one-line error). With the trainer's hook they are dropped; any other exception still prints; without it (the
    control) the reset prints, so the case does happen here."""
    import subprocess
    import sys

    err = subprocess.run([sys.executable, "-c", _SHARER_PEER_DIES, mode], capture_output=True, text=True,
                         timeout=120).stderr
    assert "ValueError: other errors still print" in err, err
    resets = re.findall(r"^(?:ConnectionResetError|BrokenPipeError|ConnectionAbortedError|EOFError)\b", err, re.M)
    assert (len(resets) == 0) if mode == "quiet" else (len(resets) >= 1), err


def test_overlap_and_staleness_metrics_by_hand():
    from mmrl.training.overlap import overlap_metrics, overlap_summary, staleness_metrics

    # W = 2 s, wait 0.5, push 0.1 -> T = 1.4; R = 1.2: ideal 2.6 / 1.4, achieved 2.6 / 2; rollout idle 0.3 of 1.6 s
    m = overlap_metrics(step_s=2.0, wait_s=0.5, push_s=0.1, rollout_s=1.2, rollout_idle_s=0.3, rollout_wall_s=1.6)
    assert m == pytest.approx({"async/rollout_s": 1.2, "async/trainer_s": 1.4, "async/trainer_idle_frac": 0.25,
                               "async/rollout_idle_frac": 0.1875, "async/ideal_speedup": 2.6 / 1.4,
                               "async/achieved_speedup": 1.3})
    # rollout-bound: R = 3, T = 1; the trainer waits 2 of its 3.2 s step (push 0.2)
    m = overlap_metrics(step_s=3.2, wait_s=2.0, push_s=0.2, rollout_s=3.0, rollout_idle_s=0.0, rollout_wall_s=3.2)
    assert m == pytest.approx({"async/rollout_s": 3.0, "async/trainer_s": 1.0, "async/trainer_idle_frac": 0.625,
                               "async/rollout_idle_frac": 0.0, "async/ideal_speedup": 4 / 3,
                               "async/achieved_speedup": 1.25})
    assert overlap_metrics(step_s=0.0, wait_s=0.0, push_s=0.0, rollout_s=0.0, rollout_idle_s=0.0,
                           rollout_wall_s=0.0) == {"async/rollout_s": 0.0, "async/trainer_s": 0.0}  # no 0 / 0
    assert staleness_metrics([1, 2, 2], 2) == pytest.approx({
        "rollout/staleness/mean": 5 / 3, "rollout/staleness/max": 2.0, "rollout/staleness/count_0": 0.0,
        "rollout/staleness/count_1": 1.0, "rollout/staleness/count_2": 2.0})
    assert staleness_metrics([0], 1) == {"rollout/staleness/mean": 0.0, "rollout/staleness/max": 0.0,
                                         "rollout/staleness/count_0": 1.0, "rollout/staleness/count_1": 0.0}
    # the summary: means of steps 2 and 3 (step 1 waited for the rollout process's start-up), staleness over all
    rows = [{"step": s, "rollout/staleness/mean": float(min(s - 1, 1)), "rollout/staleness/max": float(min(s - 1, 1)),
             **overlap_metrics(step_s=w, wait_s=a, push_s=0.0, rollout_s=1.0, rollout_idle_s=i, rollout_wall_s=2.0)}
            for s, w, a, i in [(1, 5.0, 4.0, 0.0), (2, 2.0, 0.0, 1.0), (3, 2.5, 0.5, 1.0)]]
    assert overlap_summary(rows) == pytest.approx({
        "async_rollout_s": 1.0, "async_trainer_s": 2.0, "async_trainer_idle_frac": 0.1, "async_rollout_idle_frac": 0.5,
        "async_ideal_speedup": 1.5, "async_achieved_speedup": (1.5 + 1.2) / 2, "async_achieved_over_ideal": 0.9,
        "async_staleness_mean": 2 / 3, "async_staleness_max": 1.0})
    assert overlap_summary([{"step": 1, "reward/mean": 0.5}]) == {}  # a synchronous run: nothing


# ------------------------------------------------------------------ the schedule, with a model-free producer


class CountingProducer:
    """A producer without models (built in the spawned process by name): a batch records its step, the weight it
    was made with, the data position and one random draw; `cfg` = {"fail_at": step, "exit_at": step, "sleep_at":
    step (generates for 10 minutes), "big": n (each batch carries n float32 values too), "sleep_s": seconds (each
    batch takes that long)}."""

    def __init__(self, cfg, rank, world, device):
        self.cfg, self.rank, self.w, self.position = dict(cfg), rank, None, 0

    def load_weights(self, tensors):
        self.w = float(tensors["w"])

    def state_dict(self):
        return {"data": {"position": self.position}}

    def load_state_dict(self, state):
        self.position = state["data"]["position"]

    def produce(self, step):
        if step == self.cfg.get("fail_at"):
            raise ValueError(f"reward.components: broken at step {step}")
        if step == self.cfg.get("exit_at"):
            import os

            os._exit(3)
        if step == self.cfg.get("sleep_at"):
            import time

            time.sleep(600)
        if "sleep_s" in self.cfg:  # a rollout of known length
            import time

            time.sleep(self.cfg["sleep_s"])
        self.position += 1
        extra = {"big": torch.zeros(self.cfg["big"])} if "big" in self.cfg else {}
        return ({"step": step, "w": self.w, "position": self.position, "draw": torch.rand(()), **extra},
                {"time/rollout_s": 0.0})


class Position:
    def __init__(self):
        self.sd = {"position": 0}

    def state_dict(self):
        return dict(self.sd)

    def load_state_dict(self, sd):
        self.sd = dict(sd)


def _pipe(k, cfg=None, last_step=10, mirror=None):
    from mmrl.training.async_rollout import AsyncRollout

    return AsyncRollout(f"{__name__}:CountingProducer", cfg or {}, max_staleness=k, last_step=last_step, seed=5,
                        mirror={"data": mirror or Position()})


def _run(pipe, start, stop, state=None):
    """Steps start+1..stop: the weight of version v is 10 * v; returns each batch's (step, weight made with)."""
    if state is not None:
        pipe.load_state_dict(state)
    pipe.start(start, {"w": torch.tensor(10.0 * start)})
    seen = []
    for step in range(start + 1, stop + 1):
        payload, metrics = pipe.next(step)
        assert payload["step"] == step and metrics["rollout/staleness/max"] == step - 1 - payload["w"] / 10
        seen.append((step, payload["w"], metrics["rollout/policy_version"], float(payload["draw"]),
                     payload["position"]))
        pipe.push(step, {"w": torch.tensor(10.0 * step)})
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 1, 3])
def test_each_batch_is_made_with_the_weights_of_update_step_minus_1_minus_k(k):
    pipe = _pipe(k)
    try:
        seen = _run(pipe, 0, 6)
    finally:
        pipe.close()
    assert [x[:3] for x in seen] == [(t, 10.0 * max(0, t - 1 - k), float(max(0, t - 1 - k))) for t in range(1, 7)]
    assert [x[4] for x in seen] == list(range(1, 7))  # the data position advances once per batch
    assert pipe.submitted == 6 + k  # the k batches after the last step are made too (an extended run uses them)


def test_staleness_zero_continues_the_trainers_random_stream(tmp_path):
    """k = 0: the batch's random draws continue the trainer's stream as in the synchronous loop. Also: the trainer
    holds its run directory's flock meanwhile, and the spawned rollout process has not inherited that descriptor
    (it would keep the directory locked after the trainer ended)."""
    import os

    from mmrl.run.lock import LOCK_NAME, RunLock

    class Owner:  # (a lock's owner is held by weak reference: a plain object() cannot be)
        pass

    owner = Owner()
    lock = RunLock.acquire(tmp_path, owner)
    torch.manual_seed(11)
    expected = []
    for _ in range(3):  # the synchronous loop: a rollout draw, then a training draw, each step
        expected += [float(torch.rand(())), float(torch.rand(()))]
    torch.manual_seed(11)
    pipe = _pipe(0)
    got = []
    try:
        pipe.start(0, {"w": torch.tensor(0.0)})
        for step in (1, 2, 3):
            payload, _ = pipe.next(step)
            got += [float(payload["draw"]), float(torch.rand(()))]
            pipe.push(step, {"w": torch.tensor(1.0)})
        fds = [os.readlink(f"/proc/{pipe.proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pipe.proc.pid}/fd")]
    finally:
        pipe.close()
        lock.release(owner)
    assert got == expected
    assert fds and not [t for t in fds if LOCK_NAME in t]


def test_overlap_is_measured_on_both_sides():
    """A rollout of 0.3 s beside a training step of 0.6 s, one version stale: after the start-up step the batch is
    ready when the trainer asks (it idles ~0), and the step takes T: achieved = ideal = 1.5. The rollout process
    makes batches 1 and 2 back to back (both tickets are sent at step 1), then waits ~0.3 of every 0.6 s for the
    next ticket. Step 1 waits for the process to start."""
    import time

    pipe = _pipe(1, cfg={"sleep_s": 0.3}, last_step=4)
    rows = []
    try:
        pipe.start(0, {"w": torch.tensor(0.0)})
        for step in range(1, 5):
            t0 = time.perf_counter()
            _, metrics = pipe.next(step)
            time.sleep(0.6)  # training
            metrics.update(pipe.push(step, {"w": torch.tensor(10.0 * step)}))
            rows.append({**metrics, **pipe.step_metrics(time.perf_counter() - t0)})
    finally:
        pipe.close()
    assert rows[0]["async/trainer_idle_frac"] > 0.5  # spawning the process and its first batch
    for r in rows[1:]:
        assert r["async/trainer_idle_frac"] < 0.2 and 0.3 <= r["async/rollout_s"] < 0.45, r
        assert 0.6 <= r["async/trainer_s"] < 0.75 and r["async/achieved_speedup"] / r["async/ideal_speedup"] > 0.85, r
    assert rows[1]["async/rollout_idle_frac"] < 0.25
    assert all(0.25 < r["async/rollout_idle_frac"] < 0.7 for r in rows[2:]), rows
    assert [r["rollout/staleness/count_1"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert pipe.step_metrics(1.0) == {}  # once per step


@pytest.mark.slow
def test_saved_in_flight_batches_resume_exactly():
    full = _pipe(2)
    try:
        a = _run(full, 0, 7)
    finally:
        full.close()
    part_mirror = Position()
    first = _pipe(2, mirror=part_mirror)
    try:
        b = _run(first, 0, 3)
        state = first.state_dict()  # waits for the tickets of steps 4 and 5, saves their batches
    finally:
        first.close()
    ranks = state["ranks"]
    assert state["max_staleness"] == 2 and len(ranks) == 1 and sorted(ranks[0]["ready"]) == [4, 5]
    assert part_mirror.sd == {"position": 5}  # the data position after the newest batch made
    second = _pipe(2, mirror=part_mirror)
    try:
        b += _run(second, 3, 7, state=state)
    finally:
        second.close()
    assert_same_path(b, a, why="the same producer code on the same seeds; in-flight batches come from the state")


@pytest.mark.slow
def test_a_failing_or_dying_rollout_process_stops_the_trainer_with_its_cause():
    from mmrl.training.async_rollout import RolloutProcessError

    pipe = _pipe(1, cfg={"fail_at": 2})
    pipe.start(0, {"w": torch.tensor(0.0)})
    pipe.next(1)
    pipe.push(1, {"w": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="reward.components: broken at step 2"):
        pipe.next(2)
    assert not pipe.proc.is_alive()
    pipe = _pipe(0, cfg={"exit_at": 1})
    pipe.start(0, {"w": torch.tensor(0.0)})
    with pytest.raises(RolloutProcessError, match=r"exited with code 3 while the trainer waited for the batch of step"):
        pipe.next(1)
    pipe.close()

    from mmrl.run.start import closes_runs

    @closes_runs
    def train(cfg):  # the trainer fails (a NaN loss, Ctrl-C) while its rollout process works on the next batch
        pipes.append(_pipe(1))
        pipes[-1].start(0, {"w": torch.tensor(0.0)})
        pipes[-1].next(1)
        raise KeyboardInterrupt

    pipes: list = []
    with pytest.raises(KeyboardInterrupt):
        train(None)
    assert not pipes[0].proc.is_alive()  # stopped when train() raised, not when its traceback is dropped


def test_a_rollout_process_killed_mid_batch_stops_the_trainer_within_seconds():
    """`kill -9` of the rollout process (what the OOM killer does) while a batch is half through the pipe: the
    trainer stops within seconds with one line naming the process and the signal (it read the cut batch forever)."""
    import os
    import signal
    import time

    from mmrl.training.async_rollout import RolloutProcessError

    def hung(*_):  # (pytest.fail: not an OSError, which the trainer's read would take for the pipe's end)
        pytest.fail("the trainer still waits for the batch of a dead rollout process after 20 s")

    pipe = _pipe(1, cfg={"big": 1 << 20})  # 4 MB batches: the pipe holds 64 KB, the rest waits for the trainer
    old = signal.signal(signal.SIGALRM, hung)
    try:
        pipe.start(0, {"w": torch.tensor(0.0)})
        pipe.next(1)  # ... and the batch of step 2 is being made
        pipe.push(1, {"w": torch.tensor(1.0)})
        assert pipe.outbox._reader.poll(60)  # its first bytes are in the pipe
        time.sleep(0.2)
        os.kill(pipe.proc.pid, signal.SIGKILL)
        signal.alarm(20)
        t0 = time.time()
        with pytest.raises(RolloutProcessError) as err:
            pipe.next(2)
        took = time.time() - t0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        pipe.close()
    assert str(err.value) == (f"rollout process (PID {pipe.proc.pid}, rank 0) died from signal 9 (SIGKILL: e.g. the "
                              f"OOM killer, or kill -9) while the trainer waited for the batch of step 2")
    assert took < 5 and process_ended(pipe.proc.pid)


_TRAINER = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
from test_async_rollout import _pipe
if __name__ == "__main__":
    pipe = _pipe(1, cfg={"sleep_at": 2})
    pipe.start(0, {"w": torch.tensor(0.0)})
    pipe.next(1)  # the rollout process now generates the batch of step 2 for 10 minutes
    pipe.push(1, {"w": torch.tensor(1.0)})
    print(pipe.proc.pid, flush=True)
    pipe.next(2)
"""


def test_a_rollout_process_ends_within_seconds_of_its_trainers_death(tmp_path):
    """`kill -9` of the trainer while its rollout process generates: the rollout process ends within seconds (it
    kept generating, the device held, until its batch was done) and says why."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from mmrl.testing import child_env

    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(REPO / "tests")], env=child_env(), cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rollout = None
    try:
        rollout = int(trainer.stdout.readline())
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        end = time.time() + 5
        while not process_ended(rollout) and time.time() < end:
            time.sleep(0.1)
        assert process_ended(rollout), "the rollout process outlived its trainer"
    finally:
        trainer.kill()
        if rollout is not None and not process_ended(rollout):
            os.kill(rollout, signal.SIGKILL)
    err = trainer.stderr.read()
    assert (f"mmrl: rollout process (PID {rollout}, rank 0): its trainer process (PID {trainer.pid}) is gone; "
            f"exiting") in err, err[-2000:]


def test_resume_with_in_flight_batches_on_another_number_of_processes_is_refused():
    state = {"max_staleness": 1, "ranks": [{"submitted": 3, "ready": {3: ({}, {}, {})}},
                                           {"submitted": 3, "ready": {3: ({}, {}, {})}}]}
    pipe = _pipe(1)
    try:
        with pytest.raises(ValueError, match=r"in-flight rollout batches of 2 trainer process\(es\); resume with the "
                                             r"same number of processes \(2\), not 1"):
            pipe.load_state_dict(state)
    finally:
        pipe.close()


# ------------------------------------------------------------------ the benchmark and the commands in docs/async.md


def _bench():
    import importlib.util
    import sys

    bench = REPO / "benchmarks"
    if str(bench) not in sys.path:
        sys.path.append(str(bench))
    spec = importlib.util.spec_from_file_location("bench_async_rollout", bench / "async_rollout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_measure_by_hand():
    rows = [{"step": s, "time/step_s": t, "reward/mean": r}
            for s, t, r in [(1, 30.0, 0.0), (2, 1.0, 0.1), (3, 2.0, 0.3), (4, 1.0, 0.2), (5, 1.0, 0.6)]]
    m = _bench().measure(rows, skip=1)  # steps 2..5: 4 steps in 5 s; first 2 mean 0.2, last 2 mean 0.4
    assert m["steps_per_s"] == pytest.approx(0.8) and m["seconds"] == 5.0
    assert m["reward_gain_per_s"] == pytest.approx((0.4 - 0.2) / 5.0) and m["reward_last"] == pytest.approx(0.4)
    with pytest.raises(ValueError, match="1 step"):
        _bench().measure(rows[:2], skip=1)


def test_bench_overlap_table_by_hand():
    bench = _bench()
    # sync: R = rollout + reward = 1 s, T = 3 - 1 = 2 s per step (step 1 skipped): ideal 3 / 2
    rows = [{"step": s, "time/step_s": w, "time/rollout_s": 0.8, "time/reward_s": 0.2}
            for s, w in [(1, 9.0), (2, 3.0), (3, 3.0)]]
    assert bench.sync_overlap(rows, skip=1) == pytest.approx({"rollout_s": 1.0, "trainer_s": 2.0, "ideal": 1.5})
    overlap = {k: 1.0 for k in ("async_rollout_s", "async_trainer_s", "async_ideal_speedup", "async_achieved_speedup",
                                "async_achieved_over_ideal", "async_trainer_idle_frac", "async_rollout_idle_frac")}
    results = {"sync 1 thread": [{"steps_per_s": 1 / 3, "sync_overlap": bench.sync_overlap(rows, skip=1)}] * 2,
               "async, bypass": [{"steps_per_s": 0.5, "overlap": overlap}, {"steps_per_s": 0.45, "overlap": overlap}]}
    table = bench.overlap_table(results)
    assert [r[0] for r in table] == ["async, bypass (in-run)", "async, bypass vs sync 1 thread (A/B)"]
    # A/B: achieved 0.5 / (1/3) = 1.5 and 1.35 -> 1.00 and 0.90 of the ideal 1.5
    assert table[1][1:] == ["1.000 / 1.000 / 1.000", "2.000 / 2.000 / 2.000", "1.50 / 1.50 / 1.50",
                            "1.35 / 1.43 / 1.50", "0.90 / 0.95 / 1.00", "-", "-"]


@pytest.mark.slow
def test_docs_async_commands_short_forms(tmp_path):
    """docs/async.md: the Flow-GRPO command for 3 steps. The benchmark command (which runs `mmrl train
    configs/vlm/grpo_tiny_shapes.yaml rollout.worker=process rollout.max_staleness=1` among its variants) is
    tests/test_benchmarks.py::test_async_rollout_quick_mode_runs_every_variant, the `torchrun` command
    tests/vlm/test_grpo_async.py::test_torchrun_ddp_each_rank_with_its_rollout_process."""
    import subprocess
    import sys

    from mmrl.testing import child_env

    env = child_env()
    out = tmp_path / "flow"
    proc = subprocess.run([sys.executable, "-m", "mmrl.cli", "train", "configs/diffusion/flow_grpo_tiny.yaml",
                           "rollout.worker=process", "rollout.max_staleness=1", "algo.old_logprobs=recompute",
                           "algo.rollout_correction.is_level=token", f"output_dir={out}", "train.max_steps=3",
                           "rollout.prompts_per_step=2", "rollout.group_size=4", "log.eval_every=0",
                           "log.sample_every=0"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics_rows(out)
    assert [r["rollout/policy_version"] for r in rows] == [0.0, 0.0, 1.0]
    assert all("rollout/correction/rollout_is_mean" in r for r in rows)


def test_encoded_batches_load_with_weights_only_and_refuse_code():
    import pickle

    from mmrl.runtime import get_rng_state
    from mmrl.training.payloads import decode, encode

    batch = {"payload": to_plain({"x": torch.arange(3)}), "state": {"rng": get_rng_state()}, "info": {"version": 2}}
    back = decode(encode(batch))
    assert torch.equal(back["payload"]["x"], torch.arange(3)) and back["info"] == {"version": 2}
    assert torch.equal(back["state"]["rng"]["torch"], batch["state"]["rng"]["torch"])
    buf = io.BytesIO()
    torch.save({"f": io.BytesIO}, buf)  # a class: not plain state
    with pytest.raises(pickle.UnpicklingError):
        decode(buf.getvalue())
