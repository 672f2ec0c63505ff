"""Synthetic scenes of flat coloured shapes: renderer, captions and exact visual-QA pairs.

Both trainer families use it: the diffusion side pretrains the tiny text-to-image model on
(caption, image) pairs ("a red circle on a blue background"), the VLM side asks questions whose
answers are right by construction (colour, count, shape, position).

Coordinates are resolution free: a ``Shape``'s centre ``(x, y)`` and ``size`` (side of its bounding
square) are fractions of the image side, ``y`` growing downwards as in PIL. The same scene renders at
any ``size`` in pixels. Rendering uses PIL without anti-aliasing, so every pixel is exactly one of
``COLORS``; ``sample_scene`` keeps shapes from overlapping, keeps each shape's colour different from the
background and keeps every centre off the image's central lines, so "left/right/top/bottom" is never
ambiguous.

Everything is deterministic given a ``random.Random``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Sequence

from PIL import Image, ImageDraw

__all__ = [
    "COLORS",
    "KINDS",
    "QA_KINDS",
    "Shape",
    "Scene",
    "render_scene",
    "sample_scene",
    "caption",
    "parse_caption",
    "qa_for_scene",
    "color_fraction",
]

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (245, 215, 30),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "orange": (255, 135, 0),
    "purple": (135, 40, 175),
}
KINDS: tuple[str, ...] = ("circle", "square", "triangle")
QA_KINDS: tuple[str, ...] = ("color", "count", "shape", "position")

# Centres stay at least this far (fraction of the side) from the vertical and horizontal centre lines.
CENTER_MARGIN = 0.06
_NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine",
                 10: "ten"}
_WORD_NUMBERS = {"a": 1, "an": 1, "one": 1, **{w: n for n, w in _NUMBER_WORDS.items()}}


@dataclass(frozen=True)
class Shape:
    """One flat shape. ``x``, ``y``: centre, ``size``: side of the bounding square; all fractions of
    the image side (``y`` downwards)."""

    kind: str
    color: str
    x: float
    y: float
    size: float

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Shape.kind: expected one of {list(KINDS)}, got {self.kind!r}")
        _check_color(self.color, "Shape.color")
        if not self.size > 0:
            raise ValueError(f"Shape.size: expected > 0 (fraction of the image side), got {self.size}")


@dataclass
class Scene:
    """A rendered scene: ``image`` (RGB PIL), the ``shapes`` drawn (in drawing order), ``background``."""

    image: Image.Image
    shapes: list[Shape]
    background: str
    caption: str = field(default="", repr=False)


def _check_color(name: str, what: str) -> None:
    if name not in COLORS:
        raise ValueError(f"{what}: expected one of {list(COLORS)}, got {name!r}")


def render_scene(shapes: Sequence[Shape], background: str, size: int = 64) -> Image.Image:
    """Draw ``shapes`` in order (later ones on top) on a ``background`` colour; ``size`` x ``size`` RGB."""
    _check_color(background, "background")
    if int(size) < 4:
        raise ValueError(f"render_scene: size must be >= 4 pixels, got {size}")
    size = int(size)
    img = Image.new("RGB", (size, size), COLORS[background])
    draw = ImageDraw.Draw(img)
    for s in shapes:
        cx, cy, h = s.x * size, s.y * size, s.size * size / 2
        x0, y0, x1, y1 = round(cx - h), round(cy - h), round(cx + h) - 1, round(cy + h) - 1
        fill = COLORS[s.color]
        if s.kind == "circle":
            draw.ellipse([x0, y0, x1, y1], fill=fill)
        elif s.kind == "square":
            draw.rectangle([x0, y0, x1, y1], fill=fill)
        else:  # upward triangle inscribed in the bounding square
            draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)
    return img


def _sample_coord(rng: random.Random, half: float) -> float:
    """A centre in [half, 1 - half] at least CENTER_MARGIN away from 0.5 (left/right half chosen first)."""
    lo, hi = half, 0.5 - CENTER_MARGIN
    if hi < lo:  # shape too large for the margin: put its edge at the border
        hi = lo
    c = rng.uniform(lo, hi)
    return c if rng.random() < 0.5 else 1.0 - c


def _overlap(a: Shape, b: Shape, gap: float) -> bool:
    reach = (a.size + b.size) / 2 + gap
    return abs(a.x - b.x) < reach and abs(a.y - b.y) < reach


def sample_scene(rng: random.Random, n_shapes: int | tuple[int, int] = (1, 1),
                 colors: Sequence[str] | None = None, kinds: Sequence[str] | None = None, size: int = 64,
                 backgrounds: Sequence[str] | None = None,
                 size_range: tuple[float, float] | None = None) -> Scene:
    """Random scene: ``n_shapes`` (an int or an inclusive ``(min, max)``) non-overlapping shapes.

    Shape colours come from ``colors`` (default: all of ``COLORS``), kinds from ``kinds`` (default
    ``KINDS``), the background from ``backgrounds`` (default: ``colors``) and always differs from every
    shape colour. ``size_range``: shape size as a fraction of the side (default (0.3, 0.5) for one shape,
    (0.16, 0.28) for several). Deterministic given ``rng``'s state.
    """
    lo_n, hi_n = (n_shapes, n_shapes) if isinstance(n_shapes, int) else tuple(n_shapes)
    if not 1 <= lo_n <= hi_n:
        raise ValueError(f"n_shapes: expected an int >= 1 or (min, max) with 1 <= min <= max, got {n_shapes!r}")
    colors = list(colors) if colors is not None else list(COLORS)
    kinds = list(kinds) if kinds is not None else list(KINDS)
    backgrounds = list(backgrounds) if backgrounds is not None else colors
    for c in colors + backgrounds:
        _check_color(c, "sample_scene colors/backgrounds")
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"sample_scene kinds: expected a subset of {list(KINDS)}, got {k!r}")
    if not colors or not kinds or not backgrounds:
        raise ValueError("sample_scene: colors, kinds and backgrounds must be non-empty")
    n = rng.randint(lo_n, hi_n)
    size_lo, size_hi = size_range or ((0.3, 0.5) if n == 1 else (0.16, 0.28))
    background = rng.choice(backgrounds)
    fg = [c for c in colors if c != background]
    if not fg:
        raise ValueError(f"sample_scene: no shape colour differs from background {background!r}; pass more colors")
    gap = 1.5 / size  # at least one background pixel between shapes
    for _attempt in range(100):
        shapes: list[Shape] = []
        for _ in range(n):
            for _try in range(50):
                s = rng.uniform(size_lo, size_hi)
                cand = Shape(rng.choice(kinds), rng.choice(fg), _sample_coord(rng, s / 2), _sample_coord(rng, s / 2), s)
                if not any(_overlap(cand, o, gap) for o in shapes):
                    shapes.append(cand)
                    break
            else:
                break
        if len(shapes) == n:
            image = render_scene(shapes, background, size)
            scene = Scene(image=image, shapes=shapes, background=background)
            scene.caption = caption(scene)
            return scene
    raise ValueError(f"sample_scene: could not place {n} shapes of size {size_range} without overlap; "
                     f"use smaller size_range or fewer shapes")


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _groups(shapes: Sequence[Shape]) -> list[tuple[str, str, int]]:
    """(color, kind, count) in order of first appearance."""
    counts: dict[tuple[str, str], int] = {}
    for s in shapes:
        counts[(s.color, s.kind)] = counts.get((s.color, s.kind), 0) + 1
    return [(c, k, n) for (c, k), n in counts.items()]


def caption(scene: Scene) -> str:
    """"a red circle on a blue background"; "two green squares and a red circle on a white background"."""
    parts = []
    for color, kind, n in _groups(scene.shapes):
        if n == 1:
            parts.append(f"{_article(color)} {color} {kind}")
        else:
            parts.append(f"{_NUMBER_WORDS.get(n, str(n))} {color} {kind}s")
    if not parts:
        return f"{_article(scene.background)} {scene.background} background"
    objects = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"{objects} on {_article(scene.background)} {scene.background} background"


_CAPTION_RE = re.compile(r"^(?P<objects>.+) on an? (?P<bg>\w+) background$")
_GROUP_RE = re.compile(r"^(?P<n>\w+) (?P<color>\w+) (?P<kind>circle|square|triangle)s?$")


def parse_caption(text: str) -> dict:
    """Inverse of ``caption``: ``{"background": str, "objects": [(count, color, kind), ...]}``.

    Used by rewards that only see the prompt (e.g. "fraction of pixels in the prompt's shape colour").
    """
    m = _CAPTION_RE.match(text.strip())
    if not m:
        raise ValueError(f"parse_caption: expected '<objects> on a <color> background', got {text!r}")
    bg = m.group("bg")
    _check_color(bg, f"parse_caption background in {text!r}")
    objects = []
    for part in re.split(r", | and ", m.group("objects")):
        g = _GROUP_RE.match(part)
        if not g or g.group("n") not in _WORD_NUMBERS and not g.group("n").isdigit():
            raise ValueError(f"parse_caption: cannot parse {part!r} in {text!r} (expected '<count> <color> <kind>')")
        _check_color(g.group("color"), f"parse_caption colour in {text!r}")
        n = _WORD_NUMBERS.get(g.group("n")) or int(g.group("n"))
        objects.append((n, g.group("color"), g.group("kind")))
    return {"background": bg, "objects": objects}


def _side(s: Shape, axis: str) -> str:
    if axis == "x":
        return "left" if s.x < 0.5 else "right"
    return "top" if s.y < 0.5 else "bottom"


def qa_for_scene(scene: Scene, kind: str, rng: random.Random) -> tuple[str, str]:
    """A question about ``scene`` and its exact answer (one lower-case word or a number as digits).

    - ``"color"``: "What color is the circle?" (a kind drawn once) -> colour name; if every kind appears
      more than once: "What color is the background?".
    - ``"count"``: "How many shapes are there?" or "How many triangles are there?" -> e.g. "2".
    - ``"shape"``: "What shape is the red object?" (a colour used once) -> kind; otherwise
      "Is there a red circle?" -> "yes"/"no".
    - ``"position"``: "Is the red circle on the left or the right?" / "... at the top or the bottom?"
      (a colour+kind drawn once) -> "left"/"right"/"top"/"bottom" (by the shape's centre relative to the
      image centre); otherwise "Is there a red circle on the left?" -> "yes"/"no".
    """
    shapes = scene.shapes
    if not shapes:
        raise ValueError("qa_for_scene: scene has no shapes")
    if kind == "color":
        unique = [s for s in shapes if sum(o.kind == s.kind for o in shapes) == 1]
        if not unique:
            return "What color is the background?", scene.background
        s = rng.choice(unique)
        return f"What color is the {s.kind}?", s.color
    if kind == "count":
        present = sorted({s.kind for s in shapes})
        if len(present) == 1 and rng.random() < 0.5:
            return "How many shapes are there?", str(len(shapes))
        k = rng.choice(present + ["shape"])
        n = len(shapes) if k == "shape" else sum(s.kind == k for s in shapes)
        return f"How many {k}s are there?", str(n)
    if kind == "shape":
        unique = [s for s in shapes if sum(o.color == s.color for o in shapes) == 1]
        if unique:
            s = rng.choice(unique)
            return f"What shape is the {s.color} object?", s.kind
        s = rng.choice(shapes)
        k = rng.choice(KINDS)
        present = any(o.color == s.color and o.kind == k for o in shapes)
        return f"Is there {_article(s.color)} {s.color} {k}?", "yes" if present else "no"
    if kind == "position":
        axis = rng.choice(("x", "y"))
        unique = [s for s in shapes if sum((o.color, o.kind) == (s.color, s.kind) for o in shapes) == 1]
        if unique:
            s = rng.choice(unique)
            if axis == "x":
                return f"Is the {s.color} {s.kind} on the left or the right?", _side(s, "x")
            return f"Is the {s.color} {s.kind} at the top or the bottom?", _side(s, "y")
        s = rng.choice(shapes)
        side = rng.choice(("left", "right") if axis == "x" else ("top", "bottom"))
        present = any((o.color, o.kind) == (s.color, s.kind) and _side(o, axis) == side for o in shapes)
        where = f"on the {side}" if axis == "x" else f"at the {side}"
        return f"Is there {_article(s.color)} {s.color} {s.kind} {where}?", "yes" if present else "no"
    raise ValueError(f"qa_for_scene kind: expected one of {list(QA_KINDS)}, got {kind!r}")


def color_fraction(images, color: str, tol: float = 0.2):
    """Fraction of pixels within RGB distance ``tol`` (in [0, 1] units) of ``COLORS[color]``, per image.

    ``images``: float tensor NCHW in [0, 1]; returns a float tensor [N]. The palette's closest pair
    (red/orange, blue/purple) is about 0.45 apart, so the default ``tol`` never counts a pixel for two
    colours.
    """
    import torch

    _check_color(color, "color_fraction color")
    if not (isinstance(images, torch.Tensor) and images.ndim == 4 and images.shape[1] == 3):
        raise ValueError(f"color_fraction: expected a float tensor [N, 3, H, W] in [0, 1], got "
                         f"{type(images).__name__} {tuple(getattr(images, 'shape', ()))}")
    ref = torch.tensor(COLORS[color], dtype=images.dtype, device=images.device).view(1, 3, 1, 1) / 255.0
    dist = (images - ref).pow(2).sum(1).sqrt()
    return (dist <= tol).float().mean(dim=(1, 2))
