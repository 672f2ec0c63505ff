"""vlm_grpo with a rollout rank apart from the trainer rank in one torch.distributed world (`rollout.worker: ranks`,
`dist.rollout_ranks: 1`; mmrl.training.rank_rollout), on 2 CPU ranks over gloo: max_staleness 0 equals the
synchronous one-process run; max_staleness 1 stopped at a checkpoint and extended equals the uninterrupted run (the
in-flight batch comes from the checkpoint); a kill -9 of either rank ends the other within seconds with one line,
the last complete checkpoint intact. The same on 4 ranks (2 trainer ranks in their own DDP group, 2 rollout ranks):
max_staleness 0 equals the synchronous 2-process DDP run, max_staleness 1 resumes exactly, a kill -9 of a rollout
rank ends every rank with one line each. On 3 ranks (2 trainer ranks served by one rollout rank with one model):
max_staleness 0 equals the synchronous 2-process DDP run, max_staleness 1 resumes exactly. Unsupported combinations
are refused in one line."""

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
RANKS2 = ["rollout.worker=ranks", "dist.rollout_ranks=2"]  # a world of 4: ranks 0-1 train, rank 2 + i serves rank i


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


def _torchrun(model, out, *extra, ranks=RANKS, nproc=2):
    proc = run_torchrun(["-m", "mmrl.cli", "train", *_args(model), f"output_dir={out}", *ranks, *extra], nproc=nproc,
                        cwd=ROOT, timeout=600)
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


def _rank(rank: int, port: int, args: list[str], err: Path, world: int = 2) -> subprocess.Popen:
    env = child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port))
    with open(err, "w") as stderr:
        return subprocess.Popen([sys.executable, "-m", "mmrl.cli", "train", *args], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=stderr)


def _past_a_checkpoint(out: Path) -> bool:
    try:
        return bool(list_checkpoints(out / "checkpoints")) and len(metrics_rows(out)) >= 3
    except (FileNotFoundError, ValueError):  # (a row being written)
        return False


def _kill_past_a_checkpoint(procs, out, errs, victim: int) -> float:
    """Once the run is past a checkpoint (every rank still alive), `kill -9` rank `victim` and wait for the others to
    end; seconds from the kill to the last one's end. Whatever is left is killed on the way out."""
    try:
        end = time.time() + 300
        while not _past_a_checkpoint(out) and all(p.poll() is None for p in procs) and time.time() < end:
            time.sleep(0.1)
        assert all(p.poll() is None for p in procs), "".join(e.read_text()[-2000:] for e in errs)
        t0 = time.time()
        procs[victim].kill()
        for i, p in enumerate(procs):
            if i != victim:
                p.wait(timeout=60)
        return time.time() - t0
    finally:
        for p in procs:
            if not process_ended(p.pid):
                p.kill()
            p.wait()



GONE = r"is gone \(connection (closed|reset) by peer\)"


def _assert_each_rank_ended(procs, out, errs, expected: dict) -> None:
    """The last complete checkpoint is whole; each rank r of `expected` = {r: (exit status, line regex or None)}
    printed exactly that one `mmrl: ` line (none for None) and no traceback. `{hint}` in a regex is the line's end:
    nothing saved, rerun to resume from the last checkpoint."""
    ckpts = list_checkpoints(out / "checkpoints")
    verify_checkpoint(ckpts[-1][1])
    hint = (rf"; nothing of the failed step was saved; rerun the same command to resume from step {ckpts[-1][0]} "
            rf"\({re.escape(str(ckpts[-1][1]))}\)  \(MMRL_DEBUG=1 shows the traceback\)")
    for r, (code, line) in expected.items():
        text = errs[r].read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith("mmrl: ")]
        assert len(lines) == (line is not None) and "Traceback" not in text, (r, text[-3000:])
        assert procs[r].returncode == code, (r, procs[r].returncode, text[-3000:])
        assert line is None or re.fullmatch(line.replace("{hint}", hint), lines[0]), (r, lines[0])

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
    survivor = procs[1 - victim]
    took = _kill_past_a_checkpoint(procs, out, errs, victim)
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
    (["rollout.worker=ranks"], 2, r"rollout.worker=ranks needs dist.rollout_ranks >= 1 \(the ranks of the torchrun "),
    (["dist.rollout_ranks=1"], 2, r"dist.rollout_ranks=1 needs rollout.worker=ranks, got rollout.worker=inline"),
    (RANKS2, 5, (r"dist.rollout_ranks=2 with 5 launched process\(es\): expected 2 rollout ranks after a multiple of 2 "
                 r"trainer ranks, each rollout rank serving as many \(torchrun --nproc-per-node 4: the first 2 train, "
                 r"rank 2 \+ i generates for trainer rank i; 6: the first 4 train, rank 4 \+ i for trainer ranks 2i "
                 r"and 2i \+ 1\)$")),
    (RANKS2, 3, r"dist.rollout_ranks=2 with 3 launched process\(es\): expected 2 rollout ranks after a multiple of 2 "),
    ([*RANKS, "rollout.engine=vllm"], 3, (r"rollout.engine=vllm with a rollout rank serving 2 trainer ranks is not "
                                          r"supported \(the engine samples from one random stream of its own, which "
                                          r"cannot be kept per trainer rank\); launch 2 processes")),
])
def test_unsupported_rank_settings_are_refused_in_one_line(overrides, world, match):
    from mmrl.training.rank_rollout import check_rollout_ranks

    cfg = load_config(str(ROOT / "configs/vlm/grpo_tiny_shapes.yaml"), overrides)
    with pytest.raises(ValueError, match=match):
        check_rollout_ranks(cfg, world=world)


