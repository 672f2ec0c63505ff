"""Image-editing data: rows of (source image, instruction, optional mask), and the synthetic shapes edit task.

A row of a prompt file (.jsonl / .json / .parquet, read by `mmrl.pipelines.data.load_prompts`) is an edit row
when it has a `source_image`:

    {"prompt": "make the circle red", "source_image": "images/0001.png", "mask": "masks/0001.png"}

- `prompt` (or `instruction`): the edit instruction;
- `source_image`: a path (relative to `image_root`, default the file's folder), a parquet image struct
  `{"bytes": ..., "path": ...}`, raw bytes or a base64 data URL;
- `mask` (optional, same forms): white = the region the edit may change, black = keep. Rewards that measure
  preservation compare the result with the source outside the mask (everywhere when there is none);
- other keys stay in the row's metadata (e.g. `source_caption` / `target_caption` for the CLIP direction score).

A row whose source (or mask) file is missing, is not an image or is truncated (PNG) is skipped with a warning naming
the file (as the visual-QA loader does); a mask of another size than its source is an error naming both sizes. The
pixels are decoded when a step draws the row. `load_sources(items, h, w)` gives the
source images of a batch as a float tensor at the size the model conditions on.

The synthetic task (`shapes_edit_example`, `make_shapes_edit_file`): a one-shape scene of `mmrl.pipelines.shapes`,
the instruction "make the <shape> <colour>", the mask of the shape and, for pretraining, the target scene (the same
shape in the new colour).
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from mmrl.pipelines.shapes import COLORS, Shape, render_scene, sample_scene

__all__ = ["SOURCE_KEY", "MASK_KEY", "is_edit_row", "resolve_edit_row", "load_sources", "load_masks",
           "shapes_edit_example", "make_shapes_edit_file"]

SOURCE_KEY = "source_image"
MASK_KEY = "mask"


def is_edit_row(row: dict) -> bool:
    return row.get(SOURCE_KEY) is not None


def _ref(value: Any, root: Path) -> Any:
    """An image reference as `load_image` takes it: relative paths resolved against `root`, parquet structs opened."""
    if isinstance(value, dict):  # parquet / HF datasets image struct
        value = value.get("bytes") or value.get("path")
    if isinstance(value, str) and not value.startswith("data:") and len(value) < 4096:
        p = Path(value)
        return str(p if p.is_absolute() else root / p)
    return value


def _read_image(ref: Any) -> tuple[tuple[int, int] | None, str | None]:
    """((width, height), None) when `ref` opens as an image, else (None, why not). PIL's `verify` reads the file
    through without decoding the pixels: a truncated PNG (missing chunks, a bad CRC) fails here rather than at the
    step that draws its row. (A truncated JPEG has nothing to verify: `load_image` names it when the row is drawn.)"""
    import io

    try:
        if isinstance(ref, str) and not ref.startswith("data:"):
            if not Path(ref).is_file():
                return None, f"file not found: {ref}"
            opened = Image.open(ref)
        elif isinstance(ref, (bytes, bytearray)):
            opened = Image.open(io.BytesIO(ref))
        else:  # a data URL or an in-memory image: read when the row is drawn
            return None, None
        with opened as im:
            size = im.size
            im.verify()
        return size, None
    except (OSError, ValueError, SyntaxError) as exc:  # PIL.UnidentifiedImageError is an OSError
        what = ref if isinstance(ref, str) else f"<{type(ref).__name__}>"
        if isinstance(exc, UnidentifiedImageError):
            return None, f"not an image: {what} ({type(exc).__name__})"
        return None, f"a truncated or corrupt image: {what} ({type(exc).__name__}: {exc})"


def resolve_edit_row(row: dict, root: Path, path: Any, index: int) -> dict | None:
    """The row with `source_image` / `mask` resolved to loadable references, or None (with a warning naming the
    file and row) when one of them cannot be read (missing, not an image, truncated). A mask whose size differs
    from its source's is a ValueError naming both: it would be stretched onto the source (as diffusers' inpaint
    pipelines do without a word), so its white region would not be the region to edit."""
    out, sizes = dict(row), {}
    for key in (SOURCE_KEY, MASK_KEY):
        if out.get(key) is None:
            out.pop(key, None)
            continue
        ref = _ref(out[key], root)
        sizes[key], problem = _read_image(ref)
        if problem is not None:
            warnings.warn(f"{path}: row {index} skipped: {key} {problem}", stacklevel=3)
            return None
        out[key] = ref
    src, mask = sizes.get(SOURCE_KEY), sizes.get(MASK_KEY)
    if src is not None and mask is not None and src != mask:
        raise ValueError(f"{path}: row {index}: {MASK_KEY} is {mask[0]}x{mask[1]} (width x height) but "
                        f"{SOURCE_KEY} is {src[0]}x{src[1]}; a mask marks pixels of its source, so it must have the "
                        f"source's size")
    return out


def _resize_stack(pils: Sequence[Image.Image], height: int, width: int, resample: int) -> torch.Tensor:
    arrays = [np.asarray(p.resize((width, height), resample=resample) if p.size != (width, height) else p)
              for p in pils]
    return torch.from_numpy(np.stack(arrays)).float() / 255.0


def load_sources(items: Sequence[Any], height: int, width: int) -> torch.Tensor:
    """Source images of `items` (objects with `.metadata`, or metadata dicts) as float [N, 3, height, width] in
    [0, 1], resized with Lanczos (as diffusers' VaeImageProcessor.resize) when their size differs."""
    from mmrl.pipelines.images import load_image

    metas = [getattr(it, "metadata", it) for it in items]
    missing = [i for i, m in enumerate(metas) if m.get(SOURCE_KEY) is None]
    if missing:
        raise ValueError(f"edit data: row {missing[0]} of the batch has no '{SOURCE_KEY}' (keys: {sorted(metas[0])})")
    pils = [load_image(m[SOURCE_KEY]).convert("RGB") for m in metas]
    return _resize_stack(pils, height, width, Image.LANCZOS).permute(0, 3, 1, 2).contiguous()


def load_masks(metas: Sequence[dict], height: int, width: int) -> torch.Tensor | None:
    """Edit masks of `metas` as float [N, 1, height, width] in {0, 1} (1 = may change; nearest resize); rows without
    a mask get all ones (the whole image may change); None when no row has one."""
    from mmrl.pipelines.images import load_image

    if not any(m and m.get(MASK_KEY) is not None for m in metas):
        return None
    out = torch.ones(len(metas), 1, height, width)
    for i, m in enumerate(metas):
        if m and m.get(MASK_KEY) is not None:
            gray = load_image(m[MASK_KEY]).convert("L")
            out[i, 0] = (_resize_stack([gray], height, width, Image.NEAREST)[0] > 0.5).float()
    return out


# ------------------------------------------------------------------------------------------ synthetic task


def shapes_edit_example(rng: random.Random, size: int = 64) -> dict:
    """One recolouring edit on the shapes world: {"source", "target", "mask" (PIL), "instruction", "metadata"}.

    The source is a one-shape scene; the target colour differs from the shape's and the background's; the mask
    is the shape's pixels. Metadata: `target_color`, `source_color`, `kind`, `background`, `source_caption`,
    `target_caption` (captions of the shapes grammar, e.g. "a red circle on a blue background")."""
    scene = sample_scene(rng, n_shapes=1, size=size)
    shape = scene.shapes[0]
    target = rng.choice([c for c in COLORS if c not in (shape.color, scene.background)])
    edited = Shape(shape.kind, target, shape.x, shape.y, shape.size)
    mask_shape = Shape(shape.kind, "white", shape.x, shape.y, shape.size)
    article = "an" if target[0] in "aeiou" else "a"
    meta = {"target_color": target, "source_color": shape.color, "kind": shape.kind, "background": scene.background,
            "source_caption": scene.caption,
            "target_caption": f"{article} {target} {shape.kind} on "
                              f"{'an' if scene.background[0] in 'aeiou' else 'a'} {scene.background} background"}
    return {"source": scene.image, "target": render_scene([edited], scene.background, size),
            "mask": render_scene([mask_shape], "black", size), "instruction": f"make the {shape.kind} {target}",
            "metadata": meta}


def make_shapes_edit_file(out_dir: str | Path, n: int = 64, seed: int = 0, size: int = 64,
                          with_targets: bool = False) -> Path:
    """Write `n` synthetic edits to `out_dir/edits.jsonl` (+ `images/`): rows with `prompt`, `source_image`,
    `mask` and the metadata of `shapes_edit_example` (`with_targets`: also the target image, `target_image`)."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        ex = shapes_edit_example(rng, size)
        row = {"prompt": ex["instruction"], SOURCE_KEY: f"images/{i:05d}_source.png", MASK_KEY: f"images/{i:05d}_mask.png",
               **ex["metadata"]}
        ex["source"].save(out / row[SOURCE_KEY])
        ex["mask"].save(out / row[MASK_KEY])
        if with_targets:
            row["target_image"] = f"images/{i:05d}_target.png"
            ex["target"].save(out / row["target_image"])
        rows.append(row)
    path = out / "edits.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


if __name__ == "__main__":  # python -m mmrl.pipelines.edits OUT_DIR [N] [SEED]
    import sys

    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m mmrl.pipelines.edits OUT_DIR [N] [SEED]")
    print(make_shapes_edit_file(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 64,
                                int(sys.argv[3]) if len(sys.argv) > 3 else 0))
