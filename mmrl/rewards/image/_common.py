"""Pieces shared by the learned image rewards: local weight paths, device/dtype, preprocessing as torch ops,
and a transformers-CLIP backbone (PickScore, CLIPScore and the LAION aesthetic predictor all embed with it).

Preprocessing is written with `torch.nn.functional.interpolate(..., antialias=True)` on float [0,1] tensors,
so one code path serves every input form and gradients reach the input image when a reward is
differentiable. Against the reference (PIL / torchvision on uint8 images) it differs only by uint8 rounding (see `_resize`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from mmrl.rewards.base import RewardModel, RewardOutput

# source: OpenAI CLIP (clip/clip.py `_transform`), also transformers OPENAI_CLIP_MEAN/STD
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


# ------------------------------------------------------------------------------------- weights


def require_path(path: Any, what: str, download: str, kind: str = "any") -> Path:
    """Return `path` as a Path if it exists (a directory for kind="dir", a file for kind="file"), else raise
    FileNotFoundError naming the path and what to download. Nothing is ever downloaded here."""
    hint = f"download {download} yourself and pass its local path (nothing is downloaded automatically)"
    if path is None or str(path) == "":
        raise FileNotFoundError(f"{what}: no weights path given; {hint}")
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{what}: weights path '{p}' does not exist; {hint}")
    if kind == "dir" and not p.is_dir():
        raise FileNotFoundError(f"{what}: expected a directory in Hugging Face format at '{p}', got a file; {hint}")
    if kind == "file" and not p.is_file():
        raise FileNotFoundError(f"{what}: expected a weight file at '{p}', got a directory; {hint}")
    return p


def read_json(path: Path, what: str, missing: str) -> Any:
    """The JSON value in the file `path`; FileNotFoundError "{what}: {missing}" when there is no such file, a one-line
    ValueError naming it when it is not JSON."""
    if not path.is_file():
        raise FileNotFoundError(f"{what}: {missing}")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{what}: '{path}' is not valid JSON ({exc})") from None


def load_state_dict_file(path: Path, what: str, trust_pickle: bool = False) -> dict[str, torch.Tensor]:
    """Load a `.safetensors` / `.pt` / `.pth` / `.bin` state dict on CPU. Pickles are read with
    `weights_only=True` unless `trust_pickle=True` (only for files from a source you trust)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=not trust_pickle)
    except Exception as exc:  # pickle with non-tensor objects, truncated file, ...
        from mmrl.run.files import pickle_refusal

        refused = pickle_refusal(exc, path)
        if refused is not None:
            raise ValueError(f"{what}: '{path}' was refused for safety: it is a pickle holding {refused}, which "
                             f"torch.load(weights_only=True) does not load (unpickling it could run code; nothing of "
                             f"it ran); pass trust_pickle=True only if you trust its source") from None
        raise ValueError(f"{what}: cannot read '{path}' as a torch state dict ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200]}); if the file holds more than tensors and you trust "
                         "its source, pass trust_pickle=True") from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{what}: '{path}' is not a state dict (a mapping name -> tensor, or {{'state_dict': ...}}), "
                         f"got {type(obj).__name__}")
    return {(k[len("module."):] if k.startswith("module.") else k): v for k, v in obj.items()}


def load_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str, path: Path, hint: str = "") -> None:
    """`load_state_dict(strict=True)` with an error naming the first missing/unexpected keys and shapes."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k}: expected {tuple(own[k].shape)}, got {tuple(state[k].shape)}"
              for k in own if k in state and own[k].shape != state[k].shape]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing keys (e.g. {missing[:4]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys (e.g. {unexpected[:4]})")
        if shapes:
            parts.append(f"{len(shapes)} shape mismatches (e.g. {shapes[:3]})")
        raise ValueError(f"{what}: checkpoint '{path}' does not fit the model: " + "; ".join(parts) + (f". {hint}" if hint else ""))
    module.load_state_dict(state, strict=True)


# ------------------------------------------------------------------------------------- device / dtype


def resolve(device: Any, dtype: Any) -> tuple[torch.device, torch.dtype]:
    from mmrl.runtime import resolve_device, resolve_dtype

    return resolve_device("auto" if device is None else str(device)), resolve_dtype(dtype or "float32")


# ------------------------------------------------------------------------------------- preprocessing


def _resize(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bicubic antialiased resize of float [0,1] images that reproduces PIL / torchvision on uint8 images up to
    rounding: PIL resizes separably (width pass, then height pass) and saturates to [0, 255] after each pass,
    which matters wherever bicubic overshoots (edges, noise). Plain float interpolation differs from PIL by up
    to 13/255 on noise images; this differs by < 2/255 and stays differentiable (zero gradient where clamped)."""
    h, w = x.shape[-2:]
    nh, nw = size
    if nw != w:
        x = F.interpolate(x, size=(h, nw), mode="bicubic", antialias=True, align_corners=False).clamp(0.0, 1.0)
    if nh != h:
        x = F.interpolate(x, size=(nh, nw), mode="bicubic", antialias=True, align_corners=False).clamp(0.0, 1.0)
    return x


def normalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return (x - m) / s


def resize_shortest_center_crop(x: torch.Tensor, shortest: int, crop: tuple[int, int]) -> torch.Tensor:
    """CLIP preprocessing geometry: resize the shorter side to `shortest` (longer side int(shortest*long/short)),
    then center-crop `crop` = (h, w), zero-padding if the image is smaller.
    # source: transformers get_resize_output_image_size(default_to_square=False) + center_crop; OpenAI CLIP _transform"""
    h, w = x.shape[-2:]
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = shortest, int(shortest * long / short)
    nh, nw = (new_long, new_short) if w <= h else (new_short, new_long)
    x = _resize(x, (nh, nw))
    ch, cw = crop
    if nh < ch or nw < cw:
        ph, pw = max(ch - nh, 0), max(cw - nw, 0)
        x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))
        nh, nw = x.shape[-2:]
    top, left = int(round((nh - ch) / 2.0)), int(round((nw - cw) / 2.0))
    return x[..., top:top + ch, left:left + cw]


def resize_longest_pad(x: torch.Tensor, size: int, fill: float = 0.0) -> torch.Tensor:
    """HPS preprocessing geometry: resize so the longer side is `size` (round(dim*scale)), then pad to a
    `size` x `size` square with `fill` (in [0,1] pixel units, i.e. before normalisation), image centred.
    # source: HPSv2 hpsv2/src/open_clip/transform.py ResizeMaxSize(fill=0) (padding applied always here,
    #         upstream skips it when no resize is needed, which only matters for non-square 224-side inputs)"""
    h, w = x.shape[-2:]
    scale = size / float(max(h, w))
    nh, nw = round(h * scale), round(w * scale)
    x = _resize(x, (nh, nw))
    ph, pw = size - nh, size - nw
    if ph or pw:
        x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2), value=fill)
    return x


# ------------------------------------------------------------------------------------- base class


class TorchImageReward(RewardModel):
    """A reward backed by torch modules: chunked by `batch_size`, on `device` in `dtype`, gradients to the input
    image when `differentiable=True` (model weights stay frozen either way)."""

    def __init__(self, batch_size: int, device: Any, dtype: Any, differentiable: bool):
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"reward '{self.name}': batch_size must be >= 1, got {batch_size}")
        self.device, self.dtype = resolve(device, dtype)
        self.differentiable = bool(differentiable)

    def modules(self) -> list[torch.nn.Module]:
        return []

    def _freeze(self) -> None:
        for m in self.modules():
            m.eval()
            m.requires_grad_(False)
            m.to(device=self.device, dtype=self.dtype)

    def to(self, device: Any) -> "TorchImageReward":
        self.device = resolve(device, self.dtype)[0]
        for m in self.modules():
            m.to(self.device)
        return self

    def score_images(self, images: torch.Tensor, prompts: list[str] | None, metadata: list[dict] | None) -> RewardOutput:
        # preprocessing runs in float32 (antialiased resize has no bf16/fp16 CPU kernel); models cast inputs
        x = images.to(device=self.device, dtype=torch.float32)
        with torch.set_grad_enabled(self.differentiable and torch.is_grad_enabled()):
            out = self._score(x, prompts, metadata)
        return out

    def _score(self, x: torch.Tensor, prompts: list[str] | None, metadata: list[dict] | None) -> RewardOutput:
        raise NotImplementedError


def unique_index(prompts: Sequence[str]) -> tuple[list[str], torch.Tensor]:
    """Unique prompts (first-seen order) and the index of each prompt in that list: a group of G images
    sharing one prompt encodes the text once."""
    uniq: dict[str, int] = {}
    idx = [uniq.setdefault(p, len(uniq)) for p in prompts]
    return list(uniq), torch.tensor(idx, dtype=torch.long)


def check_prompts(prompts: Sequence[Any] | None, name: str) -> list[str]:
    if prompts is None:
        raise ValueError(f"reward '{name}' needs prompts (one per image)")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise ValueError(f"reward '{name}': prompt {i} must be a string, got {type(p).__name__}")
    return list(prompts)


