"""Group-wise and pairwise rewards: a sample's score depends on the other samples of its group.

A GRPO-style trainer draws G images per prompt; a group reward scores each image against the others of its group
instead of on an absolute scale (Pref-GRPO, Wang et al. 2025, arXiv 2508.20751: pointwise scores whose small
differences are blown up by the group normalisation give an "illusory advantage"; a win rate against the group is
bounded and ranks instead of measuring):

    group_rank        s_i = (rank of r_i among its group) / (n_g - 1) in [0, 1], ties averaged, for any pointwise
                      reward r (`scorer=`, its load kwargs alongside); `pickscore_rank` is it with PickScore
    pairwise_winrate  s_i = mean over j != i of its group of P(i beats j), from a pairwise judge:
                      `bradley_terry` (a pointwise reward r, `scorer=`: P = sigmoid((r_i - r_j) / temperature), or
                      1 / 0.5 / 0 with `hard`) or `vlm_pairwise` (a VLM over an OpenAI-compatible chat API sees
                      both images and names the better one, as Pref-GRPO's UnifiedReward-Think judge; an answer
                      naming neither counts as a tie, 0.5 each) or `unified_reward` (the same judge run locally
                      with transformers: mmrl/rewards/unified_reward.py)

Every unordered pair of a group is judged once (first = the lower index), P(j beats i) = 1 - P(i beats j);
`both_orders=True` judges both orders and averages (a VLM judge's position bias cancels). A group of one scores
0.5 (no one to beat). group_rank equals pairwise_winrate with the hard judge of the same reward.

The protocol (`GroupRewardModel`): `reward(images, prompts=None, metadata=None, group_ids=None)`; groups are
`group_ids` when given, else `metadata[i]["group"]` when every sample has one, else the prompt text (identical
prompts = one group: what a recipe's rollout batch is), else the whole batch. The batch is scored whole (never
split into chunks, which could split a group), so a rollout scorer that scores micro-batches refuses these rewards.
They are image rewards; they work inside a composite (`reward.components`) like any other.

source: Pref-GRPO (CodeGoat24/Pref-GRPO at 31e7356) fastvideo/rewards/unifiedreward_flex.py `_pairwise_win_rate`
(itertools.combinations of a group, winner 1 / 2 / else 0.5 each, win rate = wins / comparisons).
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from mmrl.rewards.base import RewardModel, RewardOutput, load, register
from mmrl.rewards.registry import lookup
from mmrl.rewards.remote import RemoteRewardError, request_json
from mmrl.rewards.vlm_judge import VLMJudge, _reply_text, judge_content, openai_content

Tensor = torch.Tensor

__all__ = ["GroupRewardModel", "GroupRank", "PairwiseWinRate", "BradleyTerryJudge", "VLMPairwiseJudge",
           "resolve_group_ids", "win_rates", "is_group_reward", "parse_winner", "pairwise_verdict", "PAIRWISE_JUDGES",
           "LAZY_JUDGES"]


def is_group_reward(reward: Any) -> bool:
    """True for a group reward, or a composite holding one (its scores depend on how the batch is split)."""
    if getattr(reward, "group_reward", False):
        return True
    return any(is_group_reward(c) for c in getattr(reward, "components", {}).values()
               if isinstance(c, RewardModel))


def resolve_group_ids(n: int, prompts: Sequence[str] | None = None, metadata: Sequence[dict] | None = None,
                      group_ids: Any = None) -> Tensor:
    """Group index [n] (contiguous, first-seen order) of every sample (see the module docstring for the order)."""
    if group_ids is not None:
        ids = torch.as_tensor(group_ids).reshape(-1)
        if ids.shape[0] != n:
            raise ValueError(f"group_ids: got {ids.shape[0]} for {n} samples; pass one per sample")
        keys: list = ids.tolist()
    elif metadata is not None and all(isinstance(m, dict) and "group" in m for m in metadata):
        keys = [m["group"] for m in metadata]
    elif prompts is not None:
        keys = list(prompts)
    else:
        keys = [0] * n
    index: dict = {}
    return torch.tensor([index.setdefault(k, len(index)) for k in keys], dtype=torch.long)


def win_rates(prefer: Tensor, groups: Tensor) -> Tensor:
    """s_i = sum_{j != i, same group} prefer[i, j] / (n_g - 1); 0.5 for a group of one. prefer [B, B] = P(i beats j)."""
    same = groups[:, None] == groups[None, :]
    same.fill_diagonal_(False)
    count = same.sum(1)
    total = torch.where(same, prefer.float(), torch.zeros((), dtype=torch.float32)).sum(1)
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, 0.5))


class GroupRewardModel(RewardModel):
    """Base of group rewards: scores the whole batch at once with its groups (`score_groups`)."""

    group_reward = True
    needs_prompts = False

    def __call__(self, images: Any = None, prompts: Sequence[str] | None = None,
                 metadata: Sequence[dict] | None = None, completions: Sequence[str] | None = None,
                 group_ids: Any = None) -> RewardOutput:
        images, prompts, metadata = self._image_inputs(images, prompts, metadata)  # (never chunked: whole groups)
        groups = resolve_group_ids(images.shape[0], prompts, metadata, group_ids)
        return self.score_groups(images, prompts, metadata, groups)

    def score_groups(self, images: Tensor, prompts: list[str] | None, metadata: list[dict] | None,
                     groups: Tensor) -> RewardOutput:
        raise NotImplementedError


@register("group_rank")
class GroupRank(GroupRewardModel):
    """Normalised rank of a pointwise reward within each group: load("group_rank", scorer="clip_score", ...)
    (the other kwargs load the scorer; `scorer`, not `reward`, so the spec fits in a composite's mapping)."""

    name = "group_rank"
    unit = "rank within the group"
    score_range = (0.0, 1.0)

    def __init__(self, scorer: Any = "pickscore", device: Any = None, **scorer_kwargs: Any):
        self.base = load(scorer, **({"device": device} if device is not None else {}), **scorer_kwargs)
        self.needs_prompts = bool(getattr(self.base, "needs_prompts", False))
        self.name = f"group_rank({getattr(self.base, 'name', scorer)})"

    def score_groups(self, images, prompts, metadata, groups):
        raw = self.base(images=images, prompts=prompts, metadata=metadata).scores.detach().float().cpu()
        prefer = (raw[:, None] > raw[None, :]).float() + 0.5 * (raw[:, None] == raw[None, :]).float()
        return RewardOutput(win_rates(prefer, groups), {"score": raw, "group": groups})

    def to(self, device: Any) -> "GroupRank":
        self.base.to(device)
        return self


@register("pickscore_rank")
def pickscore_rank(**kwargs: Any) -> GroupRank:
    """PickScore's rank within each group (`group_rank` with scorer="pickscore"; kwargs go to PickScore)."""
    rank = GroupRank(scorer="pickscore", **kwargs)
    rank.name = "pickscore_rank"
    return rank


# ------------------------------------------------------------------------------------------ pairwise judges


class BradleyTerryJudge:
    """P(a beats b) = sigmoid((r_a - r_b) / temperature) from a pointwise reward r (every image scored once);
    `hard`: 1 if r_a > r_b, 0.5 if equal, else 0."""

    def __init__(self, scorer: Any = "pickscore", temperature: float = 1.0, hard: bool = False, device: Any = None,
                 **scorer_kwargs: Any):
        if temperature <= 0:
            raise ValueError(f"bradley_terry judge: temperature must be > 0, got {temperature}")
        self.reward = load(scorer, **({"device": device} if device is not None else {}), **scorer_kwargs)
        self.temperature, self.hard = float(temperature), bool(hard)
        self.needs_prompts = bool(getattr(self.reward, "needs_prompts", False))

    def compare(self, images: Tensor, prompts, metadata, first: Tensor, second: Tensor) -> tuple[Tensor, dict]:
        r = self.reward(images=images, prompts=prompts, metadata=metadata).scores.detach().float().cpu()
        d = r[first] - r[second]
        p = (d > 0).float() + 0.5 * (d == 0).float() if self.hard else torch.sigmoid(d / self.temperature)
        return p, {"score": r}


DEFAULT_PAIRWISE_PROMPT = (
    "You will see two images that a text-to-image model generated from the same prompt: Image 1 first, then "
    "Image 2. Compare them on prompt alignment (objects, attributes, counts, text and spatial relations asked for) "
    "and on visual quality (sharpness, coherence, no artifacts). Reason briefly, then answer on the last line with "
    "exactly 'Image 1 is better' or 'Image 2 is better'.\nPrompt: {prompt}"
)

_IMG1 = re.compile(r"\bimage\s*1\b", re.IGNORECASE)
_IMG2 = re.compile(r"\bimage\s*2\b", re.IGNORECASE)


_TIE = re.compile(r"\b(equally|equal|tie)\b", re.IGNORECASE)


def _verdict(text: str, require_answer: bool = False) -> tuple[str, bool]:
    """(the verdict, found): the last <answer>...</answer> if the reply has one, else its last non-empty line;
    `require_answer` (a chain-of-thought reply, whose last line may be inside the reasoning): only the <answer>."""
    text = text or ""
    answers = re.findall(r"<answer>(.*?)</answer>", text, re.IGNORECASE | re.DOTALL)
    if answers or require_answer:
        return (answers[-1], True) if answers else ("", False)
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1], True) if lines else ("", False)


