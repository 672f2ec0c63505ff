"""Rollout ranks apart from trainer ranks in one torch.distributed world (`rollout.worker: ranks`,
`dist.rollout_ranks: K`): the rollout process of `mmrl.training.async_rollout` as a rank of the torchrun world.

    torchrun --nproc-per-node 2 -m mmrl.cli train CONFIG rollout.worker=ranks dist.rollout_ranks=1 \\
        rollout.max_staleness=1     # 1 trainer + 1 rollout rank (--nproc-per-node 4 dist.rollout_ranks=2: 2 + 2)

    if serve_rollout_rank(cfg, BUILDER):   # first thing in the recipe: a rollout rank serves here, then its run ends
        return {}
    ...                                    # a trainer rank: the recipe as with rollout.worker=process

In a world of 2K processes the first K train and the last K generate and score: rank K + i serves trainer rank i (its
data shard, as trainer rank i's rollout process would). In a world of M + K (K dividing M, K < M) rank M + j serves
trainer ranks j*n to j*n + n - 1 (n = M / K) with one producer, their batches in turn (`rank_shared`). A rollout rank
builds the same producer a rollout process builds (`async_worker.run_producer`, the same message loop), a trainer rank
drives it through `RankRollout`: `AsyncRollout` with its messages on a `RankChannel` instead of multiprocessing queues.
Everything else is the process mode's: the schedule and `rollout.max_staleness` (k = 0 equals the synchronous run),
in-flight batches saved with checkpoints and never regenerated, the metrics. The trainer ranks' default process group
holds them alone (`DistContext.init(store=...)` on the launcher's store): every collective of the recipe (DDP, FSDP, the
advantages' all-gather, metrics, checkpoint barriers, DCP) involves the trainer ranks only; a rollout rank joins no
default group.

On the channel (point to point, send / recv with one tag per direction): every message is a size and
its pickled bytes as a uint8 tensor; the weights of a push follow their header as the flat buffers of
`payloads.pack_tensors` (one tensor per dtype). A reader thread on each side receives into a local queue, so the
trainer polls it as it polls the rollout process's queue. The channel of a pair is always a gloo group of its two
ranks (beside NCCL trainer groups too): a receive kept waiting on NCCL's stream would block the sends of the other
direction, so weights and batches go through host memory. A peer that dies closes its connection: gloo's pending
receive fails at once, and the survivor ends with one line naming the rank (a trainer: `RolloutProcessError`, a
RunError: the last complete checkpoint stays and the CLI prints the resume hint; a rollout rank: exits 1); the other
trainer ranks then fail in their next collective (`mmrl.distributed.launch.lost_rank_message`: one line too).

Supported: K trainer ranks and K rollout ranks (one node or several with torchrun's `--nnodes`), the HF and vLLM rollout
engines (a rollout rank joins no process group of the world, so vLLM's in-process engine makes its own); a rollout rank
serving several trainer ranks with the HF engine (vLLM refused: its one random stream). Exercised on CPU with gloo
(worlds of 2, 3 and 4; vLLM's CPU build with 2); NCCL, GPUs and several nodes are not (benchmarks/gpu_check.py runs it).
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import sys
import threading
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from mmrl.distributed.launch import peer_gone
from mmrl.training.async_rollout import (WORKERS, AsyncRollout, RolloutProcessError,  # noqa: F401 (re-exported)
                                         check_rollout_ranks)
from mmrl.training.async_worker import run_producer
from mmrl.training.rank_shared import Tagged, serve_shared, until_all_stopped
from mmrl.training.payloads import decode, encode, pack_tensors

__all__ = ["RankChannel", "RankRollout", "check_rollout_ranks", "serve_rollout_rank"]

TO_ROLLOUT, TO_TRAINER = 11, 12  # the tags of the two directions
# a channel's receive waits for the peer's next message: a trainer's evaluation or checkpoint at real scale may take
# longer than gloo's default 30 minutes, and a peer that dies closes its connection (noticed at once), so the wait
# itself need not time out
CHANNEL_TIMEOUT = datetime.timedelta(days=7)
# a trainer rank's rollout rank (global rank), the pair's gloo group and whether it sends the weights' tensors
_PEER: tuple[int, Any, bool] | None = None


def rank_rollout(cfg: Any, **kw: Any) -> RankRollout:
    """The trainer rank's `RankRollout` (after `serve_rollout_rank` returned False on it)."""
    if _PEER is None:
        raise RuntimeError("rollout.worker=ranks: the recipe must call serve_rollout_rank(cfg, builder) first")
    return RankRollout(cfg=cfg, peer=_PEER[0], group=_PEER[1], sends_weights=_PEER[2], **kw)


