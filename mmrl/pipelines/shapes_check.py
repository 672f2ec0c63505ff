"""GenEval-style compositional check for the synthetic shapes world (`mmrl.pipelines.shapes`), fully offline.

GenEval (Ghosh et al. 2023, arXiv 2310.11513) asks an object detector whether a generated image holds what the
prompt names: the objects, their colours, their counts and their relative positions. Here the "world" is flat
coloured shapes on a flat background, so the detector is exact on rendered scenes and needs no model:

1. every pixel takes the nearest palette colour (`shapes.COLORS`) if it is within `tol` (RGB distance, [0, 1]
   units), else no colour; the background is the most common colour of the image border;
2. per shape colour, a 3x3 morphological opening removes strokes thinner than 3 pixels (blurred edges of a
   generated image between two colours pass through a third one, e.g. red|blue -> purple);
3. 4-connected components of at least `min_area` (fraction of the image) are objects;
4. a component's kind comes from two descriptors: the mean width of its top third over its bottom third
   (an upward triangle ~0.3, a square or circle ~1) and its fill of the bounding box (square 1, circle pi/4).

Prompts: the caption grammar of `shapes.caption` ("two red circles and a blue square on a white background",
the background part optional) and a position grammar "<one object> left of|right of|above|below <one object>
[on a <colour> background]", e.g. "a blue square left of a green circle".

Checks per prompt (each a bool; `None` when the prompt does not ask for it), as GenEval's task types:
  object     every named kind appears (any colour);
  color      every named (colour, kind) appears;
  count      every named (colour, kind) appears exactly its count times;
  position   the largest object of each side of the relation is where the prompt says, by centres, with the
             offset along the relation's axis larger than `position_margin` (fraction of the side);
  background the detected background is the named one;
  exact      stricter than GenEval, reported apart and not part of `correct`: the detected objects are exactly
             the named ones (no extra object of any colour or kind). A busy texture can hold the named shape
             somewhere (GenEval passes it); it fails `exact`.
`correct` = every asked check but `exact` holds (GenEval's per-image score); accuracies are means over the prompts
that ask.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from mmrl.pipelines.shapes import COLORS, KINDS, Scene, Shape, render_scene

__all__ = ["ObjectSpec", "ShapesPrompt", "DetectedObject", "Detection", "CHECKS", "RELATIONS",
           "parse_shapes_prompt", "detect_shapes", "check_prompt", "scene_for_prompt", "check_images", "accuracy"]

CHECKS = ("object", "color", "count", "position", "background", "exact")
RELATIONS = ("left of", "right of", "above", "below")
_PALETTE_NAMES = list(COLORS)
_PALETTE = np.array([COLORS[c] for c in _PALETTE_NAMES], dtype=np.float32) / 255.0  # [8, 3]
_NUMBERS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
            "eight": 8, "nine": 9, "ten": 10}


@dataclass(frozen=True)
class ObjectSpec:
    """`count` shapes of one `color` and `kind` named by a prompt."""

    count: int
    color: str
    kind: str


@dataclass(frozen=True)
class ShapesPrompt:
    """A parsed prompt: the objects, the background colour (None = not named) and the relation between
    objects[0] and objects[1] (None = no position asked)."""

    objects: tuple[ObjectSpec, ...]
    background: str | None = None
    relation: str | None = None


_BG_RE = re.compile(r"^(?P<rest>.+?) on an? (?P<bg>\w+) background$")
_GROUP_RE = re.compile(r"^(?P<n>\w+) (?P<color>\w+) (?P<kind>\w+?)s?$")
_REL_RE = re.compile(r"^(?P<a>.+?) (?P<rel>left of|right of|above|below) (?P<b>.+)$")


def _group(text: str, prompt: str) -> ObjectSpec:
    m = _GROUP_RE.match(text)
    if not m:
        raise ValueError(f"shapes prompt {prompt!r}: cannot read {text!r} (expected '<count> <colour> <kind>', "
                         f"e.g. 'two red circles')")
    n, color, kind = m.group("n"), m.group("color"), m.group("kind")
    count = int(n) if n.isdigit() else _NUMBERS.get(n)
    if count is None or count < 1:
        raise ValueError(f"shapes prompt {prompt!r}: count {n!r} is not a number word ({list(_NUMBERS)}) or digits")
    if color not in COLORS:
        raise ValueError(f"shapes prompt {prompt!r}: colour {color!r} is not one of {list(COLORS)}")
    if kind not in KINDS:
        raise ValueError(f"shapes prompt {prompt!r}: shape {kind!r} is not one of {list(KINDS)}")
    return ObjectSpec(count, color, kind)


def parse_shapes_prompt(text: str) -> ShapesPrompt:
    """"two red circles and a blue square on a white background" / "a blue square left of a green circle".

    Raises ValueError naming the part it cannot read (a prompt from outside the shapes world)."""
    body = " ".join(text.strip().rstrip(".").lower().split())
    background = None
    m = _BG_RE.match(body)
    if m:
        body, background = m.group("rest"), m.group("bg")
        if background not in COLORS:
            raise ValueError(f"shapes prompt {text!r}: background {background!r} is not one of {list(COLORS)}")
    rel = _REL_RE.match(body)
    if rel:
        a, b = _group(rel.group("a"), text), _group(rel.group("b"), text)
        if a.count != 1 or b.count != 1:
            raise ValueError(f"shapes prompt {text!r}: a position relates one object to one object "
                             f"(e.g. 'a red circle left of a blue square')")
        return ShapesPrompt((a, b), background, rel.group("rel"))
    return ShapesPrompt(tuple(_group(p, text) for p in re.split(r", | and ", body)), background)


# ------------------------------------------------------------------------------------------ detector


@dataclass(frozen=True)
class DetectedObject:
    """One connected region of a shape colour: bounding-box centre `x`, `y` and `area` as fractions of the image
    side / area (y downwards), `kind` in KINDS or "other" (an irregular blob), plus the two descriptors."""

    color: str
    kind: str
    x: float
    y: float
    area: float
    fill: float
    taper: float


@dataclass
class Detection:
    background: str | None
    objects: list[DetectedObject]

    def to_dict(self) -> dict:
        return {"background": self.background,
                "objects": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(o).items()}
                            for o in self.objects]}


def _to_array(image: Any) -> np.ndarray:
    """float32 [H, W, 3] in [0, 1] from a float tensor [3, H, W] in [0, 1], a PIL image or a uint8 array."""
    if hasattr(image, "detach"):  # torch tensor, CHW
        t = image.detach().float().cpu()
        if t.dim() != 3 or t.shape[0] != 3:
            raise ValueError(f"detect_shapes: expected an image tensor [3, H, W] in [0, 1], got {tuple(t.shape)}")
        return t.clamp(0, 1).permute(1, 2, 0).numpy()
    if hasattr(image, "convert"):  # PIL
        return np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    arr = np.asarray(image)
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"detect_shapes: expected an image array [H, W, 3], got shape {arr.shape}")
    return arr.astype(np.float32) / (255.0 if arr.dtype == np.uint8 else 1.0)


def _shift_stack(mask: np.ndarray, fill: Any) -> np.ndarray:
    """The 3x3 neighbourhood of every pixel: [9, H, W] (outside the image = `fill`)."""
    h, w = mask.shape
    p = np.pad(mask, 1, constant_values=fill)
    return np.stack([p[dy:dy + h, dx:dx + w] for dy in range(3) for dx in range(3)])


def _opening(mask: np.ndarray) -> np.ndarray:
    eroded = _shift_stack(mask, False).all(0)
    return _shift_stack(eroded, False).any(0) & mask


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """4-connected components of a bool mask, as index arrays (flat pixel indices); vectorised min-label
    propagation with pointer jumping (no per-pixel Python loop)."""
    h, w = mask.shape
    big = h * w
    lab = np.where(mask, np.arange(big).reshape(h, w), big)
    while True:
        p = np.pad(lab, 1, constant_values=big)
        nb = np.minimum.reduce([p[1:-1, 1:-1], p[:-2, 1:-1], p[2:, 1:-1], p[1:-1, :-2], p[1:-1, 2:]])
        new = np.where(mask, nb, big)
        flat = np.append(new.reshape(-1), big)
        new = np.where(mask, flat[new], big)  # jump to the label's own label
        if np.array_equal(new, lab):
            break
        lab = new
    flat = lab.reshape(-1)
    return [np.flatnonzero(flat == r) for r in np.unique(flat[flat < big])]


def _describe(idx: np.ndarray, h: int, w: int) -> tuple[str, float, float, float, float]:
    ys, xs = np.divmod(idx, w)
    y0, y1, x0, x1 = ys.min(), ys.max(), xs.min(), xs.max()
    bh, bw = y1 - y0 + 1, x1 - x0 + 1
    fill = len(idx) / float(bh * bw)
    widths = np.bincount(ys - y0, minlength=bh).astype(np.float64)  # pixels per row
    third = max(1, bh // 3)
    taper = widths[:third].mean() / max(widths[-third:].mean(), 1e-9)
    aspect = max(bh, bw) / min(bh, bw)
    if aspect > 1.5 or fill < 0.35:
        kind = "other"
    elif taper < 0.6:
        kind = "triangle"
    elif fill >= 0.88:
        kind = "square"
    else:
        kind = "circle"
    return kind, (x0 + x1 + 1) / 2 / w, (y0 + y1 + 1) / 2 / h, fill, taper  # bounding-box centre, as Shape.x/y


def detect_shapes(image: Any, tol: float = 0.3, min_area: float = 0.004, max_side: int = 128) -> Detection:
    """Background colour and shapes of one image (see the module docstring).

    image: float tensor [3, H, W] in [0, 1], PIL image or uint8 array [H, W, 3]; larger than `max_side` pixels it
    is first reduced (box filter; the shapes world is resolution free). tol: largest RGB distance ([0, 1] units)
    of a pixel to its palette colour (the palette's closest pair is ~0.45 apart). min_area: smallest object, as
    a fraction of the image area (the smallest `sample_scene` shape, a 0.16-side triangle, covers ~0.013).
    """
    arr = _to_array(image)
    if max(arr.shape[:2]) > max_side:
        from PIL import Image

        scale = max_side / max(arr.shape[:2])
        size = (max(1, round(arr.shape[1] * scale)), max(1, round(arr.shape[0] * scale)))
        pil = Image.fromarray((arr * 255).round().astype(np.uint8)).resize(size, Image.BOX)
        arr = np.asarray(pil, dtype=np.float32) / 255.0
    h, w = arr.shape[:2]
    dist = np.sqrt(((arr[:, :, None, :] - _PALETTE) ** 2).sum(-1))  # [H, W, 8]
    labels = np.where(dist.min(-1) <= tol, dist.argmin(-1), -1)
    border = np.concatenate([labels[0], labels[-1], labels[1:-1, 0], labels[1:-1, -1]])
    border = border[border >= 0]
    bg = int(np.bincount(border).argmax()) if len(border) else -1
    objects = []
    for c in range(len(_PALETTE_NAMES)):
        if c == bg:
            continue
        mask = _opening(labels == c)
        if not mask.any():
            continue
        for idx in _components(mask):
            if len(idx) < min_area * h * w:
                continue
            kind, x, y, fill, taper = _describe(idx, h, w)
            objects.append(DetectedObject(_PALETTE_NAMES[c], kind, float(x), float(y), len(idx) / (h * w),
                                          float(fill), float(taper)))
    objects.sort(key=lambda o: -o.area)
    return Detection(_PALETTE_NAMES[bg] if bg >= 0 else None, objects)


# ------------------------------------------------------------------------------------------ checks


def _relation_holds(a: DetectedObject, b: DetectedObject, relation: str, margin: float) -> bool:
    if relation == "left of":
        return a.x < b.x - margin
    if relation == "right of":
        return a.x > b.x + margin
    if relation == "above":
        return a.y < b.y - margin
    return a.y > b.y + margin  # below


def check_prompt(spec: ShapesPrompt, det: Detection, position_margin: float = 0.05) -> dict[str, bool | None]:
    """{check: True/False, or None when the prompt does not ask for it} for CHECKS, plus `correct` (all asked
    checks but `exact`)."""
    objs = det.objects
    out: dict[str, bool | None] = {
        "object": all(any(o.kind == s.kind for o in objs) for s in spec.objects),
        "color": all(any((o.color, o.kind) == (s.color, s.kind) for o in objs) for s in spec.objects),
        "count": all(sum((o.color, o.kind) == (s.color, s.kind) for o in objs) == s.count for s in spec.objects),
        "position": None,
        "background": None if spec.background is None else det.background == spec.background,
    }
    if spec.relation is not None:
        a, b = ([o for o in objs if (o.color, o.kind) == (s.color, s.kind)] for s in spec.objects[:2])
        # objects are sorted largest first: compare the largest match of each side, as GenEval its top detection
        out["position"] = bool(a and b) and _relation_holds(a[0], b[0], spec.relation, position_margin)
    out["correct"] = all(v for v in out.values() if v is not None)
    named = sorted((s.color, s.kind) for s in spec.objects for _ in range(s.count))
    out["exact"] = sorted((o.color, o.kind) for o in objs) == named
    return out


def scene_for_prompt(spec: ShapesPrompt, rng: random.Random, size: int = 64) -> Scene:
    """A rendered scene that satisfies `spec` exactly (the reference a perfect generator would draw; the
    detector's accuracy on these is its ceiling). Shapes of side 0.16-0.26 at random non-overlapping places;
    for a relation the two objects sit in opposite halves along its axis; an unnamed background is a colour no
    object has."""
    background = spec.background or rng.choice([c for c in COLORS if c not in {o.color for o in spec.objects}])
    wanted = [(o.kind, o.color) for o in spec.objects for _ in range(o.count)]
    for _attempt in range(200):
        shapes: list[Shape] = []
        for i, (kind, color) in enumerate(wanted):
            s = rng.uniform(0.16, 0.26)
            lo, hi = s / 2, 1 - s / 2
            xr, yr = (lo, hi), (lo, hi)
            if spec.relation is not None:  # object 0 on the relation's side, object 1 on the other
                first = spec.relation in ("left of", "above")
                half = (lo, 0.44) if (i == 0) == first else (0.56, hi)
                xr, yr = (half, yr) if spec.relation in ("left of", "right of") else (xr, half)
            cand = Shape(kind, color, rng.uniform(*xr), rng.uniform(*yr), s)
            gap = 2.0 / size  # at least two background pixels between shapes
            if any(max(abs(o.x - cand.x), abs(o.y - cand.y)) < (o.size + s) / 2 + gap for o in shapes):
                break
            shapes.append(cand)
        if len(shapes) == len(wanted):
            return Scene(image=render_scene(shapes, background, size), shapes=shapes, background=background)
    raise ValueError(f"scene_for_prompt: could not place {len(wanted)} shapes without overlap; ask for fewer")


def check_images(images: Sequence[Any], prompts: Sequence[str], **detect_kw: Any) -> list[dict | None]:
    """Per image: {"checks": check_prompt(...), "detected": Detection.to_dict()}, or None for a prompt outside
    the shapes grammar (nothing to check). `detect_kw` go to `detect_shapes` (and `position_margin`)."""
    if len(images) != len(prompts):
        raise ValueError(f"check_images: {len(images)} images but {len(prompts)} prompts")
    margin = detect_kw.pop("position_margin", 0.05)
    out: list[dict | None] = []
    for image, prompt in zip(images, prompts):
        try:
            spec = parse_shapes_prompt(prompt)
        except ValueError:
            out.append(None)
            continue
        det = detect_shapes(image, **detect_kw)
        out.append({"checks": check_prompt(spec, det, margin), "detected": det.to_dict()})
    return out


def accuracy(results: Sequence[dict | None]) -> dict[str, Any]:
    """{"accuracy": {check: mean over prompts that ask it, ..., "overall": mean of `correct`}, "asked": {check:
    number of images}, "checked": images with a shapes prompt, "skipped": the others}. A check nobody asked: None."""
    done = [r["checks"] for r in results if r is not None]
    acc: dict[str, float | None] = {}
    asked: dict[str, int] = {}
    for name in (*CHECKS, "correct"):
        vals = [c[name] for c in done if c.get(name) is not None]
        key = "overall" if name == "correct" else name
        asked[key] = len(vals)
        acc[key] = sum(vals) / len(vals) if vals else None
    return {"accuracy": acc, "asked": asked, "checked": len(done), "skipped": len(results) - len(done)}
