"""A vision-language model as judge: score = (the judge's "Final Score: x" on a 1-5 scale) / 5.

Each image is sent with its prompt to an OpenAI-compatible chat endpoint (``POST {base_url}/chat/completions``,
e.g. a local vLLM / SGLang server running UnifiedReward-qwen or any instruction-tuned VLM)::

    judge = load("vlm_judge", base_url="http://127.0.0.1:8000/v1", model="UnifiedReward-qwen-7b")
    judge(images, prompts)   # scores in [0, 1]

The default instruction follows UnifiedReward's pointwise image-generation protocol (judge alignment with the
caption and visual quality, then print ``Final Score:`` on a 1-5 scale) in our own wording; pass
``prompt_template=`` (with ``{prompt}``) to change it, or a name of ``unified_reward_prompts.PROMPTS`` for the
authors' exact text (``"pointwise"`` for a served UnifiedReward-qwen; the pairwise judge of ``group.py``:
``"pairwise"``, ``"think"``, ``"pref_grpo_think"``). Replies without a parseable final score get 0 and a
message in ``details["parse_error"]`` (empty string when parsed). Requests run concurrently in a thread
pool (``max_workers``) and reuse ``remote.request_json`` (timeouts, retries with exponential backoff).
The API key is ``api_key=`` or the environment variable named by ``api_key_env`` (no header if neither).
Images travel as base64 PNG data URLs (uint8-rounded, see remote.py).
"""

from __future__ import annotations

import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from mmrl.rewards.base import RewardModel, RewardOutput, register
from mmrl.rewards.remote import RemoteRewardError, encode_image_base64, request_json
from mmrl.rewards.unified_reward_prompts import PROMPTS

__all__ = ["VLMJudge", "VLMEditJudge", "DEFAULT_JUDGE_PROMPT", "DEFAULT_EDIT_JUDGE_PROMPT", "parse_final_score",
           "judge_content", "openai_content", "pointwise_verdict"]

# Own wording of the UnifiedReward pointwise protocol (alignment + quality, "Final Score" on 1-5).
DEFAULT_JUDGE_PROMPT = (
    "You will see an image that a text-to-image model generated from the prompt below. Judge it on two things:\n"
    "1. Prompt alignment: are the objects, attributes, counts, text and spatial relations the prompt asks for "
    "shown correctly?\n"
    "2. Visual quality: is the image sharp and coherent, free of artifacts and distorted shapes, and pleasant "
    "to look at?\n"
    "First list the key elements of the prompt and say for each whether the image shows it. Then give one "
    "overall score from 1 (poor) to 5 (excellent) on the last line, written exactly as 'Final Score: X'.\n"
    "Prompt: {prompt}"
)

_SCORE_RE = re.compile(r"final\s*score\s*[:=]?\s*\**\s*([-+]?\d+(?:\.\d+)?)", re.IGNORECASE)


def parse_final_score(text: str) -> float | None:
    """The number after the last "Final Score:" in `text` (markdown bold tolerated); None if absent.

    >>> parse_final_score("Alignment good.\\n**Final Score:** 4.5"), parse_final_score("I like it")
    (4.5, None)
    """
    hits = _SCORE_RE.findall(text or "")
    return float(hits[-1]) if hits else None


def pointwise_verdict(text: str, max_score: float) -> tuple[float, float, str]:
    """(score = x / max_score clamped to [0, 1], raw x, parse error or "") of a judge's reply; a reply without a
    parseable "Final Score: x" is (0, nan, the reason). Shared by the HTTP judge and the local ones
    (`mmrl.rewards.unified_reward`)."""
    raw = parse_final_score(text)
    if raw is None:
        return 0.0, math.nan, "no 'Final Score: x' in the reply"
    return min(1.0, max(0.0, raw / max_score)), raw, ""


def judge_content(images: Sequence[Any], text: str) -> list[dict]:
    """One judge turn: the images in order, then the instruction (UnifiedReward's and Pref-GRPO's order), as
    `{"type": "image", "image": x}` / `{"type": "text", "text": ...}` items: a local Qwen-VL takes them as they
    are (qwen_vl_utils' message form), the HTTP judges turn the images into data URLs (`openai_content`)."""
    return [*({"type": "image", "image": im} for im in images), {"type": "text", "text": text}]


def openai_content(content: Sequence[dict]) -> list[dict]:
    """`judge_content` items in OpenAI chat form: each image a base64 PNG data URL."""
    return [{"type": "image_url", "image_url": {"url": encode_image_base64(c["image"], data_url=True)}}
            if c["type"] == "image" else c for c in content]


def _reply_text(reply: Any) -> str:
    try:
        content = reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"reply is not an OpenAI chat completion: {str(reply)[:200]}") from None
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        raise ValueError(f"reply content is not text: {str(content)[:200]}")
    return content


