"""The training side of multi-turn episodes: a step's episodes as one padded `RolloutBatch` (with a zero-weight
placeholder row for a rank that kept nothing), the format warm start's (prompt, action) pairs, and the FSDP helpers
(pairing the ranks' unequal forwards, dropping sharded gradients, refusing a trainable vision tower)."""

from __future__ import annotations

import random
from typing import Any, Sequence

import torch

from mmrl.vlm.batch import RolloutBatch
from mmrl.vlm.common import encode_prompt, vision_tower
from mmrl.vlm.envs import make_env
from mmrl.vlm.episodes import ChatFormat, Episode



def episode_batch(model: Any, episodes: Sequence[Episode], pad_id: int,
                  advantages: Sequence[torch.Tensor] | None = None,
                  placeholder_from: Sequence[Episode] | None = None) -> RolloutBatch | None:
    """The episodes as one `RolloutBatch` (padded once): prompt = the first prompt, response = everything after it
    (policy turns and observations), ``loss_mask`` = the policy turns, ``old_logprobs`` = the rollout's log-probs,
    `advantages`: per episode, over ids[prompt_len:] (``credit.token_advantages``). No episodes: None, or with
    `placeholder_from` a one-row batch of ``placeholder_episode(placeholder_from)`` with zero advantages (the row a
    rank without training episodes runs at weight 0 so the collectives pair)."""
    if not episodes:
        if placeholder_from is None:
            return None
        ph = placeholder_episode(placeholder_from)
        return episode_batch(model, [ph], pad_id, [torch.zeros(len(ph.ids) - ph.prompt_len)])
    return RolloutBatch.build(model, [ep.ids[:ep.prompt_len] for ep in episodes],
                              [ep.ids[ep.prompt_len:] for ep in episodes], [ep.merged_mm() for ep in episodes],
                              pad_id, loss_mask=[ep.loss_mask[ep.prompt_len:] for ep in episodes],
                              old_logprobs=[ep.old_logprobs[ep.prompt_len:] for ep in episodes],
                              advantages=None if advantages is None else list(advantages))


def placeholder_episode(episodes: Sequence[Episode]) -> Episode:
    """A local episode for the zero-weight micro-batches of a rank that has nothing to train on in a step."""
    for ep in episodes:
        if ep.policy_tokens > 0:
            return ep
    for ep in episodes:
        if len(ep.ids) > ep.prompt_len > 0:
            return ep
    raise RuntimeError("vlm_multiturn: this rank has no episode with tokens to run the placeholder micro-batch "
                       "that keeps the gradient all-reduce paired (every reset failed?)")


def format_pairs(tasks: dict[str, dict], fmt: ChatFormat, eos_id: int, batch_size: int, seed: int):
    """`next_pairs(step)` for ``mmrl.vlm.warm_start.format_warm_start``: `batch_size` first-turn prompts of random
    tasks (seeds 10^6 .. 2*10^6, never trained on) -> a random well-formed action (``Env.format_example``) + EOS."""
    rng = random.Random(seed + 99991)
    names = list(tasks)
    envs = {n: make_env(n, **tasks[n]) for n in names}

    def next_pairs(step: int) -> tuple[list, list, list]:
        prompts, resps, mms = [], [], []
        for _ in range(batch_size):
            name = rng.choice(names)
            env = envs[name]
            obs = env.reset(rng.randrange(10**6, 2 * 10**6))
            example = env.format_example(rng)
            if example is None:
                raise ValueError(f"warm_start.steps > 0 but environment {name!r} has no format_example()")
            enc = encode_prompt(fmt.processor, fmt.first_prompt(obs), obs.images)
            prompts.append(enc.input_ids)
            resps.append(fmt.tokenizer(example, add_special_tokens=False)["input_ids"] + [eos_id])
            mms.append(enc.mm)
        return prompts, resps, mms

    return next_pairs


def zero_grads(model: Any, params: Sequence[torch.Tensor]) -> None:
    """Drop the gradients of `params` and of everything ``model.parameters()`` yields now.

    Both are needed under FSDP2: after a forward the root unit's parameters are unsharded, so
    ``model.zero_grad()`` would not reach the sharded parameters that hold (and accumulate) the gradients;
    `params` (the optimizer's / PolicyStates' references) are those sharded ones."""
    for p in params:
        p.grad = None
    model.zero_grad(set_to_none=True)


def check_fsdp_rl_params(model: Any, rl_params: Sequence[torch.Tensor]) -> None:
    """Under FSDP the RL update must not train the vision tower: a text-only turn leaves it without gradients on
    some ranks, and FSDP2 reduce-scatters only the gradients that exist, so the ranks' collectives would not pair."""
    vision_ids = {id(p) for p in vision_tower(model).parameters()}
    if any(id(p) in vision_ids for p in rl_params):
        raise ValueError("dist.strategy=fsdp: the RL update would train the vision tower, but text-only turns leave "
                         "it without gradients on some ranks and FSDP's gradient reduce-scatter would not pair; add "
                         "model.freeze=[visual] (full fine-tuning), keep LoRA off the vision tower, or use "
                         "dist.strategy=ddp with dist.find_unused_parameters=true")
