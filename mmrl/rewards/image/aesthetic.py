"""LAION improved aesthetic predictor (Schuhmann 2022): an MLP on the unit-normalised CLIP ViT-L/14 image
embedding, trained with MSE on 1-10 ratings (SAC + LAION-Logos + AVA); scores about 1-10 (most photos 4-7).
# source: christophschuhmann/improved-aesthetic-predictor simple_inference.py (MLP, normalized embedding)

MLP (`sac+logos+ava1-l14-linearMSE.pth`, keys `layers.{0,2,4,6,7}.{weight,bias}`): Linear 768->1024,
Dropout, 1024->128, Dropout, 128->64, Dropout, 64->16, 16->1, no activations. The ReLU variant
(`...-reluMSE.pth`, keys `layers.{0,3,6,9,11}`) is recognised from its keys too.
Weights: the .pth from that repository, plus a local `openai/clip-vit-large-patch14` directory (`clip=`;
the same network as OpenAI `clip.load("ViT-L/14")` the predictor was trained on).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mmrl.rewards.base import RewardOutput, register
from mmrl.rewards.image._common import HFClip, TorchImageReward, load_state_dict_file, require_path

# Sequential index layouts of the two released MLPs: linear layer positions, and the module list
_LINEAR_IDX = [0, 2, 4, 6, 7]
_RELU_IDX = [0, 3, 6, 9, 11]


def build_aesthetic_mlp(state: dict[str, torch.Tensor], what: str = "aesthetic") -> nn.Sequential:
    """nn.Sequential matching the state dict's `layers.N.*` layout (linear or ReLU variant), weights loaded."""
    state = {k[len("layers."):] if k.startswith("layers.") else k: v for k, v in state.items()}
    idx = sorted({int(k.split(".")[0]) for k in state if k.split(".")[0].isdigit()})
    if idx == _LINEAR_IDX:
        drop = {1: 0.2, 3: 0.2, 5: 0.1}
        relu: set[int] = set()
    elif idx == _RELU_IDX:
        drop = {2: 0.2, 5: 0.2, 8: 0.1}
        relu = {1, 4, 7, 10}
    else:
        raise ValueError(f"{what}: MLP state dict has layers {idx}; expected layers.{_LINEAR_IDX} "
                         f"(linearMSE) or layers.{_RELU_IDX} (reluMSE) with .weight/.bias")
    mods: list[nn.Module] = []
    for i in range(idx[-1] + 1):
        if i in idx:
            w = state.get(f"{i}.weight")
            if w is None or w.dim() != 2 or f"{i}.bias" not in state:
                raise ValueError(f"{what}: MLP layer {i} needs 2-D 'layers.{i}.weight' and 'layers.{i}.bias'")
            mods.append(nn.Linear(w.shape[1], w.shape[0]))
        elif i in relu:
            mods.append(nn.ReLU())
        else:
            mods.append(nn.Dropout(drop.get(i, 0.0)))
    mlp = nn.Sequential(*mods)
    try:
        mlp.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"{what}: MLP weights do not chain: {str(exc).splitlines()[-1][:200]}") from None
    if mlp[idx[-1]].out_features != 1:
        raise ValueError(f"{what}: last MLP layer must output 1 value, got {mlp[idx[-1]].out_features}")
    return mlp


@register("aesthetic")
class LaionAesthetic(TorchImageReward):
    name = "aesthetic"

    def __init__(self, weights: Any = None, clip: Any = None, *, batch_size: int = 32, device: Any = None,
                 dtype: Any = "float32", differentiable: bool = False, trust_pickle: bool = False):
        super().__init__(batch_size, device, dtype, differentiable)
        mlp_path = require_path(weights, "aesthetic", "'sac+logos+ava1-l14-linearMSE.pth' from "
                                "github.com/christophschuhmann/improved-aesthetic-predictor", kind="file")
        clip_dir = require_path(clip, "aesthetic CLIP", "'openai/clip-vit-large-patch14'", kind="dir")
        self.mlp = build_aesthetic_mlp(load_state_dict_file(mlp_path, "aesthetic", trust_pickle))
        self.clip = HFClip(clip_dir, clip_dir, "aesthetic", "'openai/clip-vit-large-patch14'")
        dim, want = self.clip.model.config.projection_dim, self.mlp[0].in_features
        if dim != want:
            raise ValueError(f"aesthetic: the MLP expects {want}-d CLIP embeddings (ViT-L/14: 768) but the CLIP "
                             f"at '{clip_dir}' projects to {dim}")
        self._freeze()

    def modules(self):
        return [self.clip.model, self.mlp]

    def _score(self, x, prompts, metadata):
        emb = self.clip.image_embeds(x)  # model dtype; the MLP shares it
        return RewardOutput(self.mlp(emb).squeeze(-1).float(), {})
