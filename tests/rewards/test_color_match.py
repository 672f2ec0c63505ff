import math

import pytest
import torch

from mmrl.pipelines.shapes import COLORS, Shape, render_scene
from mmrl.rewards import load


def _t(pil):
    import numpy as np

    return torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1).float()[None] / 255


def test_prompt_color_by_hand():
    img = _t(render_scene([Shape("square", "red", 0.25, 0.25, 0.5)], "blue", size=32))
    # the square covers 16x16 of 32x32 pixels (exact palette colours, no anti-aliasing)
    red_frac = (img[0] == torch.tensor(COLORS["red"]).view(3, 1, 1) / 255).all(0).float().mean().item()
    prompt = "a red square on a blue background"
    hard = load("prompt_color", hard=True)(img, [prompt]).scores
    assert hard.item() == pytest.approx(1 - red_frac)
    shape = load("prompt_color", target="shape", hard=True)(img, [prompt]).scores
    assert shape.item() == pytest.approx(red_frac)
    # soft: blue pixels count 1; red pixels count exp(-d^2 / (2 sigma^2)) with d = |red - blue|
    d2 = sum((a - b) ** 2 for a, b in zip(COLORS["red"], COLORS["blue"])) / 255 ** 2
    expected = (1 - red_frac) + red_frac * math.exp(-d2 / (2 * 0.25 ** 2))
    soft = load("prompt_color")(img, [prompt]).scores
    assert soft.item() == pytest.approx(expected, rel=1e-5)


def test_prompt_color_gradient_and_errors():
    x = torch.rand(2, 3, 8, 8, requires_grad=True)
    r = load("prompt_color")
    out = r(x, ["a red circle on a blue background", "a green square on a white background"])
    out.scores.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="cannot read a colour"):
        r(torch.rand(1, 3, 8, 8), ["a photo of a cat"])
    with pytest.raises(ValueError, match="needs prompts"):
        r(torch.rand(1, 3, 8, 8))
    assert r(torch.rand(1, 3, 8, 8), ["anything"], metadata=[{"color": "red"}]).details["color"] == ["red"]
