"""VideoAlign's VideoReward (Liu et al. 2025, "Improving Video Generation with Human Feedback"): a Qwen2-VL-2B
reward model scoring a generated video and its prompt on visual quality (VQ), motion quality (MQ) and text
alignment (TA); overall = VQ + MQ + TA.

```python
load("videoalign", weights="/ckpt/VideoReward", base="/ckpt/Qwen2-VL-2B-Instruct")            # overall
load("videoreward", weights=..., base=..., head="mq")                                         # one head
```

What the authors' inference does (KwaiVGI/VideoAlign@219ab9db inference.py, trainer.py, vision_process.py) and
this module reimplements:
- Checkpoint: `model_config.json` (data / model / LoRA / inference sections) and `checkpoint-<step>/model.pth`,
  the full state dict of the PEFT-wrapped `Qwen2VLRewardModelBT` (transformers 4.45 names, LoRA rank 64 on every
  decoder linear, kept apart from the base weights). The latest step is read unless `step=` is given. The base
  model's config and processor come from `model_config.model_name_or_path` (Qwen/Qwen2-VL-2B-Instruct, not part
  of the download): `base=` gives its local copy. Here LoRA is merged into the linears at load
  (W + alpha / r * B @ A; equal up to float rounding). Loading and the forward are `mmrl.rewards.vlm_head`'s.
- Special tokens <|VQ_reward|>, <|MQ_reward|>, <|TA_reward|> are added to the base tokenizer; the prompt
  (`detailed_special`) holds one of each; `rm_head` (Linear(hidden, 1, bias=False)) on the final hidden states at
  those three positions gives VQ, MQ, TA (the head in the model's dtype, as theirs). The decoder runs with plain positions 0..L-1 in all three M-RoPE
  sections (the authors' forward calls the decoder without Qwen2-VL's 3-D rope index; the model was trained so).
- Video: frames sampled at `fps` (2) of the clip's own rate (`video_fps`: mmrl's videos carry none; 16 is the
  rate mmrl and diffusers' Wan examples write clips at), at least 4, an even count, indices
  round(linspace(0, F - 1, n)); then smart_resize (factor 28, min 128*28*28, max `max_frame_pixels` = 200704
  pixels) with torchvision's antialiased bicubic on uint8 frames; the Qwen2-VL processor rescales and normalises.
- Output: (raw - mean) / std per head with `inference_config`'s statistics (`normalize=False`: raw).

`details`: "vq", "mq", "ta", "overall" (each [B]); `scores` = the head named by `head`.
Weights: https://huggingface.co/KlingTeam/VideoReward (MIT; base Qwen/Qwen2-VL-2B-Instruct, Apache-2.0).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from mmrl.rewards.base import RewardOutput, register
from mmrl.rewards.image._common import read_json, require_path, resolve
from mmrl.rewards.video import VideoRewardModel
from mmrl.rewards.vlm_head import QwenVLRewardBackbone, merge_lora  # noqa: F401 (merge_lora: VideoReward's LoRA)

HEADS = ("vq", "mq", "ta", "overall")
REWARD_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
DOWNLOAD = "'KlingTeam/VideoReward' (formerly KwaiVGI/VideoReward)"
BASE_DOWNLOAD = "'Qwen/Qwen2-VL-2B-Instruct'"
# source: KwaiVGI/VideoAlign@219ab9db vision_process.py (VIDEO_MIN_PIXELS, FRAME_FACTOR, FPS_MIN_FRAMES,
# FPS_MAX_FRAMES) and data.py (DataConfig defaults)
VIDEO_MIN_PIXELS = 128 * 28 * 28
FRAME_FACTOR = 2
MIN_FRAMES, MAX_FRAMES = 4, 768
DEFAULT_VIDEO_FPS = 16.0

# source: KwaiVGI/VideoAlign@219ab9db prompt_template.py DETAILED_PROMPT_WITH_SPECIAL_TOKEN (MIT), the text the
# released checkpoint was trained with; the model reads the three scores at its reward tokens, so it is kept verbatim
DETAILED_SPECIAL_PROMPT = """
You are tasked with evaluating a generated video based on three distinct criteria: Visual Quality, Motion Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of the three categories, with 0 being the worst and 10 being the best. Each evaluation should be independent of the others.

**Visual Quality:**  
Evaluate the overall visual quality of the video, with a focus on static factors. The following sub-dimensions should be considered:
- **Reasonableness:** The video should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The video should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

Please provide the ratings of Visual Quality: <|VQ_reward|>
END

**Motion Quality:**  
Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following sub-dimensions:
- **Stability:** Evaluate the continuity and stability between frames. There should be no sudden, unnatural jumps, and the video should maintain stable attributes (e.g., no fluctuating colors, textures, or missing body parts).
- **Naturalness:** The movement should align with physical laws and be realistic. For example, clothing should flow naturally with motion, and facial expressions should change appropriately (e.g., blinking, mouth movements).
- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between different motions or camera angles should be seamless, and the overall dynamic feel should be visually pleasing.
- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend naturally with the background, without obvious artifacts or the feeling of cut-and-paste effects.
- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any areas where the video might have blurry or unsteady sections that hinder visual continuity.
- **Amplitude:** If the video is largely static or has little movement, assign a low score for motion quality.

