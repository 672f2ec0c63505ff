"""LRM, the noise-aware latent reward model of LPO (Zhang et al. 2025, arXiv 2502.01051): LRM-1.5 (SD1.5 latents).

score = logit_scale.exp() * cos(image_features, text_features), where
- text_features = text_projection(pooled CLIP text output of the prompt),
- image_features = visual_projection([avg-pooled outputs of the UNet's four down blocks (their last resnet) and of its
  mid block]) for the noisy latent x_t at timestep t, the UNet conditioned on the prompt; with `guidance_scale` > 1
  the mid block's pooled output is classifier-free guided (u + w (c - u), u from the empty prompt) and the down
  blocks' are the conditional ones (`multi_scale_cfg=False`, the released LPO configs) or guided too (`True`).
The UNet's up blocks are never run (the authors' `use_up_blocks=False`).
# source: Kwai-Kolors/LPO@9c2e8b8 lpo/lpo/preference_models/models/sd15_preference_model.py (SD15PreferenceModel:
#         get_text_features, get_image_features, get_preference_score, load), configs/lpo_sd-v1-5_*.py

Checkpoint (`weights=`: a local LRM-1.5 directory of HF casiatao/LRM, the authors' `save` layout): `unet/` (diffusers
UNet2DConditionModel), `text_encoder/` (when it was trained; else the base's), `state_dict.pt` ({visual_projection:
{weight}, text_projection: {weight}, logit_scale}). `base=`: the SD1.5 diffusers directory (tokenizer, text encoder).
Input: SD1.5 latents [B, 4, h, w] as the UNet sees them (VAE latent x 0.18215), noisy at `timestep` (default 0: a
final latent; LPO scores x_{t-1} at the step's t; `metadata[i]["timestep"]` per sample overrides it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from mmrl.rewards.base import RewardOutput, register
from mmrl.rewards.image._common import resolve, unique_index
from mmrl.rewards.latent import LatentRewardModel, LatentSpace

WHAT = "lpo_lrm"
DOWNLOAD = "an LRM-1.5 directory of 'casiatao/LRM'"
BASE_DOWNLOAD = "'runwayml/stable-diffusion-v1-5' (a diffusers directory)"
STAGES = (2, 5, 8, 11)  # the down-block samples the head reads (SD1.5: each block's last resnet; authors' indices)


class _MidReached(Exception):
    """Raised by the mid block's hook: the forward stops before the up blocks."""


class LRMHead(nn.Module):
    """`state_dict.pt`'s projections and logit scale."""

    def __init__(self, visual_dim: int, text_dim: int, projection_dim: int):
        super().__init__()
        self.visual_projection = nn.Linear(visual_dim, projection_dim, bias=False)
        self.text_projection = nn.Linear(text_dim, projection_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.zeros([]))


def unet_features(unet: nn.Module, latents, timesteps, encoder_hidden_states) -> tuple[torch.Tensor, list]:
    """(mid block output, the down path's samples: conv_in's output then every down block's res samples), from
    diffusers' own UNet forward stopped after the mid block."""
    samples: list[torch.Tensor] = []
    mid: list[torch.Tensor] = []

    def on_mid(_m, _i, out):
        mid.append(out)
        raise _MidReached

    hooks = [unet.conv_in.register_forward_hook(lambda _m, _i, out: samples.append(out))]
    hooks += [b.register_forward_hook(lambda _m, _i, out: samples.extend(out[1])) for b in unet.down_blocks]
    hooks.append(unet.mid_block.register_forward_hook(on_mid))
    try:
        unet(latents, timesteps, encoder_hidden_states=encoder_hidden_states, return_dict=False)
    except _MidReached:
        pass
    finally:
        for h in hooks:
            h.remove()
    return mid[0], samples


