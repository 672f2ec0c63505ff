"""Tiny CLIP-family reward backbones: transformers ``CLIPModel`` and open_clip ``CLIP`` (with an HPS-style copy)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mmrl.tiny.components import _prepare_dir, seed_weights, side_effect_free
from mmrl.tiny.vocab import _load_tokenizer

# source: OpenAI CLIP preprocessing constants (also transformers OPENAI_CLIP_MEAN / _STD)
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


@side_effect_free
def build_tiny_clip(path, seed: int = 0) -> Path:
    """Tiny transformers ``CLIPModel`` + ``CLIPProcessor`` at ``path`` (PickScore / CLIP-score layout).

    Text and vision towers: hidden 32, 2 layers, 2 heads; 32x32 images in 8x8 patches; projection 16.
    The processor resizes the shortest edge to 32, centre-crops 32x32 and normalises with CLIP's
    real mean/std; the tokenizer is the local CLIP BPE.
    """
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    path = _prepare_dir(path)
    tok = _load_tokenizer("clip")
    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=16,
    )
    seed_weights(seed)
    model = CLIPModel(cfg).eval()
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                         do_center_crop=True, image_mean=CLIP_MEAN, image_std=CLIP_STD)
    model.save_pretrained(path)
    CLIPProcessor(image_processor=image_processor, tokenizer=tok).save_pretrained(path)
    return path


# open_clip model configs (the same schema as open_clip/model_configs/*.json)
OPEN_CLIP_CONFIGS = {
    "tiny": {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
        # open_clip's own SimpleTokenizer (BPE file shipped in the wheel) has 49408 tokens: keep width tiny
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 2},
    },
}


@side_effect_free
def build_tiny_open_clip(path, seed: int = 0, arch: str = "tiny") -> Path:
    """Tiny open_clip ``CLIP`` at ``path`` in open_clip's local-dir format, plus an HPS-style copy.

    Writes ``open_clip_config.json`` (``{"model_cfg", "preprocess_cfg"}``), ``open_clip_model.safetensors``
    and ``hps_style.pt`` = ``{"state_dict": state_dict}`` (how HPSv2 checkpoints are stored).
    Load with :func:`load_open_clip` or ``open_clip.create_model_and_transforms("local-dir:" + path)``.
    """
    import open_clip
    from safetensors.torch import save_file

    if arch not in OPEN_CLIP_CONFIGS:
        raise ValueError(f"build_tiny_open_clip: unknown arch {arch!r}; expected one of {sorted(OPEN_CLIP_CONFIGS)}")
    path = _prepare_dir(path)
    model_cfg = json.loads(json.dumps(OPEN_CLIP_CONFIGS[arch]))
    preprocess_cfg = {"size": model_cfg["vision_cfg"]["image_size"], "mean": CLIP_MEAN, "std": CLIP_STD,
                      "interpolation": "bicubic", "resize_mode": "shortest"}
    seed_weights(seed)
    model = open_clip.CLIP(**json.loads(json.dumps(model_cfg)))
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    (path / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}, indent=2) + "\n")
    save_file(sd, str(path / "open_clip_model.safetensors"))
    torch.save({"state_dict": sd}, path / "hps_style.pt")
    return path


def load_open_clip(path, device: str | torch.device = "cpu"):
    """Load a model written by :func:`build_tiny_open_clip` with open_clip's own functions.

    Returns ``(model, preprocess_val, tokenizer)``; nothing is downloaded.
    """
    import open_clip

    path = Path(path)
    if not (path / "open_clip_config.json").is_file():
        raise FileNotFoundError(f"load_open_clip: {path / 'open_clip_config.json'} not found "
                                "(expected a directory written by build_tiny_open_clip)")
    name = f"local-dir:{path}"
    model, _, preprocess_val = open_clip.create_model_and_transforms(name, device=device)
    return model.eval(), preprocess_val, open_clip.get_tokenizer(name)
