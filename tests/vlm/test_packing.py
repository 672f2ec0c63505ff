"""Padding-free packing of the VLM training passes (RolloutBatch.packed): log-probs and gradients equal the padded
forward's, with images, text-only rows, two images in a row and an empty response; the row boundaries matter."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_grpo import _cfg, _mixed_rows, tiny_path  # noqa: E402,F401  (the tiny model fixture and rows)

from mmrl.vlm.batch import RolloutBatch  # noqa: E402


def _batch(tiny_path):
    model, proc, P, R, MM = _mixed_rows(tiny_path)
    return model, RolloutBatch.build(model, P, R, MM, proc.tokenizer.pad_token_id)


def test_pack_rows_first_fit_decreasing_by_hand():
    from mmrl.vlm.batch import pack_rows

    # decreasing: 9 (row 1), 7 (row 3), 5 (row 0), 3 (row 2), 2 (row 4); capacity 10:
    # 9 -> bin 0 (1 left), 7 -> bin 1 (3 left), 5 -> bin 2 (5 left), 3 -> bin 1 (0 left), 2 -> bin 2 (3 left)
    assert pack_rows([5, 9, 3, 7, 2], 10) == [[1], [3, 2], [0, 4]]
    assert pack_rows([5, 9, 3, 7, 2], 9) == [[1], [3, 4], [0, 2]]  # 7 + 2 fill bin 1; 5 + 3 fit bin 2
    assert pack_rows([4, 4, 4], 100) == [[0, 1, 2]]  # ties keep row order
    assert pack_rows([3, 0, 2], 3) == [[0, 1], [2]]  # an empty row fits anywhere
    with pytest.raises(ValueError, match="12 tokens does not fit a capacity of 10"):
        pack_rows([12, 3], 10)


def _layout(batch):
    lens = batch.attention_mask.sum(-1)
    return {"one row": 10 ** 6, "longest": 0, "longest + shortest": int(lens.max() + lens.min())}


@pytest.mark.parametrize("layout", ["one row", "longest", "longest + shortest"])
def test_packed_logprobs_and_gradients_equal_padded(tiny_path, layout):
    """Each packing layout (everything in one row; bins of the longest sequence; bins holding two sequences and a
    filler tail) gives the padded forward's log-probs, entropies and parameter gradients."""
    model, batch = _batch(tiny_path)
    batch.pack_length = _layout(batch)[layout]
    keep = batch.attention_mask.bool()
    lens = keep.sum(-1)
    kw, cols, index, valid = batch.pack()
    R, W = kw["input_ids"].shape
    assert kw["position_ids"].shape == (4, R, W) and int(keep.sum()) < keep.numel()  # the padded batch had padding
    if layout == "one row":
        assert (R, W) == (1, int(keep.sum()))
    elif layout == "longest":
        assert W == int(lens.max()) and R <= len(batch)
    else:  # some bin holds two sequences, some bin ends in a filler sequence
        assert 1 < R < len(batch) and R * W > int(keep.sum())
    # logits are kept only at the columns that predict a response token
    assert len(cols) <= int(batch.response_mask.sum()) and len(cols) < W
    grads = {}
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        lp, ent = batch.replace(packed=packed).forward_logprobs(model, 0.7, with_entropy=True, entropy_grad=True)
        lp = lp * batch.response_mask
        (lp.sum() + 0.1 * (ent * batch.response_mask).sum()).backward()
        grads[packed] = (lp.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None])
    (a, ga), (b, gb) = grads[False], grads[True]
    assert torch.allclose(a, b, atol=2e-5, rtol=0) and (a != 0).sum() == batch.response_mask.sum()
    assert len(ga) == len(gb) and all(torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(ga, gb))
    # micro-batched no-grad passes and select() keep the packing; cached vision features follow the packed order
    from mmrl.vlm.common import VisionCache

    assert torch.allclose(batch.replace(packed=True).logprobs(model, 2), batch.logprobs(model, 2), atol=2e-5)
    cache = VisionCache(model)
    cached = batch.replace(packed=True).logprobs(model, len(batch), vision_cache=cache)
    assert cache.vision_calls > 0 and torch.allclose(cached, batch.logprobs(model, len(batch)), atol=2e-5)
    sub = batch.replace(packed=True).select([2, 0])
    assert sub.packed and sub.pack_length == batch.pack_length and sub.pad_id == batch.pad_id


def test_pack_layout_images_in_packed_order(tiny_path):
    """The bins reorder rows (longest first): the packed row holds every row's real tokens unchanged, text
    positions restart per sequence, the filler tail is pad tokens, and the image features follow the packed order."""
    model, batch = _batch(tiny_path)
    batch.pack_length = _layout(batch)["longest + shortest"]
    keep = batch.attention_mask.bool()
    lens = keep.sum(-1).tolist()
    kw, cols, index, valid = batch.pack()
    from mmrl.vlm.batch import cat_mm, pack_rows

    bins = pack_rows(lens, batch.pack_length)
    assert bins != [[i] for i in range(len(batch))]  # rows really are regrouped
    for r, b in enumerate(bins):
        o = 0
        for i in b:
            assert torch.equal(kw["input_ids"][r, o:o + lens[i]], batch.input_ids[i, keep[i]])
            assert torch.equal(kw["position_ids"][0, r, o:o + lens[i]], torch.arange(lens[i]))
            assert torch.equal(kw["position_ids"][1:, r, o:o + lens[i]], batch.position_ids[:, i, keep[i]])
            o += lens[i]
        assert (kw["input_ids"][r, o:] == batch.pad_id).all()
        assert torch.equal(kw["position_ids"][0, r, o:], torch.arange(kw["input_ids"].shape[1] - o))
    order = [i for b in bins for i in b]
    assert torch.equal(kw["pixel_values"], cat_mm([batch.mm[i] for i in order])["pixel_values"])


def test_row_boundaries_matter(tiny_path):
    """Without the position restarts the rows would attend to each other: the log-probs then differ, so the
    equality above comes from the block-diagonal mask, not from luck."""
    model, batch = _batch(tiny_path)
    batch.pack_length = 10 ** 6  # one row
    kw, cols, index, valid = batch.pack()
    kw["position_ids"][0] = torch.arange(kw["input_ids"].shape[1])  # one long sequence
    logits = model(**kw, use_cache=False, logits_to_keep=cols).logits
    picked = logits.reshape(-1, logits.shape[-1])[index.reshape(-1)].reshape(*index.shape, -1)
    from mmrl.vlm.batch import token_logprobs

    lp, _ = token_logprobs(picked, batch.input_ids[:, batch.prompt_len:])
    padded, _ = batch.forward_logprobs(model)
    assert not torch.allclose(lp[valid], padded[valid], atol=1e-3)


def test_packing_in_the_recipe_gives_the_padded_run(tiny_path, tmp_path):
    """`update.packing: true` trains like the padded run (same rewards; losses equal to float precision)."""
    import json

    from mmrl.vlm.grpo import train

    rows = {}
    for packing in ("false", "true"):
        out = tmp_path / packing
        train(_cfg(tiny_path, out, f"update.packing={packing}"))
        rows[packing] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows["false"], rows["true"]):
        assert a["reward/mean"] == b["reward/mean"]
        assert a["policy/loss"] == pytest.approx(b["policy/loss"], abs=1e-5)
