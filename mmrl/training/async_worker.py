"""The rollout process's side of `mmrl.training.async_rollout`: its main loop (`worker_main`, the target of the
process the trainer spawns), and how it notices a dead trainer: a `kill -9` or an OOM kill of the trainer ends it
within `POLL_S`, whatever it is doing, so that no orphan keeps the device."""

from __future__ import annotations

import importlib
import os
import queue as queue_mod
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch

from mmrl.perf.meter import attach_flops_meter
from mmrl.runtime import get_rng_state, seed_everything, set_rng_state, tune_malloc
from mmrl.training.payloads import decode, encode, to_plain, unpack_tensors

POLL_S = 0.5  # how often a blocked side checks that the other one is still alive


def _import(spec: str) -> Callable:
    module, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _picklable(exc: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - an exception type that does not survive pickling
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _next_message(inbox: Any, parent: Any) -> tuple | None:
    """The next message for the rollout process; None once the trainer process is gone."""
    while True:
        try:
            return inbox.get(timeout=POLL_S)
        except queue_mod.Empty:
            pass
        except (OSError, EOFError):  # a message cut by the trainer's death, or whose shared tensors died with it
            pass
        if parent is not None and not parent.is_alive():
            return None


def _exit_with_trainer(parent: Any, rank: int) -> None:
    """A thread of the rollout process: end the process within `POLL_S` of its trainer's death (a `kill -9`, the
    OOM killer), whatever the process is doing (building the producer, generating): no orphan keeps the device.
    The trainer's end is seen on its sentinel pipe, or (should a process the trainer forked hold that pipe open) by
    this process being handed to another parent."""
    pid = parent.pid
    while parent.is_alive() and os.getppid() == pid:
        parent.join(timeout=POLL_S)
    _trainer_gone(pid, rank)


_GONE = threading.Lock()


def _trainer_gone(pid: int, rank: int) -> None:
    """The one line and the exit, from whichever thread sees the trainer's death first (the watch thread, or the
    main thread finding the inbox's writer gone); the other blocks here until the exit."""
    _GONE.acquire()
    print(f"mmrl: rollout process (PID {os.getpid()}, rank {rank}): its trainer process (PID {pid}) is gone; "
          f"exiting", file=sys.stderr, flush=True)
    os._exit(1)


def _no_shared_progress_lock() -> None:
    """tqdm's bars (a model's "Loading weights") take a lock shared between processes by default: a named semaphore
    that a killed rollout process leaks, and the trainer's exit then warns about. This process's bars need no lock
    shared with another process (a thread lock stays)."""
    try:
        from tqdm.std import TqdmDefaultWriteLock
    except ImportError:
        return
    if not hasattr(TqdmDefaultWriteLock, "mp_lock"):
        TqdmDefaultWriteLock.mp_lock = None


def _from_resource_sharer(tb: Any) -> bool:
    """Whether a traceback starts in multiprocessing's resource-sharer thread (`_ResourceSharer._serve`)."""
    code = tb.tb_frame.f_code if tb is not None else None
    return code is not None and code.co_name == "_serve" and code.co_filename.endswith("resource_sharer.py")


def quiet_resource_sharer() -> None:
    """A process at the other end of a queue (the rollout process, or the trainer) killed while it fetches a shared
    tensor's file descriptor resets the connection of multiprocessing's resource-sharer thread in this process. That
    thread catches the error itself and hands it to `sys.excepthook` (not `threading.excepthook`), which would print a
    traceback beside the one-line error that reports the death (each side notices the other's death on its own): that
    thread's connection errors are dropped; every other exception goes to the previous hook."""
    previous = sys.excepthook
    if getattr(previous, "_mmrl_quiet_sharer", False):
        return

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if issubclass(exc_type, (ConnectionError, EOFError)) and _from_resource_sharer(tb):
            return
        previous(exc_type, exc, tb)

    hook._mmrl_quiet_sharer = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def worker_main(builder: str, cfg: Any, rank: int, world: int, device: str, threads: int, inbox: Any,
                 outbox: Any) -> None:
    """The rollout process: build the producer, then serve `inbox` in order until "stop" or the trainer is gone.

    It never exits on its own while the trainer lives: the tensors of a batch it sent are shared through file
    descriptors that the trainer fetches from this process when it unpickles the batch, so after an error it sends
    the error and waits for "stop"."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    # this process only reads `inbox`: with the trainer holding the only write end, a message cut by the trainer's
    # death ends in EOF instead of a read that waits forever
    inbox._writer.close()
    if parent is not None:
        threading.Thread(target=_exit_with_trainer, args=(parent, rank), daemon=True,
                         name="mmrl-trainer-watch").start()
    outbox.cancel_join_thread()  # exiting never blocks on batches nobody will read
    quiet_resource_sharer()
    _no_shared_progress_lock()
    def get() -> tuple | None:
        msg = _next_message(inbox, parent)
        if msg is None and parent is not None:  # the trainer is gone: the line before the process ends, not after
            _trainer_gone(parent.pid, rank)
        return msg

    run_producer(builder, cfg, rank, world, device, threads, get, outbox.put)


def run_producer(builder: str, cfg: Any, rank: int, world: int, device: str, threads: int,
                 get: Callable[[], tuple | None], put: Callable[[tuple], Any], loop: Callable | None = None) -> None:
    """Build the producer and `serve` the trainer (`loop`: another loop of `serve`'s signature); an error (also while
    building) goes to the trainer, which raises it, and this side then waits for "stop" (or the trainer's end: `get`
    returns None)."""
    try:
        tune_malloc()  # as the trainer (start_run): buffers stay in the heap between calls
        if threads > 0:
            torch.set_num_threads(threads)
        producer = _import(builder)(cfg, rank, world, device)
        # the rollout's forwards are part of the step's FLOPs (perf/tflops_per_step), as in the synchronous loop
        flops_model = getattr(producer, "flops_model", None)
        meter = attach_flops_meter(flops_model) if flops_model is not None else None
        put(("ready", os.getpid()))
        (loop or serve)(producer, meter, get, put)
    except BaseException as exc:  # noqa: BLE001 - reported to the trainer, which raises it
        try:
            put(("error", _picklable(exc), traceback.format_exc()))
        except Exception:  # noqa: BLE001 - the queue is gone too
            return
        while (msg := get()) is not None and msg[0] != "stop":
            pass  # until the trainer has taken what was sent


def serve(producer: Any, meter: Any, get: Callable[[], tuple | None], put: Callable[[tuple], Any]) -> None:
    """Serve the trainer's messages in order until "stop" or the trainer is gone (`get` returns None): the loop
    of a rollout process and of a rollout rank (`mmrl.training.rank_rollout`), whatever carries the messages."""
    # per batch: `idle` = blocked waiting for a message (the next ticket is not sent yet: max_staleness reached),
    # `wall` = since the previous batch was handed over (its encoding counts to the next batch's span)
    version, idle, load_s, mark = -1, 0.0, 0.0, time.perf_counter()
    while True:
        t0 = time.perf_counter()
        msg = get()
        t1 = time.perf_counter()
        idle += t1 - t0
        if msg is None or msg[0] == "stop":
            return
        kind = msg[0]
        if kind == "weights":
            version = int(msg[1])
            producer.load_weights(unpack_tensors(msg[2]))
            load_s += time.perf_counter() - t1
        elif kind == "state":
            producer.load_state_dict(msg[1])
        elif kind == "produce":
            batch, now = make_batch(producer, meter, msg, version, t1, idle=idle, load_s=load_s, mark=mark)
            put(batch)
            idle, load_s, mark = 0.0, 0.0, now
        else:
            raise ValueError(f"rollout process: unknown message {kind!r}")


def make_batch(producer: Any, meter: Any, msg: tuple, version: int, t1: float, *, idle: float, load_s: float,
               mark: float) -> tuple[tuple, float]:
    """The ("batch", step, bytes) message answering the ticket `msg` ("produce", step, seed, rng), made with the
    weights of `version`, and the time it was done. `t1`: when the ticket was taken up; `idle`, `load_s`: the
    seconds spent waiting for messages and loading weights since the previous batch, made at `mark`."""
    _, step, seed, rng = msg
    if rng is not None:
        set_rng_state(decode(rng))
    if seed is not None:
        seed_everything(seed)
    if meter is not None:
        meter.pop()  # (forwards of weight loads and the like are not the rollout's)
    payload, metrics = producer.produce(step)
    plain = to_plain(payload)
    produce_s = time.perf_counter() - t1
    state = {"producer": producer.state_dict(), "rng": get_rng_state() if rng is not None else None}
    now = time.perf_counter()
    info = {"version": version, "idle_s": idle, "wall_s": now - mark, "produce_s": produce_s,
            "weight_load_s": load_s, "metrics": dict(metrics), "flops": meter.pop() if meter is not None else 0}
    return ("batch", int(step), encode({"payload": plain, "state": state, "info": info})), now
