"""UnifiedReward (Wang et al. 2025, CodeGoat24/UnifiedReward): Qwen2.5-VL fine-tuned to judge generated images,
run locally with transformers from a downloaded checkpoint (`weights=`, a directory; nothing is downloaded).

    load("unified_reward", weights="/models/UnifiedReward-qwen-7b")                  # pointwise, in [0, 1]
    load("unified_reward", weights="/models/UnifiedReward-qwen-7b", mode="pairwise")  # win rate in the group
    load("unified_reward", weights="/models/UnifiedReward-Think-qwen-7b", mode="think")
    load("pairwise_winrate", judge="unified_reward", weights=..., think=True, both_orders=True)

Modes (the authors' image-generation prompts; `prompt_template=`: another text with {prompt}, or a name of PROMPTS,
e.g. "pref_grpo_think", the Think prompt Pref-GRPO trains with):
    pointwise  one image + caption; the reply lists the caption's elements and ends with "Final Score: x" (1-5);
               score = x / 5, a reply without one scores 0 with `details["parse_error"]` (as `vlm_judge`)
    pairwise   two images of one prompt; the reply ends with "Image 1 is better." / "Image 2 is better." /
               "Both images are equally good."; the image's score is its win rate in its group
               (`pairwise_winrate`: every pair of a group judged once, a tie or an unparsed verdict is 0.5 each)
    think      as pairwise, with UnifiedReward-Think's chain-of-thought prompt: reasoning in <think>...</think>,
               the verdict only from <answer>...</answer> (a reply cut off before it is a tie with a parse error)

Inference is the authors' (their qwen inference scripts): the checkpoint's chat template, one user turn with the
images then the instruction, each image resized by qwen_vl_utils' fetch_image (what their process_vision_info
does; images arrive as tensors and are rounded to uint8 RGB first), the checkpoint's processor, `model.generate`
with max_new_tokens 512, the new tokens decoded with skip_special_tokens. Decoding is greedy (do_sample=False);
the rest of the checkpoint's generation_config.json applies (Qwen2.5-VL-Instruct's repetition_penalty 1.05): their
call samples with that config's top_k=1, which is the same argmax. Several turns run as one batch (left padding,
`batch_size`); `details["response"]` holds every raw reply. The prompt building and the reply parsing are the HTTP
judges' (`vlm_judge.judge_content`, `pointwise_verdict`, `group.pairwise_verdict`).

source: CodeGoat24/UnifiedReward at ff6f520: inference_qwen/image_generation/qwen_point_score_image_generation.py,
qwen_pair_rank_image_generation.py, UnifiedReward-Think/inference_qwen/image_generation/
qwen_infer_cot_image_generation.py (their prompts, verbatim, are data in unified_reward_prompts.py: the replies of a
checkpoint depend on the exact text it was trained on); the Think answer format as Pref-GRPO reads it (CodeGoat24/Pref-GRPO at 3e787f6,
fastvideo/rewards/unifiedreward_think.py `_extract_answer`).
"""

from __future__ import annotations

import copy
import json
from typing import Any, Sequence

import torch

from mmrl.rewards.base import RewardModel, RewardOutput, register, to_pil_list
from mmrl.rewards.group import PAIRWISE_JUDGES, PairwiseWinRate, pairwise_verdict
from mmrl.rewards.image._common import check_prompts, require_path, resolve
from mmrl.rewards.unified_reward_prompts import PROMPTS
from mmrl.rewards.vlm_judge import judge_content, pointwise_verdict

__all__ = ["UnifiedReward", "UnifiedRewardPairwiseJudge", "QwenVLJudge", "PROMPTS", "unified_reward"]

DOWNLOAD = "a UnifiedReward checkpoint (e.g. the Hugging Face repository CodeGoat24/UnifiedReward-qwen-7b)"
MODES = ("pointwise", "pairwise", "think")


def _template(prompt_template: str | None, mode: str) -> str:
    """The instruction of `mode`: its default, a name of PROMPTS, or the text given (with {prompt})."""
    template = PROMPTS[mode] if prompt_template is None else PROMPTS.get(prompt_template, prompt_template)
    if not isinstance(template, str) or "{prompt}" not in template:
        raise ValueError(f"unified_reward: prompt_template must be one of {sorted(PROMPTS)} or a string containing "
                         f"'{{prompt}}', got {str(template)[:80]!r}")
    return template


