"""HPSv3 (Ma et al., ICCV 2025): a Qwen2-VL-7B reward model trained on HPDv3 with an uncertainty-aware ranking loss.

The model reads the image and the prompt inside a long rating instruction, ends the user turn with the special token
`<|Reward|>`, and an MLP head on that token's last hidden state predicts (mu, log sigma). `scores` is mu (what the
authors report as the HPSv3 score); `details["sigma"]` = exp(log sigma) is the model's uncertainty about it.
# source: MizzenAI/HPSv3 as packaged in `hpsv3` 1.0.0 (PyPI, 2025-08): hpsv3/inference.py (HPSv3RewardInferencer:
#   prepare_batch, reward -> logits[:, 0] "miu"), hpsv3/model/qwen2vl_trainer.py (Qwen2VLRewardModelBT: head, pooling
#   at the special token), hpsv3/dataset/data_collator_qwen.py (INSTRUCTION, prompt_with_special_token),
#   hpsv3/config/HPSv3_7B.yaml (output_dim 2, use_special_tokens, min = max pixels 256*28*28), the "uncertainty"
#   loss of VLMRewardTrainer.compute_loss (sigma = exp(output[:, 1])).

Preprocessing as theirs: each image resized (qwen-vl-utils smart_resize, PIL bicubic) to about 256*28*28 pixels
(multiples of 28, aspect kept), then the base model's Qwen2-VL processor; the chat template of the base model.

Weights: `HPSv3.safetensors` from the Hugging Face repository MizzenAI/HPSv3 (`weights=` the file or its directory),
and the base model's config and processor files from Qwen/Qwen2-VL-7B-Instruct (`processor=`; its weights are not
read). Nothing is downloaded. The backbone runs in bfloat16 by default (as the authors run it), the head in float32.
"""

from __future__ import annotations

from typing import Any

import torch

from mmrl.rewards.base import RewardOutput, register
from mmrl.rewards.image._common import TorchImageReward, check_prompts, require_path
from mmrl.rewards.vlm_head import QwenVLRewardBackbone, find_checkpoint

# source: hpsv3/dataset/data_collator_qwen.py INSTRUCTION and prompt_with_special_token (verbatim, spaces included)
INSTRUCTION = """
You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. 

**Visual Quality:**  
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

**Text Alignment:**  
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.
Textual prompt - {text_prompt}


"""
REWARD_PROMPT = """
Please provide the overall ratings of this image: <|Reward|>

END
"""
PIXELS = 256 * 28 * 28  # min = max pixels of every image (hpsv3/inference.py prepare_batch)


@register("hpsv3")
class HPSv3(TorchImageReward):
    """HPSv3 score (mu) of each image for its prompt; details: sigma (the predicted uncertainty of mu)."""

    name = "hpsv3"
    needs_prompts = True
    unit = "HPSv3 (mu)"

    def __init__(self, weights: Any = None, processor: Any = None, *, batch_size: int = 8, device: Any = None,
                 dtype: Any = "bfloat16", min_pixels: int = PIXELS, max_pixels: int = PIXELS,
                 trust_pickle: bool = False):
        super().__init__(batch_size, device, dtype, differentiable=False)
        download = "'HPSv3.safetensors' from 'MizzenAI/HPSv3'"
        checkpoint = find_checkpoint(weights, ["HPSv3.safetensors"], "hpsv3", download)
        base = require_path(processor, "hpsv3 processor", "the config and processor files of "
                            "'Qwen/Qwen2-VL-7B-Instruct' (the base model; its weights are not needed)", kind="dir")
        self.min_pixels, self.max_pixels = int(min_pixels), int(max_pixels)
        self.backbone = QwenVLRewardBackbone(checkpoint, base, what="hpsv3", head_prefixes=["rm_head."],
                                             family="qwen2_vl", device=self.device, dtype=self.dtype,
                                             trust_pickle=trust_pickle)
        self.backbone.check_outputs(2, "mu, log sigma: HPSv3_7B.yaml output_dim 2")

    def modules(self):
        return [self.backbone.model, *self.backbone.heads.values()]

    def to(self, device: Any) -> HPSv3:
        super().to(device)
        self.backbone.device = self.device
        return self

    def _score(self, x, prompts, metadata):
        prompts = check_prompts(prompts, self.name)
        bb = self.backbone
        texts = bb.chat_texts([[{"type": "image"}, {"type": "text", "text": INSTRUCTION.format(text_prompt=p)
                                                    + REWARD_PROMPT}] for p in prompts])
        batch = bb.encode(texts, images=bb.resize(x, self.min_pixels, self.max_pixels))
        out = bb.heads["rm_head."](bb.token_hidden(batch)[:, 0]).cpu()
        return RewardOutput(out[:, 0].clone(), {"sigma": torch.exp(out[:, 1])})
