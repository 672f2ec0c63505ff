"""Tiny, randomly initialised models of the real architectures, saved in the standard formats.

Every builder seeds a private random state (the caller's is restored: building has no side effect on a run
that seeded before it), builds the genuine diffusers / transformers / open_clip class with very small sizes,
saves it with ``save_pretrained`` (or open_clip's files) and returns the path.
Loading back is exactly what a real checkpoint uses (``StableDiffusion3Pipeline.from_pretrained``,
``AutoProcessor.from_pretrained``, ...), so tests and the CPU demo exercise the real code paths.

Tokenizers are built locally (no network): small byte-level BPE vocabularies trained here, with a
deterministic trainer, on a fixed corpus covering the synthetic prompts and visual-QA tasks
(colours, shapes, positions, counts). The generated files are stored in ``assets/tokenizers/``
(``clip/``, ``t5/``, ``qwen/``); ``build_tokenizer_assets()`` regenerates them byte for byte.

What is simplified away: the weights are random (see ``CALIBRATION.md``), the vocabularies are a
few hundred to a thousand tokens instead of 49k-152k.

Modules: ``vocab.py`` (corpus, BPE, tokenizers), ``components.py`` (shared encoders and helpers),
``diffusion_models.py`` (SD3, FLUX, FLUX Kontext), ``qwen_image_models.py`` (Qwen-Image, -Edit, -Edit Plus),
``family_models.py`` (Wan, Z-Image, FLUX.2 [dev] / [klein]), ``ltx2.py`` (LTX-2), ``hunyuan_video15.py``
(HunyuanVideo 1.5),
``vlm_models.py`` (Qwen2/2.5/3-VL), ``clip_models.py`` (CLIP, open_clip), ``unified_reward.py`` (the UnifiedReward
judge);
every name is importable from ``mmrl.tiny``.
"""

from __future__ import annotations

from pathlib import Path

from mmrl.tiny.clip_models import (  # noqa: F401
    CLIP_MEAN,
    CLIP_STD,
    OPEN_CLIP_CONFIGS,
    build_tiny_clip,
    build_tiny_open_clip,
    load_open_clip,
)
from mmrl.tiny.components import count_parameters  # noqa: F401
from mmrl.tiny.diffusion_models import build_tiny_flux, build_tiny_flux_kontext, build_tiny_sd3
from mmrl.tiny.latent_rewards import build_tiny_dina_lrm, build_tiny_lpo_lrm  # noqa: F401
from mmrl.tiny.family_models import (  # noqa: F401
    build_tiny_flux2,
    build_tiny_flux2_klein,
    build_tiny_wan,
    build_tiny_z_image,
)
from mmrl.tiny.ltx2 import build_tiny_ltx2  # noqa: F401
from mmrl.tiny.glm4v import build_tiny_glm4v  # noqa: F401
from mmrl.tiny.internvl import build_tiny_internvl  # noqa: F401
from mmrl.tiny.hunyuan_video15 import build_tiny_hunyuan_video15  # noqa: F401
from mmrl.tiny.hpsv3 import build_tiny_edit_reward, build_tiny_hpsv3  # noqa: F401  (authors'-format reward checkpoints)
from mmrl.tiny.qwen_image_models import (  # noqa: F401
    build_tiny_qwen_image,
    build_tiny_qwen_image_edit,
    build_tiny_qwen_image_edit_plus,
)
from mmrl.tiny.janus import build_tiny_janus  # noqa: F401
from mmrl.tiny.unified_reward import build_tiny_unified_reward, build_tiny_unified_reward_qwen3vl  # noqa: F401
from mmrl.tiny.videoalign import build_tiny_videoalign  # noqa: F401
from mmrl.tiny.vlm_models import (  # noqa: F401
    QWEN_MAX_PIXELS,
    QWEN_MIN_PIXELS,
    build_tiny_qwen2_vl,
    build_tiny_qwen3_vl,
    build_tiny_qwen25_vl,
)
from mmrl.tiny.vocab import (  # noqa: F401
    ASSETS_DIR,
    CAPITALISED,
    COLOURS,
    COMMON_WORDS,
    CORPUS_WORDS,
    NUMBER_WORDS,
    POSITIONS,
    QWEN3_CHAT_TEMPLATE,
    QWEN_CHAT_TEMPLATE,
    QWEN_NORMAL_ADDED_TOKENS,
    QWEN_SPECIAL_TOKENS,
    SHAPES,
    _load_tokenizer,
    build_tokenizer_assets,
    make_clip_tokenizer,
    make_qwen_tokenizer,
    make_t5_tokenizer,
    train_bpe,
)

BUILDERS = {
    "sd3": build_tiny_sd3,
    "flux": build_tiny_flux,
    "flux_kontext": build_tiny_flux_kontext,
    "qwen_image": build_tiny_qwen_image,
    "qwen_image_edit": build_tiny_qwen_image_edit,
    "qwen_image_edit_plus": build_tiny_qwen_image_edit_plus,
    "wan": build_tiny_wan,
    "z_image": build_tiny_z_image,
    "flux2": build_tiny_flux2,
    "flux2_klein": build_tiny_flux2_klein,
    "ltx2": build_tiny_ltx2,
    "hunyuan_video15": build_tiny_hunyuan_video15,
    "qwen2_vl": build_tiny_qwen2_vl,
    "qwen25_vl": build_tiny_qwen25_vl,
    "qwen3_vl": build_tiny_qwen3_vl,
    "glm4v": build_tiny_glm4v,
    "internvl": build_tiny_internvl,
    "clip": build_tiny_clip,
    "open_clip": build_tiny_open_clip,
    "unified_reward": build_tiny_unified_reward,
    "hpsv3": build_tiny_hpsv3,              # reward checkpoints in their authors' formats (with their base model)
    "edit_reward": build_tiny_edit_reward,
}


def build_all(root, seed: int = 0, vlm_head_dim: int = 16) -> dict[str, Path]:
    """Build every tiny model into ``root/<name>`` (names as in ``BUILDERS``); returns name -> path.

    vlm_head_dim: head size of the Qwen2-VL / Qwen2.5-VL, GLM-4.1V and InternVL text decoders (16 = the smallest;
    vLLM's CPU backend takes 32, 64, ...: ``mmrl.vlm.vllm_engine.CPU_HEAD_SIZES``)."""
    root = Path(root)
    with_head = {"qwen2_vl", "qwen25_vl", "glm4v", "internvl"}
    return {name: build(root / name, seed=seed, **({"head_dim": vlm_head_dim} if name in with_head else {}))
            for name, build in BUILDERS.items()}
