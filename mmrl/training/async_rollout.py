"""Rollouts in their own process, ahead of the trainer by at most `rollout.max_staleness` policy versions.

    pipe = rollout_process(cfg, ctx, run, "mmrl.vlm.rollout_worker:VLMRolloutProducer", stateful)  # None: inline
    start, _ = restore_checkpoint(ctx, run, states, stateful)   # stateful["async_rollout"]: in-flight batches
    pipe.start(start, policy_weights(states))                    # this version's weights + the data position
    for step in range(start + 1, N + 1):
        payload, metrics = pipe.next(step)                       # the batch of `step`, tagged with its version
        ... advantages, update (decoupled PPO / rollout correction for the off-policy gap) ...
        metrics |= pipe.push(step, policy_weights(states, only=params))   # after every update

The rollout process (``torch.multiprocessing``, spawn) builds a *producer* from the run's config: its own copy of
the policy (the HF model, a vLLM engine, or a diffusion pipeline), the reward and the data stream. It serves one
FIFO channel of three messages: ``weights`` (the trainer's "default" policy state after update v, copied into the
producer's model: `load_weights`), ``state`` (the data position on start and resume) and ``produce`` (generate and
score the batch of step t). Batches come back on a second channel, tagged with the version of the weights that
produced them, as the bytes of a torch.save archive (`payloads.encode`); the weights of one push cross through
shared memory (torch.multiprocessing's queue reductions), packed into one flat buffer per dtype.

Schedule (k = max_staleness). When the trainer asks for the batch of step t (`next(t)`) it first sends the ticket
of step t+k; the weights of version t-1 were pushed before it (after update t-1) and the channel is FIFO, so the
batch of step t is generated with exactly version max(0, t-1-k), whatever the timing: an async run is reproducible,
its staleness at step t is min(k, t-1), and while the trainer trains step t the rollout process works on the batches
up to t+k. With k = 0 the ticket carries the trainer's RNG state, which the trainer takes back with the batch: the
rollout process then computes exactly what the synchronous loop would (the same random stream, the same weights):
equal metrics (tested). With k > 0 the rollout noise of step t comes from a seed of (seed, rank, t) (`rank_seed`),
a stream of its own. A run makes the k batches after its last step too (while it trains its last k steps); they
are saved with the final checkpoint, so a run extended later (a larger train.max_steps) continues exactly.

Resume rule: **in-flight batches are saved, never regenerated** (regenerating them would need the older weights
that produced them). `state_dict()` (called by `save_checkpoint`) first waits for every submitted ticket, then
returns the finished batches (as plain tensors / numbers / strings, loadable with ``weights_only=True``) together
with the data position after the newest one. A resumed run consumes the saved batches, sends the weights of its
restored version and continues the schedule: exactly the uninterrupted run (tested). A checkpoint therefore costs
the wait for up to k batches.

Metrics of `next` / `push`: ``rollout/staleness/mean|max|count_<s>`` (trainer version - batch version),
``rollout/policy_version``; timing-dependent (under ``time/``): ``time/async/wait_s`` (trainer waiting for and
receiving the batch), ``time/async/queue_length`` (finished batches waiting when the trainer asks),
``time/async/weight_push_s``, ``time/async/weight_load_s``, and the producer's own ``time/*`` (rollout, reward).
Of `step_metrics` (from the step tail, which knows the step's wall time): the overlap metrics ``async/*``
(`mmrl.training.overlap`: idle fractions of both sides, the rollout and training seconds R and T, the ideal and the
achieved speed-up), timing-dependent too.

Several processes (DDP under torchrun, also across machines): every trainer rank starts its own rollout process on
its node and pushes to it; each producer generates its rank's share. Checkpoints gather every rank's in-flight
batches to rank 0 (`gather_for_checkpoint`, a collective) and resume on the same number of ranks. FSDP is refused:
the rollout process needs whole weights.

source: the design facts in verl (fully_async_policy, v1 separate_async), AReaL (max_head_offpolicyness,
decoupled PPO), slime (train_async: one-step-off), OpenRLHF (async queue; queued batches are not saved there).
"""

from __future__ import annotations

import os
import queue as queue_mod
import sys
import time
import weakref
from typing import Any, Callable, Iterable, Protocol

