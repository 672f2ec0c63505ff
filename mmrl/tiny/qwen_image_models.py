"""Tiny Qwen-Image pipelines: ``QwenImagePipeline`` (text-to-image), ``QwenImageEditPipeline`` and
``QwenImageEditPlusPipeline`` (editing a source image), with the real component classes.

Sizes (shared by the three): ``QwenImageTransformer2DModel`` patch 2, 64 in / 16 out channels (16 latent channels
packed 2x2), 2 blocks, 2 heads x 16, rope axes 4+6+6, ``joint_attention_dim`` 64 = the text encoder's hidden size;
``AutoencoderKLQwenImage`` base_dim 8, z_dim 16, 8x spatial downsampling (64x64 images <-> 16x8x8 latents);
``Qwen2_5_VLForConditionalGeneration`` text encoder with the tiny VLM decoder (hidden 64, 2 layers) and vision
tower (depth 2); the ``qwen_image`` tokenizer (templates tokenize to the 34 / 64 tokens the pipelines drop).
Scheduler: Qwen-Image's dynamic-shift flow-matching Euler.
"""

from __future__ import annotations

from pathlib import Path

from mmrl.tiny.components import _prepare_dir, seed_weights, side_effect_free
from mmrl.tiny.vlm_models import _qwen_processor, _qwen_text_config, _qwen_token_ids
from mmrl.tiny.vocab import _load_tokenizer

TEXT_HIDDEN = 64  # the tiny Qwen2.5-VL decoder's hidden size = the transformer's joint_attention_dim


def _qwen_image_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # source: Qwen/Qwen-Image scheduler/scheduler_config.json (exponential dynamic shift, terminal sigma 0.02)
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")


def _qwen_image_parts(seed: int, zero_cond_t: bool = False):
    """(transformer, vae, text_encoder, tokenizer) of the tiny Qwen-Image family."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = _load_tokenizer("qwen_image")
    ids = _qwen_token_ids(tok)
    seed_weights(seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=TEXT_HIDDEN, axes_dims_rope=(4, 6, 6), zero_cond_t=zero_cond_t)
    seed_weights(seed + 1)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True])
    cfg = Qwen2_5_VLConfig(
        text_config=_qwen_text_config(tok, ids),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TEXT_HIDDEN,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           window_size=112, fullatt_block_indexes=[1], tokens_per_second=2),
        image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"], vision_end_token_id=ids["vision_end_token_id"],
        tie_word_embeddings=False)
    seed_weights(seed + 2)
    text_encoder = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    return transformer, vae, text_encoder, tok


@side_effect_free
def build_tiny_qwen_image(path, seed: int = 0) -> Path:
    """Tiny ``QwenImagePipeline`` at ``path`` (text-to-image; see the module docstring for sizes)."""
    from diffusers import QwenImagePipeline

    path = _prepare_dir(path)
    transformer, vae, text_encoder, tok = _qwen_image_parts(seed)
    QwenImagePipeline(scheduler=_qwen_image_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tok,
                      transformer=transformer).save_pretrained(path)
    return path


@side_effect_free
def build_tiny_qwen_image_edit(path, seed: int = 0, plus: bool = False) -> Path:
    """Tiny ``QwenImageEditPipeline`` (or ``QwenImageEditPlusPipeline`` with ``plus=True``, whose transformer uses
    ``zero_cond_t`` as Qwen-Image-Edit-2511's) at ``path``: the Qwen-Image parts plus a ``Qwen2VLProcessor`` (the
    text encoder also sees the source image)."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
    from transformers import Qwen2VLProcessor

    path = _prepare_dir(path)
    transformer, vae, text_encoder, tok = _qwen_image_parts(seed, zero_cond_t=plus)
    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    cls(scheduler=_qwen_image_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tok,
        processor=_qwen_processor(Qwen2VLProcessor, tok), transformer=transformer).save_pretrained(path)
    return path


@side_effect_free
def build_tiny_qwen_image_edit_plus(path, seed: int = 0) -> Path:
    """Tiny ``QwenImageEditPlusPipeline`` (Qwen-Image-Edit-2509 / 2511 layout) at ``path``."""
    return build_tiny_qwen_image_edit(path, seed, plus=True)
