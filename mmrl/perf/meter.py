"""The per-step performance metrics every recipe logs: FLOPs from the architecture (mmrl.perf.flops) of every forward
and backward of the policy model, model FLOPs utilisation against the device's peak, and peak memory.

    attach_flops_meter(policy_model)                  # once, after the model is built (hooks; nothing else changes)
    metrics.update(perf_metrics(ctx, policy_model, step_seconds, device))   # every step, on every rank (a collective)

Logged keys: ``perf/tflops_per_step`` (forwards + backwards of the policy over all ranks in the step, 1e12 FLOPs),
``perf/tflops_per_s`` (that over the step's wall time), ``perf/mfu`` (that over the peak of all ranks' devices; only
when the peak is known: a CUDA device in ``PEAK_BF16_TFLOPS`` or ``MMRL_PEAK_TFLOPS`` set, per device), and
``perf/peak_memory_gib`` (largest over ranks; CUDA: torch's peak allocated memory in the step; CPU: the process's
peak resident memory in the step, Linux VmHWM). Model FLOPs: gradient-checkpointing recomputation is not counted.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmrl.perf.flops import FlopsEstimator, Pass, flops_estimator

# dense (no sparsity) bf16 tensor-core peak per GPU, TFLOP/s, from NVIDIA's datasheets; matched against
# torch.cuda.get_device_name() in this order (first substring match)
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("B200", 2250.0),  # B200 datasheet: 4.5 PFLOPS with sparsity
    ("H200", 989.0),   # H200 SXM datasheet: 1,979 TFLOPS with sparsity
    ("H100 PCIe", 756.0), ("H100", 989.0),  # H100 datasheet: PCIe 1,513 / SXM 1,979 TFLOPS with sparsity
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0), ("A800", 312.0),  # A100 datasheet: 312 TFLOPS bf16 dense
    ("L40S", 362.0),   # L40S datasheet: 733 TFLOPS with sparsity
]
_METER_ATTR = "_mmrl_flops_meter"
_PAUSED = [0]  # > 0 inside `not_counted()`


@contextmanager
def not_counted():
    """Forwards inside the block are not training cost (the sample grids: what a run shows, not what it trains
    with): left out of every FlopsMeter and of the diffusion recipes' transformer-evaluation counters, so
    `perf/tflops_per_step` and `cost/*` do not depend on how often a run draws samples."""
    _PAUSED[0] += 1
    try:
        yield
    finally:
        _PAUSED[0] -= 1


def counting_paused() -> bool:
    return _PAUSED[0] > 0


def device_peak_tflops(device: torch.device | str) -> float | None:
    """Dense bf16 peak of one device in TFLOP/s: ``MMRL_PEAK_TFLOPS`` if set, else the table for CUDA devices;
    None when unknown (CPUs, unlisted GPUs)."""
    env = os.environ.get("MMRL_PEAK_TFLOPS")
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"MMRL_PEAK_TFLOPS: expected a number of TFLOP/s per device, got {env!r}") from None
        if value <= 0:
            raise ValueError(f"MMRL_PEAK_TFLOPS: expected a positive number, got {env!r}")
        return value
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for key, v in PEAK_BF16_TFLOPS if key in name), None)


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out:
        return _first_tensor(out[0])
    for key in ("sample", "last_hidden_state", "logits"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    return None


class FlopsMeter:
    """Sums FLOPs of the forwards of the modules it watches, and of their backwards when a gradient reaches the
    forward's output (a tensor hook: a forward whose output never gets a backward is counted once)."""

    def __init__(self):
        self.flops = 0
        self.estimators: list[FlopsEstimator] = []
        self._handles: list[Any] = []

    def watch(self, module: nn.Module) -> bool:
        """Count `module`'s forwards if its class has an estimator; returns whether it has."""
        est = flops_estimator(module)
        if est is None:
            return False
        pending: list[Pass] = []

        def pre(mod, args, kwargs):
            pending.append(None if counting_paused() else est.shapes(args, kwargs))

        def post(mod, args, kwargs, out):
            shape = pending.pop()
            if shape is None:  # inside not_counted(), or a forward its estimator does not count
                return
            self.flops += est.forward_flops(shape)
            t = _first_tensor(out)
            if t is not None and t.requires_grad and torch.is_grad_enabled():
                back = est.backward_flops(shape)
                t.register_hook(lambda g: self._add(back))

        self._handles += [module.register_forward_pre_hook(pre, with_kwargs=True),
                          module.register_forward_hook(post, with_kwargs=True)]
        self.estimators.append(est)
        return True

    def _add(self, n: int) -> None:
        self.flops += n

    def refresh(self) -> None:
        """Re-read which weights train (call after PolicyStates / freezing changed requires_grad)."""
        for est in self.estimators:
            est.refresh()

    def pop(self) -> int:
        """FLOPs counted since the last pop."""
        n, self.flops = self.flops, 0
        return n

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def attach_flops_meter(model: nn.Module) -> FlopsMeter | None:
    """A FlopsMeter on `model`: on the model itself when its class has an estimator, else on its outermost
    submodules that have one (Qwen-VL: the vision tower, the decoder) and an `lm_head`. Kept on the model
    (``perf_metrics`` finds it); attaching twice returns the same meter, re-reading which weights train. None (and
    nothing attached) when no part of the model has an estimator: the run then logs no FLOPs rather than a partial
    count."""
    meter = getattr(model, _METER_ATTR, None)
    if meter is not None:
        meter.refresh()
        return meter
    meter = FlopsMeter()
    if not meter.watch(model):
        def walk(mod: nn.Module) -> None:
            for name, child in mod.named_children():
                if isinstance(child, nn.Linear) and name != "lm_head":  # a layer of an uncounted model
                    continue
                if not meter.watch(child):
                    walk(child)

        walk(model)
    if not meter.estimators:
        return None
    object.__setattr__(model, _METER_ATTR, meter)  # a plain attribute (not a submodule or buffer)
    return meter


