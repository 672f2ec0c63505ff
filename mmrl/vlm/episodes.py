"""Multi-turn episodes: the trajectory record (`Episode`, `Turn`), chat rendering of observations (`ChatFormat`),
the environment rollout loop (`rollout_episodes`), and what the recipe does with a list of episodes (task specs,
metrics, gathering across processes, sample files); its config sections `env` and `rollout` are in
``mmrl.vlm.config``.

Trajectory layout (token-in, token-out: the policy's own sampled ids are never re-tokenised)::

    [prompt_1 | response_1 | env_2 | response_2 | env_3 | ... | response_K]
     system + user(obs_1)   closing of the assistant turn ("<|im_end|>\\n" or the part the model did not
     + "<|im_start|>assistant\\n"   emit) + user(obs_k, its images) + the next generation prompt

``loss_mask`` is 1 exactly on response tokens; prompt and environment tokens are context only (zero
gradient, see tests). Each turn's prompt is the whole trajectory so far, with the images of every turn
(their vision tensors concatenated in order, positions from ``mmrl.pipelines.qwen_vl.get_rope_index``
via ``mmrl.vlm.common.collate``), so the trainer's forward over the full trajectory sees exactly the
prefixes the sampler saw and recomputed log-probs match the rollout's (``diag/logprob_drift``).

Engines: the HF engine re-prefills the whole history every turn (no cross-turn KV cache); the vLLM engine takes the
same token ids (``prompt_token_ids``) with every observation's images so far (``Episode.images``), and its prefix
cache reuses the KV blocks of the earlier turns.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field
from typing import Any, Hashable, Literal, Sequence

import torch

from mmrl.vlm.common import EncodedPrompt, encode_prompt, render_prompt
from mmrl.vlm.envs import EnvManager, Observation, StepResult
from mmrl.vlm.rollout import GenRequest, SamplingParams

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
    images: list = field(default_factory=list)  # every observation's images in order (what the vLLM engine is sent)
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
    the next generation prompt) minus a special token the model already emitted at the end of its response:
    Qwen's ``<|im_end|>`` (the closing), GLM-4.1V's ``<|user|>`` (its turn end is the next user turn's header).
    Needs an append-only template (Qwen2/2.5/3-VL, GLM-4.1V and InternVL's are).
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
        """Closing of the previous assistant turn + user turn, minus what the model already emitted."""
        full = render_prompt(self.processor, self._probe + [self._user(obs)])
        if not full.startswith(self._base):
            raise ValueError("ChatFormat: the chat template is not append-only (rendering a longer chat changed "
                             "the earlier turns); multi-turn token-in/token-out rollout needs one that is")
        return self.after_response(last_response_ids, self.closing + full[len(self._base):])

    def after_response(self, response_ids: Sequence[int], text: str) -> str:
        """`text` (what the template puts after the response) minus a special token the model already emitted at
        its end (its EOS): the template writes that token itself, and the trajectory must hold it once."""
        if response_ids and int(response_ids[-1]) in self._special_ids:
            last = self.tokenizer.decode([int(response_ids[-1])])
            if last and text.startswith(last):
                return text[len(last):]
        return text


def encode_observation(fmt: ChatFormat, obs: Observation, first: bool, last_response_ids: Sequence[int],
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
                     sampling: SamplingParams, max_turns: int, max_seq_len: int,
                     scheduling: Literal["lockstep", "independent"] = "lockstep",
                     stats: RolloutStats | None = None) -> list[Episode]:
    """Run one episode per spec ({"task", "seed", "group", "env_kwargs"?, "task_kwargs"?}) to the end.

    An episode ends when its environment says done ("done", or "max_turns" if the env ran out of turns),
    after min(max_turns, env.max_turns) turns ("max_turns"), when the next observation plus
    ``sampling.max_new_tokens`` cannot fit in `max_seq_len` tokens ("truncated"; observation texts are cut
    first, counted in ``obs_truncated``), or when its environment raises ("error").
    ``scheduling="lockstep"``: every turn generates for all live episodes, then steps their environments
    concurrently. ``"independent"``: episodes advance on their own: a generation batch holds whichever episodes
    are ready, and each episode's environment step is submitted as soon as its response exists, so slow
    environments never hold up the others. Generation is seeded from ``sampling.seed`` (+ a call counter),
    so lockstep rollouts are reproducible.
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
            outs = engine.generate([GenRequest(prompt_text="", images=list(ep.images), metadata={"episode": ep.index})
                                    for ep in eps], sp, encoded=enc)
            stats.generation_s += time.perf_counter() - t0
            for ep, out in zip(eps, outs):
                start = len(ep.ids)
                ep.append(out.response_ids, True, out.response_logprobs)
                ep.turns.append(Turn(start, len(ep.ids), anchor=ep.anchor, finish_reason=out.finish_reason,
                                     text=out.text))

    if scheduling not in ("lockstep", "independent"):
        raise ValueError(f"rollout.episode_scheduling: expected 'lockstep' or 'independent', got {scheduling!r}")
    live = [ep for ep in episodes if not ep.done]
    if scheduling == "lockstep":
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
    enc, cut = encode_observation(fmt, res.observation, first, last, budget)
    stats.preprocessing_s += time.perf_counter() - t
    if enc is None:
        ep.finish("truncated")
        return
    ep.obs_truncated += int(cut)
    ep.append(enc.input_ids, False)
    if enc.mm:
        ep.mm.append(enc.mm)
    ep.images += list(res.observation.images)
    if first:
        ep.prompt_len = len(ep.ids)
    ep.anchor = res.observation.anchor



