"""UnifiedReward (Wang et al. 2025, CodeGoat24/UnifiedReward): Qwen2.5-VL and Qwen3-VL models fine-tuned to judge
generated images, run locally with transformers from a downloaded checkpoint (`weights=`, a directory; nothing is
downloaded). The backbone is read from the checkpoint's config.json `model_type` (`BACKBONES`).

    load("unified_reward", weights="/models/UnifiedReward-qwen-7b")                  # pointwise, in [0, 1]
    load("unified_reward", weights="/models/UnifiedReward-2.0-qwen3vl-8b", mode="pairwise")  # win rate in the group
    load("unified_reward", weights="/models/UnifiedReward-Think-qwen-7b", mode="think")
    load("pairwise_winrate", judge="unified_reward", weights=..., think=True, both_orders=True)

Modes (the authors' image-generation prompts; `prompt_template=`: another text with {prompt}, or a name of PROMPTS,
e.g. "pref_grpo_think", the Think prompt Pref-GRPO trains with):
    pointwise  one image + caption; the reply lists the caption's elements and ends with "Final Score: x" (1-5);
               score = x / 5, a reply without one scores 0 with `details["parse_error"]` (as `vlm_judge`)
    pairwise   two images of one prompt; the reply ends with "Image 1 is better." / "Image 2 is better." /
               "Both images are equally good."; the image's score is its win rate in its group
               (`pairwise_winrate`: every pair of a group judged once, a tie or an unparsed verdict is 0.5 each)
    think      as pairwise, with UnifiedReward-Think's chain-of-thought prompt (on Qwen3-VL: their Qwen3-VL Think
               script's, the same text as "pref_grpo_think"): reasoning in <think>...</think>, the verdict only from
               <answer>...</answer> (a reply cut off before it is a tie with a parse error)

Inference is the authors': one user turn with the images then the instruction, the checkpoint's chat template and
processor, `model.generate` decoding greedily, the new tokens decoded with skip_special_tokens; the rest of the
checkpoint's generation_config.json applies (Qwen2.5-VL-Instruct's repetition_penalty 1.05). Per backbone:
    qwen2_5_vl  their transformers scripts: each image resized by qwen_vl_utils' fetch_image (what their
                process_vision_info does), max_new_tokens 512; their call samples with the config's top_k=1,
                which is the same argmax
    qwen3_vl    their vLLM client (vllm_qwen/vllm_request.py): each image sent as a JPEG of quality 95, resized by
                the checkpoint's processor (vLLM's), max_tokens 4096; their request's "do_sample": False is not a
                vLLM parameter, so their server samples with the config's temperature (Qwen3-VL-Instruct's 0.7):
                mmrl decodes greedily, what the request asks
Images arrive as tensors and are rounded to uint8 RGB first. Several turns run as one batch (left padding,
`batch_size`); `details["response"]` holds every raw reply. The prompt building and the reply parsing are the HTTP
judges' (`vlm_judge.judge_content`, `pointwise_verdict`, `group.pairwise_verdict`). LLaVA-OneVision judges
(UnifiedReward-7b, -7b-v1.5, -Think-7b) are refused with one line: they exist only in the original LLaVA-NeXT format.

source: CodeGoat24/UnifiedReward at ff6f520: inference_qwen/image_generation/qwen_point_score_image_generation.py,
qwen_pair_rank_image_generation.py, UnifiedReward-Think/inference_qwen/image_generation/
qwen_infer_cot_image_generation.py, UnifiedReward-Think/inference_qwen/UnifiedReward-Think-qwen3-inference/
qwen3_infer_cot_image_generation.py and vllm_server.sh, vllm_qwen/vllm_request.py (their prompts, verbatim, are data
in unified_reward_prompts.py: the replies of a checkpoint depend on the exact text it was trained on); the Think answer
format as Pref-GRPO reads it (CodeGoat24/Pref-GRPO at 3e787f6, fastvideo/rewards/unifiedreward_think.py
`_extract_answer`).
"""

from __future__ import annotations

import copy
import io
import json
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from mmrl.rewards.base import RewardModel, RewardOutput, register, to_pil_list
from mmrl.rewards.group import PAIRWISE_JUDGES, PairwiseWinRate, pairwise_verdict
from mmrl.rewards.image._common import check_prompts, require_path, resolve
from mmrl.rewards.unified_reward_prompts import PROMPTS
from mmrl.rewards.vlm_judge import judge_content, pointwise_verdict