Please provide the ratings of Motion Quality: <|MQ_reward|>
END

**Text Alignment:**  
Assess how well the video matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial expressions like talking or blinking) align with the described prompt. The motion should match the prompt in terms of type, scale, and direction.
- **Environment Relevance:** Assess whether the background and scene fit the prompt. This includes checking if real-world locations or scenes are accurately represented, though some stylistic adaptation is acceptable.  
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the video adheres to this style.
- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, focus shifts) are consistent with the expected behavior from the prompt.

Textual prompt - {text_prompt}
Please provide the ratings of Text Alignment: <|TA_reward|>
END
"""


def _section(cfg: dict, key: str, path: Path) -> dict:
    value = cfg.get(key)
    if not isinstance(value, dict):
        raise ValueError(f"videoalign: '{path}' has no '{key}' section (expected the VideoReward model_config.json "
                         f"with data_config, model_config, peft_lora_config)")
    return value


def read_checkpoint(weights: Any, step: int | None = None) -> tuple[dict, Path]:
    """(model_config.json as a dict, the checkpoint-<step>/model.pth to load): the latest step unless `step`."""
    root = require_path(weights, "videoalign", DOWNLOAD, kind="dir")
    cfg = read_json(root / "model_config.json", "videoalign", f"'{root}' has no model_config.json; expected the "
                    f"VideoReward layout (model_config.json + checkpoint-<step>/model.pth) of {DOWNLOAD}")
    steps = sorted((int(p.name.split("-")[-1]), p) for p in root.glob("checkpoint-*")
                   if p.is_dir() and p.name.split("-")[-1].isdigit())
    if not steps:
        raise FileNotFoundError(f"videoalign: '{root}' has no checkpoint-<step> directory (expected e.g. "
                                f"checkpoint-11352/model.pth of {DOWNLOAD})")
    chosen = dict(steps).get(int(step)) if step is not None else steps[-1][1]
    if chosen is None:
        raise FileNotFoundError(f"videoalign: step={step}: no checkpoint-{step} in '{root}'; have "
                                f"{[s for s, _ in steps]}")
    if not (chosen / "model.pth").is_file():
        found = sorted(p.name for p in chosen.iterdir())
        raise FileNotFoundError(f"videoalign: '{chosen}' has no model.pth (the full state dict the released "
                                f"checkpoint ships); found {found}")
    return cfg, chosen / "model.pth"


def sample_frames(video_u8: torch.Tensor, video_fps: float, fps: float | None, num_frames: int | None) -> torch.Tensor:
    """uint8 [F, 3, H, W] -> the frames the model sees (the authors' smart_nframes + uniform sampling)."""
    total = video_u8.shape[0]
    if num_frames is not None:
        n = round(num_frames / FRAME_FACTOR) * FRAME_FACTOR
    else:
        lo = math.ceil(MIN_FRAMES / FRAME_FACTOR) * FRAME_FACTOR
        hi = math.floor(min(MAX_FRAMES, total) / FRAME_FACTOR) * FRAME_FACTOR
        n = round(min(max(total / video_fps * fps, lo), hi) / FRAME_FACTOR) * FRAME_FACTOR
    n = min(n, total)
    if n < FRAME_FACTOR:
        raise ValueError(f"reward 'videoalign' needs videos of >= {FRAME_FACTOR} frames, got {total}")
    idx = torch.linspace(0, total - 1, n).round().long()
    return video_u8[idx]


@register("videoalign", "videoreward")
class VideoAlign(VideoRewardModel):
    """VideoReward's VQ / MQ / TA heads and their sum (see the module docstring)."""

    name = "videoalign"
    needs_prompts = True
    unit = "VideoReward (z-scored heads)"

    def __init__(self, weights: Any = None, base: Any = None, head: str = "overall", step: int | None = None,
                 normalize: bool = True, video_fps: float = DEFAULT_VIDEO_FPS, fps: float | None = None,
                 num_frames: int | None = None, max_pixels: int | None = None, batch_size: int = 2,
                 device: Any = None, dtype: Any = "float32"):
        if head not in HEADS:
            raise ValueError(f"videoalign: head must be one of {list(HEADS)}, got {head!r}")
        if video_fps <= 0 or (fps is not None and fps <= 0) or (num_frames is not None and num_frames < 2):
            raise ValueError(f"videoalign: video_fps and fps must be > 0 and num_frames >= 2, got video_fps={video_fps}, "
                             f"fps={fps}, num_frames={num_frames}")
        if fps is not None and num_frames is not None:
            raise ValueError(f"videoalign: give fps (frames sampled per second) or num_frames (frames per video), "
                             f"not both; got fps={fps}, num_frames={num_frames}")
        cfg, model_pth = read_checkpoint(weights, step)
        where = Path(weights) / "model_config.json"
        data, mcfg, lora = (_section(cfg, k, where) for k in ("data_config", "model_config", "peft_lora_config"))
        if data.get("prompt_template_type") != "detailed_special" or mcfg.get("reward_token") != "special":
            raise ValueError(f"videoalign: '{where}' has prompt_template_type={data.get('prompt_template_type')!r}, "
                             f"reward_token={mcfg.get('reward_token')!r}; only the released checkpoint's "
                             "'detailed_special' + 'special' (scores at the three reward tokens) is supported")
        self.head, self.normalize, self.batch_size = head, bool(normalize), int(batch_size)
        self.video_fps = float(video_fps)
        self.fps = float(fps if fps is not None else data.get("fps") or 2.0)
        # as the authors' reward(): fps and num_frames exclude each other; an explicit fps overrides the config's
        # num_frames, a num_frames (from the call or the config) the fps
        self.num_frames = num_frames if num_frames is not None else None if fps is not None else data.get("num_frames")
        self.max_pixels = int(max_pixels or data.get("max_frame_pixels") or 240 * 320)
        stats = cfg.get("inference_config")
        self.stats = None if not stats else torch.tensor([[stats[f"{h}_mean"] for h in ("VQ", "MQ", "TA")],
                                                          [stats[f"{h}_std"] for h in ("VQ", "MQ", "TA")]])
        base_dir = base if base is not None else mcfg.get("model_name_or_path")
        if base_dir is None or not Path(base_dir).is_dir():
            raise FileNotFoundError(f"videoalign: base model {str(base_dir)!r} (model_config.model_name_or_path of "
                                    f"'{where}') is not a local directory; download {BASE_DOWNLOAD} yourself and "
                                    "pass base=<its local path> (nothing is downloaded automatically)")
        self.device, self.dtype = resolve(device, dtype)
        lora_on = bool(lora.get("lora_enable"))
        scale = 0.0 if not lora_on else lora["lora_alpha"] / (
            math.sqrt(lora["lora_r"]) if lora.get("use_rslora") else lora["lora_r"])
        self.backbone = QwenVLRewardBackbone(model_pth, Path(base_dir), what="videoalign", head_prefixes=["rm_head."],
                                             reward_tokens=REWARD_TOKENS, family="qwen2_vl", device=self.device,
                                             dtype=self.dtype, lora_scale=scale, base_arg="base")
        if hasattr(self.backbone.processor.video_processor, "cap_pixels_per_frame"):
            self.backbone.processor.video_processor.cap_pixels_per_frame = False  # frames arrive sized (`_frames`),
            # as the authors' fetch_video returns them to a processor (transformers 4.45) that caps nothing
        # the authors' rm_head is part of the model, loaded in its dtype (vlm_head builds heads in float32)
        self.rm_head = self.backbone.heads["rm_head."].to(self.dtype)

    def to(self, device: Any) -> "VideoAlign":
        self.device = self.backbone.device = resolve(device, self.dtype)[0]
        self.backbone.model.to(self.device)
        self.rm_head.to(self.device)
        return self

    def _frames(self, video: torch.Tensor) -> torch.Tensor:
        """float [F, 3, H, W] in [0, 1] -> float [n, 3, h, w] in [0, 255] as the authors' fetch_video returns."""
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms.functional import resize

        from mmrl.pipelines.images import smart_resize

        u8 = (video.float().clamp(0, 1) * 255).round().to(torch.uint8)  # the uint8 frames a saved clip holds
        frames = sample_frames(u8, self.video_fps, self.fps, self.num_frames)
        h, w = smart_resize(frames.shape[2], frames.shape[3], 28, min_pixels=VIDEO_MIN_PIXELS, max_pixels=self.max_pixels)
        return resize(frames, [h, w], interpolation=InterpolationMode.BICUBIC, antialias=True).float()

    def inputs(self, videos: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The processor's batch (right-padded, on the device) for videos [B, F, 3, H, W] in [0, 1] and their prompts."""
        texts = self.backbone.chat_texts([[{"type": "video"}, {
            "type": "text", "text": DETAILED_SPECIAL_PROMPT.format(text_prompt=p)}] for p in prompts])
        return self.backbone.encode(texts, videos=[self._frames(v) for v in videos], videos_kwargs={"do_rescale": True})

    @torch.no_grad()
    def raw_heads(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, 3] raw VQ, MQ, TA: rm_head on the final hidden states at the reward tokens."""
        hidden = self.backbone.token_hidden(batch)  # [B, 3, H] float32 (exact: upcast from the model's dtype)
        logits = self.rm_head(hidden.flatten(0, 1).to(self.dtype)).float().view(*hidden.shape[:2], -1)
        return logits.diagonal(dim1=1, dim2=2) if logits.shape[-1] == len(REWARD_TOKENS) else logits[..., 0]

    def score_videos(self, videos, prompts, metadata):
        heads = self.raw_heads(self.inputs(videos, list(prompts))).cpu()
        if self.normalize and self.stats is not None:
            heads = (heads - self.stats[0]) / self.stats[1]
        details = {"vq": heads[:, 0], "mq": heads[:, 1], "ta": heads[:, 2], "overall": heads.sum(1)}
        return RewardOutput(details[self.head].clone(), details)
