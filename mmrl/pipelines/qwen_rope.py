"""Qwen-VL M-RoPE: the 3-D (temporal, height, width) rotary position index, vectorised, and the grid checks it
shares with ``mmrl.pipelines.qwen_vl`` (which re-exports ``get_rope_index`` and ``rope_kwargs_from_config``).

``get_rope_index`` equals ``transformers``' ``<Model>.get_rope_index`` for Qwen2-VL, Qwen2.5-VL and Qwen3-VL but
is vectorised over the whole batch: running counts (cumsum), ``searchsorted`` to find each item, and per-token
table look-ups; the only Python loop is over the two modalities (image, video).

The placement rule (transformers 5.x): text tokens advance the position by one each; a vision item
with merged grid (t, h, w) placed at running position p gets positions ``(p + t_i * interval, p + h_i,
p + w_i)`` and advances the running position by ``max(h, w)`` (not by t). Padding positions are 0 and
``deltas = max(position) + 1 - number of attended tokens`` per row.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

ROPE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# Checkpoint families whose get_rope_index is line-for-line one of the above.
# glm4v: transformers 5.24 Glm4vModel.get_rope_index places items as Qwen3-VL (videos one item per frame).
_ROPE_ALIASES = {"qwen3_vl_moe": "qwen3_vl", "glm4v": "qwen3_vl"}


# --------------------------------------------------------------------------------------------- helpers


def _grid_tensor(grid: Any, name: str) -> torch.Tensor | None:
    if grid is None:
        return None
    g = torch.as_tensor(grid)
    if g.ndim == 1 and g.numel() == 3:
        g = g.unsqueeze(0)
    if g.ndim != 2 or g.shape[1] != 3:
        raise ValueError(f"{name} must have shape [N, 3] (t, h, w per item), got {tuple(g.shape)}")
    if g.is_floating_point() or g.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {g.dtype}")
    if g.numel() and bool((g <= 0).any()):
        raise ValueError(f"{name} entries must be positive, got {g.tolist()}")
    return g.long()


def _tokens_per_item(grid: torch.Tensor | None, merge_size: int, name: str) -> list[int]:
    """Feature count per item: prod(t, h, w) // merge_size**2 (h and w must be multiples of merge_size)."""
    if grid is None:
        return []
    bad = (grid[:, 1] % merge_size != 0) | (grid[:, 2] % merge_size != 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{name}[{i}] = {grid[i].tolist()}: h and w must be multiples of merge_size={merge_size}"
        )
    return (grid.prod(-1) // merge_size**2).tolist()


# ----------------------------------------------------------------------------------------- rope index


def rope_kwargs_from_config(config: Any) -> dict[str, Any]:
    """Keyword arguments of ``get_rope_index`` read from a transformers Qwen-VL config."""
    model_type = _ROPE_ALIASES.get(config.model_type, config.model_type)
    vision = config.vision_config
    return dict(
        model_type=model_type,
        spatial_merge_size=int(vision.spatial_merge_size),
        image_token_id=int(config.image_token_id),
        video_token_id=int(config.video_token_id),
        # GLM-4.1V names it image_start_token_id (unused by the placement rule; kept for the signature)
        vision_start_token_id=int(getattr(config, "vision_start_token_id", None) or config.image_start_token_id),
        tokens_per_second=getattr(vision, "tokens_per_second", None),
    )


def _item_rank_tables(
    grid: torch.Tensor, interval: torch.Tensor | None, merge: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-vision-token (t, h, w) offsets and advances (int32), in item order, after a zero sentinel.

    Item k with merged grid (t, h, w) contributes t*h*w consecutive entries laid out t-major, then h,
    then w (the order of its pad tokens); the advance ``max(h, w)`` sits at its last entry. Built from
    per-grid-row values (a grid row = w tokens sharing t and h) with repeat_interleave, so divisions
    run once per grid row, not per token.
    """
    device = grid.device
    i32 = torch.int32
    K = grid.shape[0]
    tt, hh, ww = grid[:, 0], grid[:, 1] // merge, grid[:, 2] // merge
    n_tok = tt * hh * ww
    n = int(n_tok.sum())
    rows_per_item = tt * hh
    n_rows = int(rows_per_item.sum())
    item_of_row = torch.repeat_interleave(torch.arange(K, device=device), rows_per_item, output_size=n_rows)
    r = torch.arange(n_rows, device=device) - (rows_per_item.cumsum(0) - rows_per_item).index_select(0, item_of_row)
    hh_row = hh.index_select(0, item_of_row)
    h_row = (r % hh_row).to(i32)
    t_row = r // hh_row
    if interval is not None:
        # source: transformers Qwen2_5_VLModel.get_vision_position_ids: (arange(t) * interval).long()
        t_row = (t_row * interval.index_select(0, item_of_row)).long()
    t_row = t_row.to(i32)
    w_row = ww.index_select(0, item_of_row)
    row_of_rank = torch.repeat_interleave(
        torch.arange(n_rows, device=device, dtype=i32), w_row, output_size=n
    )
    row_start = (w_row.cumsum(0) - w_row).to(i32)
    tables = torch.empty(4, n + 1, dtype=i32, device=device)
    tables[:, 0] = 0  # sentinel read by every non-vision token
    t_tab, h_tab, w_tab, adv_tab = tables
    torch.index_select(t_row, 0, row_of_rank, out=t_tab[1:])
    torch.index_select(h_row, 0, row_of_rank, out=h_tab[1:])
    torch.index_select(row_start, 0, row_of_rank, out=w_tab[1:])
    torch.sub(torch.arange(n, device=device, dtype=i32), w_tab[1:], out=w_tab[1:])
    adv_tab.zero_()
    adv_tab[n_tok.cumsum(0)] = torch.maximum(hh, ww).to(i32)  # index = last rank + 1 (sentinel offset)
    return t_tab, h_tab, w_tab, adv_tab


def _locate_items(
    count: torch.Tensor, n_tok: torch.Tensor, valid: torch.Tensor | None, L: int, kind: str, grid: torch.Tensor
) -> torch.Tensor:
    """Flat index of each item's first pad token; checks every item is one attended run within a row.

    ``count`` is the inclusive running count of this modality's attended pad tokens over the flattened
    batch, so the k-th pad token sits at ``searchsorted(count, k + 1)``. An item whose first and last
    token share a row and whose attended tokens in between are exactly its ``n_tok`` pads is intact;
    two items of one modality must not touch (transformers groups runs of one token type, so they would
    merge). Tokens masked out by ``valid`` are ignored, as transformers drops them before grouping.
    """
    dt = count.dtype
    ends = n_tok.cumsum(0).to(dt)
    first = torch.searchsorted(count, ends - n_tok.to(dt) + 1)
    last = torch.searchsorted(count, ends)
    row_first, row_last = first // L, last // L
    valid_flat = None if valid is None else valid.reshape(-1)
    attended_cumsum = None  # only built on the rare paths that need it (masked tokens inside/between items)

    broken = (row_first != row_last) | (last - first + 1 != n_tok)
    if bool(broken.any()) and valid_flat is not None:
        attended_cumsum = valid_flat.cumsum(0)
        broken = (row_first != row_last) | (attended_cumsum[last] - attended_cumsum[first] + 1 != n_tok)
    if bool(broken.any()):
        k = int(broken.nonzero()[0, 0])
        raise ValueError(
            f"{kind} {k} (grid {grid[k].tolist()}, {int(n_tok[k])} tokens) is not one contiguous run of {kind} pad"
            f" tokens within a row (it starts in row {int(row_first[k])}): the per-row pad counts do not match"
            f" the grids (check_vision_token_counts names the row)"
        )
    if first.numel() > 1:
        same_row = row_first[1:] == row_last[:-1]
        touching = same_row & (first[1:] == last[:-1] + 1)
        if valid_flat is not None:
            # a gap made only of masked tokens also makes two items touch once padding is dropped
            after = last[:-1] + 1
            maybe = same_row & ~touching & ~valid_flat[after.clamp(max=valid_flat.numel() - 1)]
            if bool(maybe.any()):
                if attended_cumsum is None:
                    attended_cumsum = valid_flat.cumsum(0)
                between = attended_cumsum[first[1:] - 1] - attended_cumsum[last[:-1]]
                touching |= maybe & (between == 0)
        if bool(touching.any()):
            k = int(touching.nonzero()[0, 0])
            raise ValueError(
                f"{kind}s {k} and {k + 1} are adjacent with no token between them (row {int(row_first[k])}); wrap"
                f" each in <|vision_start|> ... <|vision_end|> (Qwen-VL cannot tell where one ends)"
            )
    return first


def get_rope_index(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | Sequence[float] | None = None,
    *,
    model_type: str,
    spatial_merge_size: int,
    image_token_id: int,
    video_token_id: int,
    vision_start_token_id: int,
    tokens_per_second: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """3-D M-RoPE position ids for a batch, equal to transformers' ``get_rope_index`` for ``model_type``.

    Args:
        input_ids: ``[B, L]`` token ids with expanded pad tokens.
        attention_mask: ``[B, L]`` (1 = attend); left, right or any padding. ``None`` = all attended.
        image_grid_thw / video_grid_thw: ``[N, 3]`` grids (before merging), in batch order.
        second_per_grid_ts: seconds per temporal grid step, one per video (Qwen2.5-VL only; default 1).
        model_type: ``"qwen2_vl"``, ``"qwen2_5_vl"`` or ``"qwen3_vl"`` (``"qwen3_vl_moe"`` accepted).
        spatial_merge_size: the vision config's ``spatial_merge_size`` (2 for all released models).
        image_token_id / video_token_id: pad-token ids (``<|image_pad|>`` / ``<|video_pad|>``).
        vision_start_token_id: accepted for signature compatibility with transformers 4.x, which located
            vision items through it; like transformers 5.x, items are located by their pad tokens.
        tokens_per_second: Qwen2.5-VL's ``vision_config.tokens_per_second`` (temporal position spacing).

    Returns:
        ``position_ids [3, B, L]`` (dtype of ``input_ids``; padding positions are 0) and
        ``deltas [B, 1]`` (int64) = max position + 1 - number of attended tokens in the row.

    Model differences: Qwen2-VL gives video frame ``i`` temporal offset ``i``; Qwen2.5-VL gives
    ``int(i * tokens_per_second * second_per_grid_ts)``; Qwen3-VL splits each video into one item per
    temporal step (frames are separated by timestamp text), each with temporal offset 0.
    """
    model_type = _ROPE_ALIASES.get(model_type, model_type)
    if model_type not in ROPE_MODEL_TYPES:
        raise ValueError(f"unknown model_type {model_type!r}; valid: {list(ROPE_MODEL_TYPES) + list(_ROPE_ALIASES)}")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}"
        )
    B, L = input_ids.shape
    device = input_ids.device
    merge = int(spatial_merge_size)
    if B * L == 0:
        return torch.zeros(3, B, L, dtype=input_ids.dtype, device=device), torch.zeros(B, 1, dtype=torch.long, device=device)
    image_grid = _grid_tensor(image_grid_thw, "image_grid_thw")
    video_grid = _grid_tensor(video_grid_thw, "video_grid_thw")
    for name, grid in (("image_grid_thw", image_grid), ("video_grid_thw", video_grid)):
        _tokens_per_item(grid, merge, name)

    video_interval = None
    if video_grid is not None and video_grid.shape[0]:
        if model_type == "qwen3_vl":
            # source: transformers Qwen3VLModel.get_rope_index: one item per frame, each with t = 1
            video_grid = torch.repeat_interleave(video_grid, video_grid[:, 0], dim=0)
            video_grid[:, 0] = 1
        elif model_type == "qwen2_5_vl":
            if tokens_per_second is None:
                raise ValueError("model_type 'qwen2_5_vl' with videos needs tokens_per_second (vision_config)")
            n_vid = video_grid.shape[0]
            if second_per_grid_ts is None:
                second_per_grid_ts = [1] * n_vid
            if isinstance(second_per_grid_ts, torch.Tensor):
                secs = second_per_grid_ts.reshape(-1)
                # same dtype arithmetic as transformers' per-video `tokens_per_second * tensor_element`
                video_interval = tokens_per_second * secs
            else:
                secs = list(second_per_grid_ts)
                video_interval = torch.tensor([tokens_per_second * s for s in secs])
            if len(secs) < n_vid:
                raise ValueError(f"second_per_grid_ts has {len(secs)} entries for {n_vid} videos")
            video_interval = video_interval[:n_vid]

    # Dense [B, L] work is int32 and in place where possible: at 64 x 2k tokens each fresh int64
    # temporary is 1 MB, and allocating (page-faulting) those costs more than the arithmetic.
    i32 = torch.int32
    valid = None if attention_mask is None else attention_mask.to(device=device, dtype=torch.bool)

    # Per modality: attended pad tokens, their running count, the flat index of each item's first token.
    streams = []
    for kind, tid, grid, interval in (
        ("image", image_token_id, image_grid, None),
        ("video", video_token_id, video_grid, video_interval),
    ):
        is_pad = input_ids == tid
        if valid is not None:
            is_pad &= valid
        n_items = 0 if grid is None else grid.shape[0]
        if n_items == 0:
            if bool(is_pad.any()):
                raise ValueError(
                    f"input_ids hold {int(is_pad.sum())} {kind} pad tokens but no {kind}_grid_thw was given"
                )
            continue
        grid = grid.to(device)
        n_tok = grid[:, 0] * (grid[:, 1] // merge) * (grid[:, 2] // merge)
        count = is_pad.view(-1).cumsum(0, dtype=i32)
        if int(count[-1]) != int(n_tok.sum()):
            raise ValueError(
                f"input_ids hold {int(count[-1])} {kind} pad tokens (attended) but {kind}_grid_thw needs"
                f" {int(n_tok.sum())} (per {kind}: {n_tok.tolist()}); check_vision_token_counts names the sample"
            )
        first = _locate_items(count, n_tok, valid, L, kind, grid)
        if interval is not None:
            interval = interval.to(device)
        streams.append((is_pad, count, grid, interval, first))

    if streams:
        if len(streams) == 1:
            is_vis, count, grid, interval, _ = streams[0]
        else:
            # Interleave image and video items in token order; one running count over both.
            (is_img, count, grid_i, _, first_i), (is_vid, count_v, grid_v, interval_v, first_v) = streams
            is_vis = is_img.logical_or_(is_vid)
            count.add_(count_v)
            del count_v, is_vid
            order = torch.argsort(torch.cat([first_i, first_v]))
            grid = torch.cat([grid_i, grid_v]).index_select(0, order)
            interval = None
            if interval_v is not None:
                interval = torch.cat([torch.ones(grid_i.shape[0], dtype=interval_v.dtype, device=device), interval_v])
                interval = interval.index_select(0, order)
        streams.clear()  # drop references to the per-modality buffers
        t_tab, h_tab, w_tab, adv_tab = _item_rank_tables(grid, interval, merge)
        # vision token = k-th in the batch -> table entry k; every other token -> sentinel 0
        idx = count.mul_(is_vis.view(-1))
        step = adv_tab.index_select(0, idx).view(B, L)
        step += ~is_vis if valid is None else valid & ~is_vis  # text tokens advance by one
        tables = (t_tab, h_tab, w_tab)
    else:
        step = torch.ones(B, L, dtype=i32, device=device) if valid is None else valid.to(i32)
        tables = None
    # Running position = attended text tokens before the token + advances of the items ended before it.
    base = step.cumsum(1, dtype=i32)
    base -= step
    if valid is not None:
        base.mul_(valid)  # padding positions are 0
    position_ids = torch.empty(3, B, L, dtype=input_ids.dtype, device=device)
    if tables is not None:
        offset = step.view(-1)  # reuse the buffer
        for axis, tab in enumerate(tables):
            torch.index_select(tab, 0, idx, out=offset)
            torch.add(base, offset.view(B, L), out=position_ids[axis])
    else:
        position_ids.copy_(base.expand(3, B, L))

    n_valid = torch.full((B,), L, dtype=torch.long, device=device) if valid is None else valid.sum(1)
    row_max = position_ids.amax(dim=(0, 2))
    deltas = row_max.long() + 1 - n_valid
    deltas = torch.where(n_valid > 0, deltas, torch.zeros_like(deltas)).unsqueeze(1)
    return position_ids, deltas