WORKERS["ranks"] = rank_rollout  # rollout_process() makes it for rollout.worker=ranks (this module imported by then)


def _reason(exc: BaseException) -> str:
    """How a peer's connection ended, short: gloo's "Connection closed/reset by peer" without its advice."""
    text = str(exc)
    return peer_gone(exc) or (text.splitlines()[0][:200] if text else type(exc).__name__)


class RankChannel:
    """Messages to and from the other rank of a pair's gloo group `group` (module docstring): `peer` is its rank in
    that group, `name` its global rank. `on_gone(reason)`: called by the reader thread when the peer's connection
    ends (default: a ("gone", reason) message in the inbox)."""

    def __init__(self, peer: int, group: Any, send_tag: int, recv_tag: int,
                 on_gone: Callable[[str], None] | None = None, name: int | None = None, inbox: Any = None):
        self.peer, self.group, self.send_tag, self.recv_tag = peer, group, send_tag, recv_tag
        self.inbox: Any = queue_mod.Queue() if inbox is None else inbox  # (given: a `rank_shared.Tagged`)
        self.stopping = False  # "stop" was read: the peer's end that follows is no failure
        self.on_gone = on_gone or (lambda reason: self.inbox.put(("gone", reason)))
        threading.Thread(target=self._read, daemon=True, name=f"mmrl-rank-channel-{name}").start()

    def send(self, msg: tuple) -> None:
        flats: list[torch.Tensor] = []
        if msg[0] == "weights" and msg[2] is not None:  # the flat buffers go as tensors after the header
            packed = msg[2]
            flats = list(packed["flat"].values())
            msg = (msg[0], msg[1], {**packed, "flat": {k: (t.numel(), t.dtype) for k, t in packed["flat"].items()}})
        data = torch.frombuffer(bytearray(encode(msg)), dtype=torch.uint8)
        for t in (torch.tensor([data.numel()], dtype=torch.int64), data, *flats):
            # (the group's own send: it is no group of torch.distributed's registry, which has the trainers' only)
            self.group.send([t.detach().cpu().contiguous()], self.peer, self.send_tag).wait()

    def _recv(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(n, dtype=dtype)
        self.group.recv([t], self.peer, self.recv_tag).wait()
        return t

    def _read(self) -> None:
        try:
            while True:
                size = int(self._recv(1, torch.int64)[0])
                msg = decode(self._recv(size, torch.uint8).numpy().tobytes())
                if msg[0] == "weights" and msg[2] is not None:
                    flat = {k: self._recv(n, dtype) for k, (n, dtype) in msg[2]["flat"].items()}
                    msg = (msg[0], msg[1], {**msg[2], "flat": flat})
                self.stopping = self.stopping or msg[0] == "stop"
                self.inbox.put(msg)
        except Exception as exc:  # noqa: BLE001 - the peer's connection ended (gloo: "Connection closed by peer")
            if not self.stopping:
                self.on_gone(_reason(exc))

    def get(self, timeout: float) -> tuple | None:
        try:
            return self.inbox.get(timeout=timeout)
        except queue_mod.Empty:
            return None


class RankRollout(AsyncRollout):
    """`AsyncRollout` whose producer runs on rollout rank `peer` of the launcher's world (module docstring)."""

    def __init__(self, builder: str, cfg: Any, *, peer: int, group: Any, sends_weights: bool = True, **kw: Any):
        self.peer, self.group, self.sends_weights = int(peer), group, sends_weights
        super().__init__(builder, cfg, **kw)

    def _open(self, builder: str, cfg: Any, threads: int) -> None:
        self.channel = RankChannel(1, self.group, TO_ROLLOUT, TO_TRAINER, name=self.peer)
        self.closed = False
        self._finalizer = weakref.finalize(self, lambda: None)

    def _launch(self) -> None:
        pass  # the rollout rank builds its producer as it starts (`serve_rollout_rank`)

    def _push_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        # a rollout rank serving several trainer ranks loads the first one's weights (every trainer rank holds the
        # same after a DDP update): the others send the version alone, which orders their tickets (`rank_shared`)
        self._send("weights", version, pack_tensors(weights) if self.sends_weights else None)

    def _gone(self, reason: str, waiting_for: str) -> RolloutProcessError:
        self.closed = True
        return RolloutProcessError(f"rollout rank {self.peer} of the torchrun world is gone ({reason}) while the "
                                   f"trainer waited for {waiting_for}")

    def _send(self, *msg: Any) -> None:
        try:
            self.channel.send(msg)
        except RuntimeError as exc:
            raise self._gone(_reason(exc), f"it to take a {msg[0]} message") from None

    def _get(self, timeout: float, waiting_for: str) -> tuple | None:
        msg = self.channel.get(timeout)
        if msg is not None and msg[0] == "gone":
            raise self._gone(msg[1], waiting_for)
        return msg

    def close(self) -> None:
        """Tell the rollout rank to stop (idempotent; nothing when it is gone)."""
        from mmrl.training.async_rollout import _OPEN

        _OPEN.discard(self)
        if not self.closed:
            self.closed = True
            try:
                self.channel.send(("stop",))
            except Exception:  # noqa: BLE001 - the rollout rank is gone already
                pass


def serve_rollout_rank(cfg: Any, builder: str) -> bool:
    """With `dist.rollout_ranks`: join the launcher's world; on a rollout rank run the producer `builder` for its
    trainer rank(s) until they stop it, and return True (the rank's run is over); on a trainer rank make the
    trainer ranks' default process group (what `DistContext.init` returns from now on) and return False. Without:
    False, nothing done."""
    from mmrl.distributed import DistContext
    from mmrl.distributed.launch import _env_int

    check_rollout_ranks(cfg)
    if cfg.dist.rollout_ranks == 0:
        return False
    if dist.is_initialized():  # (its group would span the rollout ranks too)
        raise ValueError("rollout.worker=ranks: a torch.distributed process group exists already (made by a launcher "
                         "such as accelerate?); launch with torchrun, which leaves it to the recipe")
    # the launcher's store (torchrun's agent store, or rank 0's): the trainers' group and each pair's channel meet on
    # it under their own prefixes, so no process group spans the whole world
    store, rank, world = next(dist.rendezvous("env://"))
    trainers = world - cfg.dist.rollout_ranks
    n = trainers // cfg.dist.rollout_ranks  # trainer ranks per rollout rank: trainer i is served by trainers + i // n

    def pair_store(i: int) -> Any:  # where trainer rank i's channel meets
        return dist.PrefixStore(f"mmrl/rollout_pair/{i}", store)

    if rank < trainers:
        DistContext.init(cfg.dist.backend, store=dist.PrefixStore("mmrl/trainers", store), rank=rank, world=trainers)
        global _PEER
        _PEER = (trainers + rank // n, dist.ProcessGroupGloo(pair_store(rank), 0, 2, CHANNEL_TIMEOUT), rank % n == 0)
        return False
    served = list(range((rank - trainers) * n, (rank - trainers + 1) * n))
    local = _env_int("LOCAL_RANK")
    device = DistContext._rank_device(cfg.dist.backend, rank if local is None else local, None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    groups = {i: dist.ProcessGroupGloo(pair_store(i), 1, 2, CHANNEL_TIMEOUT) for i in served}

    once = threading.Lock()

    def trainer_gone(pair: int, reason: str) -> None:
        if once.acquire(blocking=False):  # one line, whichever thread sees the end first; it ends the process
            print(f"mmrl: rollout rank {rank}: its trainer rank {pair} is gone ({reason}); exiting",
                  file=sys.stderr, flush=True)
            os._exit(1)
        threading.Event().wait()  # the other thread is printing and ending the process

    merged: queue_mod.Queue = queue_mod.Queue()  # several trainer ranks: (trainer rank, message) of every channel
    inboxes = {i: Tagged(merged, i) for i in served} if n > 1 else {}
    channels = {i: RankChannel(0, groups[i], TO_TRAINER, TO_ROLLOUT, on_gone=lambda why, i=i: trainer_gone(i, why),
                               name=i, inbox=inboxes.get(i)) for i in served}
    ro = cfg.rollout
    threads = ro.worker_threads or getattr(cfg, "num_threads", 0) or torch.get_num_threads()
    # the producer is built once the trainers' first messages are here, sent after each built its policy: a
    # model the run builds on the fly (model.build_tiny) is written by a trainer alone, then read here
    if n == 1:
        channel = channels[served[0]]
        pending = [channel.get(None)]
        run_producer(builder, cfg, served[0], trainers, str(device), threads,
                     lambda: pending.pop() if pending else channel.get(None), channel.send)
    else:
        for inbox in inboxes.values():
            inbox.heard.wait()

        def put_all(msg: tuple) -> None:
            for i in served:
                channels[i].send(msg)

        run_producer(builder, cfg, served[0], trainers, str(device), threads,
                     until_all_stopped(merged, list(channels.values())), put_all,
                     loop=lambda producer, meter, get, put: serve_shared(
                         producer, meter, served, trainers, merged, lambda i, msg: channels[i].send(msg)))
    if not all(c.stopping for c in channels.values()):
        # no "stop": a trainer's connection broke (a send here failed first); the reader thread says why and ends
        # the process with status 1 (a normal return would race it to status 0)
        time.sleep(30)
        trainer_gone(next(i for i in served if not channels[i].stopping), "no stop message, connection silent")
    return True