@register("lpo_lrm")
class LPOLRM(LatentRewardModel):
    """LPO's LRM-1.5: SD1.5 (noisy) latents + prompt -> preference score, no VAE decode (latent reward)."""

    name = "lpo_lrm"
    unit = "LRM logit"

    def __init__(self, weights: Any = None, base: Any = None, *, timestep: int = 0, guidance_scale: float = 7.5,
                 multi_scale_cfg: bool = False, batch_size: int = 8, device: Any = None, dtype: Any = "float32",
                 trust_pickle: bool = False):
        from diffusers import UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTokenizer

        from mmrl.rewards.image._common import require_path

        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"{WHAT}: batch_size must be >= 1, got {batch_size}")
        self.device, self.dtype = resolve(device, dtype)
        weights = require_path(weights, WHAT, DOWNLOAD, kind="dir")
        base = require_path(base, f"{WHAT} base", BASE_DOWNLOAD, kind="dir")
        for need in (weights / "unet" / "config.json", weights / "state_dict.pt", base / "tokenizer"):
            if not need.exists():
                raise FileNotFoundError(f"{WHAT}: '{need}' not found; weights= must hold unet/ and state_dict.pt "
                                        f"(LPO's SD15PreferenceModel.save), base= the SD1.5 tokenizer/ and text_encoder/")
        self.tokenizer = CLIPTokenizer.from_pretrained(str(base / "tokenizer"))
        text = weights / "text_encoder" if (weights / "text_encoder").is_dir() else base / "text_encoder"
        self.text_encoder = CLIPTextModel.from_pretrained(str(text), dtype=self.dtype)
        self.unet = UNet2DConditionModel.from_pretrained(str(weights / "unet"), dtype=self.dtype)
        state = _load_lrm_state(weights / "state_dict.pt", trust_pickle)
        vis, txt = state["visual_projection"]["weight"], state["text_projection"]["weight"]
        self.head = LRMHead(vis.shape[1], txt.shape[1], vis.shape[0])
        self.head.visual_projection.weight.data.copy_(vis)
        self.head.text_projection.weight.data.copy_(txt)
        self.head.logit_scale.data.copy_(torch.as_tensor(state["logit_scale"], dtype=torch.float32).reshape([]))
        self.head.to(dtype=self.dtype)
        for m in (self.text_encoder, self.unet, self.head):
            m.eval().requires_grad_(False).to(device=self.device)
        self.latent_space = LatentSpace("sd15", int(self.unet.config.in_channels))
        self.timestep, self.guidance_scale = int(timestep), float(guidance_scale)
        self.multi_scale_cfg = bool(multi_scale_cfg)

    @classmethod
    def latent_space_of(cls, weights: Any = None, **_: Any) -> LatentSpace | None:
        import json

        try:
            config = json.loads((Path(weights).expanduser() / "unet" / "config.json").read_text())
            return LatentSpace("sd15", int(config["in_channels"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def to(self, device: Any) -> "LPOLRM":
        self.device = resolve(device, self.dtype)[0]
        for m in (self.text_encoder, self.unet, self.head):
            m.to(self.device)
        return self

    def _ids(self, prompts: list[str]) -> torch.Tensor:
        return self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                              truncation=True, return_tensors="pt").input_ids.to(self.device)

    @torch.no_grad()
    def score_latents(self, latents, prompts, metadata):
        n = latents.shape[0]
        uniq, idx = unique_index(prompts)
        hidden, pooled = self.text_encoder(self._ids(uniq), return_dict=False)[:2]
        hidden, pooled = hidden[idx.to(hidden.device)], pooled[idx.to(pooled.device)]
        text = self.head.text_projection(pooled)
        t = torch.tensor([int((m or {}).get("timestep", self.timestep)) for m in (metadata or [None] * n)],
                         device=self.device)
        x = latents.to(self.device, self.dtype)
        cfg = self.guidance_scale > 1.0
        if cfg:  # [conditional rows; unconditional rows] as the authors concatenate them
            empty = self.text_encoder(self._ids([""]), return_dict=False)[0].expand(n, -1, -1)
            hidden, x, t = torch.cat([hidden, empty]), torch.cat([x, x]), torch.cat([t, t])
        mid, samples = unet_features(self.unet, x, t, hidden)
        pooled_stages = [samples[i].mean(dim=(2, 3)) for i in STAGES] + [mid.mean(dim=(2, 3))]
        if cfg:
            guided = lambda p: p[n:] + self.guidance_scale * (p[:n] - p[n:])  # noqa: E731
            pooled_stages = [guided(p) if (k == len(STAGES) or self.multi_scale_cfg) else p[:n]
                             for k, p in enumerate(pooled_stages)]
        image = self.head.visual_projection(torch.cat(pooled_stages, dim=-1))
        image = image / image.norm(dim=-1, keepdim=True)
        text = text / text.norm(dim=-1, keepdim=True)
        cos = (image * text).sum(-1)
        scores = self.head.logit_scale.exp() * cos
        return RewardOutput(scores.float(), {"cosine": cos.float(), "timestep": t[:n].cpu()})


def _load_lrm_state(path: Path, trust_pickle: bool) -> dict:
    """`state_dict.pt`: {visual_projection: {weight}, text_projection: {weight}, logit_scale}; one line otherwise."""
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=not trust_pickle)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one line
        raise ValueError(f"{WHAT}: cannot read '{path}' ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") \
            from None
    ok = (isinstance(obj, dict) and all(isinstance(obj.get(k), dict) and "weight" in obj[k]
                                        for k in ("visual_projection", "text_projection")) and "logit_scale" in obj)
    if not ok:
        raise ValueError(f"{WHAT}: '{path}' is not LPO's state_dict.pt: expected keys visual_projection.weight, "
                         f"text_projection.weight, logit_scale, got {sorted(obj) if isinstance(obj, dict) else type(obj)}")
    return obj