import torch

from mmrl.distributed import rank_seed
from mmrl.run.files import RunError
from mmrl.run.start import close_on_failure
from mmrl.runtime import get_rng_state, how_process_ended as _how_it_ended, set_rng_state
from mmrl.training.async_worker import POLL_S, quiet_resource_sharer, worker_main
from mmrl.training.overlap import overlap_metrics, staleness_metrics
from mmrl.training.payloads import decode, encode, from_plain, pack_tensors

__all__ = ["AsyncRollout", "RolloutProducer", "rollout_process", "policy_weights", "load_policy_weights",
           "check_async_rollout", "ASYNC_SEED_RANK", "RolloutProcessError"]

ASYNC_SEED_RANK = 500_000
"""Rank offset of the rollout processes' per-step seeds (max_staleness > 0): `rank_seed(seed, ASYNC_SEED_RANK + rank,
step)` never equals a trainer rank's seed."""

_OPEN: "weakref.WeakSet[AsyncRollout]" = weakref.WeakSet()  # rollout processes of this process not yet closed


def open_rollouts() -> set[int]:
    """Ids of this process's open `AsyncRollout`s (for `close_rollouts`)."""
    return {id(p) for p in _OPEN}


def close_rollouts(since: set[int]) -> None:
    """Stop every rollout process opened after `open_rollouts()` returned `since`: a recipe that raised stops its
    rollout process at once (`mmrl.run.closes_runs`), not when its traceback is dropped."""
    for pipe in list(_OPEN):
        if id(pipe) not in since:
            pipe.close()


close_on_failure(open_rollouts, close_rollouts, set())  # closes_runs stops them when a recipe raises


class RolloutProcessError(RunError):
    """The rollout process died; the message names it, how it ended and what the trainer waited for (a RunError: the
    CLI prints it as one line with the resume hint)."""


class RolloutProducer(Protocol):
    """What a recipe's producer class (built in the rollout process as ``cls(cfg, rank, world, device)``: the
    trainer rank's device) provides. A rollout rank serving several trainer ranks (`mmrl.training.rank_shared`) also
    sets its `shards` (a `DistContext`: the share it generates) to each trainer rank's before its batch."""

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy these "default"-state tensors (`PolicyStates.state_tensors` keys) into the producer's policy."""

    def produce(self, step: int) -> tuple[Any, dict[str, float]]:
        """(payload, metrics) of step `step`: rollouts and rewards, in any structure `to_plain` accepts."""

    def state_dict(self) -> dict:
        """The producer's resumable state (the data position), by the names the trainer mirrors."""

    def load_state_dict(self, state: dict) -> None:
        ...

def check_rollout_ranks(cfg: Any, world: int | None = None) -> None:
    """One-line errors for settings the rollout ranks do not support (`world`: the launched processes; None: read
    WORLD_SIZE, as torchrun sets it)."""
    k, worker = cfg.dist.rollout_ranks, cfg.rollout.worker
    if k == 0 and worker != "ranks":
        return
    if k == 0:
        raise ValueError("rollout.worker=ranks needs dist.rollout_ranks >= 1 (the ranks of the torchrun world that "
                         "generate, one per trainer rank); or use rollout.worker=process (a rollout process beside "
                         "each trainer)")
    if worker != "ranks":
        raise ValueError(f"dist.rollout_ranks={k} needs rollout.worker=ranks, got rollout.worker={worker}")
    if world is None:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    trainers = world - k
    if trainers < k or trainers % k:
        raise ValueError(f"dist.rollout_ranks={k} with {world} launched process(es): expected {k} rollout ranks after "
                         f"a multiple of {k} trainer ranks, each rollout rank serving as many (torchrun "
                         f"--nproc-per-node {2 * k}: the first {k} train, rank {k} + i generates for trainer rank i; "
                         f"{3 * k}: the first {2 * k} train, rank {2 * k} + i for trainer ranks 2i and 2i + 1)")
    if trainers > k and getattr(cfg.rollout, "engine", None) == "vllm":
        raise ValueError(f"rollout.engine=vllm with a rollout rank serving {trainers // k} trainer ranks is not "
                         f"supported (the engine samples from one random stream of its own, which cannot be kept "
                         f"per trainer rank); launch {2 * k} processes (one rollout rank per trainer rank) or use "
                         f"rollout.engine=hf")


