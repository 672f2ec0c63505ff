"""Tiny Janus (transformers `JanusForConditionalGeneration`, Janus-Pro's architecture) for autoregressive image
generation: a 2-layer Llama decoder (hidden 32), a SigLIP vision tower (32 px, patch 8: 16 image tokens) and a VQ-VAE
with a 64-entry codebook whose decoder makes 32 x 32 images from a 4 x 4 token grid (or another size: `image_size`
and `patch_size` give (image_size / patch_size)^2 tokens). Saved with `save_pretrained` (model, generation config,
`JanusProcessor` over a word-level tokenizer of the shapes corpus) and loaded back through `from_pretrained`.
"""

from __future__ import annotations

from pathlib import Path

from mmrl.tiny.components import _prepare_dir, seed_weights, side_effect_free
from mmrl.tiny.vocab import CORPUS_WORDS

# Janus-Pro's special-token strings (deepseek-ai/Janus-Pro-7B tokenizer_config.json)
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
BOI, EOI, IMAGE = "<begin_of_image>", "<end_of_image>", "<image_placeholder>"
UNK = "<unk>"


def _janus_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [UNK, BOS, EOS, PAD, BOI, EOI, IMAGE] + CORPUS_WORDS + [".", ",", ":"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    from tokenizers import AddedToken

    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (BOS, EOS, PAD, BOI, EOI, IMAGE)])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                                   extra_special_tokens={"image_token": IMAGE, "boi_token": BOI, "eoi_token": EOI},
                                   add_bos_token=True)


@side_effect_free
def build_tiny_janus(path, seed: int = 0, image_size: int = 32, patch_size: int = 8, vq_top_width: int = 1,
                     aligner_dim: int = 2048) -> Path:
    """Tiny randomly initialised `JanusForConditionalGeneration` + `JanusProcessor` at `path` (module docstring).
    `vq_top_width`: the VQ-VAE's first channel multiplier (32 x it channels at full resolution). The decoder's last
    GroupNorm has 32 groups and no residual around it: at width 1 every group is one channel, so a one-token image
    (constant feature maps) loses its colour there; width 4 keeps 4-channel directions (mmrl.ar_image.pretrain_tiny).
    `aligner_dim`: the understanding aligner's width (transformers' default 2048, kept so the seeded weights of the
    default build do not change; generation never uses it, and 32 = the Llama width keeps a checkpoint small)."""
    from transformers import (GenerationConfig, JanusConfig, JanusForConditionalGeneration, JanusImageProcessor,
                              JanusProcessor, JanusVisionConfig, JanusVQVAEConfig, LlamaConfig)

    if image_size % patch_size:
        raise ValueError(f"tiny Janus: image_size {image_size} must be a multiple of patch_size {patch_size}")
    path = _prepare_dir(path)
    tok = _janus_tokenizer()
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (("bos", BOS), ("eos", EOS), ("pad", PAD), ("boi", BOI),
                                                               ("image", IMAGE))}
    tokens = (image_size // patch_size) ** 2
    text = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    vision = JanusVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=image_size, patch_size=patch_size, num_image_tokens=tokens,
                               projection_dim=aligner_dim)
    # GroupNorm(32): every VQ-VAE width a multiple of 32; the decoder upsamples by 2 per level after the first
    levels = {8: [1, 1, 1, 1], 16: [1, 1, 1, 1, 1], 4: [1, 1, 1]}.get(patch_size)
    if levels is None:
        raise ValueError(f"tiny Janus: patch_size must be 4, 8 or 16, got {patch_size}")
    levels[0] = vq_top_width
    vq = JanusVQVAEConfig(embed_dim=8, num_embeddings=64, base_channels=32, latent_channels=32,
                          channel_multiplier=levels, num_res_blocks=1, projection_dim=32, image_token_embed_dim=32,
                          num_patches=image_size // patch_size, resolution=image_size)
    seed_weights(seed)
    model = JanusForConditionalGeneration(JanusConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                                      vq_config=vq.to_dict(), image_token_id=ids["image"]))
    model.generation_config = GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                                               pad_token_id=ids["pad"], do_sample=True, top_k=None,
                                               guidance_scale=5.0, generation_kwargs={"boi_token_id": ids["boi"]})
    model.save_pretrained(path)
    image_processor = JanusImageProcessor(size={"height": image_size, "width": image_size})
    JanusProcessor(image_processor=image_processor, tokenizer=tok, num_image_tokens=tokens).save_pretrained(path)
    return path