__all__ = ["UnifiedReward", "UnifiedRewardPairwiseJudge", "QwenVLJudge", "BACKBONES", "PROMPTS", "unified_reward"]

DOWNLOAD = "a UnifiedReward checkpoint (e.g. the Hugging Face repository CodeGoat24/UnifiedReward-qwen-7b)"
MODES = ("pointwise", "pairwise", "think")


@dataclass(frozen=True)
class Backbone:
    """How the authors run the judges of one architecture (module docstring)."""

    label: str
    """the architecture's name in messages"""
    model_class: str
    """the transformers class that loads the checkpoint"""
    max_new_tokens: int
    """their generation length (max_new_tokens / max_tokens)"""
    jpeg_quality: int | None
    """their client sends each image as a JPEG of this quality to the processor; None: resized by qwen_vl_utils"""
    prompts: dict
    """mode -> the name in PROMPTS of the mode's default prompt"""


# config.json model_type -> backbone
BACKBONES = {
    "qwen2_5_vl": Backbone("Qwen2.5-VL", "Qwen2_5_VLForConditionalGeneration", 512, None,
                           {"pointwise": "pointwise", "pairwise": "pairwise", "think": "think"}),
    "qwen3_vl": Backbone("Qwen3-VL", "Qwen3VLForConditionalGeneration", 4096, 95,
                         {"pointwise": "pointwise", "pairwise": "pairwise", "think": "pref_grpo_think"}),
}
# original LLaVA-NeXT configs (LlavaQwenForCausalLM) and transformers' converted layout
LLAVA_TYPES = ("llava", "llava_qwen", "llava_onevision")
SUPPORTED = " or ".join(f"{t!r} ({b.label})" for t, b in BACKBONES.items())


def _template(prompt_template: str | None, mode: str, model_type: str = "qwen2_5_vl") -> str:
    """The instruction of `mode`: the backbone's default, a name of PROMPTS, or the text given (with {prompt})."""
    name = BACKBONES[model_type].prompts[mode] if prompt_template is None else prompt_template
    template = PROMPTS.get(name, name)
    if not isinstance(template, str) or "{prompt}" not in template:
        raise ValueError(f"unified_reward: prompt_template must be one of {sorted(PROMPTS)} or a string containing "
                         f"'{{prompt}}', got {str(template)[:80]!r}")
    return template


def checkpoint_type(weights: Any, what: str = "unified_reward") -> tuple[Any, str]:
    """(path, model_type) of a UnifiedReward checkpoint directory, or one line naming what is wrong with it."""
    path = require_path(weights, what, DOWNLOAD, kind="dir")
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{what}: no config.json in '{path}'; expected a Qwen2.5-VL or Qwen3-VL checkpoint "
                                f"directory ({DOWNLOAD})")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise ValueError(f"{what}: '{config}' is not a JSON model config ({exc})") from None
    if model_type in LLAVA_TYPES:
        raise ValueError(f"{what}: '{path}' holds a {model_type!r} model (config.json model_type): UnifiedReward's "
                         f"LLaVA-OneVision judges (UnifiedReward-7b, -7b-v1.5, -Think-7b) exist only in the original "
                         f"LLaVA-NeXT format, which only the authors' llava package loads; use a Qwen2.5-VL or Qwen3-VL "
                         f"UnifiedReward checkpoint (e.g. CodeGoat24/UnifiedReward-2.0-qwen3vl-8b)")
    if not isinstance(model_type, str) or model_type not in BACKBONES:
        raise ValueError(f"{what}: '{path}' holds a {model_type!r} model (config.json model_type); expected "
                         f"{SUPPORTED}, {DOWNLOAD}")
    return path, model_type


def _jpeg(image: Any, quality: int) -> Any:
    """`image` after a round trip through a JPEG file of `quality` (what the authors' vLLM client sends)."""
    from PIL import Image

    from mmrl.pipelines.images import load_image

    buf = io.BytesIO()
    load_image(image).convert("RGB").save(buf, format="JPEG", quality=quality)
    buf.seek(0)
    return Image.open(buf).convert("RGB")


