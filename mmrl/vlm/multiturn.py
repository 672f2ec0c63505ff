"""Multi-turn agentic RL for VLM policies: episode rollout against environments, trajectory assembly
with a loss mask, episode / turn / GiGPO step-level credit assignment, and the `vlm_multiturn` recipe.

Trajectory layout (token-in, token-out: the policy's own sampled ids are never re-tokenised)::

    [prompt_1 | response_1 | env_2 | response_2 | env_3 | ... | response_K]
     system + user(obs_1)   closing of the assistant turn ("<|im_end|>\\n" or the part the model did not
     + "<|im_start|>assistant\\n"   emit) + user(obs_k, its images) + the next generation prompt

``loss_mask`` is 1 exactly on response tokens; prompt and environment tokens are context only (zero
gradient, see tests). Each turn's prompt is the whole trajectory so far, with the images of every turn
(their vision tensors concatenated in order, positions from ``mmrl.pipelines.qwen_vl.get_rope_index``
via ``mmrl.vlm.common.collate``), so the trainer's forward over the full trajectory sees exactly the
prefixes the sampler saw and recomputed log-probs match the rollout's (``diag/logprob_drift``).

Credit assignment (``algo.advantage``), all from ``mmrl.core``; r_k = reward of turn k, G_k =
``discounted_returns`` over turns with ``algo.gamma``, episode return R = G_1 = sum_k gamma^(k-1) r_k:
  grpo       A(turn k of episode i) = group_advantages(R)_i             (episodes of one task = a group)
  turn_grpo  A = group_advantages(G_k) over all turns of the group's episodes (AReaL's individual mode)
  gigpo      A = group_advantages(R)_i + omega * group_advantages(G_k | same group and same anchor)
DAPO dynamic sampling drops groups whose episode returns are all equal and rolls out new tasks, up to
``algo.max_resample_rounds`` extra rounds.

Several processes (``torchrun ... dist.strategy=ddp``, see mmrl/distributed.py): ``rollout.groups_per_step`` is
global and must be divisible by the number of processes; every rank rolls out whole episode groups (its contiguous
share of each round's tasks), the episodes' turn rewards, anchors and group ids are all-gathered so advantages
(grpo / turn_grpo / GiGPO anchor groups), DAPO's kept-group decision (so every rank runs the same rounds) and the
logged episode metrics use the whole batch; each rank's loss is weighted (``DistContext.loss_scale`` of its policy
tokens) so DDP's gradient average equals the gradient of the global token-mean; every rank runs the same number of
optimizer steps (a zero-weight placeholder micro-batch when it has no episode in a mini-batch), gradients are
all-reduced once per mini-batch (``no_sync`` on the other micro-batches); rank 0 alone evaluates, logs, saves
samples and writes checkpoints, which resume on any number of processes.

FSDP (``dist.strategy=fsdp``; LoRA, or full fine-tuning with the vision tower frozen): every forward of a sharded model is a collective, but ranks run different
numbers of forwards (turns, stop steps, kept episodes). Only the decoder layers are sharded (the vision tower stays
in the root unit, so image and text forwards issue the same collectives); rollouts, evaluation (on every rank) and
the reference pass run inside ``mmrl.distributed.LockstepForwards`` (a finished rank runs dummy forwards while
another is busy); training mini-batches are padded to equal micro-batch counts with zero-weight ones; the vision
cache is off; checkpoints are gathered collectively (full tensors: they resume under any strategy).

Vision features (``train.reuse_vision_features``): the reference pass, and the training pass when the vision tower
is frozen, take each episode's image features from ``mmrl.vlm.common.VisionCache`` (computed once per step).

What is simplified away: the HF engine re-prefills the whole history every turn (no cross-turn KV
cache); the vLLM engine is not supported here (it takes text prompts, which would re-tokenise the
policy's own tokens); no value model (GAE) and no per-token rewards.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import time
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Hashable, Sequence

import torch

from mmrl.config import RunConfig, TrainConfig
from mmrl.core import (clipped_policy_loss, discounted_returns, gigpo_advantages, group_advantages, hash_anchors,
                       kl_estimate)
from mmrl.distributed import (DistConfig, DistContext, LockstepForwards, full_optimizer_state_dict,
                               load_full_optimizer_state_dict)
from mmrl.runtime import Run, Timer, get_rng_state, seed_everything, set_rng_state
from mmrl.training import (NONFINITE_KEY, SKIPPED_KEY, OnNonfinite, UpdateGuard, check_finite_weights, check_rewards,
                           finite_stats)
from mmrl.vlm.common import (EncodedPrompt, VisionCache, collate, encode_prompt, render_prompt, response_logprobs,
                             vision_has_adapters, vision_tower)
from mmrl.vlm.envs import EnvManager, Observation, StepResult, make_env
from mmrl.vlm.rollout import GenRequest, SamplingParams

ADVANTAGES = ("grpo", "turn_grpo", "gigpo")

# ============================================================================================ trajectories


@dataclass
class Turn:
    """One policy turn: response tokens ids[start:end], its reward and the anchor of the state it acted in."""

    start: int
    end: int
    reward: float = 0.0
    anchor: Hashable | None = None
    finish_reason: str = ""
    text: str = ""
    info: dict = field(default_factory=dict)


@dataclass
class Episode:
    """A trajectory: token ids, loss mask (1 = policy token), rollout log-probs (0 off the mask), images."""

    index: int
    task: str
    seed: int
    group: int
    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)
    prompt_len: int = 0
    mm: list[dict] = field(default_factory=list)  # one {"pixel_values", "image_grid_thw"} per observation
    turns: list[Turn] = field(default_factory=list)
    done: bool = False
    end_reason: str = ""  # "done" | "max_turns" | "truncated" | "error"
    obs_truncated: int = 0  # observations whose text was cut to fit max_seq_len
    error: str | None = None
    stop_strings: tuple[str, ...] = ()
    max_turns: int = 0
    anchor: Hashable | None = None  # anchor of the observation the next response answers
    success: bool = False
    _mm_memo: tuple | None = field(default=None, repr=False, compare=False)  # (len(mm), merged_mm())

    def append(self, ids: Sequence[int], policy: bool, logprobs: Sequence[float] | None = None) -> None:
        self.ids += list(ids)
        self.loss_mask += [int(policy)] * len(ids)
        self.old_logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)

    @property
    def policy_tokens(self) -> int:
        return sum(self.loss_mask)

    def merged_mm(self) -> dict[str, torch.Tensor]:
        """All observations' vision tensors concatenated in order; the same dict (and tensors) until ``mm`` grows,
        so a ``VisionCache`` (keyed by tensor identity) recognises an episode's images across passes."""
        if self._mm_memo is not None and self._mm_memo[0] == len(self.mm):
            return self._mm_memo[1]
        out = {}
        for key in ("pixel_values", "image_grid_thw"):
            parts = [m[key] for m in self.mm if m and key in m]
            if parts:
                out[key] = torch.cat(parts, 0)
        self._mm_memo = (len(self.mm), out)
        return out

    def finish(self, reason: str) -> None:
        self.done, self.end_reason = True, reason