def parse_winner(text: str, require_answer: bool = False) -> int | None:
    """1 or 2 when the verdict names exactly one of "Image 1" / "Image 2", else None (a tie). The verdict is the
    last <answer>...</answer> if the reply has one, else its last non-empty line (`require_answer`: only the
    <answer>, as for UnifiedReward-Think's replies).

    >>> parse_winner("Both fine.\\nImage 2 is better"), parse_winner("<answer>Image 1</answer>"), parse_winner("?")
    (2, 1, None)
    """
    verdict, _ = _verdict(text, require_answer)
    one, two = bool(_IMG1.search(verdict)), bool(_IMG2.search(verdict))
    return 1 if one and not two else 2 if two and not one else None


def pairwise_verdict(text: str, require_answer: bool = False) -> tuple[float, str]:
    """(P(image 1 beats image 2): 1, 0, or 0.5 for a tie, parse error or "") of a pairwise judge's reply. A stated
    tie ("Both images are equally good.") is 0.5 without an error; a reply naming no single winner is 0.5 with
    one, as Pref-GRPO counts it. Shared by the HTTP judge and the local one (`mmrl.rewards.unified_reward`).

    >>> pairwise_verdict("<think>Image 1: 9</think>", require_answer=True)
    (0.5, 'no <answer>...</answer> in the reply')
    """
    winner = parse_winner(text, require_answer)
    if winner is not None:
        return (1.0 if winner == 1 else 0.0), ""
    verdict, found = _verdict(text, require_answer)
    if not found and require_answer:
        return 0.5, "no <answer>...</answer> in the reply"
    return 0.5, "" if _TIE.search(verdict) else "no single winner named"


