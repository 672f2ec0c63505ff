"""mmrl.pipelines.images: every input form, RGB conversion and resizing equal to qwen_vl_utils (the peer)."""

from __future__ import annotations

import base64
import io
import random

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.pipelines.images import (
    ImageLoadError,
    ImageNotFoundError,
    load_image,
    pil_list_from_tensor,
    resize_for_qwen,
    smart_resize,
    to_tensor01,
)

from qwen_vl_utils import vision_process as qwen_vl_utils  # noqa: E402  (a hard dependency: the peer, never skipped)


def _pattern(h=6, w=9, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _png_bytes(image: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", **kw)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------ input forms


def test_every_input_form_gives_the_same_rgb_pixels(tmp_path):
    arr = _pattern()
    pil = Image.fromarray(arr)
    path = tmp_path / "img.png"
    pil.save(path)
    data = path.read_bytes()
    b64 = base64.b64encode(data).decode()
    forms = {
        "str path": str(path),
        "Path": path,
        "file URL": f"file://{path}",
        "PIL": pil,
        "bytes": data,
        "bare base64": b64,
        "line-wrapped base64": "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76)),
        "data URL": f"data:image/png;base64,{b64}",
        "uint8 HWC": arr,
        "float HWC": arr.astype(np.float32) / 255.0,
        "torch CHW uint8": torch.from_numpy(arr).permute(2, 0, 1),
        "torch CHW float": torch.from_numpy(arr).permute(2, 0, 1).double() / 255.0,
        "torch 1xCxHxW": torch.from_numpy(arr).permute(2, 0, 1).unsqueeze(0).float() / 255.0,
    }
    for name, x in forms.items():
        out = load_image(x)
        assert out.mode == "RGB", name
        assert np.array_equal(np.asarray(out), arr), name
    assert load_image(pil) is not pil  # a new object; the caller's image is never modified


def test_grey_and_alpha_arrays():
    grey = np.arange(12, dtype=np.uint8).reshape(3, 4) * 20
    for x in (grey, grey[:, :, None], torch.from_numpy(grey), torch.from_numpy(grey)[None]):
        out = np.asarray(load_image(x))
        assert out.shape == (3, 4, 3) and np.array_equal(out, np.repeat(grey[:, :, None], 3, axis=2))
    rgba = np.zeros((2, 2, 4), dtype=np.uint8)
    rgba[..., 0] = 200
    rgba[0, 0, 3] = 255  # opaque red-ish; the others fully transparent -> white
    out = np.asarray(load_image(rgba))
    assert out[0, 0].tolist() == [200, 0, 0]
    assert out[1, 1].tolist() == [255, 255, 255]


@pytest.mark.filterwarnings("ignore:Palette images with Transparency")
@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "P_transparent", "L", "CMYK", "1", "I;16", "RGB"])
def test_mode_conversion_matches_qwen_vl_utils(tmp_path, mode):
    rng = np.random.default_rng(1)
    base = Image.fromarray(rng.integers(0, 256, (7, 5, 4), dtype=np.uint8), mode=None)  # RGBA from shape
    if mode == "P_transparent":
        image = base.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
        image.info["transparency"] = 3
        suffix = "png"
    elif mode == "CMYK":
        image, suffix = base.convert("CMYK"), "tiff"
    elif mode == "I;16":
        image = Image.fromarray(rng.integers(0, 65535, (7, 5), dtype=np.uint16))
        suffix = "png"
    else:
        image, suffix = base.convert(mode), "png"
    path = tmp_path / f"img.{suffix}"
    image.save(path)
    expected = np.asarray(qwen_vl_utils.to_rgb(Image.open(path)))
    assert np.array_equal(np.asarray(load_image(path)), expected)
    assert np.array_equal(np.asarray(load_image(Image.open(path))), expected)


