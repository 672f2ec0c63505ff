"""Tiny diffusion pipelines: ``StableDiffusion3Pipeline``, ``FluxPipeline`` (FLUX.1-dev layout) and
``FluxKontextPipeline`` (FLUX.1 Kontext-dev layout)."""

from __future__ import annotations

from pathlib import Path

from mmrl.tiny.components import (_prepare_dir, _tiny_clip_text, _tiny_t5_encoder, _tiny_vae, seed_weights,
                                   side_effect_free)
from mmrl.tiny.vocab import _load_tokenizer


@side_effect_free
def build_tiny_sd3(path, seed: int = 0, sample_size: int = 16, num_layers: int = 2, sd35: bool = False) -> Path:
    """Tiny ``StableDiffusion3Pipeline`` (transformer, VAE, 2 CLIP encoders, T5 encoder) at ``path``.

    Sizes (CALIBRATION.md): SD3Transformer2DModel patch 2, 4 in/out channels, 2 layers, 2 heads x 16,
    joint_attention_dim = caption_projection_dim = pooled_projection_dim = 32. The two CLIP text
    encoders have hidden 16 and projection 16 each, so the concatenated CLIP prompt embeds (16 + 16
    channels) and pooled embeds (16 + 16) are exactly 32 wide; the T5 encoder has d_model 32 = joint_attention_dim
    (it is included because ``from_pretrained`` of a directory without it fails unless the caller
    passes ``text_encoder_3=None, tokenizer_3=None``). 64x64 images <-> 4x16x16 latents.
    ``num_layers`` / ``sd35`` (SD3.5-Medium's RMS q/k norm and dual attention in every block but the last): the
    base of the tiny latent rewards (`mmrl.tiny.latent_rewards`), which needs blocks after the ones it reads.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    if sample_size <= 0 or sample_size % 2:
        raise ValueError(f"build_tiny_sd3: sample_size (latent side) must be a positive multiple of the "
                         f"patch size 2, got {sample_size}")
    path = _prepare_dir(path)
    tok, t5_tok = _load_tokenizer("clip"), _load_tokenizer("t5")
    seed_weights(seed)
    transformer = SD3Transformer2DModel(
        sample_size=sample_size, patch_size=2, in_channels=4, num_layers=num_layers, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
        pooled_projection_dim=32, out_channels=4, pos_embed_max_size=max(32, sample_size // 2),
        **({"qk_norm": "rms_norm", "dual_attention_layers": tuple(range(num_layers - 1))} if sd35 else {}),
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=_tiny_vae(seed + 1),
        text_encoder=_tiny_clip_text(tok, seed + 2, 16, 16, with_projection=True),
        tokenizer=tok,
        text_encoder_2=_tiny_clip_text(tok, seed + 3, 16, 16, with_projection=True),
        tokenizer_2=tok,
        text_encoder_3=_tiny_t5_encoder(t5_tok, seed + 4, d_model=32),
        tokenizer_3=t5_tok,
    )
    pipe.save_pretrained(path)
    return path


@side_effect_free
def build_tiny_flux(path, seed: int = 0) -> Path:
    """Tiny ``FluxPipeline`` (FLUX.1-dev layout) at ``path``.

    FluxTransformer2DModel: in_channels 16 (4 latent channels x 2x2 packing), 1 double + 1 single
    block, 2 heads x 16 (rope axes 4+6+6), joint_attention_dim 32 = T5 d_model, pooled_projection_dim
    32 = CLIP hidden, ``guidance_embeds=True`` like FLUX.1-dev (the guidance-distilled model RL papers
    fine-tune; pass ``guidance_scale``). Scheduler: FLUX.1-dev's dynamic-shift flow-matching Euler.
    """
    from diffusers import FluxPipeline

    path = _prepare_dir(path)
    FluxPipeline(**_flux_parts(seed)).save_pretrained(path)
    return path


@side_effect_free
def build_tiny_flux_kontext(path, seed: int = 0) -> Path:
    """Tiny ``FluxKontextPipeline`` (FLUX.1 Kontext-dev layout: the FLUX.1-dev parts, the source image's latents
    appended to the sequence) at ``path``; the same sizes as :func:`build_tiny_flux`, no image encoder."""
    from diffusers import FluxKontextPipeline

    path = _prepare_dir(path)
    FluxKontextPipeline(**_flux_parts(seed)).save_pretrained(path)
    return path


def _flux_parts(seed: int, vae=None, num_layers: int = 1, num_single_layers: int = 1, heads: int = 2) -> dict:
    """The components of a tiny FLUX.1 pipeline (keyword arguments of FluxPipeline / FluxKontextPipeline)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    tok, t5_tok = _load_tokenizer("clip"), _load_tokenizer("t5")
    seed_weights(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=16, num_attention_heads=heads, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6),
    )
    # source: black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json (Kontext-dev ships the same)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    return dict(scheduler=scheduler, vae=vae if vae is not None else _tiny_vae(seed + 1),
                text_encoder=_tiny_clip_text(tok, seed + 2, 32, None, with_projection=False), tokenizer=tok,
                text_encoder_2=_tiny_t5_encoder(t5_tok, seed + 3, d_model=32), tokenizer_2=t5_tok,
                transformer=transformer)