# ============================================================================================ episode lists


def task_specs(tasks: dict[str, dict], first_seed: int, n_groups: int, group_offset: int,
               group_size: int) -> list[dict]:
    """`group_size` episode specs for each of `n_groups` tasks: group g has seed first_seed + g and cycles through
    the environments of `tasks` (name -> constructor kwargs) in order."""
    names = list(tasks)
    specs = []
    for g in range(n_groups):
        seed = first_seed + g
        task = names[seed % len(names)]
        specs += [{"task": task, "seed": seed, "group": group_offset + g, "env_kwargs": tasks[task]}
                  for _ in range(group_size)]
    return specs


def episode_metrics(episodes: Sequence[Episode], returns: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """Turns, end reasons, token split, success per environment, returns (`returns`: one per episode).
    Training metrics (`prefix=""`) go under rollout/ and reward/; evaluation ones under `prefix` (e.g. "eval/")."""
    n = max(len(episodes), 1)
    turns = [len(ep.turns) for ep in episodes]
    ro = prefix or "rollout/"
    rw = prefix or "reward/"
    m = {
        f"{ro}episode/turns_mean": sum(turns) / n, f"{ro}episode/turns_max": max(turns + [0]),
        f"{ro}episode/done_rate": sum(ep.end_reason == "done" for ep in episodes) / n,
        f"{ro}episode/max_turns_rate": sum(ep.end_reason == "max_turns" for ep in episodes) / n,
        f"{ro}episode/truncated_rate": sum(ep.end_reason == "truncated" for ep in episodes) / n,
        f"{ro}episode/obs_truncated_rate": sum(ep.obs_truncated > 0 for ep in episodes) / n,
        f"{ro}episode/error_rate": sum(ep.end_reason == "error" for ep in episodes) / n,
        f"{prefix}reward/mean": float(returns.mean()) if returns.numel() else 0.0,
        f"{prefix}reward/std": float(returns.std()) if returns.numel() > 1 else 0.0,
        f"{rw}success_rate": sum(ep.success for ep in episodes) / n,
    }
    if not prefix:  # token counts of the training rollouts only
        m.update({"rollout/tokens/policy_mean": sum(ep.policy_tokens for ep in episodes) / n,
                  "rollout/tokens/env_mean": sum(len(ep.ids) - ep.policy_tokens for ep in episodes) / n,
                  "rollout/tokens/total_max": max([len(ep.ids) for ep in episodes] + [0])})
    by_task: dict[str, list[bool]] = defaultdict(list)
    for ep in episodes:
        by_task[ep.task].append(ep.success)
    for task, s in by_task.items():
        m[f"{rw}success_rate/{task}"] = sum(s) / len(s)
    return m


def light(ep: Episode) -> Episode:
    """An episode without its vision tensors and log-probs (what other ranks need: turns, rewards, anchors, group,
    token counts, end reason), for all_gather_object."""
    return dataclasses.replace(ep, mm=[], images=[], old_logprobs=[], _mm_memo=None)


def gather_episodes(ctx: Any, eps: list[Episode]) -> tuple[list[Episode], list[int]]:
    """(every rank's episodes in rank order, the rank each came from); one process: (eps, [0, ...]) unchanged."""
    if not ctx.enabled:
        return list(eps), [0] * len(eps)
    parts = ctx.all_gather_object([light(ep) for ep in eps])
    return [ep for part in parts for ep in part], [r for r, part in enumerate(parts) for _ in part]


def samples_text(episodes: Sequence[Episode], n: int = 4) -> str:
    """A few trajectories as text (the policy's turns, rewards and end reasons), for the run's samples/."""
    lines = []
    for ep in episodes[:: max(1, len(episodes) // n)][:n]:
        lines.append(f"# episode {ep.index} task={ep.task} seed={ep.seed} end={ep.end_reason} success={ep.success}")
        for k, t in enumerate(ep.turns):
            lines.append(f"  turn {k + 1}: {t.text!r} reward={t.reward:+.3f} anchor={t.anchor!r}")
    return "\n".join(lines) + "\n"