@register("vlm_judge")
class VLMJudge(RewardModel):
    """VLM judge over an OpenAI-compatible chat API: UnifiedReward-style 'Final Score: x' (1-5) -> x/5."""

    name = "vlm_judge"
    unit = "judge score / max score"
    score_range = (0.0, 1.0)
    needs_prompts = True

    def __init__(self, base_url: str, model: str, api_key: str | None = None, api_key_env: str = "OPENAI_API_KEY",
                 prompt_template: str = DEFAULT_JUDGE_PROMPT, max_score: float = 5.0, max_tokens: int = 512,
                 temperature: float = 0.0, timeout: float = 60.0, retries: int = 3, backoff: float = 0.5,
                 max_workers: int = 8, on_error: str = "raise", extra_body: dict | None = None,
                 batch_size: int = 64, device: Any = None):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"vlm_judge base_url must start with http:// or https://, got {base_url!r}")
        prompt_template = PROMPTS.get(prompt_template, prompt_template)  # a UnifiedReward prompt by name
        if "{prompt}" not in prompt_template:
            raise ValueError(f"vlm_judge prompt_template must contain '{{prompt}}' or be one of {sorted(PROMPTS)}")
        if on_error not in ("raise", "zero"):
            raise ValueError(f"vlm_judge on_error must be 'raise' or 'zero', got {on_error!r}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        key = api_key if api_key is not None else os.environ.get(api_key_env or "", "")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.prompt_template = prompt_template
        self.max_score = float(max_score)
        self.max_tokens, self.temperature = int(max_tokens), float(temperature)
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.max_workers = max(1, int(max_workers))
        self.on_error = on_error
        self.extra_body = dict(extra_body or {})
        self.batch_size = int(batch_size)

    def request_body(self, image: torch.Tensor, prompt: str, source: torch.Tensor | None = None) -> dict:
        """The chat-completions request for one image (image first, then the instruction); with `source` (edit
        judging) the source image comes first, then the edited one."""
        images = [image] if source is None else [source, image]
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": openai_content(
                judge_content(images, self.prompt_template.format(prompt=prompt)))}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            **self.extra_body,
        }

    def _judge(self, image: torch.Tensor, prompt: str, source: torch.Tensor | None = None) -> tuple[float, float, str, str]:
        """(score in [0,1], raw score or nan, reply text, parse error or "")."""
        try:
            reply = request_json(self.url, self.request_body(image, prompt, source), timeout=self.timeout,
                                 retries=self.retries, backoff=self.backoff, headers=self.headers)
            text = _reply_text(reply)
        except (RemoteRewardError, ValueError) as exc:
            if self.on_error == "raise":
                raise RemoteRewardError(f"vlm_judge: {exc}", self.url, getattr(exc, "status", None)) from None
            return 0.0, math.nan, "", f"request failed: {exc}"
        score, raw, error = pointwise_verdict(text, self.max_score)
        return score, raw, text, error

    def score_images(self, images, prompts, metadata):
        prompts = prompts if prompts is not None else [""] * images.shape[0]
        with ThreadPoolExecutor(max_workers=min(self.max_workers, images.shape[0])) as pool:
            results = list(pool.map(self._judge, images.unbind(0), prompts))
        scores = torch.tensor([r[0] for r in results], dtype=torch.float32)
        return RewardOutput(scores, {
            "raw_score": torch.tensor([r[1] for r in results], dtype=torch.float32),
            "response": [r[2] for r in results],
            "parse_error": [r[3] for r in results],
        })


# Own wording of an edit-judging protocol (instruction following + preservation + quality, "Final Score" on 1-5),
# in the spirit of the edit judges the anchors use (RationalRewards-Edit, EditReward): the judge sees both images.
DEFAULT_EDIT_JUDGE_PROMPT = (
    "The first image is a source image; the second is the result of editing it with the instruction below. Judge "
    "the edit on three things:\n"
    "1. Instruction following: does the second image make exactly the change the instruction asks for?\n"
    "2. Preservation: is everything the instruction does not mention unchanged from the source image?\n"
    "3. Quality: is the edited image sharp and coherent, free of artifacts?\n"
    "First say for each point what you see. Then give one overall score from 1 (poor) to 5 (excellent) on the last "
    "line, written exactly as 'Final Score: X'.\n"
    "Instruction: {prompt}"
)


@register("vlm_edit_judge")
class VLMEditJudge(VLMJudge):
    """VLM judge of an edit: source + edited image + instruction over a chat API, 'Final Score: x' (1-5) -> x/5.

    The source image comes from metadata["source_image"]. Options as `vlm_judge`."""

    name = "vlm_edit_judge"

    def __init__(self, base_url: str, model: str, prompt_template: str = DEFAULT_EDIT_JUDGE_PROMPT, **kwargs):
        super().__init__(base_url, model, prompt_template=prompt_template, **kwargs)

    def score_images(self, images, prompts, metadata):
        from mmrl.rewards.image.edit import source_and_mask

        sources, _ = source_and_mask(metadata, images, self.name)
        prompts = prompts if prompts is not None else [""] * images.shape[0]
        with ThreadPoolExecutor(max_workers=min(self.max_workers, images.shape[0])) as pool:
            results = list(pool.map(self._judge, images.unbind(0), prompts, sources.unbind(0)))
        scores = torch.tensor([r[0] for r in results], dtype=torch.float32)
        return RewardOutput(scores, {
            "raw_score": torch.tensor([r[1] for r in results], dtype=torch.float32),
            "response": [r[2] for r in results],
            "parse_error": [r[3] for r in results],
        })
