"""Tiny ``LTX2Pipeline`` (LTX-2: text to video with audio): the genuine diffusers / transformers classes at tiny
sizes, saved with ``save_pretrained`` and loaded back by ``from_pretrained`` (the real path).

Consistency rules of the pipeline the sizes follow (checked against diffusers 0.42.1): the connectors read the stack
of every Gemma 3 hidden state (``text_proj_in_factor`` = text layers + 1) of width ``caption_channels`` = the Gemma
hidden size; the transformer's video / audio widths are its heads x head_dim and its cross-attention widths the
connectors'. The tokenizer is the project's tiny T5 vocabulary (the pipeline pads it on the left to
``max_sequence_length``, as it does Gemma's).

Sizes: transformer 2 blocks, video 2 heads x 8 (4 latent channels), audio 2 heads x 4; video VAE with one
spatio-temporal downsample after a 4x4 patch (x8 in space, x2 in time: 2k+1 frames), audio VAE 2 latent channels x
(8 mel bins / 4) = 2; Gemma 3 text model of hidden 16, 2 layers; connectors 2 heads x 8 (= the Gemma width).
32 x 64 px, 5 frames -> video latents [4, 3, 4, 8], audio latents [2, 5, 2] (16 kHz / hop 160 / 4 = 25 audio latents
per second at 24 fps: round(5 / 24 * 25) = 5).
"""

from __future__ import annotations

from pathlib import Path

from mmrl.tiny.components import _prepare_dir, seed_weights, side_effect_free
from mmrl.tiny.vocab import _load_tokenizer


@side_effect_free
def build_tiny_ltx2(path, seed: int = 0) -> Path:
    """Tiny ``LTX2Pipeline`` at ``path``: LTX2VideoTransformer3DModel, AutoencoderKLLTX2Video,
    AutoencoderKLLTX2Audio, LTX2Vocoder, LTX2TextConnectors, Gemma3ForConditionalGeneration, FlowMatchEuler."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2Pipeline, LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    path = _prepare_dir(path)
    tok = _load_tokenizer("t5")
    hidden, layers = 16, 2
    seed_weights(seed + 1)
    text = Gemma3TextConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=32, num_hidden_layers=layers,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=16,
                            max_position_embeddings=256, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                            bos_token_id=tok.pad_token_id)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=16, patch_size=8)
    text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision,
                                                               mm_tokens_per_image=4)).eval()
    seed_weights(seed + 2)
    connectors = LTX2TextConnectors(
        caption_channels=hidden, text_proj_in_factor=layers + 1, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_type="split")
    seed_weights(seed)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=2, caption_channels=hidden, rope_type="split")
    seed_weights(seed + 3)
    vae = AutoencoderKLLTX2Video(
        latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,), layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False), downsample_type=("spatiotemporal",),
        upsample_type=("spatiotemporal",), upsample_residual=(False,), upsample_factor=(2,), patch_size=4,
        patch_size_t=1, decoder_causal=False)
    seed_weights(seed + 4)
    audio_vae = AutoencoderKLLTX2Audio(base_channels=4, ch_mult=(1,), num_res_blocks=1, resolution=32,
                                       latent_channels=2, mel_bins=8)
    seed_weights(seed + 5)
    vocoder = LTX2Vocoder(in_channels=2 * 8, hidden_channels=16, upsample_kernel_sizes=[4, 4],
                          upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                          output_sampling_rate=16000)
    pipe = LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), vae=vae,
                        audio_vae=audio_vae, text_encoder=text_encoder, tokenizer=tok, connectors=connectors,
                        transformer=transformer, vocoder=vocoder)
    pipe.save_pretrained(path)
    return path
