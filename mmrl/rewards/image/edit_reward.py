"""EditReward (Wu et al. 2025, ICLR 2026): a Qwen2.5-VL-7B reward model for instruction-guided image editing, trained on
EditReward-Data (200K human preference pairs) with HPSv3's uncertainty-aware ranking loss.

It sees the source image, then the edited image, then a rating instruction with the edit instruction, closed by the
added token `<|Reward|>`; two MLP heads on that token's last hidden state each predict (mu, log sigma): head 0 reads
the "Instruction Following & Semantic Fidelity" instruction, head 1 the "Visual Quality & Realism" one (one forward
per instruction), and the model's output is their mean (the released config's pooling_strategy "mean").
`scores` = that mean mu; details: `sigma` = exp(mean log sigma), `following` and `quality` = each head's mu.
# source: TIGER-AI-Lab/EditReward @ edb027e (2026-02-06): EditReward/inference_edit.py (EditRewardInferencer:
#   prepare_batch, rm_head_type "ranknet_multi_head", reward -> logits[:, 0]),
#   EditReward/model/qwen2_5_vl_trainer.py (Qwen2_5_VLRewardModelBT_MultiHead: heads, special-token pooling, "mean"),
#   EditReward/dataset/prompts.py (INSTRUCTION_EDIT_FOLLOWING / _QUALITY), dataset/data_collator_qwen_edit.py
#   (prompt_with_special_token), config/EditReward-Qwen2.5-7B-VL.yaml (output_dim 2, min = max pixels 256*28*28).

Input: the edited images, the edit instructions as prompts, and each sample's source image in
`metadata[i]["source_image"]` (as every edit reward reads it, `mmrl.rewards.image.edit`). Both images are resized
separately, each from its own size, as the authors' fetch_image does (qwen-vl-utils smart_resize to about 256*28*28
pixels, PIL bicubic), then the base model's Qwen2.5-VL processor.

Weights: the checkpoint directory of the Qwen2.5-VL-7B EditReward model from the TIGER-Lab EditReward collection on
Hugging Face (`weights=` the directory holding `model.safetensors` or `model.pth`, or the file itself), and the config
and processor files of Qwen/Qwen2.5-VL-7B-Instruct (`processor=`; its weights are not read); the MiMo-VL-7B variant
loads the same way with XiaomiMiMo/MiMo-VL-7B-SFT-2508 as `processor=` (a Qwen2.5-VL architecture). The Qwen3-VL
variant is not supported. Nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

import torch

from mmrl.rewards.base import RewardOutput, register, to_image_list
from mmrl.rewards.image._common import TorchImageReward, check_prompts, require_path
from mmrl.rewards.image.edit import source_images
from mmrl.rewards.vlm_head import QwenVLRewardBackbone, find_checkpoint

# source: EditReward/dataset/prompts.py INSTRUCTION_EDIT_FOLLOWING, INSTRUCTION_EDIT_QUALITY (verbatim, spaces included)
INSTRUCTION_FOLLOWING = """
You are tasked with evaluating an edited image **in comparison with the original source image** based on **Instruction Following & Semantic Fidelity**, and assigning a score from 1 to 4, with 1 being the worst and 4 being the best.  
This dimension focuses on how accurately, completely, and exclusively the model executed the given text instruction.

**Inputs Provided:**  
- Source Image (before editing)  
- Edited Image (after applying the instruction)  
- Text Instruction  

**Sub-Dimensions to Evaluate:**

- **Semantic Accuracy:**  
  Assess whether the edited content accurately captures the semantics of the instruction. The edited result should precisely match the intended meaning. For example, if the instruction is "replace apples with oranges," the object must clearly be oranges, not other fruits.

- **Completeness of Editing:**  
  Check whether **all parts** of the instruction are fully executed. For multi-step edits (e.g., "replace a red car with a blue bicycle"), both the color change and the object replacement must be done without omissions.

- **Exclusivity of Edit (No Over-Editing):**  
  Ensure that only the requested parts are changed. The rest of the image (as seen in the source) should remain unaltered. For example, if the instruction only involves replacing an object, the background, lighting, and unrelated objects should not be unnecessarily modified.

**Scoring Criteria:**
- **4 (Very Good):** Perfectly accurate, complete, and exclusive execution of the instruction.  
- **3 (Relatively Good):** Largely correct, but with minor omissions or slight over-editing.  
- **2 (Relatively Poor):** Major misinterpretation, incomplete edits, or noticeable unintended changes.  
- **1 (Very Poor):** Instruction ignored or completely wrong execution.

Text instruction - {text_prompt}
"""
INSTRUCTION_QUALITY = """
You are tasked with evaluating an edited image **in comparison with the original source image** based on **Visual Quality & Realism**, and assigning a score from 1 to 4, with 1 being the worst and 4 being the best.  
This dimension focuses on how realistic, artifact-free, and aesthetically appealing the edited image is, while remaining consistent with the source image.