class ChatFormat:
    """Renders observations as chat turns with the processor's template, as text deltas.

    The first prompt is ``system? + user(obs) + generation prompt``; each later observation is the text
    the template appends after an assistant message (the assistant turn's closing, the user message,
    the next generation prompt). Needs an append-only template (Qwen2/2.5/3-VL are).
    """

    def __init__(self, processor: Any, system_prompt: str | None = None):
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        probe = self.system + [self._user(Observation("Q")), {"role": "assistant", "content": "XYZ"}]
        self._base = render_prompt(processor, probe, add_generation_prompt=False)
        self.closing = self._base.split("XYZ")[-1]  # e.g. "<|im_end|>\n"
        self._probe = probe
        self._special_ids = set(int(i) for i in self.tokenizer.all_special_ids)

    @staticmethod
    def _user(obs: Observation) -> dict:
        content = [{"type": "image"} for _ in obs.images]
        if obs.text:
            content.append({"type": "text", "text": obs.text})
        return {"role": "user", "content": content}

    def first_prompt(self, obs: Observation) -> str:
        return render_prompt(self.processor, self.system + [self._user(obs)])

    def next_segment(self, obs: Observation, last_response_ids: Sequence[int]) -> str:
        """Closing of the previous assistant turn (minus what the model already emitted) + user turn."""
        full = render_prompt(self.processor, self._probe + [self._user(obs)])
        if not full.startswith(self._base):
            raise ValueError("ChatFormat: the chat template is not append-only (rendering a longer chat changed "
                             "the earlier turns); multi-turn token-in/token-out rollout needs one that is")
        return self.closing_after(last_response_ids) + full[len(self._base):]

    def closing_after(self, response_ids: Sequence[int]) -> str:
        """The assistant turn's closing text minus a special token the model already emitted (its EOS)."""
        if response_ids and int(response_ids[-1]) in self._special_ids:
            last = self.tokenizer.decode([int(response_ids[-1])])
            if self.closing.startswith(last):
                return self.closing[len(last):]
        return self.closing


def _encode_observation(fmt: ChatFormat, obs: Observation, first: bool, last_response_ids: Sequence[int],
                        budget: int) -> tuple[EncodedPrompt | None, bool]:
    """Encode an observation into at most `budget` tokens, cutting its text from the end if needed.

    Returns (encoded or None if even an empty text does not fit, whether the text was cut)."""
    def enc(text: str) -> EncodedPrompt:
        o = Observation(text, obs.images, obs.anchor)
        s = fmt.first_prompt(o) if first else fmt.next_segment(o, last_response_ids)
        return encode_prompt(fmt.processor, s, obs.images)

    e = enc(obs.text)
    if len(e.input_ids) <= budget:
        return e, False
    text_ids = fmt.tokenizer(obs.text, add_special_tokens=False)["input_ids"]
    keep = len(text_ids) - (len(e.input_ids) - budget)
    while keep >= 0:
        e = enc(fmt.tokenizer.decode(text_ids[:keep]))
        if len(e.input_ids) <= budget:
            return e, True
        keep -= max(1, len(e.input_ids) - budget)
    return None, True


# ============================================================================================ rollout


@dataclass
class RolloutStats:
    generation_s: float = 0.0
    environment_s: float = 0.0
    preprocessing_s: float = 0.0


def rollout_episodes(engine: Any, fmt: ChatFormat, manager: EnvManager, specs: Sequence[dict],
                     sampling: SamplingParams, max_turns: int, max_seq_len: int, async_mode: bool = False,
                     stats: RolloutStats | None = None) -> list[Episode]:
    """Run one episode per spec ({"task", "seed", "group", "env_kwargs"?, "task_kwargs"?}) to the end.

    An episode ends when its environment says done ("done", or "max_turns" if the env ran out of turns),
    after min(max_turns, env.max_turns) turns ("max_turns"), when the next observation plus
    ``sampling.max_new_tokens`` cannot fit in `max_seq_len` tokens ("truncated"; observation texts are cut
    first, counted in ``obs_truncated``), or when its environment raises ("error").
    Sync mode: every turn generates for all live episodes, then steps their environments concurrently.
    ``async_mode``: episodes advance independently: a generation batch holds whichever episodes are
    ready, and each episode's environment step is submitted as soon as its response exists, so slow
    environments never hold up the others. Generation is seeded from ``sampling.seed`` (+ a call counter),
    so sync-mode rollouts are reproducible.
    """
    stats = stats if stats is not None else RolloutStats()
    t = time.perf_counter()
    resets = manager.reset([{k: v for k, v in s.items() if k != "group"} for s in specs])
    stats.environment_s += time.perf_counter() - t
    episodes = [Episode(i, s["task"], int(s["seed"]), int(s.get("group", i))) for i, s in enumerate(specs)]
    for ep, res in zip(episodes, resets):
        ep.stop_strings = manager.stop_strings.get(ep.index, ())
        env_max = manager.max_turns.get(ep.index, 0) or max_turns
        ep.max_turns = min(max_turns, env_max)
        _apply_observation(ep, res, fmt, sampling, max_seq_len, stats, first=True)
    calls = [0]

    def generate(batch: list[Episode]) -> None:
        by_stop: dict[tuple, list[Episode]] = defaultdict(list)
        for ep in batch:
            by_stop[ep.stop_strings].append(ep)
        for stops, eps in by_stop.items():
            sp = dataclasses.replace(sampling, n=1, stop=list(stops))
            if sampling.seed is not None:
                sp.seed = int(sampling.seed) * 1000003 + calls[0]
            calls[0] += 1
            t0 = time.perf_counter()
            enc = [EncodedPrompt(list(ep.ids), ep.merged_mm(), "") for ep in eps]
            outs = engine.generate([GenRequest(prompt_text="", metadata={"episode": ep.index}) for ep in eps], sp,
                                   encoded=enc)
            stats.generation_s += time.perf_counter() - t0
            for ep, out in zip(eps, outs):
                start = len(ep.ids)
                ep.append(out.response_ids, True, out.response_logprobs)
                ep.turns.append(Turn(start, len(ep.ids), anchor=ep.anchor, finish_reason=out.finish_reason,
                                     text=out.text))

    live = [ep for ep in episodes if not ep.done]
    if not async_mode:
        while live:
            generate(live)
            t = time.perf_counter()
            results = manager.step([ep.index for ep in live], [ep.turns[-1].text for ep in live])
            stats.environment_s += time.perf_counter() - t
            for ep, res in zip(live, results):
                _apply_step(ep, res, fmt, sampling, max_seq_len, stats)
            live = [ep for ep in live if not ep.done]
        return episodes

    ready = list(live)
    pending: dict = {}
    while ready or pending:
        if ready:
            batch, ready = ready, []
            generate(batch)
            for ep in batch:
                pending[manager.submit_step(ep.index, ep.turns[-1].text)] = ep
        t = time.perf_counter()
        finished, _ = wait(list(pending), timeout=0 if ready else None, return_when=FIRST_COMPLETED)
        stats.environment_s += time.perf_counter() - t  # time spent waiting for environments only
        for fut in finished:
            ep = pending.pop(fut)
            _apply_step(ep, fut.result(), fmt, sampling, max_seq_len, stats)
            if not ep.done:
                ready.append(ep)
    return episodes


def _apply_step(ep: Episode, res: StepResult, fmt: ChatFormat, sampling: SamplingParams, max_seq_len: int,
                stats: RolloutStats) -> None:
    turn = ep.turns[-1]
    turn.reward, turn.info = float(res.reward), dict(res.info)
    ep.success = ep.success or bool(res.info.get("success", False))
    if "error" in res.info:
        ep.error = res.info["error"]
        ep.finish("error")
    elif res.done:
        ep.finish("max_turns" if res.info.get("max_turns") else "done")
    elif len(ep.turns) >= ep.max_turns:
        ep.finish("max_turns")
    else:
        _apply_observation(ep, res, fmt, sampling, max_seq_len, stats, first=False)


