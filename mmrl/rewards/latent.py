"""Latent rewards: score a diffusion family's final latents with the prompt, without decoding them to pixels.

```python
r = load("dina_lrm", weights="/ckpt/DiNa-LRM-SD35M-12layers", base="/ckpt/stable-diffusion-3.5-medium")
r(latents=x0, prompts=["a red apple"])        # x0 [B, 16, h, w]: the policy's final latents, as it samples them
r.latent_space                               # LatentSpace(family='sd3', channels=16)
```

The flag on the reward protocol: `kind == "latent"` (beside "image" / "video" / "text") and `latent_space`, the
latents it scores: a flow-model family (`FlowModel.family`, e.g. "sd3") and its channel count. The latents are the
ones the family's transformer sees (`(vae_latent - shift_factor) * scaling_factor`, diffusers' `output_type="latent"`).
A latent reward is called with `latents=` (images are not taken) and needs prompts.

Recipes (`mmrl.diffusion.rollout.rollout_and_score`): when every component of `reward.components` is a latent reward
the rollout hands the final latents to the reward and skips the VAE decode; when some component scores pixels the
rollout decodes as before and the composite gives each component its own input. Sample grids and evaluations still
decode (their images are shown). A latent reward of another family or channel count than `model.path` is refused
when the config loads (`check_latent_rewards`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from mmrl.rewards.base import RewardModel, RewardOutput, _check_len


@dataclass(frozen=True)
class LatentSpace:
    """The latents a latent reward scores."""

    family: str
    """`FlowModel.family` of the models whose latents these are ("sd3"; "sd15" for a UNet family mmrl does not
    train)."""
    channels: int
    """Latent channels C of [B, C, h, w] (SD3.5: 16)."""

    def __str__(self) -> str:
        return f"{self.family} latents with {self.channels} channels"


class LatentRewardModel(RewardModel):
    """Base class of latent rewards: `__call__(latents=[B, C, h, w], prompts, metadata)` checks the latents against
    `latent_space`, splits them into chunks of `batch_size` and calls `score_latents`."""

    kind = "latent"
    needs_prompts = True
    latent_space: LatentSpace

    def __call__(self, images: Any = None, prompts: Sequence[str] | None = None,
                 metadata: Sequence[dict] | None = None, completions: Sequence[str] | None = None,
                 latents: Any = None) -> RewardOutput:
        if latents is None:
            raise ValueError(f"reward '{self.name}' scores {self.latent_space} [B, C, h, w], not images: pass "
                             f"latents=... (a recipe passes its final latents itself)")
        x = self.check_latents(latents)
        n = x.shape[0]
        if prompts is None:
            raise ValueError(f"reward '{self.name}' needs prompts (one per latent)")
        prompts, metadata = _check_len(prompts, n, "prompts", self.name), _check_len(metadata, n, "metadata", self.name)
        return self._chunked(n, lambda s: self.score_latents(x[s], prompts[s],
                                                             None if metadata is None else metadata[s]))

    def check_latents(self, latents: Any) -> torch.Tensor:
        """`latents` as a float [B, C, h, w] tensor of this reward's space; one line naming what is wrong."""
        space = self.latent_space
        if not isinstance(latents, torch.Tensor):
            raise TypeError(f"reward '{self.name}': latents must be a tensor [B, {space.channels}, h, w], got "
                            f"{type(latents).__name__}")
        if latents.dim() == 3:
            latents = latents.unsqueeze(0)
        if latents.dim() != 4 or latents.shape[1] != space.channels:
            raise ValueError(f"reward '{self.name}' scores {space} [B, {space.channels}, h, w], got latents of shape "
                             f"{tuple(latents.shape)}")
        if latents.shape[0] == 0:
            raise ValueError(f"reward '{self.name}': empty batch (no latents)")
        if not latents.is_floating_point() or not bool(torch.isfinite(latents).all()):
            raise ValueError(f"reward '{self.name}': latents must be finite floats, got {latents.dtype} with "
                             f"{int((~torch.isfinite(latents.float())).sum())} non-finite values")
        return latents

    def score_latents(self, latents: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        raise NotImplementedError

    @classmethod
    def latent_space_of(cls, **kwargs: Any) -> LatentSpace | None:
        """The latent space `cls(**kwargs)` would score, read from its config files without loading weights (None
        when they cannot be read: loading then names the problem)."""
        return None


# ------------------------------------------------------------------------------------- what recipes ask


def takes_latents(reward: Any) -> bool:
    """Whether `reward` (or a component of a composite) scores latents: the rollout then passes `latents=`."""
    return getattr(reward, "kind", None) == "latent" or any(
        getattr(c, "kind", None) == "latent" for c in getattr(reward, "components", {}).values())


def needs_pixels(reward: Any) -> bool:
    """Whether scoring `reward` needs decoded images (False only when every component scores latents or sound)."""
    return getattr(reward, "kind", None) not in ("latent", "audio")


def check_latent_rewards(components: Mapping[str, Any], policy: Callable[[], LatentSpace | None], model_path: Any,
                         where: str = "reward.components") -> None:
    """A latent reward of `components` (a `reward.components` mapping) that scores another family's latents, or
    another channel count, than the policy's (`policy()`, the space of the model at `model_path`, asked only when a
    component is a latent reward; None: unknown yet, nothing checked): one line naming the component, both spaces and
    the fix. Reads config files only (no weights)."""
    from mmrl.rewards.registry import lookup

    if "components" in components and isinstance(components["components"], Mapping):
        components = components["components"]  # {components: {...}, normalize: ...}
    space_of_policy = None
    for key, spec in components.items():
        kwargs = dict(spec) if isinstance(spec, Mapping) else {}
        kwargs.pop("weight", None)
        name = kwargs.pop("reward", kwargs.pop("name", key))
        cls = lookup(str(name))
        if not (isinstance(cls, type) and issubclass(cls, LatentRewardModel)):
            continue
        space = cls.latent_space_of(**kwargs)
        space_of_policy = space_of_policy or policy()
        if space is None or space_of_policy is None:
            continue
        if (space.family, space.channels) != (space_of_policy.family, space_of_policy.channels):
            raise ValueError(_mismatch(f"{where}.{key}", name, space, space_of_policy, model_path))


def check_reward_latents(reward: Any, policy: LatentSpace | None, model_path: Any,
                         where: str = "reward.components") -> None:
    """`check_latent_rewards` on a loaded reward: every latent component of `reward` against the loaded policy's
    latent space (a model built after the config loaded, e.g. `model.build_tiny`)."""
    comps = getattr(reward, "components", None) or {"reward": reward}
    if policy is None:
        return
    for key, comp in comps.items():
        space = getattr(comp, "latent_space", None) if getattr(comp, "kind", None) == "latent" else None
        if space is not None and (space.family, space.channels) != (policy.family, policy.channels):
            raise ValueError(_mismatch(f"{where}.{key}", comp.name, space, policy, model_path))


def _mismatch(at: str, name: str, space: LatentSpace, policy: LatentSpace, model_path: Any) -> str:
    return (f"{at}: reward '{name}' scores {space}, but model.path '{model_path}' makes {policy}; a latent reward "
            f"scores only its own family's latents (use a pixel reward, or a model of family {space.family})")
