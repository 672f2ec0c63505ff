"""Random models of the real architectures (mmrl.perf.architectures; the diffusion families register theirs when
mmrl.diffusion.models is imported) saved as complete pipelines / model directories, so the recipes load them through
the same `from_pretrained(local_path)` path as a downloaded checkpoint.

    build_random_model("sd35_medium", "/tmp/sd35")                 # the 2.24B transformer at real size, random bf16
    build_random_model("sd35_medium", "/tmp/s", small=True)        # the same code path at tiny widths (CPU tests)

The trained model is at its published size (or the given depth). What is around it is smaller than the real thing,
with the widths the trained model needs: text encoders of 2 layers whose outputs have the real widths (they run once
per prompt, outside the training step), the 16-channel VAE of SD3 / FLUX at its real size (tiny with `small`), and
the tiny tokenizers (so text is tokenised into a few hundred ids). Qwen-VL keeps its real vocabulary size (151936
logits) with the tiny tokenizer's special-token ids.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmrl.tiny.components import _prepare_dir, _tiny_clip_text, _tiny_t5_encoder
from mmrl.tiny.vlm_models import _qwen_processor, _qwen_token_ids, _save_vlm
from mmrl.tiny.vocab import _load_tokenizer


def _vae(latent_channels: int, small: bool, scaling: float, shift: float):
    """SD3 / FLUX's 16-channel AutoencoderKL (4 blocks, 128-512 channels, 8x) or a 3-block tiny one (4x)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(1)
    blocks, groups = ((16, 32, 32), 8) if small else ((128, 256, 512, 512), 32)
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels,
                         down_block_types=("DownEncoderBlock2D",) * len(blocks),
                         up_block_types=("UpDecoderBlock2D",) * len(blocks), block_out_channels=blocks,
                         layers_per_block=1 if small else 2, norm_num_groups=groups, sample_size=64 if small else 1024,
                         scaling_factor=scaling, shift_factor=shift, use_quant_conv=False, use_post_quant_conv=False)


def build_random_model(name: str, path, *, small: bool = False, depth: dict | None = None,
                       dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """Write a random `name` (mmrl.perf.architectures) model directory at `path` (see the module docstring)."""
    from mmrl.perf.architectures import get_architecture

    arch = get_architecture(name, small)
    path = _prepare_dir(path)
    if arch.kind == "qwen_vl":
        return _save_qwen_vl(arch, path, depth, dtype, seed)
    if arch.kind not in ("sd3", "flux"):
        raise ValueError(f"build_random_model: no pipeline builder for {name!r} ({arch.kind}) yet; builders: SD3, "
                         f"FLUX.1 and Qwen-VL architectures")
    torch.manual_seed(seed)
    model = arch.build(depth, dtype=dtype)
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, StableDiffusion3Pipeline

    tok, t5_tok = _load_tokenizer("clip"), _load_tokenizer("t5")
    c = model.config
    if arch.kind == "sd3":
        # source: stabilityai/stable-diffusion-3.5-medium vae/ and scheduler/ configs (scaling, shift; shift 3.0)
        first = c.pooled_projection_dim * 3 // 8  # CLIP-L 768 + CLIP-G 1280 = the 2048 pooled width
        pipe = StableDiffusion3Pipeline(
            transformer=model, scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
            vae=_vae(c.in_channels, small, 1.5305, 0.0609),
            text_encoder=_tiny_clip_text(tok, seed + 2, first, first, with_projection=True), tokenizer=tok,
            text_encoder_2=_tiny_clip_text(tok, seed + 3, c.pooled_projection_dim - first,
                                           c.pooled_projection_dim - first, with_projection=True), tokenizer_2=tok,
            text_encoder_3=_tiny_t5_encoder(t5_tok, seed + 4, d_model=c.joint_attention_dim), tokenizer_3=t5_tok)
    else:
        # source: black-forest-labs/FLUX.1-dev vae/ and scheduler/ configs
        pipe = FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                      base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                      max_image_seq_len=4096),
            vae=_vae(c.in_channels // 4, small, 0.3611, 0.1159),
            text_encoder=_tiny_clip_text(tok, seed + 2, c.pooled_projection_dim, None, with_projection=False),
            tokenizer=tok, text_encoder_2=_tiny_t5_encoder(t5_tok, seed + 3, d_model=c.joint_attention_dim),
            tokenizer_2=t5_tok, transformer=model)
    pipe.save_pretrained(path)
    return path


def _save_qwen_vl(arch, path: Path, depth, dtype, seed) -> Path:
    """The VLM with the tiny tokenizer's special-token ids (the real vocabulary size is kept), saved with its
    processor."""
    import transformers

    tok = _load_tokenizer("qwen")
    ids = _qwen_token_ids(tok)
    cfg = arch.model_config(depth)
    cfg.update({k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                    "vision_end_token_id")})
    cfg["text_config"].update(vocab_size=max(len(tok), cfg["text_config"]["vocab_size"]),
                              bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
                              pad_token_id=ids["pad_token_id"])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(seed)
        model = getattr(transformers, arch.class_name)(getattr(transformers, arch.config_class)(**cfg)).eval()
    finally:
        torch.set_default_dtype(previous)
    processor_cls = getattr(transformers, arch.class_name.replace("ForConditionalGeneration", "Processor"))
    return _save_vlm(model, _qwen_processor(processor_cls, tok), ids, path)
