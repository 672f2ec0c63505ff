"""Tiny GLM-4.1V (transformers ``Glm4vForConditionalGeneration`` + ``Glm4vProcessor``), saved as the hub's
THUDM/GLM-4.1V-9B-Thinking directory is (config.json, safetensors, processor and tokenizer files).

Sizes (facts measured in /work/shared/facts/MODEL_KINDS_2026.md, checked against transformers 5.24.0
``configuration_glm4v.py``): text decoder hidden 64, 2 layers, 4 heads of 16, 2 kv heads, M-RoPE
``mrope_section [1, 1, 2]`` over half of each head (``partial_rotary_factor 0.5``, GLM's partial rope); vision tower
depth 1, hidden 32, patch 14, merge 2 (``head_dim=32`` for vLLM's CPU attention doubles the decoder's widths and
the M-RoPE sections); images resized into [56*56, 112*112] pixels (a 56x56 image = 4 tokens).
Tokenizer: the tiny Qwen byte-level BPE of ``mmrl.tiny.vocab`` plus GLM-4.1V's special tokens (the real strings,
source: THUDM/GLM-4.1V-9B-Thinking tokenizer_config.json) and a chat template with GLM's layout
(``[gMASK]<sop><|user|>\\n...<|assistant|>\\n``, images as ``<|begin_of_image|><|image|><|end_of_image|>``).
"""

from __future__ import annotations

from pathlib import Path

from mmrl.tiny.components import _prepare_dir, seed_weights, side_effect_free
from mmrl.tiny.vocab import _load_tokenizer

GLM4V_SPECIAL_TOKENS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                        "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
                        "<|image|>", "<|video|>"]
GLM4V_MIN_PIXELS = 56 * 56
GLM4V_MAX_PIXELS = 112 * 112

GLM4V_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item or 'image_url' in item %}"
    "<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif item['type'] == 'video' or 'video' in item %}"
    "<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif 'text' in item %}"
    "{{ item['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def glm4v_tokenizer():
    """The tiny Qwen tokenizer with GLM-4.1V's special tokens and chat template (eos ``<|user|>`` as GLM-4.1V's
    generation config stops on it; pad ``<|endoftext|>``)."""
    tok = _load_tokenizer("qwen")
    tok.add_special_tokens({"additional_special_tokens": GLM4V_SPECIAL_TOKENS})
    tok.chat_template = GLM4V_CHAT_TEMPLATE
    return tok


@side_effect_free
def build_tiny_glm4v(path, seed: int = 0, head_dim: int = 16) -> Path:
    """Tiny ``Glm4vForConditionalGeneration`` + ``Glm4vProcessor`` at ``path`` (see the module docstring).

    `head_dim`: of the text decoder (a multiple of 16; hidden 4 * head_dim, intermediate 2 * hidden, mrope_section
    scaled alike); vLLM's CPU backend needs one of ``mmrl.vlm.vllm_engine.CPU_HEAD_SIZES`` (e.g. 32)."""
    from transformers import (Glm4vConfig, Glm4vForConditionalGeneration, Glm4vImageProcessor, Glm4vProcessor,
                              Glm4vVideoProcessor)

    if head_dim < 16 or head_dim % 16:
        raise ValueError(f"tiny GLM-4.1V: head_dim must be a multiple of 16 (mrope_section 1:1:2 over a quarter of "
                         f"each head), got {head_dim}")
    unit, hidden = head_dim // 16, 4 * head_dim
    path = _prepare_dir(path)
    tok = glm4v_tokenizer()
    tid = tok.convert_tokens_to_ids
    eos, pad = tid("<|user|>"), tid("<|endoftext|>")
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4096,
                rms_norm_eps=1e-5, hidden_act="silu", pad_token_id=pad, eos_token_id=eos,
                # as the real config.json: transformers' decoder has q/k/v biases whatever it says, vLLM's Glm4
                # reads this flag (default False) and without it drops the biases (a synced bias then never lands)
                # source: huggingface/transformers@231653db models/glm4v/convert_glm4v_mgt_weights_to_hf.py
                # ("attention_bias": add_qkv_bias, default True)
                attention_bias=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [unit, unit, 2 * unit], "partial_rotary_factor": 0.5})
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, image_size=56, out_hidden_size=hidden)
    cfg = Glm4vConfig(text_config=text, vision_config=vision, image_token_id=tid("<|image|>"),
                      video_token_id=tid("<|video|>"), image_start_token_id=tid("<|begin_of_image|>"),
                      image_end_token_id=tid("<|end_of_image|>"), video_start_token_id=tid("<|begin_of_video|>"),
                      video_end_token_id=tid("<|end_of_video|>"))
    seed_weights(seed)
    model = Glm4vForConditionalGeneration(cfg).eval()
    size = {"shortest_edge": GLM4V_MIN_PIXELS, "longest_edge": GLM4V_MAX_PIXELS}
    processor = Glm4vProcessor(image_processor=Glm4vImageProcessor(size=size, patch_size=14, merge_size=2,
                                                                   temporal_patch_size=2),
                               tokenizer=tok, video_processor=Glm4vVideoProcessor(),
                               chat_template=GLM4V_CHAT_TEMPLATE)
    model.generation_config.eos_token_id = [eos, pad]
    model.generation_config.pad_token_id = pad
    model.generation_config.bos_token_id = pad
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path
