"""Load and normalise images: one entry point from every common input form to an RGB ``PIL.Image``.

``load_image`` accepts a path (``str``/``Path``, ``file://``), a ``PIL.Image``, raw ``bytes``, a base64
string (bare, or a ``data:image/...;base64,`` URL), a numpy array (HWC uint8, HW grey, HWC float in
[0, 1]) or a torch tensor (CHW / HW / 1xCxHxW, uint8 or float in [0, 1]). Every result is EXIF-rotated
and converted to RGB the way ``qwen_vl_utils`` does (RGBA is composited on white, every other mode goes
through ``Image.convert("RGB")``), so pixels match what the Qwen-VL reference preprocessing feeds the
model. URLs are not fetched: download first (training data should not depend on the network).

``to_rgb``, ``smart_resize`` and ``resize_for_qwen`` call ``qwen_vl_utils`` (``to_rgb``, ``smart_resize``,
``fetch_image``), the Qwen-VL reference preprocessing, with mmrl's argument checks and input forms around them.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

__all__ = [
    "ImageLoadError",
    "ImageNotFoundError",
    "load_image",
    "to_rgb",
    "smart_resize",
    "resize_for_qwen",
    "to_tensor01",
    "pil_list_from_tensor",
    "IMAGE_MIN_TOKEN_NUM",
    "IMAGE_MAX_TOKEN_NUM",
    "MAX_RATIO",
]


class ImageLoadError(ValueError):
    """An input could not be turned into an image; the message names the source and the reason."""


class ImageNotFoundError(ImageLoadError, FileNotFoundError):
    """A path that does not exist (catchable as ``FileNotFoundError`` and as ``ImageLoadError``)."""


def _describe(x: Any, limit: int = 80) -> str:
    """Short printable description of an input for error messages (never dumps a whole base64 blob)."""
    if isinstance(x, (str, Path)):
        s = str(x)
        return repr(s if len(s) <= limit else s[:limit] + f"... ({len(s)} chars)")
    if isinstance(x, (bytes, bytearray)):
        return f"<{len(x)} bytes>"
    if isinstance(x, np.ndarray):
        return f"<numpy array shape={tuple(x.shape)} dtype={x.dtype}>"
    if isinstance(x, torch.Tensor):
        return f"<torch tensor shape={tuple(x.shape)} dtype={x.dtype}>"
    return f"<{type(x).__name__}>"


def to_rgb(image: Image.Image) -> Image.Image:
    """``qwen_vl_utils.to_rgb``: RGBA pasted on white using alpha, every other mode through ``convert("RGB")`` (a
    new image in every case)."""
    return _qwen_vision_process().to_rgb(image)


def _open_bytes(data: bytes, source: str) -> Image.Image:
    try:
        with io.BytesIO(data) as bio:
            image = Image.open(bio)
            image.load()
        return image
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ImageLoadError(f"cannot decode image from {source}: {type(e).__name__}: {e}") from e


def _open_path(path: Path) -> Image.Image:
    if not path.exists():
        raise ImageNotFoundError(f"image file not found: {str(path)!r}")
    if path.is_dir():
        raise ImageLoadError(f"image path is a directory, expected a file: {str(path)!r}")
    try:
        with Image.open(path) as image:
            image.load()
            return image
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ImageLoadError(f"cannot read image file {str(path)!r}: {type(e).__name__}: {e}") from e


def _b64decode(s: str, source: str) -> bytes:
    s = "".join(s.split()).translate(_URLSAFE)  # line-wrapped and URL-safe variants are common
    try:
        return base64.b64decode(s + "=" * (-len(s) % 4), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageLoadError(f"invalid base64 image data in {source}: {e}") from e


_URLSAFE = str.maketrans("-_", "+/")
_B64_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_\n\r")


def _from_string(s: str) -> Image.Image:
    source = _describe(s)
    if s.startswith("data:"):
        header, sep, payload = s.partition(",")
        if not sep or ";base64" not in header:
            raise ImageLoadError(f"data URL must be 'data:image/...;base64,<data>', got {source}")
        return _open_bytes(_b64decode(payload, source), f"data URL {source}")
    if s.startswith(("http://", "https://")):
        raise ImageLoadError(f"URLs are not fetched by load_image; download the file first: {source}")
    if s.startswith("file://"):
        return _open_path(Path(s[len("file://") :]))
    if _path_exists(s):
        return _open_path(Path(s))
    # Not an existing file: a long string made only of base64 characters is a bare base64 image.
    if len(s) >= 64 and set(s) <= _B64_CHARS:
        return _open_bytes(_b64decode(s, source), f"base64 string {source}")
    return _open_path(Path(s))


def _path_exists(s: str) -> bool:
    try:
        return Path(s).exists()
    except (OSError, ValueError):  # name too long / embedded NUL: not a path
        return False


def _from_array(a: np.ndarray, source: str) -> Image.Image:
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] not in (3, 4)):
        raise ImageLoadError(
            f"array image must be HW (grey) or HWC with C in (1, 3, 4), got shape {tuple(a.shape)} from {source}"
        )
    if a.size == 0:
        raise ImageLoadError(f"empty image array from {source}")
    if a.dtype == np.uint8:
        u8 = a
    elif a.dtype == np.bool_:
        u8 = a.astype(np.uint8) * 255
    elif np.issubdtype(a.dtype, np.floating):
        lo, hi = float(np.nanmin(a)), float(np.nanmax(a))
        if not (np.isfinite(lo) and np.isfinite(hi)) or lo < -1e-3 or hi > 1 + 1e-3:
            raise ImageLoadError(
                f"float image values must lie in [0, 1], got range [{lo:.4g}, {hi:.4g}] from {source}"
                " (divide uint8-scaled data by 255)"
            )
        u8 = np.clip(np.rint(a.astype(np.float64) * 255.0), 0, 255).astype(np.uint8)
    elif np.issubdtype(a.dtype, np.integer):
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi > 255:
            raise ImageLoadError(f"integer image values must lie in [0, 255], got [{lo}, {hi}] from {source}")
        u8 = a.astype(np.uint8)
    else:
        raise ImageLoadError(f"unsupported array dtype {a.dtype} from {source}")
    # fromarray infers L / RGB / RGBA from the shape of a uint8 array
    return Image.fromarray(np.ascontiguousarray(u8))


def _from_tensor(t: torch.Tensor, source: str) -> Image.Image:
    t = t.detach().cpu()
    if t.ndim == 4 and t.shape[0] == 1:
        t = t[0]
    if t.ndim == 3:
        if t.shape[0] not in (1, 3, 4):
            raise ImageLoadError(f"tensor image must be CHW with C in (1, 3, 4), got shape {tuple(t.shape)} from {source}")
        a = t.permute(1, 2, 0)
    elif t.ndim == 2:
        a = t
    else:
        raise ImageLoadError(f"tensor image must be CHW, HW or 1xCxHxW, got shape {tuple(t.shape)} from {source}")
    if a.is_floating_point():
        a = a.float()
    return _from_array(a.numpy(), source)


def load_image(x: Any, *, exif_transpose: bool = True) -> Image.Image:
    """Return ``x`` as an RGB ``PIL.Image`` (a new object; the input is never modified).

    Accepts: path (``str``/``Path``/``file://``), ``PIL.Image``, encoded ``bytes``, base64 ``str`` (bare
    or ``data:`` URL), numpy HWC uint8 / HW grey / HWC float [0, 1], torch CHW / HW (uint8 or float in
    [0, 1]). EXIF orientation is applied; RGBA is composited on white, other modes (LA, P, L, CMYK, I;16,
    ...) converted with PIL as ``qwen_vl_utils.to_rgb`` does.

    Raises:
        ImageNotFoundError: a path that does not exist (also a ``FileNotFoundError``).
        ImageLoadError: anything else unreadable (a ``ValueError``), naming the source and the reason.
    """
    source = _describe(x)
    if isinstance(x, Image.Image):
        image = x
    elif isinstance(x, Path):
        image = _open_path(x)
    elif isinstance(x, str):
        if not x:
            raise ImageLoadError("empty string is not an image path or base64 data")
        image = _from_string(x)
    elif isinstance(x, (bytes, bytearray, memoryview)):
        image = _open_bytes(bytes(x), source)
    elif isinstance(x, np.ndarray):
        image = _from_array(x, source)
    elif isinstance(x, torch.Tensor):
        image = _from_tensor(x, source)
    else:
        raise ImageLoadError(
            f"unsupported image input {source}; expected path, PIL.Image, bytes, base64 str, numpy array or torch tensor"
        )
    if exif_transpose:
        try:
            image = ImageOps.exif_transpose(image)
        except Exception as e:  # corrupt EXIF blocks should not make the pixels unusable
            raise ImageLoadError(f"cannot apply EXIF orientation to {source}: {type(e).__name__}: {e}") from e
    try:
        return to_rgb(image)
    except (OSError, ValueError) as e:
        raise ImageLoadError(f"cannot convert {source} (mode {image.mode}) to RGB: {e}") from e


# --------------------------------------------------------------------------------------------- resizing
# The arithmetic is qwen_vl_utils' own (imported on first use: it pulls in torchvision); mmrl adds the argument
# checks with one-line errors (qwen_vl_utils asserts or divides by zero) and any input form of load_image.


def _qwen_vision_process():
    from qwen_vl_utils import vision_process

    return vision_process


def __getattr__(name: str) -> Any:
    """IMAGE_MIN_TOKEN_NUM, IMAGE_MAX_TOKEN_NUM, MAX_RATIO: qwen_vl_utils' constants (read on first use)."""
    if name in ("IMAGE_MIN_TOKEN_NUM", "IMAGE_MAX_TOKEN_NUM", "MAX_RATIO"):
        return getattr(_qwen_vision_process(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    max_ratio: float | None = None,
) -> tuple[int, int]:
    """Target ``(height, width)``: multiples of ``factor``, area in ``[min_pixels, max_pixels]``, aspect kept.

    ``qwen_vl_utils.smart_resize`` (defaults ``min_pixels = IMAGE_MIN_TOKEN_NUM * factor**2``, ``max_pixels =
    IMAGE_MAX_TOKEN_NUM * factor**2``). ``factor`` is ``patch_size * spatial_merge_size``: 28 for Qwen2/2.5-VL, 32
    for Qwen3-VL. ``max_ratio`` may only tighten qwen_vl_utils' ``MAX_RATIO`` (200; transformers' Qwen-VL image
    processors refuse wider images too).

    Raises:
        ValueError: aspect ratio above the limit (qwen_vl_utils' message), non-positive sizes or factor,
            ``max_pixels < min_pixels``, or ``max_ratio`` above qwen_vl_utils' limit.
    """
    vp = _qwen_vision_process()
    if height <= 0 or width <= 0:
        raise ValueError(f"smart_resize needs positive height and width, got height={height}, width={width}")
    if factor <= 0:
        raise ValueError(f"smart_resize factor must be positive, got {factor}")
    if max_ratio is not None and max_ratio > vp.MAX_RATIO:
        raise ValueError(f"smart_resize max_ratio={max_ratio} is above qwen_vl_utils' MAX_RATIO ({vp.MAX_RATIO}); "
                         f"Qwen-VL's image processors refuse such images as well")
    lo = min_pixels if min_pixels is not None else vp.IMAGE_MIN_TOKEN_NUM * factor**2
    hi = max_pixels if max_pixels is not None else vp.IMAGE_MAX_TOKEN_NUM * factor**2
    if hi < lo:
        raise ValueError(f"max_pixels ({hi}) must be >= min_pixels ({lo})")
    ratio = max(height, width) / min(height, width)
    if max_ratio is not None and ratio > max_ratio:
        raise ValueError(f"absolute aspect ratio must be smaller than {max_ratio}, got {ratio}")
    return vp.smart_resize(height, width, factor, min_pixels=min_pixels, max_pixels=max_pixels)


def resize_for_qwen(
    image: Any,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    factor: int = 28,
) -> Image.Image:
    """Load ``image`` (any ``load_image`` input: EXIF rotation applied, which fetch_image does not) and resize it with
    ``qwen_vl_utils.fetch_image({"image": pil, "min_pixels": ..., "max_pixels": ...}, image_patch_size=factor // 2)``
    (smart_resize dimensions, PIL's default bicubic resampling). An image already of those dimensions is returned
    as loaded."""
    image = load_image(image)
    if factor % 2:
        raise ValueError(f"resize_for_qwen factor must be patch_size * 2 (Qwen-VL's spatial merge), got {factor}")
    width, height = image.size
    if smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels) == (height, width):
        return image  # checks the arguments too, with mmrl's errors, before qwen_vl_utils sees them
    element: dict[str, Any] = {"image": image}
    if min_pixels is not None:
        element["min_pixels"] = min_pixels
    if max_pixels is not None:
        element["max_pixels"] = max_pixels
    return _qwen_vision_process().fetch_image(element, image_patch_size=factor // 2)


# ------------------------------------------------------------------------------------ tensor round trip


def to_tensor01(images: Any) -> torch.Tensor:
    """Float32 NCHW tensor in [0, 1] from a list of images (any ``load_image`` input) or a tensor.

    A float tensor NCHW/CHW is validated and returned (as float32, CHW gets a batch dim); uint8 tensors
    are divided by 255. Lists must hold images of one size (error names the first mismatching index).
    """
    if isinstance(images, torch.Tensor):
        t = images.detach()
        if t.ndim == 3:
            t = t.unsqueeze(0)
        if t.ndim != 4 or t.shape[1] not in (1, 3):
            raise ValueError(f"expected an image tensor NCHW or CHW with C in (1, 3), got shape {tuple(images.shape)}")
        if t.shape[1] == 1:
            t = t.expand(-1, 3, -1, -1)
        if t.dtype == torch.uint8:
            return t.float() / 255.0
        if not t.is_floating_point():
            raise ValueError(f"expected a float or uint8 image tensor, got dtype {t.dtype}")
        t = t.float()
        if t.numel() and (t.min() < -1e-3 or t.max() > 1 + 1e-3):
            raise ValueError(
                f"float image tensor values must lie in [0, 1], got range [{t.min().item():.4g}, {t.max().item():.4g}]"
            )
        return t.clamp(0.0, 1.0).contiguous()
    if isinstance(images, (Image.Image, str, Path, bytes, np.ndarray)):
        images = [images]
    if not isinstance(images, Sequence) or len(images) == 0:
        raise ValueError(f"expected a non-empty list of images or an image tensor, got {_describe(images)}")
    arrays = []
    for i, item in enumerate(images):
        pil = load_image(item)
        if arrays and pil.size != (arrays[0].shape[1], arrays[0].shape[0]):
            raise ValueError(
                f"images must share one size to stack: image 0 is {arrays[0].shape[1]}x{arrays[0].shape[0]} (WxH),"
                f" image {i} is {pil.size[0]}x{pil.size[1]}; resize first"
            )
        arrays.append(np.asarray(pil, dtype=np.uint8))
    batch = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)
    return batch.float().div_(255.0).contiguous()


def pil_list_from_tensor(images: torch.Tensor) -> list[Image.Image]:
    """RGB ``PIL.Image`` list from a float NCHW/CHW tensor in [0, 1] (values clamped, rounded to uint8)."""
    if not isinstance(images, torch.Tensor):
        raise ValueError(f"expected a torch tensor NCHW or CHW, got {_describe(images)}")
    t = images.detach().cpu()
    if t.ndim == 3:
        t = t.unsqueeze(0)
    if t.ndim != 4 or t.shape[1] not in (1, 3):
        raise ValueError(f"expected an image tensor NCHW or CHW with C in (1, 3), got shape {tuple(images.shape)}")
    if t.dtype != torch.uint8:
        t = (t.float().clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)
    if t.shape[1] == 1:
        t = t.expand(-1, 3, -1, -1)
    arr = t.permute(0, 2, 3, 1).contiguous().numpy()
    return [Image.fromarray(a) for a in arr]
