"""Rule-based text rewards for VLM / LLM policies: answer extraction, math accuracy, multiple choice,
exact / number match, format checks, box IoU, and accuracy+format mixes (geo3k).

Two layers, as in TRL's ``trl/rewards``:

* plain callables ``fn(completions, answer=None, **kwargs) -> list[float]`` usable directly as TRL
  reward functions (dataset columns arrive as keyword arguments; the ground truth is read from the
  ``answer``, ``solution`` or ``ground_truth`` column, whichever is given), plus small string helpers
  (``extract_boxed``, ``math_equal`` ...) with doctests, defined in ``mmrl.rewards.answers`` and re-exported here;
* ``RewardModel`` classes registered with kind ``"text"`` (``load("math_accuracy")`` ...) that read the
  ground truth from ``metadata[i]["answer"]`` (or ``"solution"`` / ``"ground_truth"``) and return
  ``RewardOutput(scores[B], details)`` with per-sample details (the extracted answer, components).

A completion may be a string or a conversational message list (``[{"role": "assistant", "content": ...}]``);
the last message's text is scored.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch

from mmrl.rewards.answers import (
    _numbers_close,
    _text,
    box_iou,
    extract_box,
    extract_boxed,
    extract_choice,
    extract_final_answer,
    extract_last_number,
    extract_tagged,
    math_equal,
    normalize_answer,
    parse_number,
)
from mmrl.rewards.base import RewardModel, RewardOutput, register

__all__ = [
    "extract_boxed", "extract_tagged", "extract_last_number", "extract_final_answer", "extract_choice",
    "extract_box", "normalize_answer", "parse_number", "math_equal", "box_iou",
    "math_accuracy", "multiple_choice", "number_match", "exact_match", "format_reward", "iou_reward",
    "accuracy_format", "GROUND_TRUTH_KEYS", "THINK_ANSWER_PATTERN", "GEO3K_FORMAT_PATTERN",
]

GROUND_TRUTH_KEYS = ("answer", "solution", "ground_truth")

# <think>...</think> followed by an answer in \boxed{} or <answer></answer>.
THINK_ANSWER_PATTERN = r"\s*<think>.*?</think>\s*(?:.*\\boxed\{.*\}.*|<answer>.*?</answer>)\s*"
# source: verl/utils/reward_score/geo3k.py format_reward (fullmatch, DOTALL)
GEO3K_FORMAT_PATTERN = r"<think>.*</think>.*\\boxed\{.*\}.*"


# ----------------------------------------------------------------------------------- TRL-style callables


def _golds(kwargs: dict, n: int) -> list:
    for k in GROUND_TRUTH_KEYS:
        if kwargs.get(k) is not None:
            g = kwargs[k]
            if isinstance(g, str) or not hasattr(g, "__len__") or len(g) != n:
                got = f"{type(g).__name__} of length {len(g)}" if hasattr(g, "__len__") else type(g).__name__
                raise ValueError(f"ground truth column '{k}' must be a list with one entry per completion ({n}), "
                                 f"got {got}")
            return list(g)
    raise ValueError(f"no ground truth: pass one of {list(GROUND_TRUTH_KEYS)} (a list, one per completion)")


def math_accuracy(completions: Sequence[Any], answer: Sequence[str] | None = None, **kwargs) -> list[float]:
    """1.0 if the completion's final answer (``\\boxed{}`` > ``<answer>`` > last number) equals the ground
    truth mathematically, else 0.0.

    >>> math_accuracy([r"... \\boxed{\\frac{1}{2}}", "<answer>3</answer>", "I think 0.5"], answer=["0.5", "4", "1/2"])
    [1.0, 0.0, 1.0]
    """
    golds = _golds({"answer": answer, **kwargs}, len(completions))
    return [float(math_equal(extract_final_answer(c), _gold_answer(g))) for c, g in zip(completions, golds)]


def multiple_choice(completions: Sequence[Any], answer: Sequence[str] | None = None, letters: str = "ABCDE",
                    **kwargs) -> list[float]:
    """1.0 if the chosen letter (see ``extract_choice``) equals the ground-truth letter.

    >>> multiple_choice(["(B)", "The answer is C.", "B. because", "no idea"], answer=["B", "(B)", "b", "A"])
    [1.0, 0.0, 1.0, 0.0]
    """
    golds = _golds({"answer": answer, **kwargs}, len(completions))
    out = []
    for c, g in zip(completions, golds):
        gl = extract_choice(str(g).strip().upper(), letters)
        out.append(float(gl is not None and extract_choice(c, letters) == gl))
    return out


def number_match(completions: Sequence[Any], answer: Sequence[Any] | None = None, tol: float = 1e-6,
                 **kwargs) -> list[float]:
    """1.0 if the completion's final answer is a number equal to the ground truth within `tol`.
    A ground truth like ``"... #### 72"`` (GSM8K) uses its last number.

    >>> number_match(["so 1,000 total", r"\\boxed{2.50}", "7"], answer=["1000", "2.5", "#### 8"])
    [1.0, 1.0, 0.0]
    """
    golds = _golds({"answer": answer, **kwargs}, len(completions))
    out = []
    for c, g in zip(completions, golds):
        gv = g if isinstance(g, (int, float)) else parse_number(_gold_answer(str(g), fallback="number"))
        pv = parse_number(extract_final_answer(c))
        out.append(float(pv is not None and gv is not None and _numbers_close(pv, float(gv), tol)))
    return out


def exact_match(completions: Sequence[Any], answer: Sequence[str] | None = None, lowercase: bool = True,
                **kwargs) -> list[float]:
    """1.0 if the answer (``\\boxed{}`` > ``<answer>`` > whole text) equals the ground truth after
    ``normalize_answer`` (case-insensitive by default).

    >>> exact_match(["<answer>Red.</answer>", "red car", r"\\boxed{\\text{Paris}}"], answer=["red", "red", "paris"])
    [1.0, 0.0, 1.0]
    """
    golds = _golds({"answer": answer, **kwargs}, len(completions))
    return [float(normalize_answer(extract_final_answer(c, fallback="text") or "", lowercase)
                  == normalize_answer(_gold_answer(str(g)), lowercase)) for c, g in zip(completions, golds)]


def format_reward(completions: Sequence[Any], pattern: str = THINK_ANSWER_PATTERN, **kwargs) -> list[float]:
    """1.0 if the whole completion matches `pattern` (``re.fullmatch``, DOTALL); default: ``<think>...</think>``
    followed by an answer in ``\\boxed{}`` or ``<answer></answer>``.

    >>> format_reward(["<think>a</think> \\\\boxed{1}", "<think>a</think><answer>1</answer>", "\\\\boxed{1}",
    ...                "<think>a</think>"])
    [1.0, 1.0, 0.0, 0.0]
    """
    rx = re.compile(pattern, flags=re.DOTALL)
    return [float(rx.fullmatch(_text(c)) is not None) for c in completions]


def iou_reward(completions: Sequence[Any], answer: Sequence[Any] | None = None, threshold: float | None = None,
               **kwargs) -> list[float]:
    """IoU of the predicted box with the ground-truth box (``[x1, y1, x2, y2]``, list or text); with
    `threshold`, 1.0 if IoU >= threshold else 0.0. Unparseable -> 0.

    >>> iou_reward(["[0, 0, 2, 2]", "[1, 1, 3, 3]", "none"], answer=[[0, 0, 2, 2], "[0,0,2,2]", [0, 0, 1, 1]])
    [1.0, 0.14285714285714285, 0.0]
    """
    golds = _golds({"answer": answer, **kwargs}, len(completions))
    out = []
    for c, g in zip(completions, golds):
        pb, gb = extract_box(c), extract_box(g)
        v = box_iou(pb, gb) if pb is not None and gb is not None else 0.0
        out.append(float(v >= threshold) if threshold is not None else v)
    return out


def accuracy_format(completions: Sequence[Any], answer: Sequence[str] | None = None, accuracy_weight: float = 0.9,
                    format_weight: float = 0.1, pattern: str = GEO3K_FORMAT_PATTERN, **kwargs) -> list[float]:
    """geo3k-style ``accuracy_weight * math_accuracy + format_weight * format``.
    # source: verl/utils/reward_score/geo3k.py compute_score (0.9 / 0.1)

    >>> accuracy_format(["<think>r</think> \\\\boxed{3}", "\\\\boxed{3}", "<think>r</think> \\\\boxed{4}"], answer=["3"] * 3)
    [1.0, 0.9, 0.1]
    """
    acc = math_accuracy(completions, answer, **kwargs)
    fmt = format_reward(completions, pattern)
    return [accuracy_weight * a + format_weight * f for a, f in zip(acc, fmt)]


def _gold_answer(g: Any, fallback: str | None = "text") -> str:
    """Ground truth as an answer string: a boxed / tagged solution is reduced to its answer; GSM8K's
    ``#### x`` to x."""
    s = str(g)
    m = re.search(r"####\s*(.+?)\s*$", s)
    if m:
        return m.group(1)
    ans = extract_final_answer(s, fallback=None)
    if ans is not None:
        return ans
    if fallback == "number" and parse_number(s) is None:
        return extract_last_number(s) or s
    return s.strip()


