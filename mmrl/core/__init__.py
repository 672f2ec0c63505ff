"""Pure-torch RL math: advantage estimators, KL estimators, policy / preference losses.

Imports only torch. Functions take tensors and scalars (never config objects) and document shapes.
"""

from mmrl.core.advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_to_tokens,
    discounted_returns,
    gae,
    get_advantage_estimator,
    gigpo_advantages,
    group_advantages,
    hash_anchors,
    masked_whiten,
    register_advantage,
    reinforce_pp_advantages,
    rloo_advantages,
)
from mmrl.core.kl import gaussian_kl_equal_std, kl_estimate
from mmrl.core import cpgd as _cpgd  # noqa: F401  (registers the `cpgd` advantage estimator and policy loss)
from mmrl.core.shaping import keep_groups, overlong_penalty
from mmrl.core.losses import (
    AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    clipped_policy_loss,
    dpo_loss,
    get_policy_loss,
    gspo_policy_loss,
    nft_loss,
    nft_optimality_prob,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "POLICY_LOSSES",
    "agg_loss",
    "broadcast_to_tokens",
    "clipped_policy_loss",
    "discounted_returns",
    "dpo_loss",
    "gae",
    "gaussian_kl_equal_std",
    "get_advantage_estimator",
    "get_policy_loss",
    "gigpo_advantages",
    "group_advantages",
    "gspo_policy_loss",
    "hash_anchors",
    "keep_groups",
    "kl_estimate",
    "masked_whiten",
    "nft_loss",
    "nft_optimality_prob",
    "overlong_penalty",
    "register_advantage",
    "reinforce_pp_advantages",
    "rloo_advantages",
]