def add_flops(model: nn.Module, n: int) -> None:
    """Add `n` FLOPs counted elsewhere in this step (a rollout process's forwards) to `model`'s meter, if any."""
    meter = getattr(model, _METER_ATTR, None)
    if meter is not None:
        meter._add(int(n))


def _rss_peak_gib() -> float | None:
    status = Path("/proc/self/status")
    if not status.is_file():
        return None
    m = re.search(r"VmHWM:\s+(\d+) kB", status.read_text())
    return int(m.group(1)) / 2**20 if m else None


def reset_peak_memory(device: torch.device | str) -> None:
    """Start a new peak-memory window (CUDA allocator stats, or the process's VmHWM on Linux)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or not permitted: the peak then covers the whole run so far
        pass


def peak_memory_gib(device: torch.device | str) -> float | None:
    """Peak memory since the last `reset_peak_memory` (see the module docstring), GiB."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return _rss_peak_gib()


def perf_metrics(ctx: Any, model: nn.Module, step_seconds: float, device: torch.device | str) -> dict[str, float]:
    """The ``perf/*`` metrics of the step that just ended (see the module docstring) and a new peak-memory window.
    A collective under several processes: every rank calls it. Without a meter on `model`: only memory."""
    meter = getattr(model, _METER_ATTR, None)
    local = float(meter.pop()) if meter is not None else 0.0
    mem = peak_memory_gib(device)
    if ctx.enabled:
        flops = float(ctx.all_reduce_sum(local))
        mems = [m for m in ctx.all_gather_object(mem) if m is not None]
        mem = max(mems) if mems else None
    else:
        flops = local
    out: dict[str, float] = {}
    if meter is not None:
        out["perf/tflops_per_step"] = flops / 1e12
        if step_seconds > 0:
            out["perf/tflops_per_s"] = flops / 1e12 / step_seconds
            peak = device_peak_tflops(device)
            if peak is not None:
                # every process's device (under sequence parallelism a group's processes share one forward, which
                # the meter counts once per group)
                out["perf/mfu"] = flops / 1e12 / step_seconds / (peak * getattr(ctx, "processes", ctx.world_size))
    if mem is not None:
        out["perf/peak_memory_gib"] = mem
    reset_peak_memory(device)
    return out
