"""A plain Python function as a reward model, called the way TRL calls reward functions.

    def brightness(images, prompts, **kwargs):          # an image reward: one float per image
        return images.mean(dim=(1, 2, 3)).tolist()
    def says_red(completions, answer, **kwargs):         # a text reward: dataset columns arrive by name
        return [float(a in c) for c, a in zip(completions, answer)]

    reward = from_callable(brightness)                    # kind "image" (it takes `images`)
    reward = from_callable(says_red)                      # kind "text" (it takes `completions`)
    reward(images=x, prompts=p).scores                    # FloatTensor[B], like every zoo reward

Arguments, by keyword: image rewards get `images` (float NCHW in [0, 1]), `prompts`, and every metadata key as a
list with one entry per sample (the prompt file's extra columns, e.g. `text` for OCR); text rewards get
`completions`, `prompts` (when known) and the metadata columns (e.g. `answer`). A function without `**kwargs`
gets only the arguments it names. It returns one number per sample (list, tuple, array or tensor); `None` (TRL's
"does not apply") becomes NaN, which the trainers treat like any non-finite reward (`reward.on_nonfinite`).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch

from mmrl.rewards.base import RewardModel, RewardOutput

__all__ = ["FunctionReward", "from_callable"]


def _infer_kind(fn: Callable) -> str:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    if "images" in params:
        return "image"
    if "completions" in params:
        return "text"
    raise ValueError(f"reward function {getattr(fn, '__name__', fn)!r}: cannot tell whether it scores images or text; "
                     f"name its first argument `images` or `completions`, or pass kind='image' / 'text'")


class FunctionReward(RewardModel):
    """`fn` wrapped as a RewardModel (see the module docstring)."""

    def __init__(self, fn: Callable, kind: str | None = None, name: str | None = None, batch_size: int = 0):
        if not callable(fn):
            raise TypeError(f"reward function: expected a callable, got {type(fn).__name__}")
        self.fn = fn
        self.kind = kind or _infer_kind(fn)
        if self.kind not in ("image", "text"):
            raise ValueError(f"reward function kind: expected 'image' or 'text', got {self.kind!r}")
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.batch_size = batch_size  # 0: the whole batch in one call
        try:
            params = inspect.signature(fn).parameters
            self._takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
            self._names = set(params)
        except (TypeError, ValueError):
            self._takes_all, self._names = True, set()

    def _call(self, n: int, named: dict[str, Any], metadata: Sequence[dict] | None) -> RewardOutput:
        columns = sorted({k for m in (metadata or []) for k in m})
        kwargs = {k: [m.get(k) for m in metadata] for k in columns if k not in named} if metadata else {}
        kwargs.update(named)
        if not self._takes_all:
            kwargs = {k: v for k, v in kwargs.items() if k in self._names}
        out = self.fn(**kwargs)
        if isinstance(out, torch.Tensor):
            scores = out.detach().float().reshape(-1).cpu()
        else:
            try:
                values = list(out)
            except TypeError:
                raise TypeError(f"reward function {self.name!r} returned {type(out).__name__}; expected one number "
                                f"per sample (a list, array or tensor of length {n})") from None
            scores = torch.tensor([self._number(v, i, n, named) for i, v in enumerate(values)], dtype=torch.float32)
        if scores.shape[0] != n:
            raise ValueError(f"reward function {self.name!r} returned {scores.shape[0]} scores for {n} samples")
        return RewardOutput(scores, {})

    def _number(self, value: Any, i: int, n: int, named: dict[str, Any]) -> float:
        """Sample i's score as a float (None -> NaN); a string (even '0.5') or anything else float() refuses is an
        error naming the function and the sample, not float()'s bare "could not convert"."""
        if value is None:
            return float("nan")
        if not isinstance(value, (str, bytes)):
            try:
                return float(value)
            except (TypeError, ValueError):
                pass
        prompts = named.get("prompts")
        where = f" (prompt {prompts[i]!r:.80})" if isinstance(prompts, (list, tuple)) and i < len(prompts) else ""
        raise TypeError(f"reward function {self.name!r} returned {value!r:.80} ({type(value).__name__}) for sample {i} "
                        f"of {n}{where}; expected one number per sample (None where it does not apply)")

    def score_images(self, images, prompts, metadata):
        return self._call(images.shape[0], {"images": images, "prompts": prompts}, metadata)

    def score_texts(self, completions, metadata, prompts):
        named = {"completions": completions}
        if prompts is not None:
            named["prompts"] = prompts
        return self._call(len(completions), named, metadata)


def from_callable(fn: Callable, kind: str | None = None, name: str | None = None) -> FunctionReward:
    """`fn` as a RewardModel; `kind` ("image" / "text") is inferred from its argument names when not given."""
    return fn if isinstance(fn, FunctionReward) else FunctionReward(fn, kind=kind, name=name)
