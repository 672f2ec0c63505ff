"""vlm_grpo's rollout process (`rollout.worker: process`, `mmrl.training.async_rollout`): the producer builds its own
copy of the policy from the run's `model:` section, the rollout engine (`rollout.engine`: the HF sampling loop, or
vLLM, whose weights then follow through `VLLMWeightSyncer` after every push), the reward and the data stream, and
`produce(step)` runs the step's `rollout_step` (generation, rewards, DAPO rounds), the function the synchronous
recipe runs."""

from __future__ import annotations

from typing import Any

import torch

from mmrl.distributed import DistContext
from mmrl.rewards import load as load_reward
from mmrl.runtime import Timer, resolve_dtype
from mmrl.training.async_rollout import load_policy_weights
from mmrl.vlm.policy import build_policy
from mmrl.vlm.rollout_collect import build_data, make_rollout_engine, rollout_step

BUILDER = "mmrl.vlm.rollout_worker:VLMRolloutProducer"


class VLMRolloutProducer:
    """Built in the rollout process as ``VLMRolloutProducer(cfg, rank, world, device)``."""

    def __init__(self, cfg: Any, rank: int, world: int, device: str):
        self.cfg, self.shards = cfg, DistContext(rank=rank, world_size=world)
        self.states, self.processor = build_policy(cfg.model, torch.device(device), resolve_dtype(cfg.dtype),
                                                   keep_ref=False)
        self.engine, self.syncer = make_rollout_engine(cfg, self.states, self.processor)
        self.reward_model = load_reward(cfg.reward.name, **cfg.reward.kwargs)
        self.data, _ = build_data(cfg)
        self.synced = False
        self.flops_model = self.states.model  # its forwards join the trainer's perf/tflops_per_step

    def load_weights(self, tensors: dict) -> None:
        load_policy_weights(self.states, tensors)
        if self.syncer is not None:  # vLLM: its own weight-update path, from this process's HF copy
            # the first push (start or resume) may change layers training never touches (a warm start): send all
            self.syncer.sync(full=True if not self.synced else None)
            self.synced = True

    def state_dict(self) -> dict:
        return {"data": self.data.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.data.load_state_dict(state["data"])

    def produce(self, step: int) -> tuple[dict, dict]:
        """(the step's rollouts and first response, this step's timings); each process keeps its own count of kept
        samples (no collective with the other rollout processes)."""
        timer = Timer()
        roll, first = rollout_step(self.cfg, self.engine, self.processor, self.reward_model, self.data, self.shards,
                                   timer)
        return {"roll": roll, "first": first}, timer.pop()
