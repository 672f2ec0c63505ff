"""Janus-Pro-7B at its published width (mmrl.perf.architectures): for `benchmarks/real_width.py`'s memory rows.

The config: transformers' `JanusConfig` with Janus-Pro-7B's published sizes (deepseek-ai/Janus-Pro-7B config.json:
language_config hidden 4096, intermediate 11008, 30 layers, 32 heads, vocabulary 102400, 16384 positions; SigLIP-L/16
at 384 px understanding tower with an aligner 1024 -> 4096; generation aligner 8 -> 4096, generation head 4096 ->
4096 -> 16384 image tokens; the VQ-16 tokenizer, 16384 codes of width 8), the sub-config defaults of transformers
5.24 elsewhere. One training row is what `janus_grpo`'s update runs per image: the prompt and its unconditional copy,
each followed by the image's 576 token embeddings, through the decoder in one batch of 2; the guided log-probabilities
of the 576 tokens (`JanusPolicy.guided_logprobs`, the recipe's own code).
"""

from __future__ import annotations

import torch
from torch import nn

from mmrl.ar_image.grpo import JANUS_LORA_TARGETS
from mmrl.perf.architectures import Architecture, register_architecture

# BOS, pad and begin-of-image of Janus-Pro's tokenizer (any ids below the vocabulary give the same memory)
_BOS, _PAD, _BOI = 100000, 100015, 100016


def _janus_row(model: nn.Module, row: dict, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    vocab = model.config.text_config.vocab_size
    ids = torch.randint(0, min(_BOS, vocab), (1, row["prompt_tokens"]), generator=g)
    ids[0, 0], ids[0, -1] = _BOS % vocab, _BOI % vocab
    codes = model.config.vq_config.num_embeddings
    return {"ids": ids, "tokens": torch.randint(0, codes, (1, row["image_tokens"]), generator=g)}


def _janus_loss(model: nn.Module, inputs: dict) -> torch.Tensor:
    """Minus the mean guided log-probability of the row's image tokens (guidance 5, as the recipe)."""
    from mmrl.ar_image.janus import JanusPolicy

    vocab = model.config.text_config.vocab_size
    gen = model.generation_config
    gen.bos_token_id, gen.pad_token_id = _BOS % vocab, _PAD % vocab
    gen.generation_kwargs = {**(getattr(gen, "generation_kwargs", None) or {}), "boi_token_id": _BOI % vocab}
    policy = JanusPolicy(model, None, guidance_scale=5.0)
    return -policy.guided_logprobs(inputs["ids"], inputs["tokens"])[0].mean()


register_architecture(Architecture(
    name="janus_pro_7b", kind="janus", class_name="JanusForConditionalGeneration", config_class="JanusConfig",
    config=dict(
        text_config=dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=30,
                         num_attention_heads=32, num_key_value_heads=32, vocab_size=102400,
                         max_position_embeddings=16384, rms_norm_eps=1e-6, hidden_act="silu",
                         tie_word_embeddings=False),
        vision_config=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, image_size=384,
                           patch_size=16, projection_dim=4096, num_image_tokens=576),
        vq_config=dict(num_embeddings=16384, embed_dim=8, projection_dim=4096, image_token_embed_dim=4096),
        image_token_id=100581, tie_word_embeddings=False),
    depth={"text_config.num_hidden_layers": 30},
    source="deepseek-ai/Janus-Pro-7B config.json (DeepSeek-LLM-7B decoder, SigLIP-L/16 384 px, VQ-16; model card "
           "7B); the sizes as in transformers' JanusConfig",
    lora_targets=(), lora_regex=JANUS_LORA_TARGETS, full_trains=("model.language_model.", "model.generation_head."),
    recipe="configs/ar_image/janus_grpo_janus_pro_7b_hps.yaml",
    # the recipe's micro-batch: 8 images (each 2 decoder rows: the prompt and its unconditional copy), a prompt of
    # ~64 tokens in Janus' user turn, 576 image tokens (384 x 384 px); full fine-tuning of the decoder and the
    # generation head (T2I-R1); LoRA rows at rank 32 (the recipe's LoRA default)
    step=dict(rows=8, prompt_tokens=64, image_tokens=576, lora_rank=32),
    inputs=_janus_row, loss=_janus_loss,
    small_widths={"text_config.hidden_size": 64, "text_config.intermediate_size": 128,
                  "text_config.num_attention_heads": 4, "text_config.num_key_value_heads": 4,
                  "text_config.vocab_size": 256, "vision_config.hidden_size": 32,
                  "vision_config.num_attention_heads": 2, "vision_config.projection_dim": 64,
                  "vq_config.projection_dim": 64, "vq_config.image_token_embed_dim": 64,
                  "vq_config.num_embeddings": 64, "vq_config.base_channels": 32},
    small_row=dict(prompt_tokens=8, image_tokens=16)))
