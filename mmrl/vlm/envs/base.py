"""The environment interface (``Env``, ``Observation``, ``StepResult``, ``EnvError``), the registry
(``register_env`` / ``make_env``) and the turn-discounted return. See the ``mmrl.vlm.envs`` docstring."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence


@dataclass
class Observation:
    """What the policy sees next: a user message of `images` (PIL, shown first) and `text`."""

    text: str
    images: list = field(default_factory=list)
    anchor: Hashable | None = None


@dataclass
class StepResult:
    """Outcome of one reset or step of one episode (reset: reward 0, done False)."""

    observation: Observation
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


@dataclass
class EnvError:
    """An environment that raised: which episode, which task, what happened."""

    index: int
    task: str
    phase: str  # "reset" | "step"
    message: str  # "ExcType: message"
    traceback: str  # the last frames, short


class Env:
    """Base class of environments. Subclasses set `stop_strings` / `max_turns` and implement
    `reset(seed, **task) -> Observation` and `step(action_text) -> (Observation, reward, done, info)`."""

    name: str = ""
    stop_strings: tuple[str, ...] = ()
    max_turns: int = 4

    def reset(self, seed: int, **task: Any) -> Observation:
        raise NotImplementedError

    def step(self, action_text: str) -> tuple[Observation, float, bool, dict]:
        raise NotImplementedError

    def close(self) -> None:
        """Release resources (called by EnvManager when an episode slot is reused or closed)."""

    def format_example(self, rng: random.Random) -> str | None:
        """A well-formed (not necessarily correct) action, for a format-only warm start; None = no warm start."""
        return None


ENVS: dict[str, Callable[..., Env]] = {}


def register_env(name: str) -> Callable:
    """Decorator: register an `Env` subclass (or a factory returning one) under `name`."""

    def deco(factory: Callable[..., Env]) -> Callable[..., Env]:
        if name in ENVS and ENVS[name] is not factory:
            raise ValueError(f"environment {name!r} is already registered")
        ENVS[name] = factory
        if isinstance(factory, type) and not factory.name:
            factory.name = name
        return factory

    return deco


def available_envs() -> list[str]:
    return sorted(ENVS)


def make_env(name: str, **kwargs: Any) -> Env:
    """Build a registered environment; unknown names raise ValueError listing the valid ones."""
    if name not in ENVS:
        raise ValueError(f"unknown environment {name!r}; valid: {available_envs()}")
    env = ENVS[name](**kwargs)
    if not isinstance(env, Env):
        raise TypeError(f"environment factory {name!r} returned {type(env).__name__}, expected an Env")
    return env


def turn_discounted_return(turn_rewards: Sequence[float], gamma: float) -> float:
    """sum_k gamma^(k-1) r_k over turns k = 1..K: the episode return with a turn-level discount.

    A success rewarded 1 at turn k (0 before) returns gamma^(k-1), as AReaL's multi-turn math agent
    (per-turn reward; backward pass reward[i] += gamma * reward[i+1]; the first turn's value).
    """
    # source: AReaL examples/multi_turn_math (ArealOpenAI.apply_reward_discount(turn_discount=0.9))
    total, g = 0.0, 1.0
    for r in turn_rewards:
        total += g * float(r)
        g *= gamma
    return total