def test_rollout_ranks_serving_several_trainer_ranks_are_accepted():
    from mmrl.training.rank_rollout import check_rollout_ranks

    for ranks, world in ((RANKS, 3), (RANKS, 5), (RANKS2, 6), ([*RANKS, "rollout.engine=vllm"], 2)):
        check_rollout_ranks(load_config(str(ROOT / "configs/vlm/grpo_tiny_shapes.yaml"), ranks), world=world)


def test_a_shared_rollout_rank_makes_each_trainer_ranks_batch_with_its_version_shard_and_data():
    """Trainer rank 0's weights of version 1 arrive before trainer rank 1's ticket of version 0 (another channel):
    that batch is still made with version 0; each batch with its trainer rank's shard and data position."""
    import queue

    import torch

    from mmrl.training.payloads import decode, pack_tensors
    from mmrl.training.rank_shared import serve_shared

    class Producer:
        shards, pos, w = None, None, None

        def load_weights(self, tensors):
            self.w = float(tensors["w"])

        def state_dict(self):
            return {"data": {"pos": self.pos}}

        def load_state_dict(self, state):
            self.pos = state["data"]["pos"]

        def produce(self, step):
            self.pos += 1
            return {"rank": self.shards.rank, "world": self.shards.world_size, "w": self.w, "pos": self.pos}, {}

    inbox, out = queue.Queue(), []
    weights = lambda v: pack_tensors({"w": torch.tensor(float(v))})
    for rank, msg in [(0, ("state", {"data": {"pos": 10}})), (1, ("state", {"data": {"pos": 20}})),
                      (0, ("weights", 0, weights(0))), (1, ("weights", 0, None)), (0, ("produce", 1, None, None)),
                      (0, ("weights", 1, weights(1))), (0, ("produce", 2, None, None)), (1, ("produce", 1, None, None)),
                      (1, ("weights", 1, None)), (1, ("produce", 2, None, None)), (0, ("stop",)), (1, ("stop",))]:
        inbox.put((rank, msg))
    serve_shared(Producer(), None, [0, 1], 2, inbox, lambda rank, msg: out.append((rank, msg[1], decode(msg[2]))))
    made = sorted((rank, step, b["info"]["version"], b["payload"]) for rank, step, b in out)
    assert made == [(0, 1, 0, {"rank": 0, "world": 2, "w": 0.0, "pos": 11}),
                    (0, 2, 1, {"rank": 0, "world": 2, "w": 1.0, "pos": 12}),
                    (1, 1, 0, {"rank": 1, "world": 2, "w": 0.0, "pos": 21}),
                    (1, 2, 1, {"rank": 1, "world": 2, "w": 1.0, "pos": 22})]


def test_a_shared_rollout_rank_drops_the_tickets_of_a_trainer_rank_that_stopped():
    """Trainer rank 1 asks for a batch of version 1 (whose tensors come from rank 0, later) and then stops: that batch
    is never made nor sent to the closing rank; rank 0's batches still are."""
    import queue

    import torch

    from mmrl.training.payloads import pack_tensors
    from mmrl.training.rank_shared import serve_shared

    class Producer:
        shards = None

        def load_weights(self, tensors):
            pass

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

        def produce(self, step):
            return {"rank": self.shards.rank}, {}

    inbox, out = queue.Queue(), []
    weights = lambda v: pack_tensors({"w": torch.tensor(float(v))})
    for rank, msg in [(0, ("state", {})), (1, ("state", {})), (0, ("weights", 0, weights(0))),
                      (1, ("weights", 0, None)), (1, ("weights", 1, None)), (1, ("produce", 2, None, None)),
                      (1, ("stop",)), (0, ("weights", 1, weights(1))), (0, ("produce", 2, None, None)), (0, ("stop",))]:
        inbox.put((rank, msg))
    serve_shared(Producer(), None, [0, 1], 2, inbox, lambda rank, msg: out.append((rank, msg[1])))
    assert out == [(0, 2)]


