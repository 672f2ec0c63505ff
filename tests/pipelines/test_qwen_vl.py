"""mmrl.pipelines.qwen_vl against transformers' own Qwen-VL implementations (the peer in a dependency).

The transformers models are built tiny inline (a few thousand parameters); only their config and
``get_rope_index`` are used. transformers 5.x's ``get_rope_index`` takes ``mm_token_type_ids`` (0 text,
1 image, 2 video) instead of looking for vision-start tokens, so the harness builds those from the ids.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from mmrl.pipelines.qwen_vl import (
    QwenVisionTokens,
    check_vision_token_counts,
    expand_vision_placeholders,
    get_rope_index,
    mm_token_type_ids,
    rope_kwargs_from_config,
)

import transformers  # noqa: E402  (a hard dependency: the peer implementation must be there, never skipped)

PAD, IMG, VID, VSTART, VEND = 0, 60, 61, 62, 63  # tiny vocab of 64: text ids are 1..59
MERGE = 2
TEXT_CFG = dict(
    hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
    intermediate_size=16, vocab_size=64, bos_token_id=None, eos_token_id=None, pad_token_id=PAD,
)
TOKEN_IDS = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND)


@pytest.fixture(scope="module")
def hf_models():
    """One tiny transformers model per model type (only config + get_rope_index are used)."""
    from transformers import (
        Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen2VLConfig, Qwen2VLModel, Qwen3VLConfig, Qwen3VLModel,
    )

    torch.manual_seed(0)
    q2 = Qwen2VLModel(Qwen2VLConfig(
        text_config=dict(TEXT_CFG, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, spatial_merge_size=MERGE),
        **TOKEN_IDS,
    ))
    q25 = Qwen2_5_VLModel(Qwen2_5_VLConfig(
        text_config=TEXT_CFG,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                           fullatt_block_indexes=[0], spatial_merge_size=MERGE, tokens_per_second=4),
        **TOKEN_IDS,
    ))
    q3 = Qwen3VLModel(Qwen3VLConfig(
        text_config=dict(TEXT_CFG, head_dim=8),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                           deepstack_visual_indexes=[], spatial_merge_size=MERGE),
        **TOKEN_IDS,
    ))
    return {"qwen2_vl": q2, "qwen2_5_vl": q25, "qwen3_vl": q3}


def _random_batch(rng: random.Random, model_type: str, batch: int, max_items: int, video_prob: float,
                  padding: str, max_hw: int = 8, max_t: int = 4):
    """Token rows with 0..max_items vision items each, padded left or right, plus grids in batch order."""
    rows, image_grids, video_grids = [], [], []
    for _ in range(batch):
        ids = [rng.randrange(1, 60) for _ in range(rng.randrange(1, 6))]
        for _ in range(rng.randrange(0, max_items + 1)):
            h, w = MERGE * rng.randrange(1, max_hw // MERGE + 1), MERGE * rng.randrange(1, max_hw // MERGE + 1)
            if rng.random() < video_prob:
                t = rng.randrange(1, max_t + 1)
                video_grids.append([t, h, w])
                if model_type == "qwen3_vl":  # "<x.y seconds>" text before every frame, all in one wrapper
                    ids += [VSTART]
                    for _ in range(t):
                        ids += [rng.randrange(1, 60) for _ in range(rng.randrange(1, 4))]
                        ids += [VSTART] + [VID] * (h * w // MERGE**2) + [VEND]
                    ids += [VEND]
                else:
                    ids += [VSTART] + [VID] * (t * h * w // MERGE**2) + [VEND]
            else:
                image_grids.append([1, h, w])
                ids += [VSTART] + [IMG] * (h * w // MERGE**2) + [VEND]
            ids += [rng.randrange(1, 60) for _ in range(rng.randrange(0, 6))]
        rows.append(ids)
    L = max(len(r) for r in rows) + rng.randrange(0, 3)
    input_ids = torch.full((batch, L), PAD, dtype=torch.long)
    mask = torch.zeros((batch, L), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(L - len(r), L) if padding == "left" else slice(0, len(r))
        input_ids[i, sl] = torch.tensor(r)
        mask[i, sl] = 1
    as_grid = lambda g: torch.tensor(g, dtype=torch.long) if g else None  # noqa: E731
    return input_ids, mask, as_grid(image_grids), as_grid(video_grids)


def _hf_rope(model, model_type, input_ids, mask, image_grid, video_grid, second_per_grid_ts=None):
    kwargs = dict(
        mm_token_type_ids=mm_token_type_ids(input_ids, IMG, VID),
        image_grid_thw=image_grid,
        video_grid_thw=None if video_grid is None else video_grid.clone(),
        attention_mask=mask,
    )
    if model_type == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = second_per_grid_ts
    return model.get_rope_index(input_ids, **kwargs)


def _ours(model, model_type, input_ids, mask, image_grid, video_grid, second_per_grid_ts=None):
    kw = rope_kwargs_from_config(model.config)
    assert kw["model_type"] == model_type
    return get_rope_index(input_ids, mask, image_grid, video_grid, second_per_grid_ts, **kw)


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_get_rope_index_equals_transformers_on_random_batches(hf_models, model_type):
    model = hf_models[model_type]
    rng = random.Random(1234)
    for case in range(20):
        padding = ("left", "right")[case % 2]
        batch = rng.randrange(1, 6)
        input_ids, mask, image_grid, video_grid = _random_batch(
            rng, model_type, batch, max_items=3, video_prob=0.35, padding=padding
        )
        secs = None
        if model_type == "qwen2_5_vl":
            model.config.vision_config.tokens_per_second = rng.choice([2, 4, 25])
            if video_grid is not None and case % 3:
                vals = [rng.choice([0.5, 1.0, 2.0, 0.3, 1 / 3, 0.7]) for _ in range(video_grid.shape[0])]
                secs = torch.tensor(vals, dtype=torch.float32) if case % 3 == 1 else vals
        if case % 4 == 3:  # holes: mask out some text tokens inside rows (transformers drops them first)
            text = (input_ids != IMG) & (input_ids != VID) & (input_ids != VSTART) & (input_ids != VEND)
            holes = torch.rand(input_ids.shape, generator=torch.Generator().manual_seed(case)) < 0.15
            mask = mask * ~(holes & text)
        attn = mask if case % 5 != 4 else None  # no mask: padding counts as text on both sides
        if case % 10 == 9:  # position dtype follows input_ids (transformers supports int32 only without a mask)
            input_ids = input_ids.int()
        expected = _hf_rope(model, model_type, input_ids, attn, image_grid, video_grid, secs)
        got = _ours(model, model_type, input_ids, attn, image_grid, video_grid, secs)
        msg = f"{model_type} case {case} ({padding} padding, mask={'yes' if attn is not None else 'no'})"
        assert got[0].dtype == expected[0].dtype and got[1].dtype == expected[1].dtype, msg
        assert torch.equal(got[0], expected[0]), msg
        assert torch.equal(got[1], expected[1]), msg


def test_rope_index_batch_invariance_and_padding(hf_models):
    """A row's positions do not depend on its batch mates or on which side it is padded."""
    model = hf_models["qwen2_5_vl"]
    rng = random.Random(7)
    ids_l, mask_l, ig, vg = _random_batch(rng, "qwen2_5_vl", 4, 3, 0.3, "left")
    kw = rope_kwargs_from_config(model.config)
    pos_l, d_l = get_rope_index(ids_l, mask_l, ig, vg, **kw)
    # re-pad every row on the right and compare the attended positions
    ids_r = torch.full_like(ids_l, PAD)
    mask_r = torch.zeros_like(mask_l)
    for i in range(ids_l.shape[0]):
        r = ids_l[i][mask_l[i].bool()]
        ids_r[i, : len(r)] = r
        mask_r[i, : len(r)] = 1
    pos_r, d_r = get_rope_index(ids_r, mask_r, ig, vg, **kw)
    assert torch.equal(d_l, d_r)
    for i in range(ids_l.shape[0]):
        assert torch.equal(pos_l[:, i][:, mask_l[i].bool()], pos_r[:, i][:, mask_r[i].bool()])


