"""Tiny ``HunyuanVideo15Pipeline`` (HunyuanVideo 1.5 text-to-video) with its real component classes, saved with
``save_pretrained`` and loaded back by ``from_pretrained``.

Components (diffusers 0.42.1): ``HunyuanVideo15Transformer3DModel`` (2 heads x 16, 1 double-stream block, 1 token
refiner block; ``in_channels`` = 2 x 4 latent channels + 1: the noisy latents, zero condition latents and a zero mask
for text-to-video), ``AutoencoderKLHunyuanVideo15`` (4 latent channels, 4x spatial, 2x temporal), a
``Qwen2_5_VLTextModel`` text encoder (hidden 16, 3 layers: the pipeline reads the third-to-last hidden state) with a
Qwen2-style tokenizer, a ``T5EncoderModel`` (d_model 32 = ``text_embed_2_dim``) with ``ByT5Tokenizer()`` for quoted
glyph text, ``FlowMatchEulerDiscreteScheduler(shift=7)`` and a ``ClassifierFreeGuidance`` guider.

The pipeline renders the prompt into its system template, pads to 1000 + 108 tokens and drops the first 108 (the
template's system turn, as the real Qwen2.5-VL tokenizer splits it): the tokenizer here has every pre-token of that
turn as one token, so the template is exactly 108 tokens and the user's text is what remains.
"""

from __future__ import annotations

from pathlib import Path

from mmrl.tiny.components import _prepare_dir, seed_weights, side_effect_free

TEMPLATE_TOKENS = 108  # HunyuanVideo15Pipeline.prompt_template_encode_start_idx
TEXT_HIDDEN = 16  # the Qwen2.5-VL text model's hidden size = the transformer's text_embed_dim
GLYPH_HIDDEN = 32  # the T5 encoder's d_model = the transformer's text_embed_2_dim
DEFAULT_GUIDANCE = 6.0  # the published 480p / 720p t2v guider's scale (diffusers' conversion script)


def hunyuan_video15_template() -> str:
    """The pipeline's system turn as the chat template renders it (what the tokenizer must split into 108 tokens)."""
    from diffusers import HunyuanVideo15Pipeline

    import inspect

    system = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"


def make_hunyuan_video15_tokenizer():
    """The ``qwen_image`` tokenizer's construction with the HunyuanVideo 1.5 template's pre-tokens as single tokens."""
    from mmrl.tiny.vocab import make_qwen_image_tokenizer

    return make_qwen_image_tokenizer(extra_texts=(hunyuan_video15_template(),))


@side_effect_free
def build_tiny_hunyuan_video15(path, seed: int = 0, guidance_scale: float = DEFAULT_GUIDANCE) -> Path:
    """Build the tiny pipeline into ``path`` (see the module docstring); ``guidance_scale``: the saved guider's scale
    (the pipeline takes no guidance argument: its guider holds it)."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    path = _prepare_dir(path)
    tok = make_hunyuan_video15_tokenizer()
    n = len(tok(hunyuan_video15_template(), add_special_tokens=False).input_ids)
    if n != TEMPLATE_TOKENS:  # a vocabulary change that splits the template differently would crop the prompt
        raise RuntimeError(f"tiny HunyuanVideo 1.5 tokenizer: the template is {n} tokens, the pipeline drops "
                           f"{TEMPLATE_TOKENS}")
    seed_weights(seed)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=TEXT_HIDDEN,
        text_embed_2_dim=GLYPH_HIDDEN, image_embed_dim=12, rope_axes_dim=(4, 6, 6), target_size=32, task_type="t2v")
    seed_weights(seed + 1)
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(16, 16), layers_per_block=1,
                                      spatial_compression_ratio=4, temporal_compression_ratio=2,
                                      downsample_match_channel=False, upsample_match_channel=False)
    seed_weights(seed + 2)
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tok), hidden_size=TEXT_HIDDEN, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]},
        pad_token_id=tok.pad_token_id, bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)).eval()
    tok_2 = ByT5Tokenizer()
    seed_weights(seed + 3)
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tok_2), d_model=GLYPH_HIDDEN, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=tok_2.pad_token_id, eos_token_id=tok_2.eos_token_id)).eval()
    pipe = HunyuanVideo15Pipeline(
        text_encoder=text_encoder, tokenizer=tok, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=text_encoder_2, tokenizer_2=tok_2,
        guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))
    pipe.save_pretrained(path)
    return path