class QwenVLJudge:
    """A local Qwen2.5-VL or Qwen3-VL checkpoint (`BACKBONES`, by config.json model_type) that answers judge turns
    (`vlm_judge.judge_content` lists) greedily, `batch_size` turns per `generate` call (module docstring).
    `max_new_tokens` None: the authors' length for the backbone. `what` names the reward in error messages."""

    def __init__(self, weights: Any, what: str = "unified_reward", device: Any = None, dtype: Any = None,
                 max_new_tokens: int | None = None, batch_size: int = 8):
        path, self.model_type = checkpoint_type(weights, what)
        self.backbone = backbone = BACKBONES[self.model_type]
        max_new_tokens = backbone.max_new_tokens if max_new_tokens is None else max_new_tokens
        if int(max_new_tokens) < 1 or int(batch_size) < 1:
            raise ValueError(f"{what}: max_new_tokens and batch_size must be >= 1, got {max_new_tokens}, {batch_size}")
        import transformers
        from transformers import AutoProcessor

        from mmrl.run.files import refusing_pickled_weights

        # dtype None: the checkpoint's own (bfloat16 for the released ones), as the authors' torch_dtype="auto"
        self.device, self.dtype = resolve(device, dtype)[0], "auto" if dtype is None else resolve(device, dtype)[1]
        self.batch_size = int(batch_size)
        try:
            self.processor = AutoProcessor.from_pretrained(str(path), padding_side="left", local_files_only=True)
        except (OSError, ValueError, TypeError) as exc:
            raise FileNotFoundError(f"{what}: no {backbone.label} processor (tokenizer, chat template, preprocessor "
                                    f"config) in '{path}' ({str(exc).splitlines()[0][:160]})") from None
        model_class = getattr(transformers, backbone.model_class, None)
        if model_class is None:
            raise ImportError(f"{what}: '{path}' is a {backbone.label} checkpoint, which needs transformers' "
                              f"{backbone.model_class}; the installed transformers {transformers.__version__} has none "
                              f"(upgrade transformers)")
        with refusing_pickled_weights(what, path):  # a pickled .bin: one line naming it
            try:
                model = model_class.from_pretrained(str(path), dtype=self.dtype, local_files_only=True)
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
            quality = self.backbone.jpeg_quality
            images = [resize_for_qwen(c["image"]) if quality is None else _jpeg(c["image"], quality)
                      for t in chunk for c in t if c["type"] == "image"]
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
                 max_new_tokens: int | None = None, batch_size: int = 8, device: Any = None, dtype: Any = None):
        _template(prompt_template, "pointwise")  # a bad template: one line before the model loads
        self.max_score = float(max_score)
        self.judge = QwenVLJudge(weights, self.name, device, dtype, max_new_tokens, batch_size)
        self.prompt_template = _template(prompt_template, "pointwise", self.judge.model_type)
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
    UnifiedReward-Think prompt of the checkpoint's backbone, the verdict only from <answer>...</answer>."""

    needs_prompts = True

    def __init__(self, weights: Any = None, think: bool = False, prompt_template: str | None = None,
                 max_new_tokens: int | None = None, batch_size: int = 8, device: Any = None, dtype: Any = None):
        self.think = bool(think)
        mode = "think" if self.think else "pairwise"
        _template(prompt_template, mode)  # a bad template: one line before the model loads
        self.judge = QwenVLJudge(weights, "unified_reward", device, dtype, max_new_tokens, batch_size)
        self.prompt_template = _template(prompt_template, mode, self.judge.model_type)

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
                   max_score: float = 5.0, both_orders: bool = False, max_new_tokens: int | None = None,
                   batch_size: int = 8, device: Any = None, dtype: str | None = None) -> RewardModel:
    """UnifiedReward, a Qwen2.5-VL or Qwen3-VL judge run locally: pointwise 'Final Score' / 5, or pairwise / Think
    win rate.

    mode "pointwise": a RewardModel of one image; "pairwise" or "think": the win rate of each image in its group
    (`pairwise_winrate` with this judge; `both_orders` judges each pair twice). max_new_tokens None: the authors'
    (512 on Qwen2.5-VL, 4096 on Qwen3-VL)."""
    if mode not in MODES:
        raise ValueError(f"unified_reward: mode must be one of {', '.join(MODES)}; got {mode!r}")
    common = dict(weights=weights, prompt_template=prompt_template, max_new_tokens=max_new_tokens,
                  batch_size=batch_size, device=device, dtype=dtype)
    if mode == "pointwise":
        return UnifiedReward(max_score=max_score, **common)
    reward = PairwiseWinRate(judge="unified_reward", both_orders=both_orders, think=mode == "think", **common)
    reward.name = f"unified_reward({mode})"
    return reward
