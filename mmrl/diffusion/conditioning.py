"""What the diffusion recipes hand a model family besides the prompt text: the source images of edit data.

Every recipe encodes a step's prompts with `encode_items(model, items, height, width)`; a text-to-image family
gets the prompt texts, an edit family (`FlowModel.needs_source_image`) also gets each row's source image at the
rollout's size (`mmrl.pipelines.edits.load_sources`), and returns `PromptEmbeds` rows that carry the image's
latents. From there the rollout, the CFG negative (the same source image), every loss and the evaluation see one
kind of object, so no recipe and no sampler has an edit branch. The source image stays in each row's metadata,
which is what the edit rewards (`edit_preservation`, `clip_direction`, `edit_region_color`, `vlm_edit_judge`)
read it from.

`check_items(model, items, key)`: an edit model with rows lacking `source_image` (or a text-to-image model given
edit rows) is refused before any step, naming the data key and the row. `sample_panels(...)`: sample grids show
each edited image next to its source, with the instruction.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from mmrl.pipelines.edits import MASK_KEY, SOURCE_KEY, load_sources

__all__ = ["encode_items", "check_items", "check_data", "sample_panels", "is_edit_batch"]


def _meta(item: Any) -> dict:
    return getattr(item, "metadata", None) or {}


def check_items(model: Any, items: Sequence[Any], key: str) -> None:
    """Refuse data the model family cannot use: an edit family needs a `source_image` in every row of `key`'s file,
    a text-to-image family takes none (one line naming the key, the row and the family). `model`: a FlowModel or
    its class (`flow_model_class(path)`: checks before any weight loads)."""
    cls = model if isinstance(model, type) else type(model)
    edit = bool(getattr(cls, "needs_source_image", False))
    for i, item in enumerate(items):
        has = _meta(item).get(SOURCE_KEY) is not None
        if edit and not has:
            raise ValueError(f"{key}: {cls.__name__} ({cls.family}) edits a source image, but row {i} has no "
                             f"'{SOURCE_KEY}' (its keys: {sorted(_meta(item))}); edit data are .jsonl/.json/.parquet "
                             f"rows with prompt (the instruction) and {SOURCE_KEY} (see docs/editing.md)")
        if has and not edit:
            raise ValueError(f"{key}: row {i} is an edit ('{SOURCE_KEY}' given) but {cls.__name__} ({cls.family}) "
                             f"generates from text only; use an edit family's model.path")


def check_data(model_path: Any, **files: Sequence[Any]) -> None:
    """`check_items` for each data file of a recipe before the model loads: `check_data(cfg.model.path,
    train_prompts=train_items, eval_prompts=eval_items)` (keys named `data.<name>` in errors)."""
    from mmrl.diffusion.models import flow_model_class

    cls = flow_model_class(model_path)
    for name, items in files.items():
        check_items(cls, items, f"data.{name}")


def encode_items(model: Any, items: Sequence[Any], height: int, width: int,
                 encode: Callable[[list[str]], Any] | None = None):
    """PromptEmbeds of a batch of data rows: `encode` (default `model.encode_prompts`; e.g. a PromptEmbedCache) on
    the prompts for text-to-image families; for edit families `model.encode_prompts(prompts, images=sources)` with
    the rows' source images resized to height x width (the prompt cache, keyed by text only, is not used)."""
    prompts = [it.prompt for it in items]
    if not getattr(model, "needs_source_image", False):
        return (encode if encode is not None else model.encode_prompts)(prompts)  # (an empty cache is falsy)
    return model.encode_prompts(prompts, images=load_sources(items, height, width).to(model.device))


def is_edit_batch(metadata: Sequence[dict]) -> bool:
    return bool(metadata) and all(m and m.get(SOURCE_KEY) is not None for m in metadata)


def sample_panels(images: torch.Tensor, captions: list[str], metadata: Sequence[dict]) -> tuple[torch.Tensor, list]:
    """Grid cells for a batch of results: unchanged for text-to-image rows; for edit rows each result follows its
    source image (cells: source, edited, source, edited, ... with "source" under the source, "source (edit only in
    mask)" when the row's mask limits the edit, and the given caption - reward, instruction - under the result), so
    an even-width grid shows pairs side by side."""
    if not is_edit_batch(metadata):
        return images, captions
    h, w = images.shape[-2:]
    sources = load_sources(list(metadata), h, w).to(images.device, images.dtype)
    cells = torch.stack([sources, images], dim=1).flatten(0, 1)
    caps = []
    for m, c in zip(metadata, captions):
        masked = " (edit only in mask)" if m.get(MASK_KEY) is not None else ""  # the mask is not drawn
        caps += [f"source{masked}", c]
    return cells, caps
