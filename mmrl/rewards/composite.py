"""Weighted sum of reward models, keeping every component's raw score.

```python
load({"pickscore": 1.0, "ocr": 0.5})                               # name -> weight
load({"pickscore": {"weight": 1.0, "weights": "/ckpt/pickscore"},  # name -> weight + load kwargs
      "clip2": {"reward": "clip_score", "weight": 0.2}})           # same model twice: give "reward"
CompositeReward.from_yaml("rewards.yaml")                           # the same mapping in YAML
```

A YAML / mapping may also be ``{"components": {...}, "normalize": "batch"}``. Score:
``sum_k w_k * s_k`` where ``s_k`` is component k's raw score, or with ``normalize="batch"`` its z-score over
the batch, ``(s_k - mean(s_k)) / (std(s_k) + eps)`` (population std), so components on different scales
contribute comparably. ``details[k]`` is component k's raw score tensor and ``details[f"{k}/{key}"]`` each
of its own details. Image (or video) and text components can be mixed: image and video components get
``images, prompts, metadata`` (videos [B, F, 3, H, W] in ``images``), text components ``completions, prompts,
metadata``; image and video components cannot (wrap image rewards with ``video_frames``). Latent components
(`mmrl.rewards.latent`) get ``latents, prompts, metadata``; they all score one latent space, and a composite of
latent components only is itself a latent reward (``kind == "latent"``: a recipe then skips the VAE decode). Audio
components (`mmrl.rewards.audio`) get ``audio, sample_rate, prompts, metadata`` beside any of these; a composite of
audio components only is an audio reward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from mmrl.rewards.base import (RewardModel, RewardOutput, load, register, score_by_size, to_image_list,
                               to_image_tensor)

NORMALIZE_MODES = ("none", "batch")


class CompositeReward(RewardModel):
    """Weighted sum of named reward components (see module docstring)."""

    name = "composite"

    def __init__(self, components: Mapping[str, RewardModel], weights: Mapping[str, float],
                 normalize: str = "none", eps: float = 1e-6):
        if not components:
            raise ValueError("composite reward needs at least one component")
        if set(components) != set(weights):
            raise ValueError(f"composite reward: components {sorted(components)} and weights {sorted(weights)} differ")
        if normalize not in NORMALIZE_MODES:
            raise ValueError(f"composite normalize must be one of {list(NORMALIZE_MODES)}, got {normalize!r}")
        self.components = dict(components)
        self.weights = {k: float(v) for k, v in weights.items()}
        self.normalize = normalize
        self.eps = float(eps)
        kinds = {c.kind for c in self.components.values()}
        self.kinds = {k: c.kind for k, c in self.components.items()}
        if {"image", "video"} <= kinds:  # one batch is either images or videos
            by = {kind: sorted(k for k, v in self.kinds.items() if v == kind) for kind in ("image", "video")}
            raise ValueError(f"composite reward mixes image components {by['image']} with video components "
                             f"{by['video']}; score videos per frame with video_frames (image_reward=<name>)")
        spaces = {str(c.latent_space) for c in self.components.values() if c.kind == "latent"}
        if len(spaces) > 1 or ("latent" in kinds and "video" in kinds):
            by = {k: str(getattr(c, "latent_space", c.kind)) for k, c in self.components.items() if c.kind != "text"}
            raise ValueError(f"composite reward mixes inputs {by}; its latent components must all score one latent "
                             f"space, of an image family")
        if spaces:
            self.latent_space = next(c.latent_space for c in self.components.values() if c.kind == "latent")
        rest = kinds - {"audio"}  # sound comes beside the pictures (or alone), it does not change their kind
        self.kind = ("audio" if not rest else "text" if rest == {"text"} else "latent" if rest == {"latent"}
                     else "video" if "video" in rest else "image")
        self.differentiable = all(c.differentiable for c in self.components.values())
        self.needs_prompts = any(getattr(c, "needs_prompts", False) for c in self.components.values())
        self.name = "composite(" + " + ".join(f"{w:g}*{k}" for k, w in self.weights.items()) + ")"

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | str | Path, normalize: str | None = None,
                     **kwargs: Any) -> "CompositeReward":
        """Build from ``{name: weight}`` / ``{name: {"weight": w, "reward": registered_name, **load_kwargs}}``
        (or ``{"components": {...}, "normalize": ...}``, or a YAML file path). `kwargs` (e.g. ``device``)
        go to every component's ``load``; per-component kwargs win."""
        if isinstance(mapping, (str, Path)):
            return cls.from_yaml(mapping, normalize=normalize, **kwargs)
        if not isinstance(mapping, Mapping):
            raise TypeError(f"composite reward spec must be a mapping or a YAML path, got {type(mapping).__name__}")
        mapping = dict(mapping)
        eps = 1e-6
        if "components" in mapping:
            extra = set(mapping) - {"components", "normalize", "eps"}
            if extra:
                raise ValueError(f"composite reward spec: unknown keys {sorted(extra)}; valid: components, normalize, eps")
            normalize = normalize or mapping.get("normalize")
            eps = float(mapping.get("eps", eps))
            mapping = dict(mapping["components"] or {})
        components, weights = {}, {}
        for key, spec in mapping.items():
            if isinstance(spec, bool) or not isinstance(spec, (int, float, Mapping)) and spec is not None:
                raise ValueError(f"composite component '{key}': expected a weight (number) or a mapping "
                                 f"with 'weight' and load kwargs, got {spec!r}")
            if spec is None or isinstance(spec, (int, float)):
                w, comp_kw, reward_name = 1.0 if spec is None else float(spec), {}, key
            else:
                comp_kw = dict(spec)
                w = float(comp_kw.pop("weight", 1.0))
                reward_name = comp_kw.pop("reward", comp_kw.pop("name", key))
            try:
                components[key] = load(reward_name, **{**kwargs, **comp_kw})
            except TypeError as exc:
                raise TypeError(f"composite component '{key}' (reward '{reward_name}'): {exc}") from exc
            weights[key] = w
        return cls(components, weights, normalize=normalize or "none", eps=eps)

    @classmethod
    def from_yaml(cls, path: str | Path, **kwargs: Any) -> "CompositeReward":
        import yaml

        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"composite reward YAML not found: {str(p)!r}")
        try:
            spec = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ValueError(f"composite reward YAML {str(p)!r} is not valid YAML: {exc}") from None
        if not isinstance(spec, Mapping):
            raise ValueError(f"composite reward YAML {str(p)!r} must hold a mapping name -> weight, got {type(spec).__name__}")
        return cls.from_mapping(spec, **kwargs)

    # ------------------------------------------------------------------ scoring

    def __call__(self, images: Any = None, prompts: Sequence[str] | None = None,
                 metadata: Sequence[dict] | None = None, completions: Sequence[str] | None = None,
                 latents: Any = None, audio: Any = None, sample_rate: Any = None) -> RewardOutput:
        if images is not None and not isinstance(images, torch.Tensor) and "image" in self.kinds.values():
            images = to_image_list(images)  # decode once, not once per component
            if len({tuple(t.shape) for t in images}) > 1:  # mixed sizes: each size is its own batch
                return score_by_size(self, images, prompts, metadata)
            images = torch.stack(images) if images else to_image_tensor([])
        raw: dict[str, RewardOutput] = {}
        for key, comp in self.components.items():
            if comp.kind == "text":
                if completions is None:
                    raise ValueError(f"composite component '{key}' scores text: pass completions=[...]")
                raw[key] = comp(prompts=prompts, metadata=metadata, completions=completions)
            elif comp.kind == "latent":
                raw[key] = comp(latents=latents, prompts=prompts, metadata=metadata)
            elif comp.kind == "audio":
                raw[key] = comp(audio=audio, sample_rate=sample_rate, prompts=prompts, metadata=metadata)
            else:
                if images is None:
                    raise ValueError(f"composite component '{key}' scores images: pass images=...")
                raw[key] = comp(images=images, prompts=prompts, metadata=metadata)
        sizes = {k: len(o) for k, o in raw.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"composite components returned different batch sizes: {sizes}")
        scores = [o.scores for o in raw.values()]
        device = next((s.device for s in scores if s.requires_grad), scores[0].device)
        total = torch.zeros_like(scores[0], dtype=torch.float32, device=device)
        details: dict[str, Any] = {}
        for key, out in raw.items():
            s = out.scores.to(device=device, dtype=torch.float32)
            details[key] = out.scores
            if self.normalize == "batch":
                s = (s - s.mean()) / (s.std(unbiased=False) + self.eps)
                details[f"{key}/normalized"] = s
            total = total + self.weights[key] * s
            for dk, dv in out.details.items():
                details[f"{key}/{dk}"] = dv
        return RewardOutput(total, details)

    def to(self, device: Any) -> "CompositeReward":
        for comp in self.components.values():
            comp.to(device)
        return self

    def __repr__(self) -> str:
        return f"CompositeReward({self.name}, normalize={self.normalize!r}, differentiable={self.differentiable})"


@register("composite")
def composite(components: Mapping[str, Any] | str, normalize: str | None = None, **kwargs: Any) -> CompositeReward:
    """Weighted sum of rewards: ``load("composite", components={"pickscore": 1.0, "ocr": 0.5})``."""
    return CompositeReward.from_mapping(components, normalize=normalize, **kwargs)
