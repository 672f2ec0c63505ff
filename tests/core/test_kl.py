import math

import pytest
import torch

from mmrl.core.kl import gaussian_kl_equal_std, kl_estimate

LOGP = torch.tensor([-1.0, -2.0])
REF = torch.tensor([-1.5, -1.0])
# logp - ref = [0.5, -1.0]; ref - logp = [-0.5, 1.0]


def test_k1_k2_k3_abs_hand_values():
    torch.testing.assert_close(kl_estimate(LOGP, REF, "k1"), torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(kl_estimate(LOGP, REF, "k2"), torch.tensor([0.125, 0.5]))
    # exp(-0.5) + 0.5 - 1 = 0.10653; exp(1) - 1 - 1 = 0.71828
    torch.testing.assert_close(
        kl_estimate(LOGP, REF, "k3"), torch.tensor([math.exp(-0.5) - 0.5, math.e - 2.0])
    )
    torch.testing.assert_close(kl_estimate(LOGP, REF, "abs"), torch.tensor([0.5, 1.0]))


def test_aliases():
    for alias, kind in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        assert torch.equal(kl_estimate(LOGP, REF, alias), kl_estimate(LOGP, REF, kind))
    with pytest.raises(ValueError, match="valid: .*low_var_kl"):
        kl_estimate(LOGP, REF, "k4")


def test_k3_clamp():
    logp = torch.zeros(3)
    ref = torch.tensor([5.0, 100.0, -100.0])
    # e^5 - 5 - 1 = 142.4 -> 10;  e^100 overflows without the inner clamp -> 10;
    # e^-20 + 20 - 1 = 19 -> 10
    out = kl_estimate(logp, ref, "k3")
    assert torch.equal(out, torch.full((3,), 10.0))


def test_gaussian_kl_hand_values_and_std_shapes():
    mean_p = torch.zeros(2, 1, 2, 2)
    mean_q = torch.zeros(2, 1, 2, 2)
    mean_q[0] = 1.0  # diff^2 = 1 everywhere -> mean 1 -> 1 / (2 * 0.5^2) = 2
    mean_q[1, 0, 0, 1] = 2.0  # diff^2 = [0, 4, 0, 0] -> mean 1 -> 1 / (2 * 2^2) = 0.125
    expected = torch.tensor([2.0, 0.125])
    std = torch.tensor([0.5, 2.0])
    torch.testing.assert_close(gaussian_kl_equal_std(mean_p, mean_q, std), expected)
    torch.testing.assert_close(gaussian_kl_equal_std(mean_p, mean_q, std.view(2, 1, 1, 1)), expected)
    torch.testing.assert_close(gaussian_kl_equal_std(mean_p, mean_q, 0.5), torch.tensor([2.0, 2.0]))  # mean diff^2 = 1
    # partial reduction keeps the channel dim
    assert gaussian_kl_equal_std(mean_p, mean_q, std, reduce_dims=(2, 3)).shape == (2, 1)


def test_gaussian_kl_matches_torch_distributions():
    gen = torch.Generator().manual_seed(0)
    mp, mq = torch.randn(3, 4, 5, generator=gen), torch.randn(3, 4, 5, generator=gen)
    std = torch.rand(3, generator=gen) + 0.1
    s = std.view(3, 1, 1).expand_as(mp)
    peer = torch.distributions.kl_divergence(
        torch.distributions.Normal(mp, s), torch.distributions.Normal(mq, s)
    ).mean(dim=(1, 2))
    torch.testing.assert_close(gaussian_kl_equal_std(mp, mq, std), peer)


def test_gaussian_kl_bad_std():
    with pytest.raises(ValueError, match="std"):
        gaussian_kl_equal_std(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3))