def test_rollout_ranks_is_checked_when_the_config_loads():
    with pytest.raises(ValueError, match=r"dist.rollout_ranks: expected >= 0 \(0 = every rank trains\), got -1"):
        load_config(str(ROOT / "configs/vlm/grpo_tiny_shapes.yaml"), ["dist.rollout_ranks=-1"])
    load_config(str(ROOT / "configs/vlm/grpo_tiny_shapes.yaml"), [*RANKS, "rollout.max_staleness=2"])  # accepted


def test_two_trainer_ranks_are_accepted_and_their_refusals_name_the_rollout_rank(monkeypatch):
    from mmrl.training.async_rollout import check_async_rollout

    load = lambda *o: load_config(str(ROOT / "configs/vlm/grpo_tiny_shapes.yaml"), [*RANKS2, *o])
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_async_rollout(load("rollout.max_staleness=1"))  # 2 trainer ranks + 2 rollout ranks: accepted
    with pytest.raises(ValueError, match=r"rollout.worker=ranks with dist.strategy=fsdp is not supported \(the rollout "
                                         r"rank needs whole weights, FSDP shards them\)"):
        check_async_rollout(load("dist.strategy=fsdp"))
    with pytest.raises(ValueError, match=r"rollout.worker=ranks with several trainer ranks and "
                                         r"algo.dynamic_sampling=true is not supported"):
        check_async_rollout(load("algo.dynamic_sampling=true"))
    monkeypatch.setenv("WORLD_SIZE", "2")  # 1 trainer rank: its rounds need no count over ranks
    check_async_rollout(load_config(str(ROOT / "configs/vlm/grpo_tiny_shapes.yaml"),
                                    [*RANKS, "algo.dynamic_sampling=true"]))


# two trainer ranks (0-1, DDP in a group of their own) and their rollout ranks: a pair each (a world of 4, rank 2 + i
# serves rank i) or one rollout rank serving both with one model, in turn (a world of 3)
LAYOUTS = {"pairs": (RANKS2, 4), "shared": (["rollout.worker=ranks", "dist.rollout_ranks=1"], 3)}