def check_async_rollout(cfg: Any, multi_process: bool | None = None, recomputes_old: bool = False) -> None:
    """One-line errors for combinations the rollout process does not support (the section's own checks run when
    the config loads: max_staleness >= 0, max_staleness > 0 only with worker=process). `multi_process`: several
    trainer processes (None: read WORLD_SIZE, as set by torchrun, less `dist.rollout_ranks`). `recomputes_old`: the
    recipe takes pi_old from a trainer forward (decoupled PPO); with stale batches that needs the importance weights
    pi_old / pi_rollout."""
    ro = cfg.rollout
    algo = getattr(cfg, "algo", None)
    correction = getattr(algo, "rollout_correction", None)
    if recomputes_old and ro.max_staleness > 0 and not (correction is not None and correction.enabled):
        # measured on the tiny VLM recipe at k=1: without the weights its entropy went 1.0 -> 6.9 (uniform) in 15 steps
        raise ValueError(f"rollout.max_staleness={ro.max_staleness} with pi_old recomputed by the trainer (algo."
                         f"old_logprobs={algo.old_logprobs}) needs algo.rollout_correction (e.g. algo."
                         f"rollout_correction.is_level=token: weights pi_old / pi_rollout, decoupled PPO), else the "
                         f"stale samples count as drawn by pi_old; or use algo.old_logprobs=rollout (bypass: the ratio "
                         f"against the policy that sampled)")
    check_rollout_ranks(cfg)
    if multi_process is None:  # (the trainer processes: a world with rollout ranks has as many of them)
        multi_process = int(os.environ.get("WORLD_SIZE", "1") or 1) - cfg.dist.rollout_ranks > 1
    if ro.worker not in ("process", "ranks"):
        return
    side, trainers = ("rollout process", "processes") if ro.worker == "process" else ("rollout rank", "trainer ranks")
    strategy = getattr(getattr(cfg, "dist", None), "strategy", "none")
    if strategy == "fsdp":
        raise ValueError(f"rollout.worker={ro.worker} with dist.strategy=fsdp is not supported (the {side} needs "
                         f"whole weights, FSDP shards them); use dist.strategy=ddp or rollout.worker=inline")
    if multi_process and getattr(algo, "dynamic_sampling", False):
        raise ValueError(f"rollout.worker={ro.worker} with several {trainers} and algo.dynamic_sampling=true is not "
                         f"supported (the generation rounds need a count over all ranks); use one process or "
                         f"rollout.worker=inline")


def rollout_process(cfg: Any, ctx: Any, run: Any, builder: str, stateful: dict[str, Any],
                    mirror: Iterable[str] = ("data",)) -> "AsyncRollout | None":
    """The recipe's `AsyncRollout` when `rollout.worker=process` (None: inline rollouts), registered in `stateful`
    as "async_rollout" (its in-flight batches go into checkpoints) and keeping the `mirror` entries of `stateful`
    (the data position) equal to the producer's. Start it with `.start(...)` after `restore_checkpoint`."""
    ro = cfg.rollout
    if ro.worker == "inline":
        return None
    check_async_rollout(cfg, multi_process=ctx.enabled)
    make = WORKERS.get(ro.worker)
    if make is None:  # "ranks": registered by mmrl.training.rank_rollout, which the recipe imports to serve the rank
        raise RuntimeError(f"rollout.worker={ro.worker}: the recipe must call serve_rollout_rank(cfg, builder) first")
    pipe = make(builder=builder, cfg=cfg, max_staleness=ro.max_staleness, last_step=cfg.train.max_steps, seed=cfg.seed,
                        rank=ctx.rank, world=ctx.world_size,
                        threads=ro.worker_threads or cfg.num_threads or torch.get_num_threads(),
                        device=run.device, mirror={name: stateful[name] for name in mirror})
    stateful["async_rollout"] = pipe
    return pipe


# ------------------------------------------------------------------------------------------ weights


