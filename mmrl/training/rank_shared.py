"""A rollout rank serving several trainer ranks (`dist.rollout_ranks: K` in a world of M + K ranks, K dividing M and
K < M; `mmrl.training.rank_rollout`): rollout rank M + j serves trainer ranks j*n to j*n + n - 1 (n = M / K) with
ONE producer (one model), making each one's batches in turn, each exactly as that trainer rank's own rollout rank
(or rollout process) would make it:

- its share: the producer's `shards` is set to the trainer rank's (`DistContext(rank, M)`) for its batch;
- its data position: one per trainer rank (the producer's `state_dict`: the "state" message of its start, then the
  position after each of its batches), loaded before its batch;
- its random stream: carried by its tickets, as always (k = 0: the trainer's RNG state, taken back with the batch;
  k > 0: a seed of (seed, trainer rank, step)), so nothing of it is kept here;
- its weights: those of its ticket's version. After a DDP update every trainer rank holds the same weights, so
  only the first trainer rank of the set sends tensors; the others send their "weights" message without them (the
  version alone, which orders their tickets on their own channel as the tensors would). A ticket of version v is
  made once the first trainer's version v is here; the versions are kept until no trainer rank can ask for them
  (each one's newest version only grows), at most the few the trainer ranks' lockstep spans.

The schedule and `rollout.max_staleness` are therefore unchanged (a batch's version is fixed by its trainer rank's
channel, whatever the order the batches are made in), as are the in-flight batches each trainer rank saves with its
checkpoints. The order: the lowest step first (the trainer ranks wait for the same step together)."""

from __future__ import annotations

import copy
import queue as queue_mod
import threading
import time
from typing import Any, Callable

from mmrl.distributed import DistContext
from mmrl.training.async_worker import make_batch
from mmrl.training.payloads import unpack_tensors


class Tagged:
    """A `RankChannel`'s inbox putting (trainer rank, message) into the rollout rank's one queue."""

    def __init__(self, inbox: queue_mod.Queue, rank: int):
        self.inbox, self.rank = inbox, rank
        self.heard = threading.Event()  # a first message came

    def put(self, msg: tuple) -> None:
        self.inbox.put((self.rank, msg))
        self.heard.set()


def until_all_stopped(inbox: queue_mod.Queue, channels: list[Any]) -> Callable[[], tuple]:
    """`run_producer`'s `get` after an error: the served trainer ranks' messages, ("stop",) once each one's channel
    read its "stop" (also those read before the error)."""

    def get() -> tuple:
        while not all(c.stopping for c in channels):
            msg = inbox.get()[1]
            if msg[0] != "stop":
                return msg
        return ("stop",)

    return get


def serve_shared(producer: Any, meter: Any, ranks: list[int], world: int, inbox: queue_mod.Queue,
                 send: Callable[[int, tuple], Any]) -> None:
    """Serve trainer ranks `ranks` (of `world` trainer ranks; the first sends the weights) until each one sent "stop":
    `inbox` holds (trainer rank, message), `send(rank, msg)` answers one (module docstring)."""
    if not hasattr(producer, "shards"):
        raise TypeError(f"{type(producer).__name__}: a rollout rank serving several trainer ranks sets the producer's "
                        f"`shards` (a DistContext) per trainer rank; this producer has none")
    marks: dict[int, int] = {}  # each trainer rank's newest version (its channel's last "weights" message)
    tickets: list[tuple[int, int, int, tuple]] = []  # (step, trainer rank, version, "produce" message) not made yet
    weights: dict[int, dict] = {}  # version -> the first trainer rank's packed tensors
    states: dict[int, dict] = {}  # trainer rank -> its data position
    loaded, stopped = None, set()
    idle, load_s = dict.fromkeys(ranks, 0.0), dict.fromkeys(ranks, 0.0)
    mark = dict.fromkeys(ranks, time.perf_counter())
    while len(stopped) < len(ranks):
        due = [t for t in tickets if t[2] in weights]
        if due:
            ticket = min(due, key=lambda t: t[:2])
            tickets.remove(ticket)
            _, rank, version, msg = ticket
            t0 = time.perf_counter()
            if version != loaded:
                producer.load_weights(unpack_tensors(weights[version]))
                loaded = version
            producer.shards = DistContext(rank=rank, world_size=world)
            producer.load_state_dict(copy.deepcopy(states[rank]))
            t1 = time.perf_counter()
            batch, now = make_batch(producer, meter, msg, version, t1, idle=idle[rank],
                                    load_s=load_s[rank] + t1 - t0, mark=mark[rank])
            states[rank] = copy.deepcopy(producer.state_dict())
            send(rank, batch)
            idle[rank], load_s[rank], mark[rank] = 0.0, 0.0, now
            continue
        t0 = time.perf_counter()
        rank, msg = inbox.get()
        for r in ranks:
            idle[r] += time.perf_counter() - t0
        kind = msg[0]
        if kind == "stop":
            stopped.add(rank)
            tickets = [t for t in tickets if t[1] != rank]  # its batches not made yet: nobody will read them
        elif kind == "weights":
            marks[rank] = int(msg[1])
            if msg[2] is not None:
                weights[int(msg[1])] = msg[2]
            if len(marks) == len(ranks):  # (a trainer rank not heard of yet may need any version)
                oldest = min([marks[r] for r in ranks if r not in stopped] + [t[2] for t in tickets], default=None)
                for v in [v for v in weights if oldest is None or v < oldest]:
                    del weights[v]
        elif kind == "state":
            states[rank] = msg[1]
        elif kind == "produce":
            tickets.append((int(msg[1]), rank, marks[rank], msg))
        else:
            raise ValueError(f"rollout rank: unknown message {kind!r} from trainer rank {rank}")