class QwenVLJudge:
    """A local Qwen2.5-VL checkpoint that answers judge turns (`vlm_judge.judge_content` lists) greedily,
    `batch_size` turns per `generate` call (module docstring). `what` names the reward in error messages."""

    def __init__(self, weights: Any, what: str = "unified_reward", device: Any = None, dtype: Any = None,
                 max_new_tokens: int = 512, batch_size: int = 8):
        path = require_path(weights, what, DOWNLOAD, kind="dir")
        config = path / "config.json"
        if not config.is_file():
            raise FileNotFoundError(f"{what}: no config.json in '{path}'; expected a Qwen2.5-VL checkpoint directory "
                                    f"({DOWNLOAD})")
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
            raise ValueError(f"{what}: '{config}' is not a JSON model config ({exc})") from None
        if model_type != "qwen2_5_vl":
            raise ValueError(f"{what}: '{path}' holds a {model_type!r} model (config.json model_type); expected "
                             f"'qwen2_5_vl', {DOWNLOAD}")
        if int(max_new_tokens) < 1 or int(batch_size) < 1:
            raise ValueError(f"{what}: max_new_tokens and batch_size must be >= 1, got {max_new_tokens}, {batch_size}")
        from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

        from mmrl.run.files import refusing_pickled_weights

        # dtype None: the checkpoint's own (bfloat16 for the released ones), as the authors' torch_dtype="auto"
        self.device, self.dtype = resolve(device, dtype)[0], "auto" if dtype is None else resolve(device, dtype)[1]
        self.batch_size = int(batch_size)
        try:
            self.processor = AutoProcessor.from_pretrained(str(path), padding_side="left", local_files_only=True)
        except (OSError, ValueError, TypeError) as exc:
            raise FileNotFoundError(f"{what}: no Qwen2.5-VL processor (tokenizer, chat template, preprocessor config) "
                                    f"in '{path}' ({str(exc).splitlines()[0][:160]})") from None
        with refusing_pickled_weights(what, path):  # a pickled .bin: one line naming it
            try:
                model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(path), dtype=self.dtype,
                                                                           local_files_only=True)
            except OSError as exc:
                raise FileNotFoundError(f"{what}: cannot load the weights in '{path}' "
                                        f"({str(exc).splitlines()[0][:200]})") from None
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.dtype = self.model.dtype
        gen = copy.deepcopy(self.model.generation_config)
        # greedy; the sampling knobs back to transformers' neutral values (they act only when sampling, and a
        # non-neutral one makes generate warn)
        gen.do_sample, gen.temperature, gen.top_p, gen.top_k = False, 1.0, 1.0, 50
        gen.max_new_tokens = int(max_new_tokens)
        self.generation_config = gen

    def to(self, device: Any) -> "QwenVLJudge":
        self.device = resolve(device, self.dtype)[0]
        self.model.to(self.device)
        return self

    @torch.no_grad()
    def replies(self, turns: Sequence[list[dict]]) -> list[str]:
        """The reply text of every turn (images: PIL or any `load_image` input), in order."""
        from mmrl.pipelines.images import resize_for_qwen

        out: list[str] = []
        for s in range(0, len(turns), self.batch_size):
            chunk = turns[s:s + self.batch_size]
            texts = [self.processor.apply_chat_template([{"role": "user", "content": list(t)}], tokenize=False,
                                                        add_generation_prompt=True) for t in chunk]
            images = [resize_for_qwen(c["image"]) for t in chunk for c in t if c["type"] == "image"]
            inputs = self.processor(text=texts, images=images or None, padding=True, return_tensors="pt")
            inputs = inputs.to(self.device)
            ids = self.model.generate(**inputs, generation_config=self.generation_config)
            # left padding: every row's prompt ends at the same column
            out += self.processor.batch_decode(ids[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True,
                                               clean_up_tokenization_spaces=False)
        return out


class UnifiedReward(RewardModel):
    """UnifiedReward's pointwise score of a generated image: "Final Score: x" (1-5) -> x / max_score (module
    docstring). `batch_size` images per generate call."""

    name = "unified_reward"
    unit = "judge score / max score"
    score_range = (0.0, 1.0)
    needs_prompts = True

    def __init__(self, weights: Any = None, prompt_template: str | None = None, max_score: float = 5.0,
                 max_new_tokens: int = 512, batch_size: int = 8, device: Any = None, dtype: Any = None):
        self.prompt_template = _template(prompt_template, "pointwise")
        self.max_score = float(max_score)
        self.judge = QwenVLJudge(weights, self.name, device, dtype, max_new_tokens, batch_size)
        self.batch_size = self.judge.batch_size

    def to(self, device: Any) -> "UnifiedReward":
        self.judge.to(device)
        return self

    def score_images(self, images, prompts, metadata):
        prompts = check_prompts(prompts, self.name)
        turns = [judge_content([pil], self.prompt_template.format(prompt=p))
                 for pil, p in zip(to_pil_list(images), prompts)]
        replies = self.judge.replies(turns)
        results = [pointwise_verdict(r, self.max_score) for r in replies]
        return RewardOutput(torch.tensor([r[0] for r in results], dtype=torch.float32), {
            "raw_score": torch.tensor([r[1] for r in results], dtype=torch.float32),
            "response": replies,
            "parse_error": [r[2] for r in results],
        })


class UnifiedRewardPairwiseJudge:
    """UnifiedReward as the pairwise judge of `pairwise_winrate` (judge="unified_reward"): P(first beats second)
    = 1 / 0 / 0.5 from "Image 1 is better" / "Image 2 is better" / a tie or no verdict; `think`: the
    UnifiedReward-Think prompt, the verdict only from <answer>...</answer>."""

    needs_prompts = True

    def __init__(self, weights: Any = None, think: bool = False, prompt_template: str | None = None,
                 max_new_tokens: int = 512, batch_size: int = 8, device: Any = None, dtype: Any = None):
        self.think = bool(think)
        self.prompt_template = _template(prompt_template, "think" if self.think else "pairwise")
        self.judge = QwenVLJudge(weights, "unified_reward", device, dtype, max_new_tokens, batch_size)

    def compare(self, images: torch.Tensor, prompts, metadata, first: torch.Tensor,
                second: torch.Tensor) -> tuple[torch.Tensor, dict]:
        prompts = check_prompts(prompts, "unified_reward")
        pils = to_pil_list(images)
        turns = [judge_content([pils[i], pils[j]], self.prompt_template.format(prompt=prompts[i]))
                 for i, j in zip(first.tolist(), second.tolist())]
        replies = self.judge.replies(turns)
        verdicts = [pairwise_verdict(r, require_answer=self.think) for r in replies]
        return (torch.tensor([v[0] for v in verdicts], dtype=torch.float32),
                {"response": replies, "parse_error": [v[1] for v in verdicts]})


PAIRWISE_JUDGES["unified_reward"] = UnifiedRewardPairwiseJudge  # pairwise_winrate(judge="unified_reward")


@register("unified_reward")
def unified_reward(weights: str | None = None, mode: str = "pointwise", prompt_template: str | None = None,
                   max_score: float = 5.0, both_orders: bool = False, max_new_tokens: int = 512, batch_size: int = 8,
                   device: Any = None, dtype: str | None = None) -> RewardModel:
    """UnifiedReward, a Qwen2.5-VL judge run locally: pointwise 'Final Score' / 5, or pairwise / Think win rate.

    mode "pointwise": a RewardModel of one image; "pairwise" or "think": the win rate of each image in its group
    (`pairwise_winrate` with this judge; `both_orders` judges each pair twice)."""
    if mode not in MODES:
        raise ValueError(f"unified_reward: mode must be one of {', '.join(MODES)}; got {mode!r}")
    common = dict(weights=weights, prompt_template=prompt_template, max_new_tokens=max_new_tokens,
                  batch_size=batch_size, device=device, dtype=dtype)
    if mode == "pointwise":
        return UnifiedReward(max_score=max_score, **common)
    reward = PairwiseWinRate(judge="unified_reward", both_orders=both_orders, think=mode == "think", **common)
    reward.name = f"unified_reward({mode})"
    return reward