def test_exif_orientation_is_applied(tmp_path):
    arr = np.zeros((2, 4, 3), dtype=np.uint8)  # stored 4 wide x 2 high
    arr[0, 0] = [255, 0, 0]  # stored top-left red
    arr[1, 0] = [0, 0, 255]  # stored bottom-left blue
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    path = tmp_path / "rot.png"
    Image.fromarray(arr).save(path, exif=exif)
    out = load_image(path)
    # 90 deg clockwise: 2 wide x 4 high; the stored left column becomes the top row, bottom-left first
    assert out.size == (2, 4)
    px = np.asarray(out)
    assert px[0, 0].tolist() == [0, 0, 255] and px[0, 1].tolist() == [255, 0, 0]
    assert load_image(path, exif_transpose=False).size == (4, 2)


def test_errors_name_the_source(tmp_path):
    missing = tmp_path / "nope.png"
    with pytest.raises(ImageNotFoundError, match="nope.png") as e:
        load_image(str(missing))
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, ValueError)
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image at all")
    with pytest.raises(ImageLoadError, match=r"cannot read image file .*bad.png"):
        load_image(bad)
    with pytest.raises(ImageLoadError, match="directory"):
        load_image(tmp_path)
    with pytest.raises(ImageLoadError, match="cannot decode image from <19 bytes>"):
        load_image(b"not an image at all")
    with pytest.raises(ImageLoadError, match="invalid base64"):
        load_image("data:image/png;base64,@@@@")
    with pytest.raises(ImageLoadError, match="data URL must be"):
        load_image("data:image/png,rawdata")
    with pytest.raises(ImageLoadError, match="URLs are not fetched"):
        load_image("https://example.com/cat.png")
    with pytest.raises(ImageLoadError, match=r"\[0, 1\].*range \[0, 255\]"):
        load_image(np.linspace(0, 255, 12).reshape(2, 2, 3))
    with pytest.raises(ImageLoadError, match=r"shape \(2, 2, 5\)"):
        load_image(np.zeros((2, 2, 5), dtype=np.uint8))
    with pytest.raises(ImageLoadError, match=r"CHW with C in \(1, 3, 4\), got shape \(2, 5, 5\)"):
        load_image(torch.zeros(2, 5, 5))
    with pytest.raises(ImageLoadError, match="unsupported image input <int>"):
        load_image(3)
    with pytest.raises(ImageLoadError, match="empty string"):
        load_image("")


# ------------------------------------------------------------------------------------------- resizing


def test_smart_resize_equals_qwen_vl_utils_on_random_sizes():
    rng = random.Random(0)
    checked = 0
    for _ in range(3000):
        factor = rng.choice([14, 28, 32])
        h = rng.choice([rng.randint(1, 64), rng.randint(1, 4000), rng.randint(1, 20000)])
        w = rng.choice([rng.randint(1, 64), rng.randint(1, 4000), max(1, int(h * rng.uniform(0.2, 5)))])
        kw = {}
        if rng.random() < 0.7:
            lo = rng.choice([factor**2, 4 * factor**2, 256 * 28 * 28, rng.randint(1, 10**6)])
            hi = lo + rng.choice([0, rng.randint(0, 10**7), 1280 * 28 * 28])
            kw = dict(min_pixels=lo, max_pixels=hi)
        try:
            expected = qwen_vl_utils.smart_resize(h, w, factor, **kw)
        except ValueError as e:
            with pytest.raises(ValueError) as ours:
                smart_resize(h, w, factor, **kw)
            assert str(ours.value) == str(e)
            continue
        assert smart_resize(h, w, factor, **kw) == expected, (h, w, factor, kw)
        checked += 1
    assert checked > 2500


