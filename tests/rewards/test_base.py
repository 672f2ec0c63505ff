import io

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.rewards import RewardOutput, available, load, to_image_tensor
from mmrl.rewards.base import RewardModel, register


def _jpeg_kb(pil, q=95):
    buf = io.BytesIO()
    pil.save(buf, format="JPEG", quality=q)
    return len(buf.getvalue()) / 1000.0


def test_jpeg_rewards_match_pil_and_order():
    g = torch.Generator().manual_seed(0)
    flat = torch.full((1, 3, 32, 32), 0.5)
    noise = torch.rand(1, 3, 32, 32, generator=g)
    imgs = torch.cat([flat, noise])
    inc = load("jpeg_incompressibility")(imgs)
    com = load("jpeg_compressibility")(imgs)
    assert isinstance(inc, RewardOutput) and inc.scores.shape == (2,)
    # same number PIL gives for the uint8-rounded image
    arr = (imgs.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    expected = torch.tensor([_jpeg_kb(Image.fromarray(a)) for a in arr])
    assert torch.allclose(inc.scores, expected)
    assert torch.equal(com.scores, -inc.scores)
    assert inc.scores[1] > 2 * inc.scores[0]  # noise is much larger than a flat image
    # batch-size invariance and order
    small = load("jpeg_incompressibility", batch_size=1)(imgs.flip(0))
    assert torch.equal(small.scores, inc.scores.flip(0))


def test_input_forms_agree(tmp_path):
    t = torch.rand(2, 3, 8, 8)
    arr = (t.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    pils = [Image.fromarray(a) for a in arr]
    paths = []
    for i, p in enumerate(pils):
        paths.append(tmp_path / f"{i}.png")
        p.save(paths[-1])
    ref = torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 255
    for form in (pils, list(arr), [str(p) for p in paths], torch.from_numpy(arr).permute(0, 3, 1, 2)):
        assert torch.allclose(to_image_tensor(form), ref)


def test_bad_inputs_clear_errors(tmp_path):
    r = load("jpeg_compressibility")
    with pytest.raises(ValueError, match="empty batch"):
        r(torch.zeros(0, 3, 8, 8))
    with pytest.raises(ValueError, match=r"got 2 inputs but 3 prompts"):
        r(torch.rand(2, 3, 8, 8), prompts=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"in \[0,1\]"):
        r(torch.rand(2, 3, 8, 8) * 2 - 1)
    with pytest.raises(ValueError, match="1, 3 or 4 channels"):
        r(torch.rand(2, 2, 8, 8))
    nan_batch = torch.rand(3, 3, 8, 8)
    nan_batch[1, 0, 2, 2] = float("nan")  # NaN slips through min/max range checks; must not be scored
    with pytest.raises(ValueError, match=r"NaN/inf values \(first in image 1\)"):
        r(nan_batch)
    with pytest.raises((ValueError, FileNotFoundError), match="missing.png"):
        r([str(tmp_path / "missing.png")])
    with pytest.raises(ValueError, match="different sizes"):
        to_image_tensor([Image.new("RGB", (8, 8)), Image.new("RGB", (9, 8))])
    with pytest.raises(ValueError, match="unknown reward 'nope'; available"):
        load("nope")


def test_a_batch_of_images_of_different_sizes_is_scored_per_size_in_input_order():
    """PIL images / paths of several sizes (what the CLI accepts): each size is one call, results in input order,
    equal to scoring each image alone; per-sample details follow the same order."""
    calls = []

    @register("_test_sized")
    class Sized(RewardModel):
        name = "_test_sized"

        def score_images(self, images, prompts, metadata):
            calls.append(tuple(images.shape))
            s = images.mean(dim=(1, 2, 3)) + images.shape[-1]  # depends on the pixels and on the width
            return RewardOutput(s, {"width": [images.shape[-1]] * len(s), "seen": torch.arange(len(s)),
                                    "prompt": list(prompts)})

    r = load("_test_sized")
    ims = [Image.new("RGB", (8, 8), (i * 40, 0, 0)) if i % 2 == 0 else Image.new("RGB", (9, 6), (0, i * 40, 0))
           for i in range(5)]
    prompts = [f"p{i}" for i in range(5)]
    out = r(ims, prompts=prompts)
    assert sorted(calls) == [(2, 3, 6, 9), (3, 3, 8, 8)]
    alone = torch.cat([r([im], prompts=[p]).scores for im, p in zip(ims, prompts)])
    assert torch.allclose(out.scores, alone)
    assert out.details["width"] == [8, 9, 8, 9, 8] and out.details["prompt"] == prompts
    assert out.details["seen"].tolist() == [0, 0, 1, 1, 2]  # each image's index within its own size group
    with pytest.raises(ValueError, match="got 5 inputs but 2 prompts"):
        r(ims, prompts=["a", "b"])
    comp = load({"_test_sized": 1.0, "jpeg_incompressibility": 0.5})  # a composite takes them too
    both = comp(ims, prompts=prompts)
    assert both.scores.shape == (5,) and both.details["_test_sized/width"] == [8, 9, 8, 9, 8]


def test_registry_and_chunking():
    @register("_test_mean_brightness")
    class Bright(RewardModel):
        name = "_test_mean_brightness"
        batch_size = 3

        def score_images(self, images, prompts, metadata):
            return RewardOutput(images.mean(dim=(1, 2, 3)), {"prompt": list(prompts)})

    assert "_test_mean_brightness" in available() and "jpeg_compressibility" in available()
    imgs = torch.rand(7, 3, 4, 4)
    out = load("_test_mean_brightness")(imgs, prompts=[str(i) for i in range(7)])
    assert torch.allclose(out.scores, imgs.mean(dim=(1, 2, 3)))
    assert out.details["prompt"] == [str(i) for i in range(7)]  # chunks of 3 concatenated in order
