"""Answer strings of text completions: extraction (``\\boxed{}``, ``<answer>`` tags, last number, choice letter,
box), normalisation, numeric parsing and mathematical equality (``math_verify`` with a string / number fallback).

Pure string helpers with doctests; the rewards built on them are in ``mmrl.rewards.text`` (which re-exports these
names). A completion may be a string or a conversational message list; the last message's text is used.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from typing import Any, Callable, Sequence

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
