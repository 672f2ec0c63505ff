"""Synthetic shapes: determinism, captions and QA answers that are right by construction."""

import random

import numpy as np
import pytest

from mmrl.pipelines.shapes import (COLORS, KINDS, QA_KINDS, Scene, Shape, caption, parse_caption, qa_for_scene,
                                   render_scene, sample_scene)


def _centre_pixel(scene: Scene, s: Shape) -> tuple:
    w = scene.image.size[0]
    return scene.image.getpixel((int(s.x * w), int(s.y * w)))


def test_sample_scene_is_deterministic():
    a = sample_scene(random.Random(7), n_shapes=(1, 4))
    b = sample_scene(random.Random(7), n_shapes=(1, 4))
    assert a.shapes == b.shapes and a.background == b.background
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image))
    c = sample_scene(random.Random(8), n_shapes=(1, 4))
    assert (c.shapes, c.background) != (a.shapes, a.background)


def test_render_exact_colours_and_geometry():
    img = render_scene([Shape("square", "red", 0.25, 0.25, 0.5)], "blue", size=8)
    arr = np.asarray(img)
    assert arr.shape == (8, 8, 3)
    # square of side 4 px covering pixels [0, 4) x [0, 4); the rest is background
    assert (arr[:4, :4] == COLORS["red"]).all()
    assert (arr[4:, :] == COLORS["blue"]).all() and (arr[:, 4:] == COLORS["blue"]).all()
    # every pixel of any scene is one of the palette colours (no anti-aliasing)
    scene = sample_scene(random.Random(0), n_shapes=3)
    palette = {tuple(v) for v in COLORS.values()}
    assert {tuple(p) for p in np.asarray(scene.image).reshape(-1, 3)} <= palette


def test_captions():
    one = Scene(None, [Shape("circle", "red", 0.3, 0.3, 0.3)], "blue")
    assert caption(one) == "a red circle on a blue background"
    many = Scene(None, [Shape("square", "green", 0.2, 0.2, 0.2), Shape("circle", "red", 0.8, 0.2, 0.2),
                        Shape("square", "green", 0.2, 0.8, 0.2)], "white")
    assert caption(many) == "two green squares and a red circle on a white background"
    three = Scene(None, [Shape("triangle", "orange", 0.2, 0.2, 0.2), Shape("circle", "red", 0.8, 0.2, 0.2),
                         Shape("square", "purple", 0.2, 0.8, 0.2)], "orange")
    assert caption(three) == "an orange triangle, a red circle and a purple square on an orange background"
    assert parse_caption(caption(many)) == {"background": "white",
                                            "objects": [(2, "green", "square"), (1, "red", "circle")]}


@pytest.mark.parametrize("seed", range(40))
def test_scene_invariants_and_caption_roundtrip(seed):
    scene = sample_scene(random.Random(seed), n_shapes=(1, 4))
    assert 1 <= len(scene.shapes) <= 4 and scene.caption == caption(scene)
    parsed = parse_caption(scene.caption)
    assert parsed["background"] == scene.background
    assert sum(n for n, _, _ in parsed["objects"]) == len(scene.shapes)
    for s in scene.shapes:
        assert s.color != scene.background and s.kind in KINDS
        assert abs(s.x - 0.5) >= 0.05 and abs(s.y - 0.5) >= 0.05
        assert _centre_pixel(scene, s) == COLORS[s.color]


@pytest.mark.parametrize("seed", range(60))
def test_qa_answers_are_correct_by_construction(seed):
    rng = random.Random(seed)
    scene = sample_scene(rng, n_shapes=(1, 4), size=56)
    shapes = scene.shapes
    for kind in QA_KINDS:
        q, a = qa_for_scene(scene, kind, rng)
        assert isinstance(q, str) and q.endswith("?") and " " not in a
        if kind == "color":
            if q == "What color is the background?":
                assert a == scene.background and scene.image.getpixel((0, 0)) == COLORS[a]
            else:
                k = q.split()[-1][:-1]
                (s,) = [s for s in shapes if s.kind == k]
                assert a == s.color and _centre_pixel(scene, s) == COLORS[a]
        elif kind == "count":
            k = q.split()[2][:-1]
            assert int(a) == (len(shapes) if k == "shape" else sum(s.kind == k for s in shapes))
        elif kind == "shape":
            if q.startswith("What shape"):
                (s,) = [s for s in shapes if s.color == q.split()[4]]
                assert a == s.kind
            else:
                color, k = q[:-1].split()[-2:]
                assert a == ("yes" if any((s.color, s.kind) == (color, k) for s in shapes) else "no")
        else:
            if q.startswith("Is the "):
                color, k = q.split()[2:4]
                (s,) = [s for s in shapes if (s.color, s.kind) == (color, k)]
                if "left" in q:
                    assert a == ("left" if s.x < 0.5 else "right")
                else:
                    assert a == ("top" if s.y < 0.5 else "bottom")
            else:
                assert a in ("yes", "no")


def test_count_answer_equals_number_of_drawn_shapes():
    rng = random.Random(3)
    for _ in range(20):
        scene = sample_scene(rng, n_shapes=(1, 5), kinds=["circle"])
        q, a = qa_for_scene(scene, "count", rng)
        assert int(a) == len(scene.shapes)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="Shape.kind"):
        Shape("hexagon", "red", 0.5, 0.5, 0.3)
    with pytest.raises(ValueError, match="Shape.color"):
        Shape("circle", "teal", 0.5, 0.5, 0.3)
    with pytest.raises(ValueError, match="background"):
        render_scene([], "teal")
    with pytest.raises(ValueError, match="qa_for_scene kind"):
        qa_for_scene(sample_scene(random.Random(0)), "size", random.Random(0))
    with pytest.raises(ValueError, match="parse_caption"):
        parse_caption("a cat on a mat")
    with pytest.raises(ValueError, match="no shape colour"):
        sample_scene(random.Random(0), colors=["red"])


def test_color_fraction_counts_pixels_near_the_palette_colour():
    import torch

    from mmrl.pipelines.shapes import color_fraction

    img = torch.from_numpy(np.array(render_scene([Shape("square", "red", 0.25, 0.5, 0.5)], "blue", size=8)))
    x = img.permute(2, 0, 1)[None].float() / 255.0  # 4x4 red square on 8x8 blue: 16 of 64 pixels
    assert color_fraction(x, "red").tolist() == [0.25]
    assert color_fraction(x, "blue").tolist() == [0.75]
    assert color_fraction(x, "orange").tolist() == [0.0]  # red/orange are ~0.45 apart, tol 0.2
    noisy = (x + 0.05).clamp(0, 1)  # distance to red <= 0.05 * sqrt(3) = 0.087
    assert color_fraction(noisy, "red", tol=0.1).tolist() == [0.25]
    assert color_fraction(noisy, "red", tol=0.05).tolist() == [0.0]
    with pytest.raises(ValueError, match="color_fraction"):
        color_fraction(x[0], "red")
