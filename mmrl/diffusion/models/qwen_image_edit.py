"""Qwen-Image-Edit (`QwenImageEditPipeline`) and Qwen-Image-Edit-2509 / 2511 (`QwenImageEditPlusPipeline`) as
FlowModels: Qwen-Image conditioned on a source image."""

from __future__ import annotations

import torch

from mmrl.diffusion.models.base import PromptEmbeds, TinyCase, register_family
from mmrl.diffusion.models.qwen_image import QwenImageModel
from mmrl.tiny import build_tiny_qwen_image_edit, build_tiny_qwen_image_edit_plus


@register_family("QwenImageEditPipeline")
class QwenImageEditModel(QwenImageModel):
    """Qwen-Image-Edit: the source image conditions the model twice, as in diffusers' pipeline:

    - the Qwen2.5-VL text encoder reads it with the instruction (the chat template holds an image slot), so the
      prompt embeddings depend on the image - the CFG negative (the empty instruction) is encoded with the same
      image, per row;
    - its VAE latents `image_latents` [N, C, hc, wc] are packed and appended to the noisy latents' tokens, with
      `img_shapes` = [target, source]; the prediction is cut back to the target's tokens.

    `encode_prompts(prompts, images)` takes the source images already at the size to condition on (the pipeline
    resizes every source to a ~1024^2 area; the recipes use the rollout's height x width, as verl-omni's and
    Flow-Factory's adapters let a recipe choose), and returns rows holding `prompt_embeds(_mask)`,
    `negative_prompt_embeds(_mask)` and `image_latents`; every sampler and recipe then carries them as any
    prompt embedding. The schedule's shift is computed from the target's tokens only (as the pipeline)."""

    family = "qwen_image_edit"
    tiny_cases = (TinyCase("qwen_image_edit", build_tiny_qwen_image_edit,
                           {"height": 32, "width": 32, "guidance_scale": 4.0}),)
    needs_source_image = True
    # the same transformer as Qwen-Image; Flow-Factory's and verl-omni's edit adapters use the same targets
    # (source: verl-omni examples/flowgrpo_trainer/qwen_image_edit/run_qwen_image_edit_lora.sh)

    def encode_prompts(self, prompts, images=None):
        pils = self._source_pils(prompts, images)
        prompts = list(prompts)
        pe, mask = self.encode_text(prompts, pils)
        neg, neg_mask = self.encode_text([""] * len(prompts), pils)  # CFG negative: same image, empty instruction
        return PromptEmbeds(prompt_embeds=pe, prompt_embeds_mask=mask, negative_prompt_embeds=neg,
                            negative_prompt_embeds_mask=neg_mask, image_latents=self.encode_images(images))

    def _source_pils(self, prompts, images):
        """The source images as PIL (what the pipeline's processor reads), one per prompt; clear errors otherwise."""
        from mmrl.pipelines.images import pil_list_from_tensor

        if images is None:
            raise ValueError(f"{type(self).__name__} ({self.family}) edits a source image: encode_prompts needs "
                             f"images=[N, 3, H, W] in [0, 1], one per prompt (the data rows' 'source_image')")
        if not (isinstance(images, torch.Tensor) and images.dim() == 4 and images.shape[1] == 3):
            raise ValueError(f"{self.family}: source images must be a float tensor [N, 3, H, W] in [0, 1], got "
                             f"{type(images).__name__} {tuple(getattr(images, 'shape', ()))}")
        if images.shape[0] != len(prompts):
            raise ValueError(f"{self.family}: {len(prompts)} prompts but {images.shape[0]} source images")
        return pil_list_from_tensor(images)

    def negative_rows(self, embeds):
        """The unconditional branch keeps each row's source image: its own negative text and the same latents."""
        neg = PromptEmbeds(embeds)
        neg["prompt_embeds"], neg["prompt_embeds_mask"] = embeds["negative_prompt_embeds"], \
            embeds["negative_prompt_embeds_mask"]
        return neg

    def transformer_velocity(self, latents, sigma, embeds, guidance_scale):
        b, c, h, w = latents.shape
        cond = embeds["image_latents"]
        img_shapes = [[(1, h // 2, w // 2), (1, cond.shape[-2] // 2, cond.shape[-1] // 2)]] * b
        out = self.run_transformer(self.pack_tokens(latents, cond), img_shapes, sigma, embeds, guidance_scale)
        return self.unpack_tokens(out, c, h, w)  # the target's tokens come first


@register_family("QwenImageEditPlusPipeline")
class QwenImageEditPlusModel(QwenImageEditModel):
    """Qwen-Image-Edit-2509 / 2511 (`QwenImageEditPlusPipeline`). Differs from Qwen-Image-Edit as the pipeline does:
    the instruction is prefixed "Picture 1: <image>" inside the user turn, the text encoder sees the source resized
    to a 384^2 area (`CONDITION_IMAGE_SIZE`) while the VAE latents use the image as given, and prompts are encoded
    one at a time (the pipeline puts all of a call's images into every prompt). One source image per prompt
    (2511's recipes use one; several reference images are not supported here). Checkpoints with `zero_cond_t`
    (2511) give the source tokens timestep 0 inside the transformer."""

    family = "qwen_image_edit_plus"
    tiny_cases = (TinyCase("qwen_image_edit_plus", build_tiny_qwen_image_edit_plus,
                           {"height": 32, "width": 32, "guidance_scale": 4.0}),)

    def encode_prompts(self, prompts, images=None):
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (CONDITION_IMAGE_SIZE,
                                                                                calculate_dimensions)

        pils = self._source_pils(prompts, images)
        rows = []
        for prompt, pil in zip(prompts, pils):
            w, h = calculate_dimensions(CONDITION_IMAGE_SIZE, pil.width / pil.height)
            vl_image = [self.pipe.image_processor.resize(pil, h, w)]
            pe, mask = self.encode_text([prompt], vl_image)
            neg, neg_mask = self.encode_text([""], vl_image)
            rows.append(PromptEmbeds(prompt_embeds=pe, prompt_embeds_mask=mask, negative_prompt_embeds=neg,
                                     negative_prompt_embeds_mask=neg_mask))
        out = PromptEmbeds.cat(rows)
        out["image_latents"] = self.encode_images(images)
        return out