# ----------------------------------------------------------------------------------- RewardModel classes


def ground_truths(metadata: Sequence[dict] | None, n: int, name: str, key: str | None = None) -> list:
    """Ground truth per sample from metadata (`key`, else the first of answer / solution / ground_truth)."""
    keys = (key,) if key else GROUND_TRUTH_KEYS
    if metadata is None:
        raise ValueError(f"reward '{name}' needs ground truth: pass metadata=[{{'{keys[0]}': ...}}, ...] "
                         f"(one dict per completion with key {' or '.join(repr(k) for k in keys)})")
    out = []
    for i, m in enumerate(metadata):
        if not isinstance(m, dict):
            raise ValueError(f"reward '{name}': metadata[{i}] must be a dict, got {type(m).__name__}")
        for k in keys:
            if k in m and m[k] is not None:
                out.append(m[k])
                break
        else:
            raise ValueError(f"reward '{name}': metadata[{i}] has no ground-truth key "
                             f"{' or '.join(repr(k) for k in keys)}; got keys {sorted(m)}")
    return out


class TextReward(RewardModel):
    """Base for rule-based text rewards: subclasses implement `score_one(text, gold) -> (score, extracted)`."""

    kind = "text"
    needs_ground_truth = True
    batch_size = 1024
    unit = "1 = correct"
    score_range = (0.0, 1.0)

    def __init__(self, answer_key: str | None = None, device: Any = None):
        self.answer_key = answer_key

    def score_one(self, text: str, gold: Any) -> tuple[float, Any]:
        raise NotImplementedError

    def score_texts(self, completions, metadata, prompts):
        texts = [_text(c) for c in completions]
        golds = (ground_truths(metadata, len(texts), self.name, self.answer_key) if self.needs_ground_truth
                 else [None] * len(texts))
        pairs = [self.score_one(t, g) for t, g in zip(texts, golds)]
        scores = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
        return RewardOutput(scores, {"extracted": [p[1] for p in pairs]})