def policy_weights(states: Any, only: Iterable[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The "default" policy state's live tensors by their state-independent keys (`PolicyStates.state_tensors`):
    LoRA weights, or the full-fine-tuning parameters. `only`: just those tensors (e.g. the optimizer's parameters:
    what an update can change)."""
    tensors = states.state_tensors("default")
    if only is None:
        return tensors
    storage = {p.data_ptr() for p in only}  # (full fine-tuning hands out `p.data`: the same storage, another object)
    return {k: t for k, t in tensors.items() if t.data_ptr() in storage}


# ------------------------------------------------------------------------------------------ the rollout process
# (its own side: mmrl.training.async_worker)


def _shutdown(proc: Any, inbox: Any) -> None:
    """Stop the rollout process (finalizer: also when the trainer fails between steps)."""
    try:
        if proc.pid is not None and proc.is_alive():
            inbox.put(("stop",))
            proc.join(timeout=10)
        if proc.pid is not None and proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        # the process is gone: this process's exit must not wait to hand it messages (a full pipe would block it)
        inbox.cancel_join_thread()
    except Exception:  # noqa: BLE001 - interpreter shutdown
        pass


class AsyncRollout:
    """The trainer's side of one rollout process (module docstring).

    Args:
        builder: "module:Class" of the producer, built in the new process as ``Class(cfg, rank, world, device)``.
        cfg: the run's config (pickled to the process).
        max_staleness: k; see the module docstring.
        last_step: train.max_steps (no weights are pushed after it).
        seed: the run's seed (k > 0: per-step rollout seeds).
        rank, world: this trainer's rank and the number of trainer ranks (the producer generates its share).
        threads: torch threads of the rollout process (0 = torch's default there).
        device: the trainer's device: the producer's too, and where `next` puts the payload's tensors (None: CPU).
        mirror: trainer-side objects kept equal to the producer's state of the same name after every batch
            received (e.g. {"data": data}): what the trainer's checkpoint saves of the data position.
    """

    def __init__(self, builder: str, cfg: Any, *, max_staleness: int, last_step: int, seed: int, rank: int = 0,
                 world: int = 1, threads: int = 0, device: torch.device | str | None = None,
                 mirror: dict[str, Any] | None = None):
        if max_staleness < 0:
            raise ValueError(f"rollout.max_staleness: expected >= 0 (0 = synchronous), got {max_staleness}")
        self.k, self.last_step, self.seed, self.rank, self.world = int(max_staleness), int(last_step), int(seed), \
            int(rank), int(world)
        self.device, self.mirror = device, dict(mirror or {})
        self._open(builder, cfg, int(threads))
        _OPEN.add(self)
        self.ready: dict[int, tuple] = {}  # step -> (plain payload, state, info), finished and not yet consumed
        self.submitted = 0  # newest step whose ticket was sent (or whose batch was restored)
        self.consumed = 0  # newest step whose batch the trainer took
        self.version: int | None = None  # newest version pushed
        self._gathered: list | None = None
        self._step: dict[str, float] | None = None  # this step's timings for `step_metrics`

    # ---------------------------------------------------------------- messages (a rollout process's queues; a
    # rollout rank's channel: `mmrl.training.rank_rollout` overrides these four)
    def _open(self, builder: str, cfg: Any, threads: int) -> None:
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=worker_main, args=(builder, cfg, self.rank, self.world,
                                                            str(self.device or "cpu"), threads, self.inbox,
                                                            self.outbox),
                                daemon=True, name=f"mmrl-rollout-{self.rank}")
        self._finalizer = weakref.finalize(self, _shutdown, self.proc, self.inbox)

    def _launch(self) -> None:
        quiet_resource_sharer()
        self.proc.start()  # (torch.multiprocessing spawn: a script that trains needs `if __name__ == "__main__":`)
        # the trainer only reads `outbox`: with the rollout process holding the only write end, a batch cut by its
        # death (a kill -9 while the batch is half through the pipe) ends in EOF instead of a read that never returns
        self.outbox._writer.close()

    def _send(self, *msg: Any) -> None:
        self.inbox.put(msg)

    def _get(self, timeout: float, waiting_for: str) -> tuple | None:
        """One message from the rollout process (None after `timeout`); a RolloutProcessError once it is dead."""
        try:
            return self.outbox.get(timeout=timeout)
        except queue_mod.Empty:
            if self.proc.is_alive():
                return None
        except (OSError, EOFError):  # the pipe's end: a batch cut by the process's death (it is still exiting)
            self.proc.join(timeout=5)
            if self.proc.is_alive():
                raise
        self.close()
        code = self.proc.exitcode
        raise RolloutProcessError(f"rollout process (PID {self.proc.pid}, rank {self.rank}) {_how_it_ended(code)} "
                                  f"while the trainer waited for {waiting_for}" +
                                  ("; its output is above" if code is not None and code > 0 else "")) from None

    def _receive(self, waiting_for: str) -> None:
        """Block until one message arrives from the rollout process and file it; raise if the process failed."""
        msg = None
        while msg is None:
            msg = self._get(POLL_S, waiting_for)
        self._file(msg, waiting_for)

    def _file(self, msg: tuple, waiting_for: str) -> None:
        kind = msg[0]
        if kind == "error":
            exc, tb = msg[1], msg[2]
            self.close()
            print(f"[rollout process, rank {self.rank}] {tb.rstrip()}", file=sys.stderr, flush=True)
            raise exc
        if kind == "batch":
            step, batch = msg[1], decode(msg[2])
            state = batch["state"]
            self.ready[step] = (batch["payload"], state, batch["info"])
            for name, obj in self.mirror.items():  # the data position after the newest batch made
                obj.load_state_dict(state["producer"][name])
        # "ready": the producer is built (nothing to do)

    def _push_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self._send("weights", version, pack_tensors(weights))

    def _drain_nowait(self, waiting_for: str) -> None:
        """File the messages that have arrived, without waiting."""
        while (msg := self._get(0.0, waiting_for)) is not None:
            self._file(msg, waiting_for)

    def _submit(self, upto: int) -> None:
        """Send the tickets up to step `upto`. k = 0: with the trainer's RNG state (the synchronous loop's random
        stream); k > 0: with a seed of (seed, rank, step)."""
        while self.submitted < upto:
            t = self.submitted + 1
            if self.k == 0:
                self._send("produce", t, None, encode(get_rng_state()))
            else:
                self._send("produce", t, rank_seed(self.seed, ASYNC_SEED_RANK + self.rank, t), None)
            self.submitted = t

    # ---------------------------------------------------------------- the trainer's calls
    def start(self, step: int, weights: dict[str, torch.Tensor], producer_state: dict[str, Any] | None = None
              ) -> None:
        """Begin after `step` completed updates (0 = a fresh run): the data position (the `mirror` objects'
        state_dicts, plus `producer_state`), the weights of version `step`, then the tickets that are due."""
        state = {name: obj.state_dict() for name, obj in self.mirror.items()}
        state.update(producer_state or {})
        self._launch()
        self._send("state", state)
        self.version = self.consumed = int(step)
        self._push_weights(self.version, weights)
        self.submitted = max(self.submitted, self.version)

    def push(self, version: int, weights: dict[str, torch.Tensor]) -> dict[str, float]:
        """The weights after update `version` (not after the last step: no ticket of this run will use them; a
        resumed or extended run sends its weights in `start`)."""
        t0 = time.perf_counter()
        self.version = int(version)
        if self.version < self.last_step:
            self._push_weights(self.version, weights)
        push_s = time.perf_counter() - t0
        if self._step is not None:
            self._step["push_s"] += push_s
        return {"time/async/weight_push_s": push_s}

    def step_metrics(self, step_s: float) -> dict[str, float]:
        """The `async/*` overlap metrics of the step whose batch `next` returned last (`mmrl.training.overlap`),
        given its wall time `step_s` (`time/step_s`); called once per step by the step tail (`StepLoop`)."""
        timing, self._step = self._step, None
        return overlap_metrics(step_s=step_s, **timing) if timing is not None else {}

    def next(self, step: int) -> tuple[Any, dict[str, float]]:
        """The batch of `step` (blocks until it is made) and the step's async metrics."""
        if self.version is None:
            raise RuntimeError("AsyncRollout.next: call start() first")
        if self.version != step - 1:
            raise RuntimeError(f"AsyncRollout.next({step}): the weights of version {step - 1} were not pushed (newest: "
                               f"{self.version})")
        self._submit(step + self.k)  # ticket t is sent when the trainer asks for batch t-k: version t-1-k is pushed
        t0 = time.perf_counter()
        self._drain_nowait(f"the batch of step {step}")
        queue_length = sum(1 for s in self.ready if s >= step)
        while step not in self.ready:
            if self.submitted < step:
                raise RuntimeError(f"AsyncRollout.next({step}): no batch was requested for this step (newest "
                                   f"ticket {self.submitted}); steps must be consumed in order")
            self._receive(f"the batch of step {step}")
        wait = time.perf_counter() - t0
        plain, state, info = self.ready.pop(step)
        self.consumed = step
        if state["rng"] is not None:  # k = 0: continue the random stream where the rollout left it
            set_rng_state(state["rng"])
        metrics: dict[str, float] = {
            **staleness_metrics([self.version - info["version"]], self.k),
            "rollout/policy_version": float(info["version"]),
            "time/async/wait_s": wait, "time/async/queue_length": float(queue_length),
            "time/async/weight_load_s": info["weight_load_s"],
        }
        # the rest of the step's overlap metrics once its wall time is known (`step_metrics`); a batch saved by an
        # older mmrl has no produce_s: none for its step
        self._step = {"wait_s": wait, "push_s": 0.0, "rollout_s": info["produce_s"], "rollout_idle_s": info["idle_s"],
                      "rollout_wall_s": info["wall_s"]} if "produce_s" in info else None
        metrics.update(info["metrics"])
        self.last_flops = int(info.get("flops", 0))  # the recipe adds them to its meter (mmrl.perf.add_flops)
        return from_plain(plain, self.device), metrics

    # ---------------------------------------------------------------- checkpoints
    def _finish_submitted(self) -> None:
        while any(s not in self.ready for s in range(self.consumed + 1, self.submitted + 1)):
            self._receive(f"the in-flight batches before the checkpoint of step {self.consumed}")

    def _local_state(self) -> dict:
        self._finish_submitted()
        return {"submitted": self.submitted, "ready": {int(s): v for s, v in sorted(self.ready.items())}}

    def gather_for_checkpoint(self, ctx: Any) -> None:
        """Every rank, before a checkpoint (a collective under several processes): wait for the in-flight batches
        and collect every rank's on rank 0, whose `state_dict` then returns them all."""
        local = self._local_state()
        self._gathered = ctx.all_gather_object(local) if ctx.enabled else [local]

    def state_dict(self) -> dict:
        """{"max_staleness", "ranks": [per rank: {"submitted", "ready": {step: (payload, state, info)}}]}."""
        ranks = self._gathered if self._gathered is not None else [self._local_state()]
        self._gathered = None
        return {"max_staleness": self.k, "ranks": ranks}

    def load_state_dict(self, state: dict) -> None:
        """Take this rank's saved in-flight batches (call before `start`)."""
        ranks = state["ranks"]
        pending = sum(len(r["ready"]) for r in ranks)
        if pending and len(ranks) != self.world:
            raise ValueError(f"checkpoint holds in-flight rollout batches of {len(ranks)} trainer process(es); resume "
                             f"with the same number of processes ({len(ranks)}), not {self.world}")
        mine = ranks[self.rank] if self.rank < len(ranks) else {"submitted": 0, "ready": {}}
        self.ready = {int(s): tuple(v) for s, v in mine["ready"].items()}
        self.submitted = int(mine["submitted"]) if self.ready else 0

    def close(self) -> None:
        """Stop the rollout process (idempotent)."""
        _OPEN.discard(self)
        self._finalizer()


# rollout.worker -> the trainer side's class (or factory) made by rollout_process(); "ranks" is added by
# mmrl.training.rank_rollout (which imports this module, not the other way round)
WORKERS: dict[str, Callable[..., AsyncRollout]] = {"process": AsyncRollout}


@torch.no_grad()
def load_policy_weights(states: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Copy pushed "default"-state tensors (`policy_weights` keys) into `states` (a producer's own PolicyStates);
    a key it does not have is an error naming it (the trainer and the producer must build the same policy)."""
    live = states.state_tensors("default")
    missing = [k for k in tensors if k not in live]
    if missing:
        raise KeyError(f"rollout process: the trainer sent weights its policy does not have: {missing[:3]} "
                       f"({len(missing)} of {len(tensors)}); both must be built from the same model config")
    for k, t in tensors.items():
        live[k].copy_(t)