def _apply_observation(ep: Episode, res: StepResult, fmt: ChatFormat, sampling: SamplingParams, max_seq_len: int,
                       stats: RolloutStats, first: bool) -> None:
    if first and "error" in res.info:
        ep.error = res.info["error"]
        ep.finish("error")
        return
    t = time.perf_counter()
    budget = max_seq_len - len(ep.ids) - sampling.max_new_tokens
    last = ep.ids[ep.turns[-1].start:ep.turns[-1].end] if ep.turns else []
    enc, cut = _encode_observation(fmt, res.observation, first, last, budget)
    stats.preprocessing_s += time.perf_counter() - t
    if enc is None:
        ep.finish("truncated")
        return
    ep.obs_truncated += int(cut)
    ep.append(enc.input_ids, False)
    if enc.mm:
        ep.mm.append(enc.mm)
    if first:
        ep.prompt_len = len(ep.ids)
    ep.anchor = res.observation.anchor


# ============================================================================================ credit assignment


def turn_tensors(episodes: Sequence[Episode], gamma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(turn rewards[E, K], valid mask[E, K], discounted returns G[E, K]) with K = the most turns."""
    K = max([len(ep.turns) for ep in episodes] + [1])
    rewards = torch.zeros(len(episodes), K)
    mask = torch.zeros(len(episodes), K, dtype=torch.bool)
    for i, ep in enumerate(episodes):
        for k, t in enumerate(ep.turns):
            rewards[i, k], mask[i, k] = t.reward, True
    return rewards, mask, discounted_returns(rewards, mask, gamma)


def episode_returns(episodes: Sequence[Episode], gamma: float) -> torch.Tensor:
    """R_i = sum_k gamma^(k-1) r_k (0 for an episode without turns)."""
    _, mask, returns = turn_tensors(episodes, gamma)
    return torch.where(mask[:, 0], returns[:, 0], torch.zeros(()))


def turn_advantages(episodes: Sequence[Episode], mode: str, gamma: float, omega: float = 1.0,
                    scale_by_std: bool = True) -> torch.Tensor:
    """Advantage of every turn, [E, K] (0 where an episode has no such turn); see the module docstring."""
    if mode not in ADVANTAGES:
        raise ValueError(f"algo.advantage: expected one of {list(ADVANTAGES)}, got {mode!r}")
    _, mask, returns = turn_tensors(episodes, gamma)
    R = torch.where(mask[:, 0], returns[:, 0], torch.zeros(()))
    gid = torch.tensor([ep.group for ep in episodes], dtype=torch.long)
    if mode == "grpo":
        a = group_advantages(R, gid, scale_by_std=scale_by_std)
        return torch.where(mask, a[:, None].expand_as(mask), torch.zeros(()))
    e_idx, k_idx = mask.nonzero(as_tuple=True)
    out = torch.zeros_like(returns)
    if mode == "turn_grpo":
        out[e_idx, k_idx] = group_advantages(returns[e_idx, k_idx], gid[e_idx], scale_by_std=scale_by_std)
        return out
    # None anchors never group: give each its own key
    anchors = [episodes[e].turns[k].anchor for e, k in zip(e_idx.tolist(), k_idx.tolist())]
    anchors = [("__no_anchor__", j) if a is None else ("anchor", a) for j, a in enumerate(anchors)]
    out[e_idx, k_idx] = gigpo_advantages(R, gid, returns[e_idx, k_idx], e_idx, hash_anchors(anchors), omega=omega,
                                         scale_by_std=scale_by_std)
    return out


def token_advantages(episodes: Sequence[Episode], turn_adv: torch.Tensor) -> list[torch.Tensor]:
    """Per episode, advantages over ids[prompt_len:] (each turn's value on its response tokens, 0 elsewhere)."""
    out = []
    for i, ep in enumerate(episodes):
        a = torch.zeros(max(0, len(ep.ids) - ep.prompt_len))
        for k, t in enumerate(ep.turns):
            a[t.start - ep.prompt_len:t.end - ep.prompt_len] = turn_adv[i, k]
        out.append(a)
    return out


def rewards_finite(ep: Episode) -> bool:
    """Every turn reward of the episode is a finite number."""
    return all(math.isfinite(t.reward) for t in ep.turns)


def check_turn_rewards(episodes: Sequence[Episode], on_nonfinite: str) -> int:
    """Validate every turn reward (`mmrl.training.check_rewards`, per environment). `on_nonfinite="error"`: a NaN/inf
    reward raises naming the environment, the episode (group, seed) and the turn; `"drop_sample"`: returns how many
    episodes hold one (the recipe trains without them; `rewards_finite` tells which)."""
    by_task: dict[str, list[tuple[Episode, int]]] = defaultdict(list)
    for ep in episodes:
        by_task[ep.task] += [(ep, k) for k in range(len(ep.turns))]
    for task, rows in by_task.items():
        check_rewards(torch.tensor([ep.turns[k].reward for ep, k in rows], dtype=torch.float64), None, on_nonfinite,
                      reward=f"environment {task}",
                      labels=[f"episode {ep.index} of group {ep.group}, seed {ep.seed}, turn {k + 1}"
                              for ep, k in rows])
    return sum(not rewards_finite(ep) for ep in episodes)


def informative_groups(episodes: Sequence[Episode], returns: torch.Tensor) -> list[int]:
    """Groups (in first-seen order) whose episode returns are not all equal (DAPO dynamic sampling)."""
    by_group: dict[int, list[float]] = {}
    for ep, r in zip(episodes, returns.tolist()):
        by_group.setdefault(ep.group, []).append(r)
    return [g for g, rs in by_group.items() if len(rs) > 1 and max(rs) - min(rs) > 1e-9]


# ============================================================================================ loss


def policy_loss(model: Any, episodes: Sequence[Episode], adv: Sequence[torch.Tensor], pad_id: int, *,
                temperature: float, clip_low: float, clip_high: float, normalizer: float,
                ref_logprobs: Sequence[torch.Tensor] | None = None, kl_coef: float = 0.0, kl_kind: str = "k3",
                entropy_coef: float = 0.0, vision_cache: VisionCache | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss of one micro-batch of episodes over their policy tokens only.

    ``normalizer`` = number of policy tokens in the whole mini-batch (token-mean across micro-batches).
    ``model`` may be the DDP-wrapped policy. ``vision_cache``: image features of the episodes (the cache
    refuses itself, i.e. the vision tower runs with gradients, when the tower is trained).
    Returns (loss to backward, metrics incl. max |logp - rollout logp| as ``drift``)."""
    prompts = [ep.ids[:ep.prompt_len] for ep in episodes]
    resps = [ep.ids[ep.prompt_len:] for ep in episodes]
    mms = [ep.merged_mm() for ep in episodes]
    batch, P, rmask = collate(model, prompts, resps, mms, pad_id)
    if vision_cache is not None:
        batch = vision_cache.apply(batch, mms)
    T = rmask.shape[1]
    dev = rmask.device

    def pad(rows: Sequence[Sequence[float]], dtype=torch.float32) -> torch.Tensor:
        x = torch.zeros(len(rows), T, dtype=dtype)
        for i, r in enumerate(rows):
            x[i, :len(r)] = torch.as_tensor(list(r), dtype=dtype)
        return x.to(dev)

    logp, ent = response_logprobs(model, batch, P, batch["input_ids"][:, P:], temperature,
                                  with_entropy=entropy_coef > 0, entropy_grad=entropy_coef > 0)
    mask = pad([ep.loss_mask[ep.prompt_len:] for ep in episodes], torch.bool) & rmask
    old = pad([ep.old_logprobs[ep.prompt_len:] for ep in episodes])
    advantages = pad([a.tolist() for a in adv])
    n_tok = float(mask.sum())
    loss, m = clipped_policy_loss(logp, old, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                  agg="token-mean")
    loss = loss * (n_tok / max(normalizer, 1.0))
    if kl_coef and ref_logprobs is not None:
        ref = pad([r.tolist() for r in ref_logprobs])
        kl = torch.where(mask, kl_estimate(logp, ref, kl_kind), torch.zeros((), device=dev))
        loss = loss + kl_coef * kl.sum() / max(normalizer, 1.0)
        m["kl_ref"] = float(kl.detach().sum() / max(n_tok, 1.0))
    if ent is not None:  # entropy bonus on policy positions (token-mean over the mini-batch)
        ent_sum = torch.where(mask, ent, torch.zeros((), device=dev)).sum()
        loss = loss - entropy_coef * ent_sum / max(normalizer, 1.0)
        m["entropy"] = float(ent_sum.detach() / max(n_tok, 1.0))
    with torch.no_grad():
        diff = torch.where(mask, (logp - old).abs(), torch.zeros((), device=dev))
        m["drift"] = float(diff.max()) if n_tok else 0.0
        m["n_tokens"] = n_tok
    return loss, m


# ============================================================================================ recipe config


@dataclass
class ModelConfig:
    path: str = "runs/tiny_qwen2_vl"
    """Local checkpoint directory of a Qwen2/2.5/3-VL model (never a hub id)."""
    build_tiny: bool = False
    """If `path` holds no checkpoint, build the tiny random Qwen2-VL there first (CPU demo and tests)."""
    lora_rank: int = 0
    """LoRA rank of the trained adapter; 0 = full fine-tuning."""
    lora_alpha: int = 32
    """LoRA alpha (scale alpha / rank)."""
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names that get LoRA adapters (language model attention by default)."""
    freeze: list[str] = field(default_factory=list)
    """RL updates skip parameters whose name contains one of these (e.g. lm_head, embed_tokens); the format warm
    start still trains them. Adam moves every vocabulary row by ~lr per step even on noise, which slowly lifts
    garbage tokens; freezing the output layer during RL prevents that."""


@dataclass
class EnvConfig:
    tasks: dict[str, dict] = field(default_factory=lambda: {"grid_puzzle": {}})
    """Environment name -> constructor keyword arguments; groups cycle through the tasks in this order."""
    modules: list[str] = field(default_factory=list)
    """Python modules to import first (they register custom environments with `register_env`)."""
    backend: str = "thread"
    """EnvManager backend: `thread` or `process`."""
    max_workers: int = 4
    """Threads / worker processes stepping environments concurrently."""
    eval_episodes: int = 32
    """Episodes per task in each greedy evaluation (fixed seeds, disjoint from training seeds)."""


@dataclass
class RolloutConfig:
    groups_per_step: int = 8
    """Tasks (episode groups) per RL step."""
    group_size: int = 8
    """Episodes per task (same seed, so the same start state)."""
    max_turns: int = 6
    """Turn limit per episode (the environment's own max_turns also applies)."""
    max_new_tokens: int = 8
    """Token limit of one response."""
    max_seq_len: int = 1024
    """Token limit of a whole trajectory; observations that do not fit are cut, then the episode ends."""
    temperature: float = 1.0
    """Sampling temperature (log-probs for the ratio use the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = -1
    """Top-k sampling (<= 0 = off)."""
    async_mode: bool = False
    """Episodes advance independently (generation of ready episodes overlaps slow environment steps)."""
    system_prompt: str = ""
    """Optional system message for every episode ('' = the chat template's default)."""
    batch_size: int = 64
    """Max sequences the HF engine decodes together."""


@dataclass
class AlgoConfig:
    advantage: str = "gigpo"
    """Credit assignment: grpo (episode-level), turn_grpo (discounted turn returns), gigpo (episode + step)."""
    gamma: float = 0.95
    """Turn-level discount: a turn's return is r_k + gamma * r_{k+1} + ...; episode return sum_k gamma^(k-1) r_k."""
    omega: float = 1.0
    """GiGPO weight of the step-level (anchor-group) advantage."""
    scale_by_std: bool = True
    """Divide group advantages by the group std (False = Dr.GRPO-style mean-centring only)."""
    clip_low: float = 0.2
    """PPO ratio clip below 1."""
    clip_high: float = 0.28
    """PPO ratio clip above 1 (DAPO clip-higher)."""
    kl_coef: float = 0.0
    """Weight of a KL penalty to the reference policy (0 = off; > 0 keeps a reference copy)."""
    kl_kind: str = "k3"
    """KL estimator: k1, k2 or k3."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus on policy tokens (0 = off); counters early collapse to one action."""
    dynamic_sampling: bool = True
    """DAPO dynamic sampling: drop groups with identical episode returns and roll out new tasks."""
    max_resample_rounds: int = 2
    """Extra rollout rounds per step to refill dropped groups (then train on what was collected)."""


@dataclass
class RewardConfig:
    on_nonfinite: OnNonfinite = "error"
    """A NaN/inf turn reward from an environment: `error` (stop, naming the environment, episode and turn) or
    `drop_sample` (train without that episode: it leaves its group's statistics, a group left with < 2 episodes is
    not trained on; the count of dropped episodes is logged as reward/nonfinite_samples)."""


@dataclass
class MultiTurnTrainConfig(TrainConfig):
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    lr_end_factor: float = 1.0
    """Learning rate decays linearly from lr to lr * lr_end_factor over max_steps (1 = constant)."""
    max_grad_norm: float = 1.0
    """Gradient clipping (0 = off)."""
    ppo_epochs: int = 1
    """Passes over each step's episodes."""
    mini_batches: int = 1
    """Optimizer steps per pass (episodes are split evenly)."""
    micro_batch_size: int = 16
    """Episodes per forward/backward."""
    warm_start_steps: int = 0
    """Format-only supervised steps before RL: the first-turn prompt -> a random well-formed action
    (`Env.format_example`, e.g. a random move), so the random model learns the answer format, not the task."""
    warm_start_lr: float = 1e-3
    """Learning rate of the warm start."""
    warm_start_batch: int = 32
    """Prompts per warm-start step."""
    warm_start_params: list[str] = field(default_factory=list)
    """Warm start trains only parameters whose name contains one of these (empty = all). Fitting random
    answers with every weight teaches the model to ignore its input; `[lm_head]` teaches just the format."""
    eval_every: int = 0
    """Greedy evaluation every this many steps (0 = only before and after training)."""
    reuse_vision_features: bool = True
    """Compute each episode's image features once per step (mmrl.vlm.common.VisionCache) and reuse them in the
    reference pass and, when the vision tower is frozen, in the training pass (same embeddings); false = every
    forward runs the vision tower."""


@dataclass
class Config(RunConfig):
    algorithm: str = "vlm_multiturn"
    """Recipe name."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Environments."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Multi-turn rollout."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Credit assignment and loss."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Checks on the environments' turn rewards."""
    train: MultiTurnTrainConfig = field(default_factory=MultiTurnTrainConfig)
    """Training loop."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Multi-process training under torchrun / accelerate launch (strategy none|ddp|fsdp (LoRA), backend,
    find_unused_parameters)."""


# ============================================================================================ recipe


def _check_config(cfg: Config) -> None:
    import importlib

    for m in cfg.env.modules:  # custom environments register themselves on import
        importlib.import_module(m)
    if cfg.algo.advantage not in ADVANTAGES:
        raise ValueError(f"algo.advantage: expected one of {list(ADVANTAGES)}, got {cfg.algo.advantage!r}")
    if not cfg.env.tasks:
        raise ValueError("env.tasks: expected at least one environment name, got none")
    for name in cfg.env.tasks:
        make_env(name, **cfg.env.tasks[name])  # unknown names / bad kwargs fail here, with the valid names
    if cfg.rollout.group_size < 2 and cfg.algo.advantage != "turn_grpo":
        raise ValueError(f"rollout.group_size: group advantages need >= 2 episodes per task, "
                         f"got {cfg.rollout.group_size}")
    # sizes that would otherwise fail mid-run or silently train on nothing (no groups, no turns, no epochs)
    ro, t, env = cfg.rollout, cfg.train, cfg.env
    for key, value, least in (("rollout.groups_per_step", ro.groups_per_step, 1),
                              ("rollout.group_size", ro.group_size, 1), ("rollout.batch_size", ro.batch_size, 1),
                              ("rollout.max_turns", ro.max_turns, 1), ("rollout.max_new_tokens", ro.max_new_tokens, 1),
                              ("rollout.max_seq_len", ro.max_seq_len, ro.max_new_tokens + 1),
                              ("rollout.temperature", ro.temperature, 0),
                              ("train.micro_batch_size", t.micro_batch_size, 1),
                              ("train.mini_batches", t.mini_batches, 1), ("train.ppo_epochs", t.ppo_epochs, 1),
                              ("train.warm_start_steps", t.warm_start_steps, 0),
                              ("train.warm_start_batch", t.warm_start_batch, 1 if t.warm_start_steps else 0),
                              ("train.eval_every", t.eval_every, 0), ("env.max_workers", env.max_workers, 1),
                              ("env.eval_episodes", env.eval_episodes, 0),
                              ("algo.max_resample_rounds", cfg.algo.max_resample_rounds, 0),
                              ("model.lora_rank", cfg.model.lora_rank, 0)):
        if value < least:
            raise ValueError(f"{key}: expected >= {least}, got {value}")
    if not 0 < ro.top_p <= 1:
        raise ValueError(f"rollout.top_p: expected 0 < top_p <= 1, got {ro.top_p}")


def check_fsdp_rl_params(model: Any, rl_params: Sequence[torch.Tensor]) -> None:
    """Under FSDP the RL update must not train the vision tower: a text-only turn leaves it without gradients on
    some ranks, and FSDP2 reduce-scatters only the gradients that exist, so the ranks' collectives would not pair."""
    from mmrl.vlm.common import vision_tower

    vision_ids = {id(p) for p in vision_tower(model).parameters()}
    if any(id(p) in vision_ids for p in rl_params):
        raise ValueError("dist.strategy=fsdp: the RL update would train the vision tower, but text-only turns leave "
                         "it without gradients on some ranks and FSDP's gradient reduce-scatter would not pair; add "
                         "model.freeze=[visual] (full fine-tuning), keep LoRA off the vision tower, or use "
                         "dist.strategy=ddp with dist.find_unused_parameters=true")


def check_world_size(cfg: Config, world_size: int) -> None:
    """Every rank rolls out whole episode groups: the global groups_per_step must split evenly."""
    if cfg.rollout.groups_per_step % world_size:
        raise ValueError(f"rollout.groups_per_step={cfg.rollout.groups_per_step} (episode groups per step, global over "
                         f"all processes) must be divisible by the number of processes ({world_size}): each rank "
                         f"rolls out whole groups")


def _specs(cfg: Config, first_seed: int, n_groups: int, group_offset: int, group_size: int) -> list[dict]:
    names = list(cfg.env.tasks)
    specs = []
    for g in range(n_groups):
        seed = first_seed + g
        task = names[seed % len(names)]
        specs += [{"task": task, "seed": seed, "group": group_offset + g, "env_kwargs": cfg.env.tasks[task]}
                  for _ in range(group_size)]
    return specs


def episode_metrics(episodes: Sequence[Episode], gamma: float, prefix: str = "") -> dict[str, float]:
    """Turns, end reasons, token split, success per environment, returns."""
    n = max(len(episodes), 1)
    turns = [len(ep.turns) for ep in episodes]
    R = episode_returns(episodes, gamma) if episodes else torch.zeros(0)
    m = {
        f"{prefix}episode/turns_mean": sum(turns) / n, f"{prefix}episode/turns_max": max(turns + [0]),
        f"{prefix}episode/done_rate": sum(ep.end_reason == "done" for ep in episodes) / n,
        f"{prefix}episode/max_turns_rate": sum(ep.end_reason == "max_turns" for ep in episodes) / n,
        f"{prefix}episode/truncated_rate": sum(ep.end_reason == "truncated" for ep in episodes) / n,
        f"{prefix}episode/obs_truncated_rate": sum(ep.obs_truncated > 0 for ep in episodes) / n,
        f"{prefix}episode/error_rate": sum(ep.end_reason == "error" for ep in episodes) / n,
        f"{prefix}tokens/policy_mean": sum(ep.policy_tokens for ep in episodes) / n,
        f"{prefix}tokens/env_mean": sum(len(ep.ids) - ep.policy_tokens for ep in episodes) / n,
        f"{prefix}tokens/total_max": max([len(ep.ids) for ep in episodes] + [0]),
        f"{prefix}reward/mean": float(R.mean()) if R.numel() else 0.0,
        f"{prefix}reward/std": float(R.std()) if R.numel() > 1 else 0.0,
        f"{prefix}success_rate": sum(ep.success for ep in episodes) / n,
    }
    by_task: dict[str, list[bool]] = defaultdict(list)
    for ep in episodes:
        by_task[ep.task].append(ep.success)
    for task, s in by_task.items():
        m[f"{prefix}success_rate/{task}"] = sum(s) / len(s)
    return m


def _load_model(cfg: Config, run: Run):
    from mmrl.vlm.common import load_policy

    path = Path(cfg.model.path)
    if not (path / "config.json").is_file() and cfg.model.build_tiny:
        from mmrl.tiny import build_tiny_qwen2_vl

        build_tiny_qwen2_vl(path, seed=cfg.seed)
    model, processor = load_policy(path, device=run.device, dtype=run.dtype)
    return model, processor


def _lora(cfg: Config):
    if cfg.model.lora_rank <= 0:
        return None
    from peft import LoraConfig

    return LoraConfig(r=cfg.model.lora_rank, lora_alpha=cfg.model.lora_alpha,
                      target_modules=list(cfg.model.lora_target_modules), lora_dropout=0.0, bias="none")


def warm_start(cfg: Config, model: Any, fmt: ChatFormat, params: list[tuple[str, Any]], pad_id: int,
               eos_id: int) -> float:
    """Format-only SFT: first-turn prompts -> random well-formed actions + EOS. `params`: (name, parameter)
    pairs. Returns the last loss."""
    keep = cfg.train.warm_start_params
    named = list(params)
    params = [p for n, p in named if not keep or any(k in n for k in keep)]
    if not params:
        raise ValueError(f"train.warm_start_params={keep!r} matches no trainable parameter")
    opt = torch.optim.AdamW(params, lr=cfg.train.warm_start_lr)
    rng = random.Random(cfg.seed + 99991)
    names = list(cfg.env.tasks)
    envs = {n: make_env(n, **cfg.env.tasks[n]) for n in names}
    loss_v = float("nan")
    model.train(False)
    for step in range(cfg.train.warm_start_steps):
        prompts, resps, mms = [], [], []
        for _ in range(cfg.train.warm_start_batch):
            name = rng.choice(names)
            env = envs[name]
            obs = env.reset(rng.randrange(10**6, 2 * 10**6))
            example = env.format_example(rng)
            if example is None:
                raise ValueError(f"train.warm_start_steps > 0 but environment {name!r} has no format_example()")
            enc = encode_prompt(fmt.processor, fmt.first_prompt(obs), obs.images)
            prompts.append(enc.input_ids)
            resps.append(fmt.tokenizer(example, add_special_tokens=False)["input_ids"] + [eos_id])
            mms.append(enc.mm)
        batch, P, rmask = collate(model, prompts, resps, mms, pad_id)
        logp, _ = response_logprobs(model, batch, P, batch["input_ids"][:, P:], cfg.rollout.temperature or 1.0)
        loss = -(logp * rmask).sum() / rmask.sum()
        zero_grads(model, [p for _, p in named])
        loss.backward()
        opt.step()
        loss_v = float(loss.detach())
    zero_grads(model, [p for _, p in named])  # the other trainable parameters got gradients too
    return loss_v


def zero_grads(model: Any, params: Sequence[torch.Tensor]) -> None:
    """Drop the gradients of `params` and of everything ``model.parameters()`` yields now.

    Both are needed under FSDP2: after a forward the root unit's parameters are unsharded, so
    ``model.zero_grad()`` would not reach the sharded parameters that hold (and accumulate) the gradients;
    `params` (the optimizer's / PolicyStates' references) are those sharded ones."""
    for p in params:
        p.grad = None
    model.zero_grad(set_to_none=True)


def evaluate(cfg: Config, engine: Any, fmt: ChatFormat, manager: EnvManager) -> dict[str, float]:
    """Greedy episodes on fixed seeds (10^7 + i, never used for training)."""
    names = list(cfg.env.tasks)
    specs = []
    for t, name in enumerate(names):
        specs += [{"task": name, "seed": 10**7 + i, "group": t, "env_kwargs": cfg.env.tasks[name]}
                  for i in range(cfg.env.eval_episodes)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens)
    eps = rollout_episodes(engine, fmt, manager, specs, sp, cfg.rollout.max_turns, cfg.rollout.max_seq_len)
    m = episode_metrics(eps, cfg.algo.gamma, prefix="eval/")
    return {k: v for k, v in m.items() if "/tokens" not in k}


def train(cfg: Config) -> dict:
    from mmrl.adapters import PolicyStates
    from mmrl.vlm.rollout import HFRolloutEngine

    _check_config(cfg)
    ctx = DistContext.init(cfg.dist.backend)
    manager = None
    try:
        check_world_size(cfg, ctx.world_size)
        if not ctx.is_main:
            os.environ["MMRL_NO_PROGRESS"] = "1"
        with ctx.main_process_first():
            run = Run(cfg, write_config=ctx.is_main)  # also applies cfg.num_threads
        if ctx.enabled:
            run.device = ctx.device  # cuda:LOCAL_RANK (or cpu under gloo)
        with ctx.main_process_first():  # rank 0 builds the tiny demo model (model.build_tiny) before the others load it
            model, processor = _load_model(cfg, run)
        tok = getattr(processor, "tokenizer", processor)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        eos_id = tok.convert_tokens_to_ids("<|im_end|>")
        use_ref = cfg.algo.kl_coef > 0
        lora = _lora(cfg)
        states = PolicyStates(model, lora, old=False, **({"keep_ref_copy": use_ref} if lora is None else {}))
        fsdp = ctx.enabled and cfg.dist.strategy == "fsdp"
        if fsdp:  # shard the decoder layers (the vision tower stays in the root unit: text-only and image forwards
            # then run the same collectives), follow the shards, and build the optimizer from them (below)
            from mmrl.vlm.common import language_block_types

            ctx.wrap_model(states.model, "fsdp", fsdp_block_types=language_block_types(states.model))
            states.refresh()
        params = states.named_trainable_parameters()
        rl_params = [p for n, p in states.named_trainable_parameters() if not any(f in n for f in cfg.model.freeze)]
        if not rl_params:
            raise ValueError(f"model.freeze={cfg.model.freeze!r} excludes every trainable parameter")
        if fsdp:
            check_fsdp_rl_params(states.model, rl_params)
        opt = torch.optim.AdamW(rl_params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        n_steps, end = max(cfg.train.max_steps, 1), cfg.train.lr_end_factor
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 - (1.0 - end) * min(k, n_steps) / n_steps)
        fmt = ChatFormat(processor, cfg.rollout.system_prompt or None)
        engine = HFRolloutEngine(states.model, processor, batch_size=cfg.rollout.batch_size)
        manager = EnvManager(cfg.env.max_workers, cfg.env.backend, modules=cfg.env.modules)
        return _train_loop(cfg, run, states, opt, sched, params, fmt, engine, manager, pad_id, eos_id, use_ref, ctx,
                           fsdp=fsdp)
    finally:
        if manager is not None:
            manager.close()
        ctx.close()


def _light(ep: Episode) -> Episode:
    """An episode without its vision tensors and log-probs (what other ranks need: turns, rewards, anchors, group,
    token counts, end reason), for all_gather_object."""
    return dataclasses.replace(ep, mm=[], old_logprobs=[], _mm_memo=None)


def _gather_episodes(ctx: DistContext, eps: list[Episode]) -> tuple[list[Episode], list[int]]:
    """(every rank's episodes in rank order, the rank each came from); one process: (eps, [0, ...]) unchanged."""
    if not ctx.enabled:
        return list(eps), [0] * len(eps)
    parts = ctx.all_gather_object([_light(ep) for ep in eps])
    return [ep for part in parts for ep in part], [r for r, part in enumerate(parts) for _ in part]


def _placeholder(episodes: Sequence[Episode]) -> Episode:
    """A local episode for the zero-weight micro-batch of a rank that has nothing to train on in a mini-batch."""
    for ep in episodes:
        if ep.policy_tokens > 0:
            return ep
    for ep in episodes:
        if len(ep.ids) > ep.prompt_len > 0:
            return ep
    raise RuntimeError("vlm_multiturn: this rank has no episode with tokens to run the placeholder micro-batch "
                       "that keeps the gradient all-reduce paired (every reset failed?)")


def _train_loop(cfg: Config, run: Run, states: Any, opt: Any, sched: Any, params: list, fmt: ChatFormat, engine: Any,
                manager: EnvManager, pad_id: int, eos_id: int, use_ref: bool, ctx: DistContext | None = None,
                fsdp: bool = False) -> dict:
    ctx = ctx if ctx is not None else DistContext()
    world, rank = ctx.world_size, ctx.rank
    model = states.model
    dummy_ids = torch.full((1, 1), pad_id, dtype=torch.long, device=next(model.parameters()).device)

    dummies = [0]  # dummy forwards this rank ran in the current step (FSDP)

    def dummy() -> None:
        dummies[0] += 1
        model(input_ids=dummy_ids, use_cache=False)

    def lockstep() -> LockstepForwards:
        """FSDP: ranks run different numbers of rollout / reference forwards; pair them (one process, DDP: no-op)."""
        return LockstepForwards(ctx, model, dummy=dummy, enabled=fsdp)

    start_step, task_cursor, summary_extra = 0, 0, {}
    resume = run.find_resume()
    if resume is not None:
        states.load(resume / "policy")
        st = run.load_state(resume)
        load_full_optimizer_state_dict(opt, st["optimizer"])  # FSDP: this rank's shard of the full tensors
        sched.load_state_dict(st["scheduler"])
        set_rng_state(st["rng"])
        start_step, task_cursor = int(st["step"]), int(st["task_cursor"])  # task_cursor is global: any world size
        summary_extra = st.get("summary", {})
        if ctx.is_main:
            run.truncate_metrics(start_step)
    else:
        if cfg.train.warm_start_steps > 0:  # identical on every rank (same seeded draws; FSDP: equal forwards)
            summary_extra["warm_start_loss"] = warm_start(cfg, states.model, fmt, params, pad_id, eos_id)
        if ctx.is_main or fsdp:  # FSDP: every rank runs the evaluation forwards, rank 0 reports
            with lockstep():
                ev = evaluate(cfg, engine, fmt, manager)
            summary_extra["eval_before"] = ev
            if ctx.is_main:
                run.log(0, ev)

    # only the optimizer's parameters get gradients from here on (DDP registers those that require grad now;
    # a frozen vision tower lets the training pass reuse cached image features)
    rl_ids = {id(p) for p in opt.param_groups[0]["params"]}
    for p in states.trainable_parameters():
        p.requires_grad_(id(p) in rl_ids)
    # FSDP: already sharded in train(). The vision cache calls the tower outside the root forward: off under FSDP
    tmodel = model if fsdp else ctx.wrap_model(model, cfg.dist.strategy,
                                               find_unused_parameters=cfg.dist.find_unused_parameters)
    reuse = cfg.train.reuse_vision_features and not fsdp
    state_ids = {id(p) for p in states.trainable_parameters()}
    share_ref = reuse and not vision_has_adapters(model) and not any(
        id(p) in state_ids for p in vision_tower(model).parameters())

    sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                              max_new_tokens=cfg.rollout.max_new_tokens)
    guard = UpdateGuard(cfg.train.max_skipped_updates, ctx, run)  # a NaN/inf loss or gradient never reaches the weights
    min_group = min(2, cfg.rollout.group_size)  # a group left with fewer finite-reward episodes is not trained on
    bar = run.progress(cfg.train.max_steps, start_step)
    for step in range(start_step + 1, cfg.train.max_steps + 1):
        if ctx.enabled:  # rank-local randomness as a function of (seed, rank, step): nothing per rank to save
            seed_everything(ctx.rank_seed(cfg.seed, step))
        timer, stats, t_step = Timer(), RolloutStats(), time.perf_counter()
        dummies[0] = 0
        # ---- rollout (+ dynamic sampling); `all_eps`: every rank's episodes (light copies under several processes)
        episodes: list[Episode] = []
        all_eps: list[Episode] = []
        all_src: list[int] = []
        kept: list[int] = []
        rounds = nonfinite = 0
        states.model.eval()
        while True:
            need = cfg.rollout.groups_per_step if rounds == 0 else cfg.rollout.groups_per_step - len(kept)
            n_new = -(-need // world) * world  # whole groups on every rank (refill rounds round up)
            specs = ctx.shard(_specs(cfg, task_cursor, n_new, task_cursor, cfg.rollout.group_size))
            task_cursor += n_new
            sp = dataclasses.replace(sampling, seed=cfg.seed * 7919 + step * 101 + rounds + rank * 1_000_003)
            with lockstep():
                eps = rollout_episodes(engine, fmt, manager, specs, sp, cfg.rollout.max_turns, cfg.rollout.max_seq_len,
                                       cfg.rollout.async_mode, stats)
            episodes += eps
            g_eps, g_src = _gather_episodes(ctx, eps)
            # on the gathered episodes: every rank raises, or drops the same episodes
            nonfinite += check_turn_rewards(g_eps, cfg.reward.on_nonfinite)
            all_eps += g_eps
            all_src += g_src
            fin = [ep for ep in all_eps if rewards_finite(ep)]  # all of them unless drop_sample dropped some
            if not cfg.algo.dynamic_sampling:
                sizes = defaultdict(int)
                for ep in fin:
                    sizes[ep.group] += 1
                kept = sorted(g for g in {ep.group for ep in all_eps} if sizes[g] >= min_group)
                break
            # decided on the gathered episodes: identical on every rank, so all ranks run the same rounds
            kept = informative_groups(fin, episode_returns(fin, cfg.algo.gamma))
            rounds += 1
            if len(kept) >= cfg.rollout.groups_per_step or rounds > cfg.algo.max_resample_rounds:
                break
        metrics = episode_metrics(all_eps, cfg.algo.gamma)  # everything sampled (all ranks), before filtering
        if cfg.reward.on_nonfinite == "drop_sample":
            metrics[NONFINITE_KEY] = nonfinite  # episodes dropped for a NaN/inf turn reward
            if nonfinite:  # returns of the episodes kept
                metrics.update(finite_stats(episode_returns(all_eps, cfg.algo.gamma)))
        keep = set(kept[:cfg.rollout.groups_per_step])
        train_eps = [ep for ep in episodes if ep.group in keep and ep.policy_tokens > 0 and rewards_finite(ep)]
        sel = sorted((i for i, ep in enumerate(all_eps)
                      if ep.group in keep and ep.policy_tokens > 0 and rewards_finite(ep)),
                     key=lambda i: all_src[i])  # rank-major, each rank's own order (stable sort)
        glob_train = [all_eps[i] for i in sel]
        lo = sum(all_src[i] < rank for i in sel)
        metrics.update({"dynamic/rounds": rounds, "dynamic/kept_groups": len(keep),
                        "dynamic/episodes_sampled": len(all_eps)})
        # ---- advantages (statistics and GiGPO anchor groups over the global batch), this rank's rows
        with timer("advantages"):
            turn_adv = turn_advantages(glob_train, cfg.algo.advantage, cfg.algo.gamma, cfg.algo.omega,
                                       cfg.algo.scale_by_std) if glob_train else torch.zeros(0, 1)
            turn_adv = turn_adv[lo:lo + len(train_eps)]
            adv = token_advantages(train_eps, turn_adv)
            vcache = VisionCache(model) if reuse and train_eps else None  # this step's images, "default" state
            ref_lp = None
            if use_ref and (train_eps or fsdp):
                from mmrl.vlm.common import compute_logprobs

                ref_cache = vcache if share_ref else (VisionCache(model) if reuse else None)
                with states.use("ref"), lockstep():
                    ref_lp, _ = compute_logprobs(model, [e.ids[:e.prompt_len] for e in train_eps],
                                                 [e.ids[e.prompt_len:] for e in train_eps],
                                                 [e.merged_mm() for e in train_eps], pad_id,
                                                 cfg.train.micro_batch_size, cfg.rollout.temperature or 1.0,
                                                 vision_cache=ref_cache)
        # ---- policy update
        loss_metrics: dict[str, list[float]] = defaultdict(list)
        drift = 0.0
        with timer("train"):
            order = list(range(len(train_eps)))
            n_rows = ctx.max_int(len(order)) if ctx.enabled else len(order)  # same mini-batch count on every rank
            n_mb = max(1, min(cfg.train.mini_batches, n_rows))
            first = True
            applied = 0  # optimizer updates applied (not skipped by the guard)
            mbs = cfg.train.micro_batch_size
            n_placeholder = 0
            for _ in range(cfg.train.ppo_epochs if glob_train else 0):
                for mb in [order[i::n_mb] for i in range(n_mb)]:
                    norm = float(sum(train_eps[i].policy_tokens for i in mb))
                    scale, placeholder = 1.0, False
                    if ctx.enabled:  # this rank's token share: DDP's average = gradient of the global token-mean
                        scale = ctx.loss_scale(norm)
                        if not mb:  # nothing here in this mini-batch: a zero-weight micro-batch joins the all-reduce
                            scale, placeholder = 0.0, True
                            n_placeholder += 1
                    zero_grads(states.model, states.trainable_parameters())  # (frozen ones too: never stepped)
                    mb_losses = []  # real micro-batch losses of this mini-batch (the update guard checks them)
                    chunks = [mb[s:s + mbs] for s in range(0, len(mb), mbs)] if mb else [[]]
                    if fsdp:  # every forward/backward is a collective: equal micro-batch counts, zero-weight padding
                        chunks += [[]] * (ctx.max_int(len(chunks)) - len(chunks))
                    for ci, idx in enumerate(chunks):
                        if placeholder or not idx:
                            ph = _placeholder(episodes)
                            eps_mb, adv_mb, ref_mb = [ph], [torch.zeros(len(ph.ids) - ph.prompt_len)], None
                        else:
                            eps_mb, adv_mb = [train_eps[i] for i in idx], [adv[i] for i in idx]
                            ref_mb = None if ref_lp is None else [ref_lp[i] for i in idx]
                        with ctx.no_sync(tmodel, sync=ci == len(chunks) - 1):  # forward AND backward inside
                            loss, m = policy_loss(
                                tmodel, eps_mb, adv_mb, pad_id,
                                temperature=cfg.rollout.temperature or 1.0, clip_low=cfg.algo.clip_low,
                                clip_high=cfg.algo.clip_high, normalizer=norm, ref_logprobs=ref_mb,
                                kl_coef=cfg.algo.kl_coef, kl_kind=cfg.algo.kl_kind, entropy_coef=cfg.algo.entropy_coef,
                                vision_cache=vcache)
                            weight = 0.0 if not idx else scale
                            if weight != 1.0:
                                loss = loss * weight
                            loss.backward()
                        if placeholder or not idx:
                            continue
                        mb_losses.append(loss.detach())
                        if first:
                            drift = max(drift, m["drift"])
                        for k, v in m.items():
                            loss_metrics[k].append(v)
                    # the norm is computed (for the guard) even without clipping
                    gn = ctx.clip_grad_norm_(opt.param_groups[0]["params"],
                                             cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else math.inf)
                    if cfg.train.max_grad_norm > 0:
                        loss_metrics["grad_norm"].append(gn)
                    applied += guard.step(opt, mb_losses, gn, step)  # NaN/inf loss or gradient: skipped
                    first = False
        if ctx.enabled:  # means over every rank's micro-batches; drift = max over ranks
            merged: dict[str, list[float]] = defaultdict(list)
            parts = ctx.all_gather_object((dict(loss_metrics), n_placeholder))
            for part, _ in parts:
                for k, v in part.items():
                    merged[k] += v
            loss_metrics = merged
            metrics["dist/placeholder_minibatches"] = sum(n for _, n in parts)  # zero-weight, summed over ranks
        if fsdp:  # forwards a rank ran only to pair another rank's rollout / reference forwards, summed over ranks
            metrics["dist/lockstep_dummy_forwards"] = sum(ctx.all_gather_object(dummies[0]))
            drift = max(ctx.all_gather_object(drift))
        metrics["policy/lr"] = opt.param_groups[0]["lr"]
        metrics.update(guard.pop_metrics())
        if applied or not metrics[SKIPPED_KEY]:  # every update of the step skipped (NaN/inf): schedule unchanged
            sched.step()
        metrics.update({f"policy/{k}": sum(v) / len(v) for k, v in loss_metrics.items()
                        if k not in ("drift", "n_tokens")})
        metrics["diag/logprob_drift"] = drift
        metrics["policy/kl"] = metrics.get("policy/approx_kl", 0.0)
        if vcache is not None and vcache.vision_calls:
            metrics["vision_cache/calls"] = vcache.vision_calls
        metrics.update({"time/generation_s": stats.generation_s, "time/environment_s": stats.environment_s,
                        "time/preprocessing_s": stats.preprocessing_s, **timer.pop()})
        metrics["time/step_s"] = time.perf_counter() - t_step
        metrics["env/errors_total"] = len(manager.errors)
        if ctx.is_main or fsdp:  # the other ranks wait at the next collective (FSDP: all evaluate, rank 0 logs)
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step != cfg.train.max_steps:
                with lockstep():
                    metrics.update(evaluate(cfg, engine, fmt, manager))
            if step == cfg.train.max_steps:
                with lockstep():
                    ev = evaluate(cfg, engine, fmt, manager)
                metrics.update(ev)
                summary_extra["eval_after"] = ev
        if ctx.is_main:
            run.log(step, metrics)
            if step == 1 or step % 10 == 0:
                _save_samples(run, step, episodes)
        if (cfg.train.save_every and step % cfg.train.save_every == 0) or step == cfg.train.max_steps:
            check_finite_weights(states, step, ctx, run)  # never a checkpoint with NaN/inf weights
            with ctx.checkpoint(run, step) as d:  # rank 0 writes, the others wait
                if fsdp:  # gathering the shards is a collective: every rank takes part, rank 0 writes
                    states.save(Path(d) / "policy" if d is not None else None)
                    opt_sd = full_optimizer_state_dict(opt)
                else:
                    opt_sd = opt.state_dict() if d is not None else None
                    if d is not None:
                        states.save(Path(d) / "policy")
                if d is not None:
                    run.save_state(d, optimizer=opt_sd, scheduler=sched.state_dict(), rng=get_rng_state(),
                                   step=step, task_cursor=task_cursor, summary=summary_extra)
        bar.update(1)
        bar.set_postfix(success=f"{metrics['success_rate']:.2f}", R=f"{metrics['reward/mean']:.2f}")
    bar.close()
    ctx.close()
    if not ctx.is_main:
        return {}
    return run.finish(summary_extra)


def _save_samples(run: Run, step: int, episodes: Sequence[Episode], n: int = 4) -> None:
    """A text file with a few trajectories (the policy's turns, rewards and end reasons)."""
    lines = []
    for ep in episodes[:: max(1, len(episodes) // n)][:n]:
        lines.append(f"# episode {ep.index} task={ep.task} seed={ep.seed} end={ep.end_reason} success={ep.success}")
        for k, t in enumerate(ep.turns):
            lines.append(f"  turn {k + 1}: {t.text!r} reward={t.reward:+.3f} anchor={t.anchor!r}")
    (run.samples_dir / f"step_{step:06d}.txt").write_text("\n".join(lines) + "\n")
