"""What travels between the reward client and server: images as base64 PNG (never pickle, never a path) and
details as JSON values. See ``mmrl.rewards.remote`` for the protocol."""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from typing import Any

import numpy as np
import torch

from mmrl.rewards.base import to_pil_list


class ImageTooLargeError(ValueError):
    """An image whose header says it has more pixels than allowed (decoding it could exhaust memory)."""



def encode_image_base64(image: torch.Tensor, data_url: bool = False) -> str:
    """Float CHW [0,1] tensor -> base64 PNG (uint8 after ``round(x * 255)``); `data_url` prefixes
    ``data:image/png;base64,``."""
    buf = io.BytesIO()
    to_pil_list(image.unsqueeze(0) if image.dim() == 3 else image)[0].save(buf, format="PNG")
    b64 = base64.b64encode(buf.getvalue()).decode("ascii")
    return f"data:image/png;base64,{b64}" if data_url else b64


def decode_image_base64(s: Any, index: int = 0, max_pixels: int | None = None) -> torch.Tensor:
    """Base64 image (bare or data URL) -> float CHW RGB tensor in [0,1]; ValueError naming `index`.
    Never treats the string as a path or URL. With `max_pixels`, an image whose header declares more than
    that many pixels (width * height) raises `ImageTooLargeError` before any pixel is decoded, as does one
    over PIL's decompression-bomb limit."""
    return decode_image_bytes(base64_image_bytes(s, index), index, max_pixels)


def base64_image_bytes(s: Any, index: int = 0) -> bytes:
    """The encoded image file inside a base64 string (bare or data URL); ValueError naming `index`."""
    if not isinstance(s, str):
        raise ValueError(f"images[{index}] must be a base64 string, got {type(s).__name__}")
    if s.startswith("data:"):
        s = s.partition(",")[2]
    try:
        return base64.b64decode("".join(s.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"images[{index}] is not valid base64: {exc}") from None


def image_header_size(data: bytes, index: int = 0) -> tuple[int, int]:
    """(width, height) from an encoded image's header, without decoding a pixel; ValueError naming `index` for
    something that is not an image, `ImageTooLargeError` above PIL's decompression-bomb limit."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the caller judges the size
            with Image.open(io.BytesIO(data)) as im:  # reads the header only
                return im.size
    except Image.DecompressionBombError as exc:
        raise ImageTooLargeError(f"images[{index}] is too large to decode safely: {exc}") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ValueError(f"images[{index}] is not a decodable image ({len(data)} bytes): {exc}") from None


def decode_image_bytes(data: bytes, index: int = 0, max_pixels: int | None = None) -> torch.Tensor:
    """An encoded image file -> float CHW RGB tensor in [0,1], refusing (`ImageTooLargeError`) one whose header
    declares more than `max_pixels` pixels before decoding it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:  # reads the header only
            w, h = im.size
            if max_pixels is not None and w * h > max_pixels:
                raise ImageTooLargeError(f"images[{index}] is {w}x{h} = {w * h} pixels, more than max_pixels="
                                         f"{max_pixels}; resize it (the server refuses to decode it)")
            im.load()
            rgb = im if im.mode == "RGB" else im.convert("RGB")
            arr = np.array(rgb, dtype=np.uint8)  # one writable copy, shared by the tensor below
    except ImageTooLargeError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageTooLargeError(f"images[{index}] is too large to decode safely: {exc}") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ValueError(f"images[{index}] is not a decodable image ({len(data)} bytes): {exc}") from None
    return torch.from_numpy(arr).permute(2, 0, 1).float().div_(255.0)


def to_jsonable(v: Any) -> Any:
    """Tensors / numpy -> lists, containers recursively, other objects -> str."""
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().tolist()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, dict):
        return {str(k): to_jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [to_jsonable(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)