def test_smart_resize_extreme_aspect_ratio_and_bad_arguments():
    with pytest.raises(ValueError) as theirs:
        qwen_vl_utils.smart_resize(10, 2500, 28)
    with pytest.raises(ValueError) as ours:
        smart_resize(10, 2500, 28)
    assert str(ours.value) == str(theirs.value) == "absolute aspect ratio must be smaller than 200, got 250.0"
    # the limit can be tightened (one line, qwen_vl_utils' wording), not raised past qwen_vl_utils' (the processors
    # of transformers refuse such images too)
    with pytest.raises(ValueError, match="absolute aspect ratio must be smaller than 50, got 100.0"):
        smart_resize(10, 1000, 28, max_ratio=50)
    with pytest.raises(ValueError, match=r"max_ratio=300 is above qwen_vl_utils' MAX_RATIO \(200\)"):
        smart_resize(10, 2500, 28, max_ratio=300)
    with pytest.raises(ValueError, match="factor must be positive"):
        smart_resize(10, 10, 0)
    with pytest.raises(ValueError, match="max_pixels .* must be >= min_pixels"):
        smart_resize(100, 100, 28, min_pixels=10_000, max_pixels=100)
    with pytest.raises(ValueError, match="positive height and width, got height=0"):
        smart_resize(0, 100)
    # by hand: 100x200 at factor 28 rounds to 112x196 (within the default bounds)
    assert smart_resize(100, 200) == (112, 196)


@pytest.mark.parametrize("size,factor,bounds", [
    ((37, 91), 28, (4 * 28 * 28, 64 * 28 * 28)),
    ((640, 480), 28, (4 * 28 * 28, 100 * 28 * 28)),  # downscale
    ((20, 30), 32, (16 * 32 * 32, 64 * 32 * 32)),  # upscale, Qwen3-VL factor
    ((56, 84), 28, (None, None)),  # already a multiple: unchanged
])
def test_resize_for_qwen_equals_fetch_image(size, factor, bounds):
    h, w = size
    image = Image.fromarray(_pattern(h, w, seed=3))
    lo, hi = bounds
    ele = {"image": image}
    if lo is not None:
        ele.update(min_pixels=lo, max_pixels=hi)
    expected = qwen_vl_utils.fetch_image(ele, image_patch_size=factor // 2)
    got = resize_for_qwen(image, min_pixels=lo, max_pixels=hi, factor=factor)
    assert got.size == expected.size
    assert got.size[0] % factor == 0 and got.size[1] % factor == 0
    assert np.array_equal(np.asarray(got), np.asarray(expected))


# ------------------------------------------------------------------------------------ tensor round trip


def test_tensor_round_trip():
    arrays = [_pattern(5, 7, seed=s) for s in range(3)]
    batch = to_tensor01([Image.fromarray(a) for a in arrays])
    assert batch.shape == (3, 3, 5, 7) and batch.dtype == torch.float32
    assert torch.equal(batch[1], torch.from_numpy(arrays[1]).permute(2, 0, 1).float() / 255)
    back = pil_list_from_tensor(batch)
    assert all(np.array_equal(np.asarray(p), a) for p, a in zip(back, arrays))
    assert torch.equal(to_tensor01(batch), batch)
    assert to_tensor01(batch[0]).shape == (1, 3, 5, 7)
    assert torch.equal(to_tensor01(torch.from_numpy(arrays[0]).permute(2, 0, 1)), batch[:1])  # uint8 CHW
    assert to_tensor01(torch.rand(2, 1, 4, 4)).shape == (2, 3, 4, 4)
    # values outside [0, 1] are clamped on the way back to PIL
    assert np.asarray(pil_list_from_tensor(torch.full((3, 2, 2), 1.5))[0]).min() == 255


def test_tensor_errors():
    with pytest.raises(ValueError, match=r"image 0 is 7x5 \(WxH\), image 1 is 4x4"):
        to_tensor01([_pattern(5, 7), _pattern(4, 4)])
    with pytest.raises(ValueError, match=r"lie in \[0, 1\], got range \[-2, -2\]"):
        to_tensor01(torch.full((1, 3, 2, 2), -2.0))
    with pytest.raises(ValueError, match=r"NCHW or CHW with C in \(1, 3\), got shape \(1, 2, 2, 2\)"):
        to_tensor01(torch.zeros(1, 2, 2, 2))
    with pytest.raises(ValueError, match="non-empty list"):
        to_tensor01([])
    with pytest.raises(ValueError, match="expected a torch tensor"):
        pil_list_from_tensor(np.zeros((3, 2, 2)))
