"""OCR reward: how well the text rendered in an image matches the text the prompt asks for.

Target text = `metadata["text"]` if given, else the first span in double quotes ("..." or curly quotes), else
the first span in single quotes ('...' not part of a word, so "cat's" is not a quote). Both the target and
the recognised text are lowercased with spaces removed; the recognised text is all detected lines joined in
reading order. reward = 1 - min(edit_distance(pred, target), len(target)) / len(target), and 1 when the
target occurs inside the prediction (extra text is not penalised); an image with no text scores 0.
# source: flow_grpo/ocr.py OcrScorer (PaddleOCR there; Levenshtein distance; substring -> 0; clamp to len)

Engine: rapidocr-onnxruntime (extra `[ocr]`), whose wheel ships the PP-OCRv4 det/rec/cls ONNX models, so
it runs offline with no weight path. Not differentiable.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Sequence

import numpy as np
import torch

from mmrl.rewards.base import RewardModel, RewardOutput, register, to_pil_list

_DOUBLE = re.compile(r'"([^"]*)"|\u201c([^\u201d]*)\u201d')
_SINGLE = re.compile(r"(?<![\w])'([^']*)'(?![\w])|\u2018([^\u2019]*)\u2019")


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insert / delete / substitute, each cost 1); two-row dynamic programme."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


try:  # same numbers, C speed, when python-Levenshtein happens to be installed
    from Levenshtein import distance as _fast_distance
except ImportError:  # pragma: no cover - optional
    _fast_distance = None


def normalize_text(s: str) -> str:
    return s.replace(" ", "").lower()


def target_text(prompt: str | None, meta: dict | None) -> str | None:
    """The text an image should show: metadata["text"], else the first double-quoted, else single-quoted span;
    None when there is none (the prompt asks for no text)."""
    if meta is not None and not isinstance(meta, dict):
        raise ValueError(f"ocr: metadata entries must be dicts (e.g. {{'text': 'HELLO'}}), got {type(meta).__name__}")
    if meta and meta.get("text") is not None:
        return str(meta["text"])
    if prompt is None:
        raise ValueError("ocr: no target text: pass prompts with the text in quotes or metadata=[{'text': ...}]")
    for pattern in (_DOUBLE, _SINGLE):
        m = pattern.search(prompt)
        if m:
            return next(g for g in m.groups() if g is not None)
    return None


def ocr_similarity(pred: str, target: str) -> float:
    """1 - min(dist, len)/len on normalised strings; 1 if target is a substring of the prediction."""
    p, t = normalize_text(pred), normalize_text(target)
    if not t:
        raise ValueError(f"ocr: target text {target!r} is empty after removing spaces")
    if t in p:
        return 1.0
    dist = (_fast_distance or edit_distance)(p, t)
    return 1.0 - min(dist, len(t)) / len(t)


NO_TARGET = ("nan", "zero")


@register("ocr")
class OcrReward(RewardModel):
    """Text rendering: the image's OCR text (RapidOCR) against the prompt's quoted text, 1 - edit distance / length.

    `no_target`: the score of an image whose prompt has no quoted text and no metadata["text"]: "nan" (default:
    the reward does not apply; trainers handle it as any non-finite reward, `reward.on_nonfinite`) or "zero"."""

    name = "ocr"
    differentiable = False
    unit = "1 - edit distance / target length"
    score_range = (0.0, 1.0)

    def __init__(self, *, min_confidence: float = 0.0, batch_size: int = 16, engine_kwargs: dict | None = None,
                 no_target: str = "nan", device: Any = None, dtype: Any = None):
        if no_target not in NO_TARGET:
            raise ValueError(f"ocr: no_target must be one of {list(NO_TARGET)}, got {no_target!r}")
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError:
            raise ImportError("reward 'ocr' needs rapidocr-onnxruntime: pip install 'mmrl[ocr]'") from None
        self.engine = RapidOCR(**(engine_kwargs or {}))
        self.min_confidence = float(min_confidence)
        self.batch_size = int(batch_size)
        self.no_target = no_target
        self._warned = False

    def read(self, image_rgb: np.ndarray) -> str:
        """Recognised text of one HxWx3 uint8 RGB image (lines joined in the engine's reading order)."""
        result, _ = self.engine(np.ascontiguousarray(image_rgb[..., ::-1]))  # engine expects OpenCV BGR
        if not result:
            return ""
        return "".join(text for _box, text, conf in result if float(conf) > self.min_confidence)

    def score_images(self, images, prompts: Sequence[str] | None, metadata: Sequence[dict] | None) -> RewardOutput:
        n = images.shape[0]
        targets = [target_text(None if prompts is None else prompts[i], None if metadata is None else metadata[i])
                   for i in range(n)]
        preds = [self.read(np.asarray(pil)) for pil in to_pil_list(images)]
        missing = float("nan") if self.no_target == "nan" else 0.0
        scores = torch.tensor([missing if t is None else ocr_similarity(p, t) for p, t in zip(preds, targets)],
                              dtype=torch.float32)
        first = next((i for i, t in enumerate(targets) if t is None), None)
        if first is not None and not self._warned:
            self._warned = True
            warnings.warn(f"ocr: prompt {prompts[first]!r} has no quoted text and no metadata['text']: scored "
                          f"{missing} (no_target={self.no_target!r}: no text to compare the image with); put the "
                          f"text to render in quotes, or in training drop such samples with "
                          f"reward.on_nonfinite=drop_sample", stacklevel=2)
        return RewardOutput(scores, {"ocr_text": preds, "target": ["" if t is None else t for t in targets]})
