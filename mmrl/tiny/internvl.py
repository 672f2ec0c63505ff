"""Tiny InternVL (transformers ``InternVLForConditionalGeneration`` + ``InternVLProcessor``), saved as the hub's
OpenGVLab/InternVL3-1B-hf directory is (config.json, safetensors, processor and tokenizer files).

Sizes (facts measured in /work/shared/facts/MODEL_KINDS_2026.md, checked against transformers 5.24.0
``configuration_internvl.py`` / ``processing_internvl.py``): Qwen2 text decoder hidden 64, 2 layers, 4 heads of 16,
2 kv heads (1-D rope; ``head_dim=32`` for vLLM's CPU attention doubles the widths); vision tower 1 layer, hidden
32, 56x56 tiles of 14x14 patches, pixel shuffle 0.5 -> 4 tokens per tile;
``GotOcr2ImageProcessor(crop_to_patches=True, max_patches=4)`` (a 60x120 image -> 2 tiles + a thumbnail -> ``<img>``
+ 12 x ``<IMG_CONTEXT>`` + ``</img>``). Tokenizer: the tiny Qwen byte-level BPE of ``mmrl.tiny.vocab`` with
InternVL's image tokens (the real strings, source: OpenGVLab/InternVL3-1B-hf tokenizer_config.json) as
``extra_special_tokens``; chat template: Qwen's layout with images as ``<IMG_CONTEXT>\\n`` (InternVL-hf's template).
``decoder="qwen3"`` gives InternVL 3.5's text model (a Qwen3 decoder: q/k RMS norms per head, same sizes and
projection names), the rest unchanged.
"""

from __future__ import annotations

from pathlib import Path

from mmrl.tiny.components import _prepare_dir, seed_weights, side_effect_free
from mmrl.tiny.vocab import ASSETS_DIR

INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                   "video_token": "<video>"}
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item %}<IMG_CONTEXT>\n"
    "{% elif 'text' in item %}{{ item['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@side_effect_free
def build_tiny_internvl(path, seed: int = 0, decoder: str = "qwen2", head_dim: int = 16) -> Path:
    """Tiny ``InternVLForConditionalGeneration`` + ``InternVLProcessor`` at ``path`` (see the module docstring);
    `decoder`: the text model's ``model_type``, ``"qwen2"`` (InternVL 3) or ``"qwen3"`` (InternVL 3.5).
    `head_dim`: of the text decoder (hidden 4 * head_dim, intermediate 2 * hidden); vLLM's CPU backend needs one of
    ``mmrl.vlm.vllm_engine.CPU_HEAD_SIZES`` (e.g. 32)."""
    from transformers import (AutoTokenizer, GotOcr2ImageProcessor, InternVLConfig, InternVLForConditionalGeneration,
                              InternVLProcessor, InternVLVideoProcessor)

    if decoder not in ("qwen2", "qwen3"):
        raise ValueError(f"decoder: expected 'qwen2' (InternVL 3) or 'qwen3' (InternVL 3.5), got {decoder!r}")
    path = _prepare_dir(path)
    tok = AutoTokenizer.from_pretrained(ASSETS_DIR / "qwen", extra_special_tokens=INTERNVL_TOKENS)
    tid = tok.convert_tokens_to_ids
    eos, pad = tid("<|im_end|>"), tid("<|endoftext|>")
    hidden = 4 * head_dim
    text = {"model_type": decoder, "vocab_size": len(tok), "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head_dim,
            "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            "eos_token_id": eos, "pad_token_id": pad}
    vision = {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64, "num_hidden_layers": 1,
              "image_size": [56, 56], "patch_size": [14, 14]}
    cfg = InternVLConfig(text_config=text, vision_config=vision, image_token_id=tid("<IMG_CONTEXT>"),
                         downsample_ratio=0.5, vision_feature_layer=-1, vision_feature_select_strategy="default")
    seed_weights(seed)
    model = InternVLForConditionalGeneration(cfg).eval()
    image_processor = GotOcr2ImageProcessor(crop_to_patches=True, max_patches=4, size={"height": 56, "width": 56})
    processor = InternVLProcessor(image_processor=image_processor, tokenizer=tok,
                                  video_processor=InternVLVideoProcessor(), image_seq_length=4,
                                  chat_template=INTERNVL_CHAT_TEMPLATE)
    model.generation_config.eos_token_id = [eos, pad]
    model.generation_config.pad_token_id = pad
    model.generation_config.bos_token_id = pad
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path
