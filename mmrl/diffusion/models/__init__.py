"""Flow-matching image / video / editing models behind one small interface, loaded from a local diffusers directory.

    model = load_flow_model("path/to/sd3.5-medium")          # any registered pipeline directory
    emb = model.encode_prompts(["a red circle"])              # once per prompt; `emb.select(idx)` repeats it
    x = model.initial_noise(4, height, width, generator)       # [B, C, h, w] for every family
    sigmas = model.sigmas(num_steps, height, width)           # [num_steps + 1] in fp32, last one 0
    v = model.velocity(x, sigma, emb.select([0, 0, 0, 0]), guidance_scale=4.5)
    images = model.decode(x, height, width)                    # float [B, 3, H, W] in [0, 1]
    z = model.encode_images(images)                            # back to latents (VAE posterior mean)

`model.transformer` is the only module that trains; recipes wrap it with `mmrl.adapters.PolicyStates`
and assign the wrapped module back to `model.transformer`.

Families (one file each, registered by the pipeline class in model_index.json): `sd3.py`
(StableDiffusion3Pipeline), `flux.py` (FluxPipeline), `flux2.py` (Flux2Pipeline, Flux2KleinPipeline), `z_image.py`
(ZImagePipeline), `wan.py` (WanPipeline), `hunyuan_video15.py` (HunyuanVideo15Pipeline), `qwen_image.py` (QwenImagePipeline), `qwen_image_edit.py`
(QwenImageEditPipeline, QwenImageEditPlusPipeline), `flux_kontext.py` (FluxKontextPipeline). Edit families
(`needs_source_image`) take `encode_prompts(prompts, images=...)` and carry the source image's latents in the
returned PromptEmbeds. Adding one = a new file here with a `@register_family("<PipelineClass>")` FlowModel
subclass implementing `encode_prompts`, `transformer_velocity`, `initial_noise`, `sigmas`, `decode` (see base.py and
docs/adding-a-family.md); this package imports every module in it.

What is simplified away: no negative prompts other than "" (the empty prompt, or the empty instruction with the
same source image, is the unconditional branch of classifier-free guidance), no IP-adapters / ControlNets, no
skip-layer guidance, one source image per edit.
"""

import importlib
import pkgutil

from mmrl.diffusion.models.base import (  # noqa: F401
    ATTENTION_LORA_TARGETS, MODEL_FAMILIES, FlowModel, PromptEmbedCache, PromptEmbeds, TinyCase, available_families,
    check_num_frames, flow_model_class, load_flow_model, register_family, tiny_cases,
)
from mmrl.diffusion.models.flux import FluxModel  # noqa: F401
from mmrl.diffusion.models.sd3 import SD3Model  # noqa: F401


def import_family_modules() -> list[str]:
    """Import every module of this package (each family file registers itself on import); returns their
    names. Runs once when the package is imported."""
    names = [m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"]
    for name in names:
        importlib.import_module(f"{__name__}.{name}")
    return names


import_family_modules()
