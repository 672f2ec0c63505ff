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


def test_packed_logprobs_and_gradients_equal_padded(tiny_path):
    model, batch = _batch(tiny_path)
    keep = batch.attention_mask.bool()
    kw, index, valid = batch.pack()
    assert kw["input_ids"].shape == (1, int(keep.sum())) and kw["position_ids"].shape == (4, 1, int(keep.sum()))
    assert int(keep.sum()) < keep.numel()  # the padded batch had padding to skip
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
    # micro-batched no-grad passes and select() keep the packing
    assert torch.allclose(batch.replace(packed=True).logprobs(model, 2), batch.logprobs(model, 2), atol=2e-5)
    assert batch.replace(packed=True).select([2, 0]).packed


def test_row_boundaries_matter(tiny_path):
    """Without the position restarts the rows would attend to each other: the log-probs then differ, so the
    equality above comes from the block-diagonal mask, not from luck."""
    model, batch = _batch(tiny_path)
    kw, index, valid = batch.pack()
    kw["position_ids"][0] = torch.arange(kw["input_ids"].shape[1])  # one long sequence
    logits = model(**kw, use_cache=False).logits[0]
    picked = logits[index.reshape(-1)].reshape(*index.shape, -1)
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
