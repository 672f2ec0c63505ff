"""Qwen-VL text plumbing: vision placeholder expansion, token-count checks and a vectorised M-RoPE index.

Three jobs, all pure functions of strings and tensors (no model, no processor):

* ``expand_vision_placeholders`` turns ``<image>`` / ``<video>`` (or the chat-template form
  ``<|vision_start|><|image_pad|><|vision_end|>``) into as many pad tokens as the vision tower will emit
  features for, exactly as the Hugging Face processor does.
* ``check_vision_token_counts`` verifies tokenised ids against the grids before a forward pass and names
  the sample that is wrong (the model itself only reports a batch-wide mismatch).
* ``get_rope_index`` computes the 3-D (temporal, height, width) rotary positions for Qwen2-VL,
  Qwen2.5-VL and Qwen3-VL. It equals ``transformers``' ``<Model>.get_rope_index`` but is vectorised
  over the whole batch: running counts (cumsum), ``searchsorted`` to find each item, and per-token
  table look-ups; the only Python loop is over the two modalities (image, video). It lives in ``qwen_rope.py``
  (with the placement rule and the grid checks) and is re-exported here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from mmrl.pipelines.qwen_rope import (  # noqa: F401 - re-exported
    ROPE_MODEL_TYPES,
    _grid_tensor,
    _tokens_per_item,
    get_rope_index,
    rope_kwargs_from_config,
)

__all__ = [
    "QwenVisionTokens",
    "ROPE_MODEL_TYPES",
    "expand_vision_placeholders",
    "check_vision_token_counts",
    "mm_token_type_ids",
    "rope_kwargs_from_config",
    "get_rope_index",
]


@dataclass(frozen=True)
class QwenVisionTokens:
    """The special-token strings of the Qwen-VL tokenizers (identical for Qwen2/2.5/3-VL)."""

    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"
    image_pad: str = "<|image_pad|>"
    video_pad: str = "<|video_pad|>"

    def ids(self, tokenizer: Any) -> dict[str, int]:
        """Token ids for each field, looked up in ``tokenizer``; error if a token is not in its vocab."""
        out = {}
        for field in ("vision_start", "vision_end", "image_pad", "video_pad"):
            token = getattr(self, field)
            tid = tokenizer.convert_tokens_to_ids(token)
            if tid is None or tid == getattr(tokenizer, "unk_token_id", object()):
                raise ValueError(f"tokenizer has no id for {field} token {token!r}")
            out[field] = int(tid)
        return out


def _count_error(kind: str, per_row: list[int], n_grids: int, placeholder: str) -> ValueError:
    total = sum(per_row)
    if total > n_grids:
        # name the first row whose placeholders have no grid left
        seen = 0
        for row, n in enumerate(per_row):
            if seen + n > n_grids:
                return ValueError(
                    f"row {row} has {n} {kind} placeholder(s) ({placeholder}) but only {n_grids - seen} {kind} grid(s)"
                    f" are left for it: the texts hold {total} {kind} placeholders in total (per row: {per_row})"
                    f" and {kind}_grid_thw has {n_grids} rows" + (_ALREADY_EXPANDED_HINT if n > 8 else "")
                )
            seen += n
    return ValueError(
        f"the texts hold {total} {kind} placeholder(s) ({placeholder}; per row: {per_row}) but {kind}_grid_thw has"
        f" {n_grids} rows: the last {n_grids - total} {kind} grid(s) have no placeholder"
    )


_ALREADY_EXPANDED_HINT = " (is the text already expanded? every pad token counts as one placeholder)"


# ------------------------------------------------------------------------------------------ expansion


def expand_vision_placeholders(
    texts: Sequence[str],
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    merge_size: int = 2,
    image_placeholder: str = "<image>",
    video_placeholder: str = "<video>",
    tokens: QwenVisionTokens = QwenVisionTokens(),
    video_timestamps: Sequence[Sequence[float]] | None = None,
) -> list[str]:
    """Expand vision placeholders into the pad tokens the model fills with vision features.

    Grids are consumed in order across the batch (row 0's images first), as the HF processor does.
    Per item ``N = prod(grid_thw) // merge_size**2`` pads are written:

    * ``<image>`` -> ``<|vision_start|>`` + ``<|image_pad|>`` * N + ``<|vision_end|>``;
    * a single ``<|image_pad|>`` (the chat-template form, already wrapped in start/end) -> pad * N;
    * ``<video>`` / ``<|video_pad|>`` likewise with ``<|video_pad|>``.

    Qwen3-VL videos: pass ``video_timestamps`` (one list of ``t`` seconds values per video, one per
    temporal grid step). The video pad then becomes, per frame, ``<{s:.1f} seconds>`` + start +
    ``<|video_pad|>`` * (h*w // merge_size**2) + end, as ``Qwen3VLProcessor.replace_video_token`` does
    in transformers 5.x; the outer start/end of ``<video>`` or of the chat-template form are kept
    (transformers 5.x keeps them; 4.x's processor dropped them).

    Raises:
        ValueError: placeholder count != number of grids (naming the row and the counts), bad grids.
    """
    if isinstance(texts, str):
        raise ValueError("texts must be a list of strings, got a single str; wrap it in a list")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ValueError(f"texts[{i}] must be a str, got {type(t).__name__}")
    image_grid = _grid_tensor(image_grid_thw, "image_grid_thw")
    video_grid = _grid_tensor(video_grid_thw, "video_grid_thw")
    n_image_tokens = _tokens_per_item(image_grid, merge_size, "image_grid_thw")
    n_video_tokens = _tokens_per_item(video_grid, merge_size, "video_grid_thw")
    tk = tokens
    if video_timestamps is not None:
        video_timestamps = [list(ts) for ts in video_timestamps]
        t_per_video = [] if video_grid is None else video_grid[:, 0].tolist()
        if len(video_timestamps) != len(t_per_video) or any(
            len(ts) != t for ts, t in zip(video_timestamps, t_per_video)
        ):
            raise ValueError(
                f"video_timestamps must hold one list per video with one value per temporal grid step: expected"
                f" lengths {t_per_video}, got {[len(ts) for ts in video_timestamps]}"
            )

    alternatives = [
        ("image_tag", image_placeholder),
        ("video_tag", video_placeholder),
        ("image_pad", tk.image_pad),
        ("video_pad", tk.video_pad),
    ]
    pattern = re.compile("|".join(f"(?P<{name}>{re.escape(s)})" for name, s in alternatives if s))

    matches = [list(pattern.finditer(t)) for t in texts]
    per_row_images = [sum(m.lastgroup.startswith("image") for m in ms) for ms in matches]
    per_row_videos = [sum(m.lastgroup.startswith("video") for m in ms) for ms in matches]
    if sum(per_row_images) != len(n_image_tokens):
        raise _count_error("image", per_row_images, len(n_image_tokens), f"{image_placeholder!r} or {tk.image_pad!r}")
    if sum(per_row_videos) != len(n_video_tokens):
        raise _count_error("video", per_row_videos, len(n_video_tokens), f"{video_placeholder!r} or {tk.video_pad!r}")

    def video_body(k: int) -> str:
        if video_timestamps is None:
            return tk.video_pad * n_video_tokens[k]
        per_frame = n_video_tokens[k] // int(video_grid[k, 0])
        return "".join(
            f"<{s:.1f} seconds>" + tk.vision_start + tk.video_pad * per_frame + tk.vision_end
            for s in video_timestamps[k]
        )

    out, i_img, i_vid = [], 0, 0
    for text, ms in zip(texts, matches):
        pieces, last = [], 0
        for m in ms:
            pieces.append(text[last : m.start()])
            kind = m.lastgroup
            if kind.startswith("image"):
                pads = tk.image_pad * n_image_tokens[i_img]
                pieces.append(tk.vision_start + pads + tk.vision_end if kind == "image_tag" else pads)
                i_img += 1
            else:
                body = video_body(i_vid)
                pieces.append(tk.vision_start + body + tk.vision_end if kind == "video_tag" else body)
                i_vid += 1
            last = m.end()
        pieces.append(text[last:])
        out.append("".join(pieces))
    return out


# ------------------------------------------------------------------------------------- token checks


def mm_token_type_ids(input_ids: torch.Tensor, image_token_id: int, video_token_id: int) -> torch.Tensor:
    """0 for text, 1 for image pads, 2 for video pads (what transformers 5.x's Qwen-VL forward expects)."""
    types = torch.zeros_like(input_ids, dtype=torch.long)
    types[input_ids == image_token_id] = 1
    types[input_ids == video_token_id] = 2
    return types


def check_vision_token_counts(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    image_token_id: int,
    video_token_id: int,
    merge_size: int,
    sample_names: Sequence[str] | None = None,
    attention_mask: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` naming the first sample whose pad-token count does not match its features.

    Grids belong to rows in order, so row ``i`` must hold exactly the pads of a whole number of the
    next grids. The message gives the sample (name or index), its pad count and the counts the next
    grids would give.
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if sample_names is not None and len(sample_names) != input_ids.shape[0]:
        raise ValueError(f"sample_names has {len(sample_names)} entries for a batch of {input_ids.shape[0]}")
    for kind, grid, tid in (("image", image_grid_thw, image_token_id), ("video", video_grid_thw, video_token_id)):
        grid = _grid_tensor(grid, f"{kind}_grid_thw")
        feats = _tokens_per_item(grid, merge_size, f"{kind}_grid_thw")
        per_row = ((input_ids == tid) & valid).sum(1).tolist()
        k = 0  # next unused grid
        for row, n in enumerate(per_row):
            name = f"sample {row}" if sample_names is None else f"sample {sample_names[row]!r} (index {row})"
            got, options = 0, [0]
            while got < n and k < len(feats):
                got += feats[k]
                k += 1
                options.append(got)
            if got != n:
                raise ValueError(
                    f"{name} has {n} {kind} pad tokens (id {tid}) but the {kind} grids left for it give"
                    f" {options[1:5] if len(options) > 1 else 0} features for its next 1, 2, ... {kind}s"
                    f" ({len(feats)} {kind} grids in the batch, {sum(feats)} features in total)"
                )
        if k != len(feats):
            raise ValueError(
                f"{kind}_grid_thw has {len(feats)} rows but the batch's {kind} pad tokens only cover {k};"
                f" {kind} pads per sample: {per_row}"
            )
