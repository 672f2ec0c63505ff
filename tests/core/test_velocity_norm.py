"""Velocity-norm ratio and its hinge penalty (`mmrl.core.velocity_norm`), value and gradient by hand."""

import pytest
import torch

from mmrl.core.velocity_norm import velocity_norm_penalty, velocity_norms


def test_norms_ratio_and_penalty_by_hand():
    v = torch.tensor([[[3.0, 4.0]], [[0.0, 1.0]]], requires_grad=True)  # norms 5, 1
    v_ref = torch.tensor([[[0.0, 4.0]], [[0.0, 2.0]]])  # norms 4, 2
    assert velocity_norms(v_ref).tolist() == [4.0, 2.0]
    pen, m = velocity_norm_penalty(v, velocity_norms(v_ref))
    # ratios 5/4 = 1.25 and 1/2 = 0.5; hinge^2: 0.25^2 = 0.0625 and 0 -> mean 0.03125
    assert pen.item() == pytest.approx(0.03125)
    assert m["velocity_norm_ratio"] == pytest.approx((1.25 + 0.5) / 2)
    assert m["velocity_norm_ratio_max"] == pytest.approx(1.25)
    assert m["velocity_norm"] == pytest.approx(3.0) and m["velocity_norm_ref"] == pytest.approx(3.0)
    pen.backward()
    # d/dv of 0.5 * (||v||/4 - 1)^2 for sample 0 = 0.5 * 2 (r - 1) / 4 * v / ||v|| = 0.25/4 * v/5
    want0 = 0.5 * 2 * 0.25 / 4 * torch.tensor([3.0, 4.0]) / 5
    assert torch.allclose(v.grad[0, 0], want0)
    assert torch.equal(v.grad[1], torch.zeros(1, 2))  # below the reference norm: no gradient


def test_mask_and_errors():
    v = torch.tensor([[2.0], [10.0]])
    pen, m = velocity_norm_penalty(v, torch.tensor([1.0, 1.0]), mask=torch.tensor([True, False]))
    assert pen.item() == pytest.approx(1.0) and m["velocity_norm_ratio_max"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="ref_norm"):
        velocity_norm_penalty(v, torch.ones(3))
    with pytest.raises(ValueError, match="non-batch"):
        velocity_norms(torch.ones(3))
