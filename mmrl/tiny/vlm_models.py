"""Tiny vision-language models: Qwen2-VL, Qwen2.5-VL and Qwen3-VL with their processors."""

from __future__ import annotations

from pathlib import Path

from mmrl.tiny.components import _prepare_dir, seed_weights, side_effect_free
from mmrl.tiny.vocab import QWEN3_CHAT_TEMPLATE, _load_tokenizer

QWEN_MIN_PIXELS = 56 * 56
QWEN_MAX_PIXELS = 224 * 224


def _qwen_token_ids(tok) -> dict[str, int]:
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    ids["eos_token_id"] = tok.convert_tokens_to_ids("<|im_end|>")
    ids["pad_token_id"] = tok.convert_tokens_to_ids("<|endoftext|>")
    ids["bos_token_id"] = tok.convert_tokens_to_ids("<|endoftext|>")
    return ids


def _qwen_text_config(tok, ids: dict[str, int], head_dim: int = 16) -> dict:
    """Text decoder: 2 layers, 4 heads of `head_dim`, 2 kv heads, hidden 4 * head_dim, intermediate 2 * hidden.

    The default head_dim 16 gives hidden 64. mrope_section sums to head_dim / 2 in Qwen2-VL's 2:3:3 split
    ([16, 24, 24] at head_dim 128; [2, 3, 3] at 16).
    """
    if head_dim < 16 or head_dim % 16:
        raise ValueError(f"tiny Qwen-VL: head_dim must be a multiple of 16 (the 2:3:3 M-RoPE split of head_dim / 2), "
                         f"got {head_dim}")
    unit = head_dim // 16
    hidden = 4 * head_dim
    return dict(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-6, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "mrope_section": [2 * unit, 3 * unit, 3 * unit]},
        bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"],
    )


def _qwen_processor(processor_cls, tok, patch_size: int = 14):
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    size = {"shortest_edge": QWEN_MIN_PIXELS, "longest_edge": QWEN_MAX_PIXELS}
    image_processor = Qwen2VLImageProcessor(size=size, patch_size=patch_size, merge_size=2,
                                            temporal_patch_size=2)
    # cap_pixels_per_frame: the qwen-vl-utils reference behaviour (and silences transformers' warning)
    video_processor = Qwen2VLVideoProcessor(size=size, patch_size=patch_size, merge_size=2,
                                            temporal_patch_size=2, cap_pixels_per_frame=True)
    return processor_cls(image_processor=image_processor, tokenizer=tok,
                         video_processor=video_processor, chat_template=tok.chat_template)


def _save_vlm(model, processor, ids: dict[str, int], path: Path) -> Path:
    model.generation_config.eos_token_id = [ids["eos_token_id"], ids["pad_token_id"]]
    model.generation_config.pad_token_id = ids["pad_token_id"]
    model.generation_config.bos_token_id = ids["bos_token_id"]
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


@side_effect_free
def build_tiny_qwen2_vl(path, seed: int = 0, head_dim: int = 16) -> Path:
    """Tiny ``Qwen2VLForConditionalGeneration`` + ``Qwen2VLProcessor`` at ``path``.

    Vision tower: depth 2, embed 32, 2 heads, patch 14, merge 2 (a 56x56 image = 4 image tokens).
    Images are resized into [56*56, 224*224] pixels by the processor. `head_dim`: of the text decoder (hidden
    4 * head_dim); the default 16 is the smallest, vLLM's CPU backend needs one of
    ``mmrl.vlm.vllm_engine.CPU_HEAD_SIZES`` (e.g. 32 or 64).
    """
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    path = _prepare_dir(path)
    tok = _load_tokenizer("qwen")
    ids = _qwen_token_ids(tok)
    text = _qwen_text_config(tok, ids, head_dim)
    cfg = Qwen2VLConfig(
        text_config=text,
        vision_config=dict(depth=2, embed_dim=32, hidden_size=text["hidden_size"], num_heads=2, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"], vision_end_token_id=ids["vision_end_token_id"],
        tie_word_embeddings=False,
    )
    seed_weights(seed)
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    return _save_vlm(model, _qwen_processor(Qwen2VLProcessor, tok), ids, path)


@side_effect_free
def build_tiny_qwen25_vl(path, seed: int = 0, head_dim: int = 16) -> Path:
    """Tiny ``Qwen2_5_VLForConditionalGeneration`` + ``Qwen2_5_VLProcessor`` at ``path``.

    Same text decoder (and `head_dim` option) and tokenizer as :func:`build_tiny_qwen2_vl`; the Qwen2.5-VL vision
    tower (RMSNorm, SwiGLU MLP, window attention) with depth 2, width 32, window 112, the last block full
    attention, out_hidden_size = the text hidden size (64 by default).
    """
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    path = _prepare_dir(path)
    tok = _load_tokenizer("qwen")
    ids = _qwen_token_ids(tok)
    text = _qwen_text_config(tok, ids, head_dim)
    cfg = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=text["hidden_size"],
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           window_size=112, fullatt_block_indexes=[1], tokens_per_second=2),
        image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"], vision_end_token_id=ids["vision_end_token_id"],
        tie_word_embeddings=False,
    )
    seed_weights(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    return _save_vlm(model, _qwen_processor(Qwen2_5_VLProcessor, tok), ids, path)


@side_effect_free
def build_tiny_qwen3_vl(path, seed: int = 0, head_dim: int = 16) -> Path:
    """Tiny ``Qwen3VLForConditionalGeneration`` + ``Qwen3VLProcessor`` at ``path``.

    Text: hidden 64, 2 layers, 4 heads x 16, 2 kv heads, interleaved mrope_section [4, 2, 2] (sums to
    head_dim / 2). Vision: depth 2, width 32, patch 16, 8x8 learned position grid, deepstack from
    block 0. Chat template without the default system turn, as Qwen3-VL's. `head_dim`: of the text decoder (hidden
    4 * head_dim, mrope_section scaled alike); vLLM's CPU backend needs one of ``CPU_HEAD_SIZES`` (e.g. 32).
    """
    from transformers import (Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration,
                              Qwen3VLProcessor, Qwen3VLVideoProcessor)

    path = _prepare_dir(path)
    tok = _load_tokenizer("qwen")
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    ids = _qwen_token_ids(tok)
    text = _qwen_text_config(tok, ids, head_dim)
    unit = head_dim // 16
    text.update(head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                                    "mrope_section": [4 * unit, 2 * unit, 2 * unit],
                                                    "mrope_interleaved": True})
    text.pop("bos_token_id")
    cfg = Qwen3VLConfig(
        text_config=text,
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=text["hidden_size"],
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           num_position_embeddings=64, deepstack_visual_indexes=[0]),
        image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"], vision_end_token_id=ids["vision_end_token_id"],
        tie_word_embeddings=False,
    )
    seed_weights(seed)
    model = Qwen3VLForConditionalGeneration(cfg).eval()
    # source: Qwen/Qwen3-VL-2B-Instruct preprocessor_config.json (patch 16, mean = std = 0.5)
    size = {"shortest_edge": 64 * 64, "longest_edge": 256 * 256}
    common = dict(size=size, patch_size=16, merge_size=2, temporal_patch_size=2,
                  image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**common), tokenizer=tok,
        video_processor=Qwen3VLVideoProcessor(**common, cap_pixels_per_frame=True),
        chat_template=tok.chat_template,
    )
    return _save_vlm(model, processor, ids, path)