@register("math_accuracy")
class MathAccuracy(TextReward):
    """1 if the final answer (\\boxed{} > <answer> > last number) equals metadata 'answer' (math_verify, string fallback)."""

    name = "math_accuracy"

    def __init__(self, timeout: float = 5.0, tol: float = 1e-6, fallback: str | None = "number",
                 answer_key: str | None = None, device: Any = None):
        super().__init__(answer_key)
        self.timeout, self.tol, self.fallback = float(timeout), float(tol), fallback

    def score_one(self, text, gold):
        pred = extract_final_answer(text, fallback=self.fallback)
        return float(math_equal(pred, _gold_answer(gold), self.timeout, self.tol)), pred


@register("multiple_choice")
class MultipleChoice(TextReward):
    """1 if the chosen option letter ((B), B., 'answer is B', \\boxed{B}) equals metadata 'answer'."""

    name = "multiple_choice"

    def __init__(self, letters: str = "ABCDE", answer_key: str | None = None, device: Any = None):
        super().__init__(answer_key)
        self.letters = letters

    def score_one(self, text, gold):
        pred = extract_choice(text, self.letters)
        gl = extract_choice(str(gold).strip().upper(), self.letters)
        return float(pred is not None and pred == gl), pred


@register("number_match")
class NumberMatch(TextReward):
    """1 if the final answer is a number equal to metadata 'answer' within tol."""

    name = "number_match"

    def __init__(self, tol: float = 1e-6, answer_key: str | None = None, device: Any = None):
        super().__init__(answer_key)
        self.tol = float(tol)

    def score_one(self, text, gold):
        pred = extract_final_answer(text)
        return number_match([text], [gold], tol=self.tol)[0], pred


@register("exact_match")
class ExactMatch(TextReward):
    """1 if the normalised answer (\\boxed{} > <answer> > whole text) equals the normalised metadata 'answer'."""

    name = "exact_match"

    def __init__(self, lowercase: bool = True, answer_key: str | None = None, device: Any = None):
        super().__init__(answer_key)
        self.lowercase = bool(lowercase)

    def score_one(self, text, gold):
        pred = extract_final_answer(text, fallback="text")
        return exact_match([text], [gold], self.lowercase)[0], pred