@pytest.fixture(scope="module")
def ddp_rows(model, tmp_path_factory):
    """The synchronous 2-process DDP run both layouts must equal at max_staleness 0."""
    out = tmp_path_factory.mktemp("ddp") / "ddp"
    ddp = run_torchrun(["-m", "mmrl.cli", "train", *_args(model), "train.max_steps=2", f"output_dir={out}"], cwd=ROOT,
                       timeout=600)
    assert ddp.returncode == 0, ddp.stderr[-6000:]
    return _rows(out)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_trainer_ranks_with_rollout_ranks_equal_the_ddp_run(model, ddp_rows, tmp_path, layout):
    """With max_staleness 0 the run equals the synchronous 2-process DDP run: each rollout rank makes its trainer
    ranks' shares with their data positions and random states and the weights of their first trainer (DDP: the
    same); a DDP or collective over all ranks would hang (the rollout ranks join none)."""
    ranks, nproc = LAYOUTS[layout]
    _torchrun(model, tmp_path / "ranks", "train.max_steps=2", ranks=ranks, nproc=nproc)
    rows = _rows(tmp_path / "ranks")
    assert_same_path([{k: v for k, v in r.items() if not k.startswith(ASYNC_KEYS)} for r in rows], ddp_rows,
                     why="each rollout rank runs its trainer ranks' shares of the synchronous loop's rollout with the "
                         "same weights, random state and thread count; the trainer ranks' DDP is the same")
    assert any(r["policy/grad_norm"] > 0 for r in ddp_rows)  # the weights moved: versions differ
    assert [r["rollout/policy_version"] for r in rows] == [0.0, 1.0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_trainer_ranks_with_rollout_ranks_resume_exactly(model, tmp_path, layout):
    from mmrl.run.files import load_state_file

    ranks, nproc = LAYOUTS[layout]
    opts = ("rollout.max_staleness=1", "train.save_every=2")
    _torchrun(model, tmp_path / "full", "train.max_steps=3", *opts, ranks=ranks, nproc=nproc)
    _torchrun(model, tmp_path / "part", "train.max_steps=2", *opts, ranks=ranks, nproc=nproc)
    state = load_state_file(tmp_path / "part" / "checkpoints" / "step_2" / "state.pt")
    saved = state["stateful"]["async_rollout"]["ranks"]
    assert len(saved) == 2 and all(sorted(r["ready"]) == [3] for r in saved)  # step 3's batch of each trainer rank
    _torchrun(model, tmp_path / "part", "train.max_steps=3", *opts, ranks=ranks, nproc=nproc)  # resume from step_2
    drop = ("time/", "eval/", "perf/")  # (the interrupted run evaluates at its last step: FLOPs and eval differ)
    full, part = _rows(tmp_path / "full", drop), _rows(tmp_path / "part", drop)
    assert [r["step"] for r in part] == [1, 2, 3]
    assert_same_path(part, full, why=RESUMED_RUN + "; both trainer ranks' in-flight batches come from the checkpoint")
    assert [r["rollout/policy_version"] for r in full] == [0.0, 0.0, 1.0]


@pytest.mark.slow
def test_kill_9_of_a_rollout_rank_of_two_ends_every_rank_with_one_line(model, tmp_path):
    """Rollout rank 3 (trainer rank 1's) killed: trainer rank 1 names it, trainer rank 0 (in a collective with rank 1)
    says another rank is gone, each in one line, and stops its rollout rank 2 (status 0): all within seconds."""
    out, port = tmp_path / "run", _free_port()
    args = [*_args(model), *RANKS2, "rollout.max_staleness=1", "train.max_steps=1000", "train.save_every=2",
            f"output_dir={out}"]
    errs = [tmp_path / f"rank{r}.txt" for r in range(4)]
    procs = [_rank(r, port, args, errs[r], world=4) for r in range(4)]
    took = _kill_past_a_checkpoint(procs, out, errs, 3)
    _assert_each_rank_ended(procs, out, errs, {
        0: (2, rf"mmrl: error: another rank of the torchrun world {GONE} while rank 0 was in a collective with it; its "
               r"own output says why{hint}"),
        1: (2, rf"mmrl: error: rollout rank 3 of the torchrun world {GONE} while the trainer waited for .*{{hint}}"),
        2: (0, None)})  # (told to stop by its trainer as that one ended)
    assert took < 30, f"{took:.1f} s"


def test_a_collective_broken_by_another_ranks_death_is_one_line(monkeypatch):
    from mmrl.distributed.launch import lost_rank_message

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:33445: "
                        "Connection reset by peer. This is typically caused by a remote worker hanging ...")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert lost_rank_message(gloo) is None  # no launched world: no other rank
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert lost_rank_message(gloo) == ("another rank of the torchrun world is gone (connection reset by peer) while "
                                          "rank 0 was in a collective with it; its own output says why")
    assert lost_rank_message(RuntimeError("CUDA out of memory")) is None
    assert lost_rank_message(ConnectionResetError("Connection reset by peer")) is None  # (an OSError: not gloo's)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [2, 0])
def test_kill_9_with_a_shared_rollout_rank_ends_every_rank_with_one_line(model, tmp_path, victim):
    """2 trainer ranks served by ONE rollout rank (rank 2). Its kill: both trainers name it, each in one line. Trainer
    rank 0's kill: trainer rank 1 (in a collective with it) says another rank is gone, the rollout rank says its
    trainer is gone and exits. All within seconds, the last checkpoint whole."""
    out, port = tmp_path / "run", _free_port()
    args = [*_args(model), *LAYOUTS["shared"][0], "rollout.max_staleness=1", "train.max_steps=1000",
            "train.save_every=2", f"output_dir={out}"]
    errs = [tmp_path / f"rank{r}.txt" for r in range(3)]
    procs = [_rank(r, port, args, errs[r], world=3) for r in range(3)]
    took = _kill_past_a_checkpoint(procs, out, errs, victim)
    if victim == 2:
        expected = {r: (2, rf"mmrl: error: rollout rank 2 of the torchrun world {GONE} while the trainer waited for "
                           r".*{hint}") for r in (0, 1)}
    else:
        expected = {1: (2, rf"mmrl: error: another rank of the torchrun world {GONE} while rank 1 was in a collective "
                           r"with it; its own output says why{hint}"),
                    2: (1, rf"mmrl: rollout rank 2: its trainer rank 0 {GONE}; exiting")}
    _assert_each_rank_ended(procs, out, errs, expected)
    assert took < 30, f"{took:.1f} s"