class VLMPairwiseJudge(VLMJudge):
    """A VLM over an OpenAI-compatible chat API names the better of two images (module docstring); the endpoint,
    key, retries and thread pool are `vlm_judge`'s (`mmrl.rewards.vlm_judge.VLMJudge`). `think`: a chain-of-thought
    judge (UnifiedReward-Think served by vLLM, as Pref-GRPO does): the verdict only from <answer>...</answer>."""

    name = "vlm_pairwise"

    def __init__(self, base_url: str, model: str, prompt_template: str = DEFAULT_PAIRWISE_PROMPT, think: bool = False,
                 **kwargs: Any):
        super().__init__(base_url, model, prompt_template=prompt_template, **kwargs)
        self.think = bool(think)

    def pair_body(self, image_a: Tensor, image_b: Tensor, prompt: str) -> dict:
        """The chat-completions request for one pair (image 1, image 2, then the instruction)."""
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": openai_content(
                judge_content([image_a, image_b], self.prompt_template.format(prompt=prompt)))}],
            "max_tokens": self.max_tokens, "temperature": self.temperature, **self.extra_body,
        }

    def _judge_pair(self, args: tuple[Tensor, Tensor, str]) -> tuple[float, str, str]:
        try:
            text = _reply_text(request_json(self.url, self.pair_body(*args), timeout=self.timeout,
                                            retries=self.retries, backoff=self.backoff, headers=self.headers))
        except (RemoteRewardError, ValueError) as exc:
            if self.on_error == "raise":
                raise RemoteRewardError(f"vlm_pairwise: {exc}", self.url, getattr(exc, "status", None)) from None
            return 0.5, "", f"request failed: {exc}"
        p, error = pairwise_verdict(text, require_answer=self.think)
        return p, text, error

    def compare(self, images: Tensor, prompts, metadata, first: Tensor, second: Tensor) -> tuple[Tensor, dict]:
        prompts = prompts if prompts is not None else [""] * images.shape[0]
        jobs = [(images[i], images[j], prompts[i]) for i, j in zip(first.tolist(), second.tolist())]
        if not jobs:
            return torch.zeros(0), {"response": [], "parse_error": []}
        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(jobs))) as pool:
            results = list(pool.map(self._judge_pair, jobs))
        return torch.tensor([r[0] for r in results]), {"response": [r[1] for r in results],
                                                       "parse_error": [r[2] for r in results]}


