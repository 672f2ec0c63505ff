"""Pieces the tiny builders share: the output directory, a parameter count, the random-state isolation every
builder runs under, and the small VAE / CLIP text / T5 encoders of the diffusion pipelines."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np
import torch

F = TypeVar("F", bound=Callable)


def side_effect_free(build: F) -> F:
    """Run a tiny builder on a private random state: the CPU torch generator (seeded inside the builder with
    `seed_weights`), Python's `random` and numpy's global state are restored when it returns, so building a model
    changes nothing a caller seeded. Why: a recipe that builds its missing tiny model after seeding (`model.build_tiny`)
    would otherwise draw its LoRA init and rollouts from the builder's generator, and differ from every later run
    of the same command that finds the model on disk. CUDA generators are never touched (builders seed the CPU
    generator only; `torch.manual_seed` would also queue a CUDA seed)."""

    @functools.wraps(build)
    def wrapper(*args, **kwargs):
        py_state, np_state = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[]):
                return build(*args, **kwargs)
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)

    return wrapper  # type: ignore[return-value]


def seed_weights(seed: int) -> None:
    """Seed the CPU generator the weight initialisers draw from (not CUDA's: see `side_effect_free`)."""
    torch.default_generator.manual_seed(seed)


def count_parameters(module: torch.nn.Module) -> int:
    """Number of parameters of ``module`` (trainable or not)."""
    return sum(p.numel() for p in module.parameters())


def _tiny_vae(seed: int):
    """AutoencoderKL with 3 blocks (16/32/32 channels): 64x64x3 image <-> 4x16x16 latent.

    SD3-style: no quant convs; scaling 1, shift 0 so latents are the raw posterior.
    """
    from diffusers import AutoencoderKL

    seed_weights(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 32), layers_per_block=1, norm_num_groups=8, sample_size=64,
        scaling_factor=1.0, shift_factor=0.0, use_quant_conv=False, use_post_quant_conv=False,
    )


def _tiny_clip_text(tokenizer, seed: int, hidden: int, projection_dim: int | None, with_projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        projection_dim=projection_dim or hidden, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=77, hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    seed_weights(seed)
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return cls(cfg).eval()


def _tiny_t5_encoder(tokenizer, seed: int, d_model: int = 32):
    """T5 v1.1-style encoder (gated-gelu, like SD3's / FLUX's T5-XXL) with d_model 32."""
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(
        vocab_size=len(tokenizer), d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu", dropout_rate=0.0, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    seed_weights(seed)
    return T5EncoderModel(cfg).eval()


def _prepare_dir(path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return path
