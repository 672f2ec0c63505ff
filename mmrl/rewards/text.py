"""Rule-based text rewards for VLM / LLM policies: answer extraction, math accuracy, multiple choice,
exact / number match, format checks, box IoU, and accuracy+format mixes (geo3k).

Two layers, as in TRL's ``trl/rewards``:

* plain callables ``fn(completions, answer=None, **kwargs) -> list[float]`` usable directly as TRL
  reward functions (dataset columns arrive as keyword arguments; the ground truth is read from the
  ``answer``, ``solution`` or ``ground_truth`` column, whichever is given), plus small string helpers
  (``extract_boxed``, ``math_equal`` ...) with doctests;
* ``RewardModel`` classes registered with kind ``"text"`` (``load("math_accuracy")`` ...) that read the
  ground truth from ``metadata[i]["answer"]`` (or ``"solution"`` / ``"ground_truth"``) and return
  ``RewardOutput(scores[B], details)`` with per-sample details (the extracted answer, components).

A completion may be a string or a conversational message list (``[{"role": "assistant", "content": ...}]``);
the last message's text is scored.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from typing import Any, Callable, Sequence

import torch

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

_NUMBER_RE = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|(?<![\w.\d])[-+]?\.\d+")


# ----------------------------------------------------------------------------------- extraction


def _text(completion: Any) -> str:
    """String completion, or the last message's text of a conversational completion."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content", "")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            return "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return str(content)
    raise TypeError(f"completion must be a string or a list of chat messages, got {type(completion).__name__}")