PAIRWISE_JUDGES: dict[str, Any] = {"bradley_terry": BradleyTerryJudge, "vlm_pairwise": VLMPairwiseJudge}
# judges a reward module of the same name adds to PAIRWISE_JUDGES when it is imported (on first use, through the
# reward registry: this module never imports it): "unified_reward" (the local UnifiedReward judge)
LAZY_JUDGES = ("unified_reward",)


def _judge_class(judge: str) -> Any:
    if judge not in PAIRWISE_JUDGES and judge in LAZY_JUDGES:
        lookup(judge)
    if judge not in PAIRWISE_JUDGES:
        raise ValueError(f"pairwise_winrate: unknown judge {judge!r}; valid: {sorted({*PAIRWISE_JUDGES, *LAZY_JUDGES})}")
    return PAIRWISE_JUDGES[judge]


@register("pairwise_winrate")
class PairwiseWinRate(GroupRewardModel):
    """Win rate against the rest of the group under a pairwise judge (module docstring):
    load("pairwise_winrate", judge="vlm_pairwise", base_url=..., model=...) or judge="bradley_terry", scorer=..."""

    name = "pairwise_winrate"
    unit = "win rate within the group"
    score_range = (0.0, 1.0)

    def __init__(self, judge: str = "bradley_terry", both_orders: bool = False, device: Any = None,
                 **judge_kwargs: Any):
        judge_class = _judge_class(judge)
        if judge in ("bradley_terry", "unified_reward") and device is not None:
            judge_kwargs["device"] = device
        self.judge = judge_class(**judge_kwargs)
        self.both_orders = bool(both_orders)
        self.needs_prompts = bool(getattr(self.judge, "needs_prompts", False))
        self.name = f"pairwise_winrate({judge})"

    def score_groups(self, images, prompts, metadata, groups):
        first, second = torch.triu_indices(len(groups), len(groups), offset=1)
        same = groups[first] == groups[second]
        first, second = first[same], second[same]
        p, details = self.judge.compare(images, prompts, metadata, first, second)
        if self.both_orders:
            q, _ = self.judge.compare(images, prompts, metadata, second, first)
            p = 0.5 * (p + 1.0 - q)
        prefer = torch.full((len(groups), len(groups)), math.nan)
        prefer[first, second] = p.float()
        prefer[second, first] = 1.0 - p.float()
        scores = win_rates(torch.nan_to_num(prefer, nan=0.0), groups)
        # a judge's replies are per pair (`pair_index` row k = the images of pair k), not per image
        per_pair = {f"pair_{k}": v for k, v in details.items() if k in ("response", "parse_error")}
        if per_pair:
            per_pair["pair_index"] = torch.stack([first, second], 1)
        return RewardOutput(scores, {"group": groups, "pairs": int(len(first)),
                                     **{k: v for k, v in details.items() if k == "score"}, **per_pair})