# ------------------------------------------------------------------------------------- transformers CLIP


def _pooled(out: Any) -> torch.Tensor:
    # transformers >= 5 returns BaseModelOutputWithPooling (pooler_output = projected embedding), 4.x a tensor
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def read_image_processor_config(directory: Path) -> dict:
    """Image-processor settings from `preprocessor_config.json` (transformers 4 layout) or the
    `image_processor` section of `processor_config.json` (transformers 5 layout); {} if neither exists."""
    import json

    if (directory / "preprocessor_config.json").is_file():
        return json.loads((directory / "preprocessor_config.json").read_text())
    if (directory / "processor_config.json").is_file():
        cfg = json.loads((directory / "processor_config.json").read_text())
        return cfg.get("image_processor", {}) if isinstance(cfg.get("image_processor"), dict) else {}
    return {}


class HFClip:
    """transformers `CLIPModel` + tokenizer + image-processor geometry, all from local directories.

    `image_embeds(x01)` / `text_embeds(prompts)` return L2-normalised projected embeddings."""

    @classmethod
    def from_paths(cls, weights: Any, processor: Any, what: str, name: str | None = None) -> "HFClip":
        """The CLIP of reward `name` from the local `weights` directory (and `processor`, default the same), each
        checked with `require_path` (error messages name `what`)."""
        name = name or what
        model_dir = require_path(weights, what, "a CLIP model such as 'openai/clip-vit-large-patch14'", kind="dir")
        proc_dir = model_dir if processor is None else require_path(processor, f"{name} processor",
                                                                    "the CLIP model's tokenizer files", kind="dir")
        return cls(model_dir, proc_dir, name, "the CLIP model's tokenizer files")

    def __init__(self, model_dir: Path, processor_dir: Path, what: str, processor_download: str):
        from transformers import AutoTokenizer, CLIPModel

        from mmrl.run.files import refusing_pickled_weights

        try:
            with refusing_pickled_weights(what, model_dir):  # a pickled .bin: one line naming it
                self.model = CLIPModel.from_pretrained(str(model_dir), local_files_only=True)
        except OSError as exc:
            raise FileNotFoundError(f"{what}: '{model_dir}' is not a transformers CLIP directory (config.json + weights): "
                                    f"{str(exc).splitlines()[0][:200]}") from None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(processor_dir), local_files_only=True)
        except (OSError, ValueError, TypeError) as exc:
            raise FileNotFoundError(f"{what}: no CLIP tokenizer in '{processor_dir}' ({str(exc).splitlines()[0][:160]}); "
                                    f"download {processor_download} (tokenizer + preprocessor files) and pass "
                                    "processor=PATH") from None
        vision_size = int(self.model.config.vision_config.image_size)
        self.shortest, self.crop = vision_size, (vision_size, vision_size)
        self.mean, self.std = OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
        cfg = read_image_processor_config(processor_dir)
        if cfg:
            size = cfg.get("size", vision_size)
            self.shortest = int(size.get("shortest_edge", vision_size)) if isinstance(size, dict) else int(size)
            crop = cfg.get("crop_size", vision_size)
            self.crop = (int(crop["height"]), int(crop["width"])) if isinstance(crop, dict) else (int(crop), int(crop))
            self.mean = tuple(cfg.get("image_mean", OPENAI_CLIP_MEAN))
            self.std = tuple(cfg.get("image_std", OPENAI_CLIP_STD))
        self.max_length = int(min(getattr(self.tokenizer, "model_max_length", 77) or 77,
                                  self.model.config.text_config.max_position_embeddings))

    def preprocess(self, x: torch.Tensor) -> torch.Tensor:
        return normalize(resize_shortest_center_crop(x, self.shortest, self.crop), self.mean, self.std)

    def image_embeds(self, x: torch.Tensor) -> torch.Tensor:
        pixels = self.preprocess(x).to(self.model.dtype)
        emb = _pooled(self.model.get_image_features(pixel_values=pixels))
        return emb / emb.norm(p=2, dim=-1, keepdim=True)

    def text_embeds(self, prompts: Sequence[str], device: torch.device) -> torch.Tensor:
        uniq, idx = unique_index(prompts)
        tok = self.tokenizer(uniq, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        emb = _pooled(self.model.get_text_features(input_ids=tok["input_ids"].to(device),
                                                   attention_mask=tok["attention_mask"].to(device)))
        emb = emb / emb.norm(p=2, dim=-1, keepdim=True)
        return emb[idx.to(device)]
