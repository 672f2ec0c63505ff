"""vlm_grpo's rollout process (`rollout.worker: process`, `mmrl.training.async_rollout`): the producer builds its own
copy of the policy from the run's `model:` section, the rollout engine (`rollout.engine`: the HF sampling loop, or
vLLM, whose weights then follow through `VLLMWeightSyncer` after every push), the reward and the data stream, and
`produce(step)` runs the step's `collect_rollouts` (generation, rewards, DAPO rounds) exactly as the synchronous
recipe does."""

from __future__ import annotations

from typing import Any

import torch

from mmrl.distributed import DistContext
from mmrl.rewards import load as load_reward
from mmrl.runtime import Timer, resolve_dtype
from mmrl.training.async_rollout import load_policy_weights
from mmrl.vlm.policy import build_policy
from mmrl.vlm.rollout import SamplingParams
from mmrl.vlm.rollout_collect import build_data, collect_rollouts, make_rollout_engine, score, to_request

BUILDER = "mmrl.vlm.rollout_worker:VLMRolloutProducer"


def sampling_params(ro: Any) -> SamplingParams:
    """The training rollouts' sampling settings of a `rollout:` section."""
    return SamplingParams(n=ro.group_size, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                          max_new_tokens=ro.max_new_tokens, stop=ro.stop)


class VLMRolloutProducer:
    """Built in the rollout process as ``VLMRolloutProducer(cfg, rank, world, device)``."""

    def __init__(self, cfg: Any, rank: int, world: int, device: str):
        self.cfg, self.shards = cfg, DistContext(rank=rank, world_size=world)
        self.states, self.processor = build_policy(cfg.model, torch.device(device), resolve_dtype(cfg.dtype),
                                                   keep_ref=False)
        self.engine, self.syncer = make_rollout_engine(cfg, self.states, self.processor)
        self.reward_model = load_reward(cfg.reward.name, **cfg.reward.kwargs)
        self.data, _ = build_data(cfg)
        self.sampling = sampling_params(cfg.rollout)
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
        cfg, ro, timer = self.cfg, self.cfg.rollout, Timer()
        generated: list = []  # the first response: the placeholder row of a rank that keeps nothing

        def generate(items):
            with timer("rollout"):
                results = self.engine.generate([to_request(it, self.processor, cfg.data) for it in items],
                                               self.sampling)
            generated[:] = results[:1]
            return results

        def score_fn(results):
            with timer("reward"):
                return score(self.reward_model, results, cfg, validate=True)

        world = self.shards.world_size
        roll = collect_rollouts(lambda k: self.shards.shard(self.data.next(k * world)), generate, score_fn,
                                ro.prompts_per_step // world, ro.group_size, cfg.algo.dynamic_sampling,
                                cfg.algo.max_gen_batches)
        return {"roll": roll, "first": generated}, timer.pop()