def test_rope_index_hand_computed_qwen2_vl():
    """Text(2) + image 1x4x6 (merged 2x3) + text(2); by hand: vision at 2 + (0, h, w), text resumes at 2+3."""
    ids = torch.tensor([[5, VSTART] + [IMG] * 6 + [VEND, 7]])
    pos, delta = get_rope_index(
        ids, image_grid_thw=torch.tensor([[1, 4, 6]]), model_type="qwen2_vl", spatial_merge_size=2,
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART,
    )
    expected = torch.tensor([
        [0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],
    ]).unsqueeze(1)
    assert torch.equal(pos, expected)
    assert delta.tolist() == [[6 + 1 - 10]]


def test_rope_index_qwen25_video_interval_hand_computed():
    """Video t=3, 2x2 merged to 1x1, tokens_per_second=2, 0.75 s per grid: t offsets int(i*1.5) = 0, 1, 3."""
    ids = torch.tensor([[VSTART, VID, VID, VID, VEND]])
    pos, delta = get_rope_index(
        ids, video_grid_thw=torch.tensor([[3, 2, 2]]), second_per_grid_ts=torch.tensor([0.75]),
        model_type="qwen2_5_vl", spatial_merge_size=2, image_token_id=IMG, video_token_id=VID,
        vision_start_token_id=VSTART, tokens_per_second=2,
    )
    assert pos[:, 0].tolist() == [[0, 1, 2, 4, 2], [0, 1, 1, 1, 2], [0, 1, 1, 1, 2]]
    assert delta.tolist() == [[4 + 1 - 5]]


