"""Human Preference Score v2 / v2.1 (Wu et al. 2023): an open_clip ViT-H-14 fine-tuned on HPD v2.

score = cos(image_features, text_features) of the L2-normalised open_clip features (HPS reports the
diagonal of image @ text.T); real HPSv2 scores sit around 0.2-0.35.
# source: HPSv2 hpsv2/img_score.py (logits_per_image = image_features @ text_features.T, diagonal)
Preprocessing: resize the longer side to 224, pad to a square with black (fill 0), normalise with the
OpenAI mean/std.  # source: HPSv2 hpsv2/src/open_clip/transform.py image_transform(resize_longest_max=True)

The network is built from open_clip's own config for `arch` (default "ViT-H-14") with no pretrained tag, so
nothing is downloaded; then the HPS checkpoint (`{"state_dict": ...}` or a plain state dict, `module.`
prefixes stripped) is loaded strictly. Weights: `HPS_v2_compressed.pt` / `HPS_v2.1_compressed.pt` from the
Hugging Face repository `xswu/HPSv2`. `model_config=` (dict or JSON path, open_clip's format) replaces the
named config, e.g. for a tiny test model. The tokenizer is open_clip's bundled CLIP BPE (offline).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mmrl.rewards.base import RewardOutput, register
from mmrl.rewards.image._common import (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, TorchImageReward, check_prompts,
                                        load_state_dict_file, load_strict, normalize, require_path,
                                        resize_longest_pad, unique_index)


def build_open_clip(arch: str, model_config: Any = None) -> tuple[torch.nn.Module, dict]:
    """open_clip CLIP for `arch` (or an explicit open_clip config dict / JSON file), random weights, no download."""
    import open_clip

    if model_config is None:
        cfg = open_clip.get_model_config(arch)
        if cfg is None:
            raise ValueError(f"hps: unknown open_clip arch '{arch}'; valid: {open_clip.list_models()[:20]}... "
                             "or pass model_config={...}")
    elif isinstance(model_config, dict):
        cfg = dict(model_config)
    else:
        p = Path(model_config)
        if not p.is_file():
            raise FileNotFoundError(f"hps: model_config file '{p}' does not exist")
        cfg = json.loads(p.read_text())
    if isinstance(cfg.get("model_cfg"), dict):  # open_clip local-dir `open_clip_config.json` layout
        cfg = dict(cfg["model_cfg"])
    for key in ("embed_dim", "vision_cfg", "text_cfg"):
        if key not in cfg:
            raise ValueError(f"hps: open_clip model config lacks '{key}' (got keys {sorted(cfg)})")
    kwargs = {k: cfg[k] for k in ("embed_dim", "vision_cfg", "text_cfg", "quick_gelu", "init_logit_scale",
                                   "init_logit_bias") if k in cfg}
    cls = open_clip.CustomTextCLIP if cfg.get("custom_text") or "hf_model_name" in cfg["text_cfg"] else open_clip.CLIP
    return cls(**kwargs), cfg


class HPSv2(TorchImageReward):
    name = "hpsv2"
    needs_prompts = True
    checkpoint_name = "'HPS_v2_compressed.pt' from 'xswu/HPSv2'"

    def __init__(self, weights: Any = None, *, arch: str = "ViT-H-14", model_config: Any = None,
                 batch_size: int = 16, device: Any = None, dtype: Any = "float32", differentiable: bool = False,
                 trust_pickle: bool = False):
        super().__init__(batch_size, device, dtype, differentiable)
        path = require_path(weights, self.name, self.checkpoint_name, kind="file")
        import open_clip

        self.model, cfg = build_open_clip(arch, model_config)
        state = load_state_dict_file(path, self.name, trust_pickle)
        load_strict(self.model, state, self.name, path,
                    hint=f"is it an HPS checkpoint for open_clip arch '{arch}' (or the given model_config)?")
        context = int(cfg["text_cfg"].get("context_length", 77))
        self.tokenizer = (open_clip.get_tokenizer(arch) if model_config is None
                          else open_clip.SimpleTokenizer(context_length=context))
        size = cfg["vision_cfg"].get("image_size", 224)
        self.image_size = int(size[0] if isinstance(size, (list, tuple)) else size)
        self._freeze()

    def modules(self):
        return [self.model]

    def preprocess(self, x: torch.Tensor) -> torch.Tensor:
        return normalize(resize_longest_pad(x, self.image_size, fill=0.0), OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)

    def _score(self, x, prompts, metadata):
        prompts = check_prompts(prompts, self.name)
        img = self.model.encode_image(self.preprocess(x).to(self.dtype), normalize=True)
        uniq, idx = unique_index(prompts)
        txt = self.model.encode_text(self.tokenizer(uniq).to(x.device), normalize=True)[idx.to(x.device)]
        scores = (img * txt).sum(-1)
        return RewardOutput(scores.float(), {})


register("hpsv2")(HPSv2)


@register("hpsv21")
class HPSv21(HPSv2):
    """HPS v2.1: same architecture and formula, checkpoint `HPS_v2.1_compressed.pt`."""

    name = "hpsv21"
    checkpoint_name = "'HPS_v2.1_compressed.pt' from 'xswu/HPSv2'"
