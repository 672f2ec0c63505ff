"""KL estimators between a policy and a reference, from log-probs of samples drawn by the policy.

Pure torch; element-wise, so any shape works ([B, T] tokens, [B] diffusion steps, ...). Aggregate with
`mmrl.core.losses.agg_loss`.
"""

from __future__ import annotations

from typing import Sequence

import torch

Tensor = torch.Tensor

# verl's names mapped to ours ("abs" is its own estimator, not an alias).
_KL_KINDS = {
    "k1": "k1",
    "kl": "k1",
    "k2": "k2",
    "mse": "k2",
    "k3": "k3",
    "low_var_kl": "k3",
    "abs": "abs",
}


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-element estimate of KL(pi || pi_ref) at samples from pi; logp, ref_logp [...] -> [...].

    k1 ("kl"): logp - ref_logp                       (unbiased, high variance, can be negative)
    k2 ("mse"): 0.5 * (logp - ref_logp)^2             (biased, low variance, >= 0)
    k3 ("low_var_kl"): exp(d) - d - 1, d = ref_logp - logp, clamped to [-10, 10]  (unbiased, >= 0)
    abs: |logp - ref_logp|
    """
    # source: Schulman, "Approximating KL divergence" (2020) k1/k2/k3; clamps as verl core_algos.kl_penalty
    try:
        k = _KL_KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown KL estimator {kind!r}; valid: {sorted(_KL_KINDS)}") from None
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp/ref_logp: shapes differ, {tuple(logp.shape)} vs {tuple(ref_logp.shape)}")
    if k == "k1":
        return logp - ref_logp
    if k == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    if k == "abs":
        return (logp - ref_logp).abs()
    d = (ref_logp - logp).clamp(-20.0, 20.0)  # keeps exp finite; verl clamps the same way
    return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)


def gaussian_kl_equal_std(
    mean_p: Tensor,
    mean_q: Tensor,
    std: Tensor | float,
    reduce_dims: Sequence[int] | None = None,
) -> Tensor:
    """Closed-form KL between N(mean_p, std^2 I) and N(mean_q, std^2 I), averaged over dimensions.

    mean_p, mean_q [B, ...]; std scalar, [B] or broadcastable to mean_p (e.g. [B, 1, 1, 1]) -> kl[B]
        kl_b = mean_{d in reduce_dims} (mean_p - mean_q)^2 / (2 std_b^2)
    reduce_dims defaults to all non-batch dims. This is Flow-GRPO's per-step KL term: the per-
    dimension average of the true KL (which sums over dimensions), so its scale does not grow with
    the latent size. For 1-D inputs ([B]) nothing is reduced.
    """
    # source: Flow-GRPO arXiv 2505.05470; scripts/train_sd3.py: ((m - m_ref)**2).mean(dim=(1,2,3)) / (2 * std**2)
    if mean_p.shape != mean_q.shape:
        raise ValueError(f"mean_p/mean_q: shapes differ, {tuple(mean_p.shape)} vs {tuple(mean_q.shape)}")
    std = torch.as_tensor(std, dtype=mean_p.dtype, device=mean_p.device)
    if std.dim() == 1 and mean_p.dim() > 1:
        if std.shape[0] != mean_p.shape[0]:
            raise ValueError(f"std: expected shape [{mean_p.shape[0]}] (one per sample), got {tuple(std.shape)}")
        std = std.view(-1, *([1] * (mean_p.dim() - 1)))
    dims = tuple(range(1, mean_p.dim())) if reduce_dims is None else tuple(reduce_dims)
    sq = (mean_p - mean_q) ** 2 / (2.0 * std**2)
    return sq.mean(dim=dims) if dims else sq