def test_rope_index_empty_and_fully_masked_rows():
    kw = dict(model_type="qwen2_vl", spatial_merge_size=2, image_token_id=IMG, video_token_id=VID,
              vision_start_token_id=VSTART)
    pos, delta = get_rope_index(torch.zeros(2, 0, dtype=torch.long), **kw)
    assert pos.shape == (3, 2, 0) and delta.tolist() == [[0], [0]]
    ids = torch.tensor([[VSTART, IMG, VEND], [1, 2, 3]])
    pos, delta = get_rope_index(ids, torch.tensor([[1, 1, 1], [0, 0, 0]]), torch.tensor([[1, 2, 2]]), **kw)
    assert pos[:, 1].eq(0).all() and delta.tolist() == [[0], [0]]


def test_rope_index_text_only_and_empty_grids():
    ids = torch.tensor([[0, 0, 3, 4, 5], [3, 4, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pos, delta = get_rope_index(ids, mask, model_type="qwen3_vl", spatial_merge_size=2, image_token_id=IMG,
                                video_token_id=VID, vision_start_token_id=VSTART)
    assert pos[0].tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert torch.equal(pos[0], pos[1]) and torch.equal(pos[0], pos[2])
    assert delta.tolist() == [[0], [0]]


def test_rope_index_errors():
    kw = dict(spatial_merge_size=2, image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART)
    ids = torch.tensor([[VSTART] + [IMG] * 4 + [VEND]])
    with pytest.raises(ValueError, match="unknown model_type 'llava'"):
        get_rope_index(ids, image_grid_thw=torch.tensor([[1, 4, 4]]), model_type="llava", **kw)
    with pytest.raises(ValueError, match="hold 4 image pad tokens .* needs 6"):
        get_rope_index(ids, image_grid_thw=torch.tensor([[1, 4, 6]]), model_type="qwen2_vl", **kw)
    with pytest.raises(ValueError, match="no image_grid_thw"):
        get_rope_index(ids, model_type="qwen2_vl", **kw)
    # two images with no separator cannot be told apart
    ids2 = torch.tensor([[VSTART] + [IMG] * 8 + [VEND]])
    with pytest.raises(ValueError, match="adjacent"):
        get_rope_index(ids2, image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]), model_type="qwen2_vl", **kw)
    # an image split across rows
    ids3 = torch.tensor([[VSTART, IMG, IMG, VEND, 5, 5], [VSTART, IMG, IMG, VEND, 5, 5]])
    with pytest.raises(ValueError, match="not one contiguous run"):
        get_rope_index(ids3, image_grid_thw=torch.tensor([[1, 4, 4]]), model_type="qwen2_vl", **kw)
    # separated only by masked tokens: touching once padding is dropped
    ids4 = torch.tensor([[VSTART] + [IMG] * 4 + [VEND] + [IMG] * 4 + [VEND]])
    mask4 = torch.ones_like(ids4)
    mask4[0, 5] = 0
    with pytest.raises(ValueError, match="adjacent"):
        get_rope_index(ids4, mask4, torch.tensor([[1, 4, 4], [1, 4, 4]]), model_type="qwen2_vl", **kw)
    get_rope_index(ids4, None, torch.tensor([[1, 4, 4], [1, 4, 4]]), model_type="qwen2_vl", **kw)
    with pytest.raises(ValueError, match="tokens_per_second"):
        get_rope_index(torch.tensor([[VSTART, VID, VEND]]), video_grid_thw=torch.tensor([[1, 2, 2]]),
                       model_type="qwen2_5_vl", **kw)


# ------------------------------------------------------------------------------- placeholder expansion


def test_expand_vision_placeholders_by_hand():
    tk = QwenVisionTokens()
    texts = ["a <image> b <image>", "no vision", "<video> then <image>"]
    grids = torch.tensor([[1, 2, 2], [1, 4, 2], [1, 2, 4]])
    out = expand_vision_placeholders(texts, grids, torch.tensor([[2, 2, 2]]))
    s, e, ip, vp = tk.vision_start, tk.vision_end, tk.image_pad, tk.video_pad
    assert out == [
        f"a {s}{ip}{e} b {s}{ip * 2}{e}",
        "no vision",
        f"{s}{vp * 2}{e} then {s}{ip * 2}{e}",
    ]


def test_expand_chat_template_form_and_qwen3_video():
    tk = QwenVisionTokens()
    s, e, ip, vp = tk.vision_start, tk.vision_end, tk.image_pad, tk.video_pad
    out = expand_vision_placeholders([f"<|im_start|>user\n{s}{ip}{e}hi"], torch.tensor([[1, 4, 4]]))
    assert out == [f"<|im_start|>user\n{s}{ip * 4}{e}hi"]
    # Qwen3-VL: one timestamped, wrapped block per temporal step, inside the outer wrapper
    out = expand_vision_placeholders([f"x {s}{vp}{e} y", "<video>"], None, torch.tensor([[2, 2, 4], [1, 2, 2]]),
                                     video_timestamps=[[0.25, 1.0], [3.0]])
    assert out == [f"x {s}<0.2 seconds>{s}{vp * 2}{e}<1.0 seconds>{s}{vp * 2}{e}{e} y", f"{s}<3.0 seconds>{s}{vp}{e}{e}"]


def test_expand_count_mismatch_names_row():
    texts = ["<image>", "<image> <image>", "<image>"]
    with pytest.raises(ValueError, match=r"row 1 has 2 image placeholder.*only 1 image grid"):
        expand_vision_placeholders(texts, torch.tensor([[1, 2, 2]] * 2))
    with pytest.raises(ValueError, match=r"per row: \[1, 2, 1\].*5 rows.*last 1 image grid"):
        expand_vision_placeholders(texts, torch.tensor([[1, 2, 2]] * 5))
    once = expand_vision_placeholders(["<image>"], torch.tensor([[1, 8, 8]]))
    with pytest.raises(ValueError, match="row 0 has 16 image placeholder.*already expanded"):
        expand_vision_placeholders(once, torch.tensor([[1, 8, 8]]))
    with pytest.raises(ValueError, match="multiples of merge_size"):
        expand_vision_placeholders(["<image>"], torch.tensor([[1, 3, 2]]))
    with pytest.raises(ValueError, match="video_timestamps"):
        expand_vision_placeholders(["<video>"], None, torch.tensor([[2, 2, 2]]), video_timestamps=[[0.0]])


def test_check_vision_token_counts_names_sample():
    row = lambda n: [VSTART] + [IMG] * n + [VEND] + [PAD] * (10 - n)  # noqa: E731
    ids = torch.tensor([row(4), row(0), row(5)])
    grids = torch.tensor([[1, 4, 4], [1, 2, 4]])  # 4 and 2 features
    with pytest.raises(ValueError, match=r"sample 'c' \(index 2\) has 5 image pad tokens"):
        check_vision_token_counts(ids, grids, None, IMG, VID, 2, sample_names=["a", "b", "c"])
    with pytest.raises(ValueError, match="sample 2 has 5 image pad tokens"):
        check_vision_token_counts(ids, grids, None, IMG, VID, 2)
    ids_ok = torch.tensor([row(4), row(0), row(2)])
    check_vision_token_counts(ids_ok, grids, None, IMG, VID, 2)
    with pytest.raises(ValueError, match="has 3 rows but the batch's image pad tokens only cover 2"):
        check_vision_token_counts(ids_ok, torch.cat([grids, grids[:1]]), None, IMG, VID, 2)
    with pytest.raises(ValueError, match="has 2 video pad tokens"):
        check_vision_token_counts(torch.tensor([[VSTART, VID, VID, VEND]]), None, None, IMG, VID, 2)


# --------------------------------------------------------------- against the real HF processor (tiny)


def _tiny_qwen_tokenizer():
    """A word-level fast tokenizer whose special tokens are the Qwen-VL ones (built in memory, offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<pad>", "describe", "the", "image", "and", "compare", "with", "hello", "video"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")
    tk = QwenVisionTokens()
    fast.add_special_tokens({"additional_special_tokens": [tk.vision_start, tk.vision_end, tk.image_pad, tk.video_pad]})
    return fast


def test_expand_matches_hf_processor(hf_models):
    """Our expansion tokenises to the Qwen2-VL processor's ids (images + a video), and the rope index of
    the processor's own output equals transformers'."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    tokenizer = _tiny_qwen_tokenizer()
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 12),
        video_processor=Qwen2VLVideoProcessor(min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 6, cap_pixels_per_frame=True),
        tokenizer=tokenizer,
    )
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(40, 90), (64, 64), (120, 50), (30, 30)]]
    video = rng.integers(0, 256, (4, 60, 80, 3), dtype=np.uint8)
    tk = QwenVisionTokens()
    chat_i = f"{tk.vision_start}{tk.image_pad}{tk.vision_end}"
    chat_v = f"{tk.vision_start}{tk.video_pad}{tk.vision_end}"
    hf_texts = [f"describe {chat_i} the image", f"hello {chat_v} video", f"compare {chat_i} with {chat_i} and {chat_i}"]
    ours_texts = ["describe <image> the image", "hello <video> video", "compare <image> with <image> and <image>"]
    hf = processor(text=list(hf_texts), images=images, videos=[video], padding=True, return_tensors="pt")
    grids, vgrids = hf["image_grid_thw"], hf["video_grid_thw"]
    assert grids.shape == (4, 3) and vgrids.shape == (1, 3) and int(vgrids[0, 0]) == 2
    ours = tokenizer(expand_vision_placeholders(ours_texts, grids, vgrids), padding=True, return_tensors="pt")
    assert torch.equal(ours["input_ids"], hf["input_ids"])
    # the chat-template form expands identically
    ours_chat = tokenizer(expand_vision_placeholders(hf_texts, grids, vgrids), padding=True, return_tensors="pt")
    assert torch.equal(ours_chat["input_ids"], hf["input_ids"])
    ids = tk.ids(tokenizer)
    types = mm_token_type_ids(hf["input_ids"], ids["image_pad"], ids["video_pad"])
    assert torch.equal(types, torch.as_tensor(hf["mm_token_type_ids"]).long())
    check_vision_token_counts(hf["input_ids"], grids, vgrids, ids["image_pad"], ids["video_pad"], 2,
                              attention_mask=hf["attention_mask"])
    with pytest.raises(ValueError, match="sample 2"):
        check_vision_token_counts(hf["input_ids"], grids[[0, 1, 1, 1]], vgrids, ids["image_pad"], ids["video_pad"], 2)

    model = hf_models["qwen2_vl"]
    expected = model.get_rope_index(hf["input_ids"], mm_token_type_ids=types, image_grid_thw=grids,
                                    video_grid_thw=vgrids, attention_mask=hf["attention_mask"])
    got = get_rope_index(hf["input_ids"], hf["attention_mask"], grids, vgrids, model_type="qwen2_vl",
                         spatial_merge_size=2, image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
                         vision_start_token_id=ids["vision_start"])
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_expand_matches_hf_qwen3_processor_video(hf_models):
    """Qwen3-VL: per-frame timestamped blocks as Qwen3VLProcessor writes them; rope index equal too."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    tokenizer = _tiny_qwen_tokenizer()
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=16, min_pixels=32 * 32 * 2, max_pixels=32 * 32 * 12),
        video_processor=Qwen3VLVideoProcessor(size={"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 8},
                                              cap_pixels_per_frame=True),
        tokenizer=tokenizer,
    )
    rng = np.random.default_rng(1)
    video = rng.integers(0, 256, (4, 60, 80, 3), dtype=np.uint8)
    image = rng.integers(0, 256, (70, 40, 3), dtype=np.uint8)
    tk = QwenVisionTokens()
    hf_texts = [f"hello {tk.vision_start}{tk.video_pad}{tk.vision_end} video", f"{tk.vision_start}{tk.image_pad}{tk.vision_end}"]
    meta = VideoMetadata(total_num_frames=4, fps=2.0, frames_indices=[0, 1, 2, 3])
    hf = processor(text=list(hf_texts), images=[image], videos=[video], video_metadata=[meta], do_sample_frames=False,
                   padding=True, return_tensors="pt")
    grids, vgrids = hf["image_grid_thw"], hf["video_grid_thw"]
    assert int(vgrids[0, 0]) == 2
    # frames 0,1 -> mean(0 s, 0.5 s) = 0.25 s; frames 2,3 -> 1.25 s
    expanded = expand_vision_placeholders(["hello <video> video", "<image>"], grids, vgrids, video_timestamps=[[0.25, 1.25]])
    ours = tokenizer(expanded, padding=True, return_tensors="pt")
    assert torch.equal(ours["input_ids"], hf["input_ids"])
    ids = tk.ids(tokenizer)
    types = mm_token_type_ids(hf["input_ids"], ids["image_pad"], ids["video_pad"])
    expected = hf_models["qwen3_vl"].get_rope_index(hf["input_ids"], mm_token_type_ids=types, image_grid_thw=grids,
                                                    video_grid_thw=vgrids.clone(), attention_mask=hf["attention_mask"])
    got = get_rope_index(hf["input_ids"], hf["attention_mask"], grids, vgrids, model_type="qwen3_vl",
                         spatial_merge_size=2, image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
                         vision_start_token_id=ids["vision_start"])
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
