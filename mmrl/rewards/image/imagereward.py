"""ImageReward (Xu et al. 2023): BLIP ViT-L/16 image encoder + BERT ("med") text encoder with cross-attention to
the image tokens, then an MLP on the [CLS] output; the released `ImageReward.pt` holds all of it.

score = (mlp(text_encoder(prompt, image)[:, 0]) - 0.16717362830052426) / 1.0333394966054072 (roughly N(0,1)
over generated images; higher = preferred).
# source: THUDM/ImageReward ImageReward/ImageReward.py (ImageReward.score: [CLS] not replaced by [ENC],
#         padding to 35 tokens, MLP as improved-aesthetic-predictor's, mean/std constants)

The networks are transformers' own BLIP classes (`BlipVisionModel`, `BlipTextModel` with cross-attention,
the classes `BlipForImageTextRetrieval` is made of); `ImageReward.pt`'s keys are mapped onto them:
  blip.visual_encoder.{cls_token, pos_embed, patch_embed.proj, blocks.i.{norm1, attn.qkv, attn.proj, norm2,
  mlp.fc1, mlp.fc2}, norm}  ->  {embeddings.class_embedding, embeddings.position_embedding,
  embeddings.patch_embedding, encoder.layers.i.{layer_norm1, self_attn.qkv, self_attn.projection, layer_norm2,
  mlp.fc1, mlp.fc2}, post_layernorm}
  blip.text_encoder.*  ->  the same names (BLIP's med.py BertModel and BlipTextModel share them)
  mlp.layers.{0,2,4,6,7}  ->  the MLP
`blip.vision_proj`, `blip.text_proj` and `embeddings.position_ids` are not used by the score and are skipped.
Weights: `ImageReward.pt` from the Hugging Face repository `THUDM/ImageReward`, plus a local
`bert-base-uncased` tokenizer directory (`tokenizer=`); [DEC] and [ENC] are added to it as BLIP does, giving
the 30524-token vocabulary of the checkpoint.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from mmrl.rewards.base import RewardOutput, register
from mmrl.rewards.image._common import (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, TorchImageReward, check_prompts,
                                        load_state_dict_file, load_strict, normalize, require_path,
                                        resize_shortest_center_crop, unique_index)
from mmrl.rewards.image.aesthetic import build_aesthetic_mlp

# source: ImageReward BLIP_Pretrain(vit="large") -> BLIP create_vit("large"): ViT-L/16, LayerNorm eps 1e-6
VISION_CONFIG = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                     image_size=224, patch_size=16, layer_norm_eps=1e-6, hidden_act="gelu")
# source: THUDM/ImageReward med_config.json (bert-base sizes, 30522 + [DEC] + [ENC] tokens)
TEXT_CONFIG = dict(vocab_size=30524, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                   num_attention_heads=12, max_position_embeddings=512, layer_norm_eps=1e-12, hidden_act="gelu",
                   pad_token_id=0)
REWARD_MEAN, REWARD_STD = 0.16717362830052426, 1.0333394966054072
MAX_TEXT_LEN = 35

_VISION_RULES = [
    (r"cls_token", "embeddings.class_embedding"),
    (r"pos_embed", "embeddings.position_embedding"),
    (r"patch_embed\.proj\.(weight|bias)", r"embeddings.patch_embedding.\1"),
    (r"blocks\.(\d+)\.norm1\.(weight|bias)", r"encoder.layers.\1.layer_norm1.\2"),
    (r"blocks\.(\d+)\.norm2\.(weight|bias)", r"encoder.layers.\1.layer_norm2.\2"),
    (r"blocks\.(\d+)\.attn\.qkv\.(weight|bias)", r"encoder.layers.\1.self_attn.qkv.\2"),
    (r"blocks\.(\d+)\.attn\.proj\.(weight|bias)", r"encoder.layers.\1.self_attn.projection.\2"),
    (r"blocks\.(\d+)\.mlp\.(fc1|fc2)\.(weight|bias)", r"encoder.layers.\1.mlp.\2.\3"),
    (r"norm\.(weight|bias)", r"post_layernorm.\1"),
]


def map_imagereward_state_dict(state: dict[str, torch.Tensor]) -> tuple[dict, dict, dict, list[str]]:
    """Split an `ImageReward.pt` state dict into (vision, text, mlp) state dicts in transformers / MLP names.
    Returns also the keys that were skipped (projections, position_ids, anything outside these modules)."""
    vision, text, mlp, skipped = {}, {}, {}, []
    for key, value in state.items():
        if key.startswith("blip.visual_encoder."):
            sub = key[len("blip.visual_encoder."):]
            for pattern, repl in _VISION_RULES:
                if re.fullmatch(pattern, sub):
                    vision[re.sub(pattern, repl, sub)] = value
                    break
            else:
                raise ValueError(f"imagereward: unknown vision key '{key}' (not a BLIP ViT parameter)")
        elif key.startswith("blip.text_encoder."):
            sub = key[len("blip.text_encoder."):]
            if sub.endswith("position_ids"):
                skipped.append(key)
            else:
                text[sub] = value
        elif key.startswith("mlp."):
            mlp[key[len("mlp."):]] = value
        else:
            skipped.append(key)
    return vision, text, mlp, skipped


@register("imagereward")
class ImageReward(TorchImageReward):
    name = "imagereward"
    needs_prompts = True

    def __init__(self, weights: Any = None, tokenizer: Any = None, *, med_config: Any = None,
                 vision_config: dict | None = None, batch_size: int = 16, device: Any = None,
                 dtype: Any = "float32", differentiable: bool = False, trust_pickle: bool = False):
        super().__init__(batch_size, device, dtype, differentiable)
        from transformers import BertTokenizerFast, BlipTextConfig, BlipVisionConfig
        from transformers.models.blip.modeling_blip import BlipVisionModel
        from transformers.models.blip.modeling_blip_text import BlipTextModel

        path = require_path(weights, "imagereward", "'ImageReward.pt' from 'THUDM/ImageReward'", kind="file")
        tok_dir = require_path(tokenizer, "imagereward tokenizer", "'bert-base-uncased' (tokenizer files)", kind="dir")
        vcfg = {**VISION_CONFIG, **(vision_config or {})}
        tcfg = dict(TEXT_CONFIG)
        if med_config is not None:
            med = med_config if isinstance(med_config, dict) else json.loads(
                require_path(med_config, "imagereward med_config", "'med_config.json' from 'THUDM/ImageReward'",
                             kind="file").read_text())
            tcfg.update({k: med[k] for k in TEXT_CONFIG if k in med})

        # source: BLIP init_tokenizer(): bert-base-uncased + bos [DEC] + additional special token [ENC]
        self.tokenizer = BertTokenizerFast.from_pretrained(str(tok_dir), local_files_only=True)
        self.tokenizer.add_special_tokens({"bos_token": "[DEC]"})
        self.tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
        if len(self.tokenizer) != tcfg["vocab_size"]:
            raise ValueError(f"imagereward: tokenizer at '{tok_dir}' has {len(self.tokenizer)} tokens with [DEC]/[ENC] "
                             f"added, the text encoder expects {tcfg['vocab_size']}; use the bert-base-uncased tokenizer")

        self.vision = BlipVisionModel(BlipVisionConfig(**vcfg))
        self.text = BlipTextModel(BlipTextConfig(**tcfg, encoder_hidden_size=vcfg["hidden_size"], is_decoder=True,
                                                 bos_token_id=self.tokenizer.bos_token_id,
                                                 sep_token_id=self.tokenizer.sep_token_id),
                                  add_pooling_layer=False)
        vision_sd, text_sd, mlp_sd, self.skipped_keys = map_imagereward_state_dict(
            load_state_dict_file(path, "imagereward", trust_pickle))
        hint = "check vision_config / med_config"
        load_strict(self.vision, vision_sd, "imagereward vision encoder (blip.visual_encoder.*)", path, hint)
        load_strict(self.text, text_sd, "imagereward text encoder (blip.text_encoder.*)", path, hint)
        self.mlp = build_aesthetic_mlp(mlp_sd, "imagereward")
        if self.mlp[0].in_features != tcfg["hidden_size"]:
            raise ValueError(f"imagereward: MLP input {self.mlp[0].in_features} != text hidden size {tcfg['hidden_size']}")
        self.image_size = int(vcfg["image_size"])
        self._freeze()
        self.mlp.float()  # the head runs in float32 as upstream does (`txt_features.float()`)

    def modules(self):
        return [self.vision, self.text, self.mlp]

    def preprocess(self, x: torch.Tensor) -> torch.Tensor:
        # source: ImageReward _transform(224): Resize(224, bicubic) + CenterCrop(224) + OpenAI CLIP mean/std
        s = self.image_size
        return normalize(resize_shortest_center_crop(x, s, (s, s)), OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)

    def _score(self, x, prompts, metadata):
        prompts = check_prompts(prompts, self.name)
        image_embeds = self.vision(pixel_values=self.preprocess(x).to(self.dtype)).last_hidden_state
        uniq, idx = unique_index(prompts)
        tok = self.tokenizer(uniq, padding="max_length", truncation=True, max_length=MAX_TEXT_LEN, return_tensors="pt")
        idx = idx.to(x.device)
        out = self.text(input_ids=tok["input_ids"].to(x.device)[idx], attention_mask=tok["attention_mask"].to(x.device)[idx],
                        encoder_hidden_states=image_embeds,
                        encoder_attention_mask=torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=x.device))
        feats = out.last_hidden_state[:, 0, :].float()
        raw = self.mlp(feats).squeeze(-1)
        return RewardOutput((raw - REWARD_MEAN) / REWARD_STD, {})
