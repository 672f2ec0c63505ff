"""Data-side building blocks shared by both trainer families (never imports mmrl.diffusion or mmrl.vlm).

- ``images``: load any image input as RGB PIL, Qwen ``smart_resize``, tensor <-> PIL.
- ``qwen_vl``: ``<image>``/``<video>`` placeholder expansion, per-sample token checks, vectorised
  M-RoPE ``get_rope_index`` for Qwen2-VL / Qwen2.5-VL / Qwen3-VL.
- ``data``, ``shapes`` and ``shapes_check`` (datasets, synthetic scenes, their offline GenEval-style check) are
  imported from their modules directly.
"""

from mmrl.pipelines.images import (
    ImageLoadError,
    ImageNotFoundError,
    load_image,
    pil_list_from_tensor,
    resize_for_qwen,
    smart_resize,
    to_tensor01,
)
from mmrl.pipelines.qwen_vl import (
    QwenVisionTokens,
    check_vision_token_counts,
    expand_vision_placeholders,
    get_rope_index,
    mm_token_type_ids,
    rope_kwargs_from_config,
)

__all__ = [
    "ImageLoadError",
    "ImageNotFoundError",
    "load_image",
    "pil_list_from_tensor",
    "resize_for_qwen",
    "smart_resize",
    "to_tensor01",
    "QwenVisionTokens",
    "check_vision_token_counts",
    "expand_vision_placeholders",
    "get_rope_index",
    "mm_token_type_ids",
    "rope_kwargs_from_config",
]