**Inputs Provided:**  
- Source Image (before editing)  
- Edited Image (after applying the instruction)  
- Text Instruction  

**Sub-Dimensions to Evaluate:**

- **Plausibility & Physical Consistency:**  
  Check whether the edit aligns with the laws of physics and the scene context. Lighting, shadows, reflections, perspective, size, and interactions with the environment should all appear natural compared to the source image.

- **Artifact-Free Quality:**  
  Look for technical flaws such as blur, distortions, pixel misalignment, unnatural textures, or seams around edited regions. High-quality results should be free from such visible artifacts.

- **Aesthetic Quality:**  
  Evaluate the overall harmony and visual appeal. The image should look natural, balanced, and pleasant. Colors, composition, and atmosphere should enhance the image rather than degrade it.

**Scoring Criteria:**
- **4 (Very Good):** Perfectly realistic, artifact-free, seamless, and aesthetically pleasing.  
- **3 (Relatively Good):** Mostly realistic and clean, with only minor flaws that do not significantly distract.  
- **2 (Relatively Poor):** Noticeable physical inconsistencies or visible artifacts that make the edit unnatural.  
- **1 (Very Poor):** Severe artifacts, incoherent composition, or visually unusable result.

Text instruction - {text_prompt}
"""
REWARD_PROMPT = """
Please provide the overall ratings of this image: <|Reward|>

END
"""
PIXELS = 256 * 28 * 28  # min = max pixels of both images (EditReward/inference_edit.py prepare_batch)
HEADS = ("rm_heads.head_0.", "rm_heads.head_1.")  # following, quality (batch_dim1 -> head_0, batch_dim2 -> head_1)


@register("edit_reward")
class EditReward(TorchImageReward):
    """EditReward: how well an edit follows its instruction and how good it looks, given the source (mean of 2 heads)."""

    name = "edit_reward"
    needs_prompts = True
    unit = "EditReward (mu)"

    def __init__(self, weights: Any = None, processor: Any = None, *, batch_size: int = 4, device: Any = None,
                 dtype: Any = "bfloat16", min_pixels: int = PIXELS, max_pixels: int = PIXELS,
                 trust_pickle: bool = False):
        super().__init__(batch_size, device, dtype, differentiable=False)
        download = "the EditReward Qwen2.5-VL-7B checkpoint directory from the TIGER-Lab EditReward collection"
        # the authors look for model.pth first, then model.safetensors (inference_edit.py)
        checkpoint = find_checkpoint(weights, ["model.pth", "model.safetensors"], "edit_reward", download)
        base = require_path(processor, "edit_reward processor", "the config and processor files of "
                            "'Qwen/Qwen2.5-VL-7B-Instruct' (the base model; its weights are not needed)", kind="dir")
        self.min_pixels, self.max_pixels = int(min_pixels), int(max_pixels)
        self.backbone = QwenVLRewardBackbone(checkpoint, base, what="edit_reward", head_prefixes=HEADS,
                                             family="qwen2_5_vl", device=self.device, dtype=self.dtype,
                                             trust_pickle=trust_pickle)
        self.backbone.check_outputs(2, "mu, log sigma: EditReward-Qwen2.5-7B-VL.yaml output_dim 2")

    def modules(self):
        return [self.backbone.model, *self.backbone.heads.values()]

    def to(self, device: Any) -> EditReward:
        super().to(device)
        self.backbone.device = self.device
        return self

    def _score(self, x, prompts, metadata):
        prompts = check_prompts(prompts, self.name)
        sources = [to_image_list([s])[0] for s in source_images(metadata, self.name)]
        bb, b = self.backbone, x.shape[0]
        pair = [im for s, e in zip(bb.resize(sources, self.min_pixels, self.max_pixels),
                                   bb.resize(x, self.min_pixels, self.max_pixels)) for im in (s, e)]
        # one forward over both instructions' rows: rows [0, b) for head 0, [b, 2b) for head 1
        texts = bb.chat_texts([[{"type": "image"}, {"type": "image"},
                                {"type": "text", "text": instruction.format(text_prompt=p) + REWARD_PROMPT}]
                               for instruction in (INSTRUCTION_FOLLOWING, INSTRUCTION_QUALITY) for p in prompts])
        hidden = bb.token_hidden(bb.encode(texts, images=pair + pair))[:, 0]
        heads = torch.stack([bb.heads[HEADS[0]](hidden[:b]), bb.heads[HEADS[1]](hidden[b:])]).cpu()  # [2, B, 2]
        mean = heads.mean(0)
        return RewardOutput(mean[:, 0].clone(), {"sigma": mean[:, 1].exp(), "following": heads[0, :, 0].clone(),
                                                 "quality": heads[1, :, 0].clone()})