@register("format")
class FormatReward(TextReward):
    """1 if the completion fully matches a regex (default <think>...</think> then \\boxed{} or <answer>)."""

    name = "format"
    needs_ground_truth = False

    def __init__(self, pattern: str | None = None, style: str = "think_answer", device: Any = None):
        super().__init__(None)
        styles = {"think_answer": THINK_ANSWER_PATTERN, "geo3k": GEO3K_FORMAT_PATTERN}
        if pattern is None and style not in styles:
            raise ValueError(f"format style must be one of {sorted(styles)} (or pass pattern=...), got {style!r}")
        self.pattern = pattern or styles[style]
        self.regex = re.compile(self.pattern, flags=re.DOTALL)

    def score_one(self, text, gold):
        return float(self.regex.fullmatch(text) is not None), None

    def score_texts(self, completions, metadata, prompts):
        out = super().score_texts(completions, metadata, prompts)
        out.details.pop("extracted")
        return out


@register("iou")
class IoUReward(TextReward):
    """IoU of the predicted [x1,y1,x2,y2] box (JSON list or 4 numbers) with metadata 'answer'; optional threshold."""

    name = "iou"

    def __init__(self, threshold: float | None = None, answer_key: str | None = None, device: Any = None):
        super().__init__(answer_key)
        self.threshold = None if threshold is None else float(threshold)

    def score_texts(self, completions, metadata, prompts):
        texts = [_text(c) for c in completions]
        golds = ground_truths(metadata, len(texts), self.name, self.answer_key)
        ious, boxes = [], []
        for i, (t, g) in enumerate(zip(texts, golds)):
            gb = extract_box(g)
            if gb is None:
                raise ValueError(f"reward 'iou': ground truth of sample {i} is not a box [x1, y1, x2, y2]: {g!r}")
            pb = extract_box(t)
            boxes.append(pb)
            ious.append(box_iou(pb, gb) if pb is not None else 0.0)
        iou = torch.tensor(ious, dtype=torch.float32)
        scores = iou if self.threshold is None else (iou >= self.threshold).float()
        return RewardOutput(scores, {"iou": iou, "box": boxes})


_ACCURACY = {"math_accuracy": MathAccuracy, "multiple_choice": MultipleChoice, "number_match": NumberMatch,
             "exact_match": ExactMatch, "iou": IoUReward}


@register("accuracy_format")
class AccuracyFormat(TextReward):
    """accuracy_weight * accuracy + format_weight * format (defaults 0.9 / 0.1, geo3k format regex)."""

    name = "accuracy_format"

    def __init__(self, accuracy: str = "math_accuracy", accuracy_weight: float = 0.9, format_weight: float = 0.1,
                 pattern: str | None = None, format_style: str = "geo3k", answer_key: str | None = None,
                 device: Any = None, **accuracy_kwargs: Any):
        super().__init__(answer_key)
        if accuracy not in _ACCURACY:
            raise ValueError(f"accuracy must be one of {sorted(_ACCURACY)}, got {accuracy!r}")
        self.accuracy = _ACCURACY[accuracy](answer_key=answer_key, **accuracy_kwargs)
        self.format = FormatReward(pattern=pattern, style=format_style)
        self.accuracy_weight, self.format_weight = float(accuracy_weight), float(format_weight)

    def score_texts(self, completions, metadata, prompts):
        acc = self.accuracy.score_texts(completions, metadata, prompts)
        fmt = self.format.score_texts(completions, metadata, prompts)
        scores = self.accuracy_weight * acc.scores + self.format_weight * fmt.scores
        details = {"accuracy": acc.scores, "format": fmt.scores}
        details.update({f"accuracy/{k}": v for k, v in acc.details.items()})
        return RewardOutput(scores, details)


@register("geo3k")
class Geo3k(AccuracyFormat):
    """geo3k (verl/EasyR1): 0.9 * math accuracy of \\boxed{} + 0.1 * '<think>...</think>...\\boxed{...}' format."""

    name = "geo3k"

    def __init__(self, accuracy_weight: float = 0.9, format_weight: float = 0.1, pattern: str | None = None,
                 answer_key: str | None = None, device: Any = None, **accuracy_kwargs: Any):
        accuracy_kwargs.setdefault("fallback", None)  # as verl: only the \\boxed{} answer counts
        super().__init__("math_accuracy", accuracy_weight, format_weight, pattern, "geo3k", answer_key,
                         **accuracy_kwargs)
