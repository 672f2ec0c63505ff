"""Tiny latent rewards saved in their authors' checkpoint layouts (`mmrl.rewards.latent_dina`, `latent_lpo`).

`build_tiny_dina_lrm(path)`: `path/base/` a tiny SD3.5-style pipeline (`build_tiny_sd3` with 3 blocks, RMS q/k norm
and dual attention, 4 latent channels: the tiny SD3 policy's latent space) and the DiNa-LRM layout of
liuhuohuo/DiNa-LRM-SD35M-12layers: `config.json` (the training config's `model:` / `training:` sections, 2 blocks
read instead of 12, features after blocks [1, 2] instead of [4, 8, 12], `backbone_model_id` = `path/base`),
`checkpoint/backbone_lora/` (PEFT adapter of the backbone, saved by PEFT's save_pretrained as the authors' trainer
does) and `checkpoint/rm_head.pt` (the head's state dict). Every weight is random, including the ones the authors
initialise at zero (LoRA B, the FiLM modulation, the value gates), so every path of the scoring changes the score.

`build_tiny_lpo_lrm(path)`: LPO's LRM-1.5 layout on a tiny SD1.5-layout base (its docstring).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mmrl.tiny.components import _prepare_dir, seed_weights, side_effect_free
from mmrl.tiny.diffusion_models import build_tiny_sd3

# the sections of the authors' config/sd3m/thurstone-12layer.yaml the reward reads, at tiny sizes
DINA_MODEL_CONFIG = {
    "model_type": "thurstone", "num_transformer_layers": 2, "freeze_backbone": False, "use_ema": True,
    "ema_decay": 0.995, "use_lora": True, "use_text_features": True,
    "lora_config": {"r": 4, "lora_alpha": 8, "init_lora_weights": "gaussian"},
    "use_logistic": False, "visual_head_idx": [1, 2], "text_head_idx": [1, 2], "use_t_embed": True,
    "reward_head": {"use_proj_in": False, "width": -1, "out_dim": 1, "num_queries": 4, "num_attn_heads": 8,
                    "dropout": 0.0},
}


@side_effect_free
def build_tiny_dina_lrm(path, seed: int = 0) -> Path:
    """Tiny DiNa-LRM checkpoint + its tiny SD3 base at ``path`` (module docstring); returns ``path``."""
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig, get_peft_model

    from mmrl.rewards.latent_dina import LORA_TARGETS, DiNaModel

    path = _prepare_dir(path)
    base = build_tiny_sd3(path / "base", seed=seed, num_layers=3, sd35=True)
    cfg = {"model": {**DINA_MODEL_CONFIG, "backbone_model_id": str(base.resolve())},
           "training": {"add_noise": True}}
    (path / "config.json").write_text(json.dumps(cfg, indent=4))
    model = DiNaModel(SD3Transformer2DModel.from_pretrained(str(base / "transformer")), cfg["model"])
    lora = cfg["model"]["lora_config"]
    seed_weights(seed + 10)
    backbone = get_peft_model(model.backbone, LoraConfig(r=lora["r"], lora_alpha=lora["lora_alpha"],
                                                         init_lora_weights=lora["init_lora_weights"],
                                                         target_modules=LORA_TARGETS))
    with torch.no_grad():
        for name, p in backbone.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
        for p in model.reward_head.parameters():
            p.normal_(0.0, 0.3)
    ckpt = path / "checkpoint"
    backbone.save_pretrained(str(ckpt / "backbone_lora"))
    torch.save(model.reward_head.state_dict(), ckpt / "rm_head.pt")
    return path


@side_effect_free
def build_tiny_lpo_lrm(path, seed: int = 0) -> Path:
    """Tiny LPO LRM-1.5 at ``path``: ``path/base/`` a tiny SD1.5-layout pipeline directory (tokenizer, CLIP text
    encoder, UNet with SD1.5's four down blocks of two resnets (channels 8/16/32/32), DDPM scheduler, VAE) and the
    authors' `save` layout: ``unet/`` (the base UNet perturbed), ``text_encoder/``, ``state_dict.pt``
    (visual_projection [16, 120] over the pooled 8 + 16 + 32 + 32 down and 32 mid channels, text_projection [16, 32],
    logit_scale 2.6592, CLIP's initial value)."""
    from diffusers import DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    from mmrl.tiny.components import _tiny_clip_text, _tiny_vae
    from mmrl.tiny.vocab import _load_tokenizer

    path = _prepare_dir(path)
    tok = _load_tokenizer("clip")
    seed_weights(seed)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(8, 16, 32, 32),
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, cross_attention_dim=32, attention_head_dim=4,
        norm_num_groups=4)
    text = _tiny_clip_text(tok, seed + 2, 32, None, with_projection=False)
    pipe = StableDiffusionPipeline(vae=_tiny_vae(seed + 1), text_encoder=text, tokenizer=tok, unet=unet,
                                   scheduler=DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear",
                                                           beta_start=0.00085, beta_end=0.012,
                                                           clip_sample=False, steps_offset=1),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(path / "base")
    seed_weights(seed + 20)
    with torch.no_grad():
        for p in list(unet.parameters()) + list(text.parameters()):
            p.add_(0.05 * torch.randn_like(p))
    unet.save_pretrained(path / "unet")
    text.save_pretrained(path / "text_encoder")
    torch.save({"visual_projection": {"weight": 0.1 * torch.randn(16, 120)},
                "text_projection": {"weight": 0.1 * torch.randn(16, 32)},
                "logit_scale": torch.tensor(2.6592)}, path / "state_dict.pt")
    return path
