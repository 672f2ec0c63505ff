"""Environments for multi-turn agentic VLM RL: the interface, a registry, a concurrent manager and
two example environments.

Interface (gym-like, text in / text + images out)::

    env = make_env("grid_puzzle", width=5)
    obs = env.reset(seed=3)                    # Observation(text, images, anchor)
    obs, reward, done, info = env.step("left")

* ``Observation.text`` is the user message of the next turn, ``images`` its PIL images (shown in the
  same message, before the text), ``anchor`` a hashable summary of the environment state (GiGPO groups
  steps whose anchors are equal across the episodes of one task; ``None`` = never grouped).
* ``stop_strings`` (generation stops at any of them) and ``max_turns`` are per-environment attributes.
* ``reset(seed, **task)``: the same seed and task give the same episode, so a group of episodes of one
  task is ``reset(seed=s)`` repeated.

``EnvManager`` runs many environments concurrently in threads or worker processes; an environment that
raises ends only its own episode (done, reward 0, ``info["error"]``) and the error is recorded with the
episode index, the task and a traceback summary.

What is simplified away: no step timeouts, no vectorised env batches inside one worker, no remote
(HTTP) environments; a dead worker process is restarted but the environments it held are lost (their
next step reports an error).

Modules: ``base.py`` (interface, registry), ``manager.py`` (EnvManager), ``math_feedback.py`` and
``grid_puzzle.py`` (the examples, registered when this package is imported).
"""

from mmrl.vlm.envs.base import (
    ENVS,
    Env,
    EnvError,
    Observation,
    StepResult,
    available_envs,
    make_env,
    register_env,
    turn_discounted_return,
)
from mmrl.vlm.envs.grid_puzzle import GridPuzzleEnv, parse_move  # noqa: F401
from mmrl.vlm.envs.manager import EnvManager
from mmrl.vlm.envs.math_feedback import FEEDBACK_TEXT, MathFeedbackEnv  # noqa: F401

__all__ = [
    "Observation", "StepResult", "EnvError", "Env", "ENVS", "register_env", "make_env", "available_envs",
    "EnvManager", "MathFeedbackEnv", "GridPuzzleEnv", "turn_discounted_return",
]