def _boxed_spans(text: str) -> list[str]:
    out = []
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end():i - 1])
    return out


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if there is none.

    >>> extract_boxed(r"so \\boxed{\\frac{1}{2}}.")
    '\\\\frac{1}{2}'
    >>> extract_boxed(r"\\boxed{1} then \\boxed{2}")
    '2'
    >>> extract_boxed("no box") is None
    True
    """
    spans = _boxed_spans(text)
    return spans[-1].strip() if spans else None


def extract_tagged(text: str, tag: str = "answer") -> str | None:
    """Content of the last ``<tag>...</tag>``; None if absent.

    >>> extract_tagged("<think>hm</think><answer> 42 </answer>")
    '42'
    >>> extract_tagged("<answer>1</answer><answer>2</answer>")
    '2'
    """
    hits = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return hits[-1].strip() if hits else None


def extract_last_number(text: str) -> str | None:
    """Last number in `text` (integers, decimals, ``1,000`` style thousands, exponents); None if none.

    >>> extract_last_number("3 apples and 4.5 pears")
    '4.5'
    >>> extract_last_number("x1 = y2") is None
    True
    """
    hits = _NUMBER_RE.findall(text)
    return hits[-1] if hits else None


def extract_final_answer(text: str, fallback: str | None = "number") -> str | None:
    """Final answer of a completion: ``\\boxed{}`` > ``<answer>`` tag > `fallback`
    (``"number"``: last number, ``"text"``: the whole stripped text, None: nothing).

    >>> extract_final_answer(r"<answer>\\boxed{7}</answer>")
    '7'
    >>> extract_final_answer("<answer>blue</answer>")
    'blue'
    >>> extract_final_answer("It is 3, no 5.")
    '5'
    """
    text = _text(text)
    for cand in (extract_boxed(text), extract_tagged(text, "answer")):
        if cand is not None:
            inner = extract_boxed(cand)  # <answer>\boxed{x}</answer>
            return inner if inner is not None else cand
    if fallback == "number":
        return extract_last_number(text)
    if fallback == "text":
        return text.strip()
    return None


def extract_choice(text: str, letters: str = "ABCDE") -> str | None:
    """Multiple-choice letter: from the boxed / tagged answer if any, else the whole text, trying
    a bare letter ``B`` / ``(B)`` / ``B.``, then ``answer is B`` / ``answer: (B)``, then the last ``(B)``,
    then a line starting with ``B.`` or ``B)``. None if nothing matches. Letters are upper case only
    (a lower-case "a" is usually the article).

    >>> [extract_choice(s) for s in ["(B)", "B.", "The answer is C", r"\\boxed{D}", "so (A) is wrong; (E)"]]
    ['B', 'B', 'C', 'D', 'E']
    >>> extract_choice("A cat.") is None
    True
    """
    text = _text(text)
    cand = extract_final_answer(text, fallback=None)
    L = re.escape(letters)
    for t in ([cand, text] if cand is not None else [text]):
        t = re.sub(r"\\text\{([^{}]*)\}", r"\1", t).strip()
        m = re.fullmatch(rf"\(?\s*([{L}])\s*\)?[.:)]?(?:\s.*)?", t, flags=re.DOTALL) if t else None
        if m and (len(t) <= 3 or re.match(rf"\(?[{L}][.:)]\s|\([{L}]\)", t)):
            return m.group(1)
        hits = re.findall(rf"(?i:answer)\s*(?:is|:)?\s*:?\s*(?i:option\s*)?\(?([{L}])\b\)?", t)
        if hits:
            return hits[-1]
        hits = re.findall(rf"\(([{L}])\)", t)
        if hits:
            return hits[-1]
        hits = re.findall(rf"(?m)^\s*([{L}])[.)]", t)
        if hits:
            return hits[-1]
    return None


# ----------------------------------------------------------------------------------- normalisation


def normalize_answer(s: str, lowercase: bool = False) -> str:
    """Canonical string form for answer comparison: drops ``$``, ``\\text{}`` wrappers, ``\\left``/``\\right``,
    spacing macros, degree marks, all whitespace, a trailing period and leading zeros of integers;
    ``\\dfrac``/``\\tfrac`` -> ``\\frac``; ``1,000`` -> ``1000``.

    >>> normalize_answer(r" $\\text{ 007 }$. ")
    '7'
    >>> normalize_answer(r"\\left( 1, 2 \\right)")
    '(1,2)'
    >>> normalize_answer(r"\\dfrac{1}{2}")
    '\\\\frac{1}{2}'
    """
    s = _text(s).strip()
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}", r"\1", s)
    s = s.replace("$", "")
    s = re.sub(r"\\left\b|\\right\b", "", s)
    s = re.sub(r"\\[,;:! ]|\\quad|\\qquad", "", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|°", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
    s = re.sub(r"(?<![\d.])0+(?=\d)", "", s)
    return s.lower() if lowercase else s


def parse_number(s: str | None) -> float | None:
    """Float value of a plain number, a fraction ``a/b`` or ``\\frac{a}{b}`` (after normalisation), a
    percentage ``p%`` (-> p); None if `s` is not one of those.

    >>> parse_number(r"\\frac{1}{4}"), parse_number("1,000"), parse_number("-3/2"), parse_number("x")
    (0.25, 1000.0, -1.5, None)
    """
    if s is None:
        return None
    t = normalize_answer(s).rstrip("%").replace("\\%", "")
    m = re.fullmatch(r"([-+]?)\\frac\{([^{}]+)\}\{([^{}]+)\}", t) or re.fullmatch(r"([-+]?)\(?([^/()]+)\)?/\(?([^/()]+)\)?", t)
    try:
        if m:
            den = float(m.group(3))
            return (-1 if m.group(1) == "-" else 1) * float(m.group(2)) / den if den else None
        return float(t)
    except (ValueError, OverflowError):
        return None


def _numbers_close(a: float, b: float, tol: float) -> bool:
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)


def _string_equal(pred: str, gold: str, tol: float) -> bool:
    p, g = normalize_answer(pred), normalize_answer(gold)
    if p == g:
        return True
    pn, gn = parse_number(p), parse_number(g)
    return pn is not None and gn is not None and _numbers_close(pn, gn, tol)


def _run_with_timeout(fn: Callable[[], Any], timeout: float | None) -> tuple[bool, Any]:
    """(finished, result). In the main thread math_verify enforces its own SIGALRM timeouts; elsewhere
    (server threads, thread pools) signals are unavailable, so we run `fn` in a daemon thread and stop
    waiting after `timeout` seconds (a runaway sympy call is abandoned, never awaited at exit)."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["r"] = fn()
        except Exception as exc:  # noqa: BLE001 - any failure means "fall back"
            box["e"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive() or "e" in box:
        return False, None
    return True, box.get("r")


_NESTED_POWER = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\(?[-+]?\w+\)?\s*\^|\*\*[^*]*\*\*")
_BIG_EXPONENT = re.compile(r"(?:\^|\*\*)\s*\{?\s*\(?\s*(\d{5,})")
_BIG_FACTORIAL = re.compile(r"\d{4,}\s*!")


def _too_costly(s: str, max_len: int = 1000) -> bool:
    """Inputs sympy may spend unbounded time on while holding the GIL (power towers, huge exponents or
    factorials, very long strings): no timeout can interrupt those, so they skip symbolic comparison."""
    return len(s) > max_len or bool(_NESTED_POWER.search(s) or _BIG_EXPONENT.search(s) or _BIG_FACTORIAL.search(s))


class _DropTimeoutDisabledWarning(logging.Filter):
    """Off the main thread we call math_verify with timeouts off (we enforce our own), which it warns about
    on every call; drop that one message."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


def _as_latex(s: str) -> str:
    return s if "$" in s or "\\boxed" in s else f"${s}$"


def math_equal(pred: str | None, gold: str, timeout: float = 5.0, tol: float = 1e-6) -> bool:
    """True if `pred` equals `gold` mathematically (``math_verify`` parse + verify, both wrapped as LaTeX),
    or as normalised strings / numbers within `tol` (the fallback when math_verify fails or times out).
    Timeouts: math_verify's SIGALRM in the main thread; elsewhere a daemon thread we stop waiting for.
    Power towers / huge exponents skip the symbolic step (sympy big-integer work holds the GIL, so no
    timeout could stop it).

    >>> math_equal(r"\\frac{1}{2}", "0.5"), math_equal("0.50", r"\\dfrac12"), math_equal("2", "3")
    (True, True, False)
    """
    if pred is None:
        return False
    pred, gold = _text(pred).strip(), str(gold).strip()
    if _string_equal(pred, gold, tol):
        return True
    if _too_costly(pred) or _too_costly(gold):
        return False
    try:
        from math_verify import parse, verify
    except ImportError:  # pragma: no cover - math_verify is a dependency
        return False

    main = threading.current_thread() is threading.main_thread()
    to = int(math.ceil(timeout)) if (main and timeout) else None

    def check() -> bool:
        g = parse(_as_latex(gold), parsing_timeout=to)
        p = parse(_as_latex(pred), parsing_timeout=to)
        return bool(g) and bool(p) and bool(verify(g, p, timeout_seconds=to))

    if main:
        try:
            return check()
        except Exception:  # noqa: BLE001 - timeouts and parser errors fall back to the string match above
            return False
    done, res = _run_with_timeout(check, timeout)
    return bool(done and res)


# ----------------------------------------------------------------------------------- boxes / IoU


def extract_box(text: Any) -> list[float] | None:
    """Box ``[x1, y1, x2, y2]`` from a completion: the answer segment (boxed / ``<answer>``) if any, else
    the text; the last JSON-style list of 4 numbers, else the last 4 numbers. Lists pass through.

    >>> extract_box("<answer>[10, 20, 50, 60]</answer>")
    [10.0, 20.0, 50.0, 60.0]
    >>> extract_box("box: x1=1 y1=2 then 3 4 5 6")
    [3.0, 4.0, 5.0, 6.0]
    >>> extract_box("nothing") is None
    True
    """
    if isinstance(text, (list, tuple)) and len(text) == 4 and all(isinstance(v, (int, float)) for v in text):
        return [float(v) for v in text]
    text = _text(text)
    seg = extract_final_answer(text, fallback=None) or text
    num = r"[-+]?\d+(?:\.\d+)?"
    lists = re.findall(rf"\[\s*({num})\s*,\s*({num})\s*,\s*({num})\s*,\s*({num})\s*\]", seg)
    if lists:
        return [float(v) for v in lists[-1]]
    nums = re.findall(rf"(?<![\w.]){num}", seg)
    return [float(v) for v in nums[-4:]] if len(nums) >= 4 else None


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two ``[x1, y1, x2, y2]`` boxes; 0 for empty / inverted boxes.

    >>> box_iou([0, 0, 2, 2], [1, 1, 3, 3])  # 1 / (4 + 4 - 1)
    0.14285714285714285
    """
    ax1, ay1, ax2, ay2 = a
    bx1, by1, bx2, by2 = b
    area_a, area_b = (ax2 - ax1) * (ay2 - ay1), (bx2 - bx1) * (by2 - by1)
    if ax2 <= ax1 or ay2 <= ay1 or bx2 <= bx1 or by2 <= by1:
        return 0.0
    iw, ih = min(ax2, bx2) - max(ax1, bx1), min(ay2, by2) - max(ay1, by1)
    inter = max(0.0, iw) * max(0.0, ih)
    return inter / (area_a + area_b - inter)


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
