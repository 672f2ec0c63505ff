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
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import random
import re
import threading
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

from PIL import Image, ImageDraw

__all__ = [
    "Observation", "StepResult", "EnvError", "Env", "ENVS", "register_env", "make_env", "available_envs",
    "EnvManager", "MathFeedbackEnv", "GridPuzzleEnv", "turn_discounted_return",
]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# interface


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


# ----------------------------------------------------------------------------------------------
# concurrent manager


def _short_traceback(exc: BaseException, frames: int = 3) -> str:
    tb = traceback.extract_tb(exc.__traceback__)[-frames:]
    where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name}" for f in reversed(tb))
    return f"{type(exc).__name__}: {exc} (at {where})" if where else f"{type(exc).__name__}: {exc}"


def _run_command(envs: dict, cmd: str, slot: int, payload: Any) -> tuple:
    """Execute one command on the env in `slot` of `envs`; returns ("ok", value) or ("error", msg, tb)."""
    try:
        if cmd == "reset":
            name, env_kwargs, seed, task = payload
            old = envs.pop(slot, None)
            if old is not None:
                old.close()
            env = make_env(name, **env_kwargs)
            envs[slot] = env
            obs = env.reset(seed, **task)
            _check_observation(obs, name, "reset")
            return ("ok", (obs, env.stop_strings, env.max_turns))
        if cmd == "step":
            if slot not in envs:
                raise RuntimeError(f"episode {slot} has no live environment (never reset, or its worker died)")
            out = envs[slot].step(payload)
            if not (isinstance(out, tuple) and len(out) == 4):
                raise TypeError(f"step() must return (Observation, reward, done, info), got {type(out).__name__}")
            obs, reward, done, info = out
            _check_observation(obs, type(envs[slot]).__name__, "step")
            return ("ok", (obs, float(reward), bool(done), dict(info or {})))
        if cmd == "close":
            env = envs.pop(slot, None)
            if env is not None:
                env.close()
            return ("ok", None)
        raise ValueError(f"unknown command {cmd!r}")
    except Exception as exc:  # noqa: BLE001 - reported to the caller with the episode index
        return ("error", f"{type(exc).__name__}: {exc}", _short_traceback(exc))


def _check_observation(obs: Any, name: str, phase: str) -> None:
    if not isinstance(obs, Observation):
        raise TypeError(f"{name}.{phase}() must return an Observation, got {type(obs).__name__}")


def _worker_main(conn, modules: Sequence[str]) -> None:
    """Worker process: holds the environments of its slots and serves commands until "quit"."""
    import importlib

    for m in modules:  # user environments register themselves on import
        importlib.import_module(m)
    envs: dict[int, Env] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, KeyboardInterrupt):
            break
        if msg[0] == "quit":
            break
        conn.send(_run_command(envs, *msg))
    for env in envs.values():
        try:
            env.close()
        except Exception:  # noqa: BLE001
            pass


class _Worker:
    def __init__(self, ctx, modules: Sequence[str]):
        self.ctx, self.modules = ctx, list(modules)
        self.lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker_main, args=(child, self.modules), daemon=True)
        self.proc.start()
        child.close()

    def call(self, cmd: str, slot: int, payload: Any) -> tuple:
        with self.lock:
            try:
                self.conn.send((cmd, slot, payload))
                return self.conn.recv()
            except (EOFError, BrokenPipeError, ConnectionResetError, OSError) as exc:
                code = self.proc.exitcode
                self.proc.join(timeout=1)
                self._start()  # its environments are gone; later steps on them report errors
                return ("error", f"worker process died (exit code {code}): {type(exc).__name__}", "")

    def close(self) -> None:
        with self.lock:
            try:
                self.conn.send(("quit",))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.terminate()


class EnvManager:
    """Reset and step many episodes concurrently; each episode index owns one environment.

    ``backend="thread"``: environments live in this process, calls run in a thread pool of
    `max_workers` (good for I/O-bound or GIL-releasing environments). ``backend="process"``: `max_workers`
    worker processes (spawned); episode i lives in worker ``i % max_workers`` and its calls run there, so
    CPU-bound Python environments run in parallel. Environments are built by name from the registry
    (``register_env``); with the process backend, modules listed in `modules` are imported in each worker
    first so custom environments are registered there too.

    Errors: an exception in ``reset``/``step`` (or a dead worker) gives that episode
    ``StepResult(Observation(""), 0.0, done=True, info={"error": ..., "index": i, "task": name})``,
    appends an :class:`EnvError` to ``self.errors`` and logs a warning; other episodes continue.
    """

    def __init__(self, max_workers: int = 4, backend: str = "thread", modules: Sequence[str] = ()):
        if backend not in ("thread", "process"):
            raise ValueError(f"EnvManager backend: expected 'thread' or 'process', got {backend!r}")
        if max_workers < 1:
            raise ValueError(f"EnvManager max_workers: expected >= 1, got {max_workers}")
        self.backend, self.max_workers = backend, int(max_workers)
        self._pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="mmrl-env")
        self._local: dict[int, Env] = {}
        self._workers: list[_Worker] = []
        if backend == "process":
            ctx = mp.get_context("spawn")  # fork after torch/threads start is unsafe
            self._workers = [_Worker(ctx, modules) for _ in range(self.max_workers)]
        self._tasks: dict[int, str] = {}
        self.stop_strings: dict[int, tuple[str, ...]] = {}
        self.max_turns: dict[int, int] = {}
        self.errors: list[EnvError] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ one call
    def _call(self, cmd: str, slot: int, payload: Any) -> tuple:
        if self.backend == "process":
            return self._workers[slot % self.max_workers].call(cmd, slot, payload)
        return _run_command(self._local, cmd, slot, payload)

    def _finish(self, cmd: str, slot: int, reply: tuple) -> StepResult:
        if reply[0] == "ok":
            if cmd == "reset":
                obs, stops, max_turns = reply[1]
                self.stop_strings[slot], self.max_turns[slot] = tuple(stops), int(max_turns)
                return StepResult(obs)
            obs, reward, done, info = reply[1]
            return StepResult(obs, reward, done, info)
        _, message, tb = reply
        task = self._tasks.get(slot, "?")
        err = EnvError(index=slot, task=task, phase=cmd, message=message, traceback=tb)
        with self._lock:
            self.errors.append(err)
        logger.warning("environment error in episode %d (task %s, %s): %s", slot, task, cmd, tb or message)
        if cmd == "reset":
            self.stop_strings.setdefault(slot, ())
            self.max_turns.setdefault(slot, 0)
        return StepResult(Observation(""), 0.0, True, {"error": message, "traceback": tb, "index": slot, "task": task})

    def _submit(self, cmd: str, slot: int, payload: Any) -> Future:
        def job() -> StepResult:
            return self._finish(cmd, slot, self._call(cmd, slot, payload))

        return self._pool.submit(job)

    # ------------------------------------------------------------------ public API
    def submit_reset(self, index: int, task: str, seed: int, env_kwargs: dict | None = None,
                     task_kwargs: dict | None = None) -> Future:
        """Start resetting episode `index` with a new `task` environment; Future[StepResult]."""
        self._tasks[index] = task
        return self._submit("reset", index, (task, dict(env_kwargs or {}), int(seed), dict(task_kwargs or {})))

    def submit_step(self, index: int, action_text: str) -> Future:
        """Start stepping episode `index` with `action_text`; Future[StepResult]."""
        return self._submit("step", index, str(action_text))

    def reset(self, specs: Sequence[dict]) -> list[StepResult]:
        """Reset episodes 0..N-1 concurrently. Each spec: {"task": name, "seed": int, "env_kwargs": {...},
        "task_kwargs": {...}} (the last two optional). Returns one StepResult per spec, in order."""
        futs = []
        for i, spec in enumerate(specs):
            if "task" not in spec or "seed" not in spec:
                raise ValueError(f"EnvManager.reset: spec {i} needs keys 'task' and 'seed', got {sorted(spec)}")
            futs.append(self.submit_reset(i, spec["task"], spec["seed"], spec.get("env_kwargs"),
                                          spec.get("task_kwargs")))
        return [f.result() for f in futs]

    def step(self, indices: Sequence[int], actions: Sequence[str]) -> list[StepResult]:
        """Step the given episodes concurrently; results in the order of `indices`."""
        if len(indices) != len(actions):
            raise ValueError(f"EnvManager.step: {len(indices)} indices but {len(actions)} actions")
        futs = [self.submit_step(i, a) for i, a in zip(indices, actions)]
        return [f.result() for f in futs]

    def close(self) -> None:
        for slot in list(self._local):
            _run_command(self._local, "close", slot, None)
        for w in self._workers:
            w.close()
        self._workers = []
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "EnvManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------
# example 1: math / visual QA with feedback and retry


FEEDBACK_TEXT = "Your answer is wrong. Try again."


def _answers_match(pred: str | None, gold: str) -> bool:
    from mmrl.rewards.text import math_equal, normalize_answer

    if pred is None:
        return False
    if normalize_answer(pred, lowercase=True) == normalize_answer(gold, lowercase=True):
        return True
    return any(c.isdigit() for c in gold) and math_equal(pred, gold)


@register_env("math_feedback")
class MathFeedbackEnv(Env):
    """Question answering with feedback and retry (AReaL's multi-turn math agent, with images).

    Turn 1 shows the question (with its image if any). The answer is the ``\\boxed{}`` / ``<answer>``
    content if present, else the last number (numeric gold) or the whole reply (word gold). Correct ->
    reward 1 and the episode ends; wrong -> reward 0 and, if turns remain, the next observation is
    ``"Your answer is wrong. Try again."``; after `max_turns` wrong answers the episode ends.
    Per-turn rewards with a turn-level discount give the return gamma^(k-1) for a success at turn k
    (``turn_discounted_return``; the trainer uses ``mmrl.core.discounted_returns`` on the turn rewards).

    Task: pass ``question`` / ``answer`` (and optionally ``image``) to ``reset``; otherwise the seed
    generates one from `source`: ``"arithmetic"`` ("What is 3 + 4?", digits) or ``"shapes"``
    (``mmrl.pipelines.shapes.qa_for_scene`` on a random scene, with its image).
    Anchors: ``("question",)`` on turn 1, ``("retry", k)`` after k wrong answers.
    """

    stop_strings = ("<|im_end|>",)

    def __init__(self, max_turns: int = 3, source: str = "arithmetic", max_operand: int = 9,
                 qa_kinds: Sequence[str] = ("color", "count", "shape", "position"), image_size: int = 56,
                 feedback: str = FEEDBACK_TEXT, answer_hint: str = ""):
        if source not in ("arithmetic", "shapes"):
            raise ValueError(f"math_feedback source: expected 'arithmetic' or 'shapes', got {source!r}")
        if max_turns < 1:
            raise ValueError(f"math_feedback max_turns: expected >= 1, got {max_turns}")
        self.max_turns, self.source, self.max_operand = int(max_turns), source, int(max_operand)
        self.qa_kinds, self.image_size = tuple(qa_kinds), int(image_size)
        self.feedback, self.answer_hint = feedback, answer_hint
        self.answer: str | None = None
        self.turn = 0

    def format_example(self, rng: random.Random) -> str:
        if self.source == "arithmetic":
            return str(rng.randint(0, 2 * self.max_operand))
        return rng.choice(["red", "green", "blue", "yellow", "circle", "square", "triangle", "left", "right",
                           "top", "bottom", "yes", "no", "1", "2", "3"])

    def generate_task(self, seed: int) -> dict:
        rng = random.Random(seed)
        if self.source == "arithmetic":
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            op = rng.choice("+-") if a >= b else "+"
            return {"question": f"What is {a} {op} {b}?", "answer": str(a + b if op == "+" else a - b)}
        from mmrl.pipelines.shapes import qa_for_scene, sample_scene

        scene = sample_scene(rng, n_shapes=(1, 3), size=self.image_size)
        q, a = qa_for_scene(scene, rng.choice(self.qa_kinds), rng)
        return {"question": q, "answer": a, "image": scene.image}

    def reset(self, seed: int, question: str | None = None, answer: Any = None, image: Any = None) -> Observation:
        if (question is None) != (answer is None):
            raise ValueError("math_feedback reset: give both 'question' and 'answer' or neither")
        if question is None:
            task = self.generate_task(seed)
        else:
            task = {"question": question, "answer": answer, "image": image}
        self.answer, self.turn = str(task["answer"]).strip(), 0
        images = []
        if task.get("image") is not None:
            from mmrl.pipelines.images import load_image

            images = [load_image(task["image"])]
        text = task["question"] + (f" {self.answer_hint}" if self.answer_hint else "")
        return Observation(text, images, anchor=("question",))

    def step(self, action_text: str) -> tuple[Observation, float, bool, dict]:
        from mmrl.rewards.text import extract_final_answer

        if self.answer is None:
            raise RuntimeError("math_feedback: step() before reset()")
        self.turn += 1
        numeric = any(c.isdigit() for c in self.answer)
        pred = extract_final_answer(action_text, fallback="number" if numeric else "text")
        correct = _answers_match(pred, self.answer)
        info = {"success": correct, "pred": pred, "answer": self.answer, "turn": self.turn}
        if correct:
            return Observation(""), 1.0, True, info
        if self.turn >= self.max_turns:
            info["max_turns"] = True
            return Observation(""), 0.0, True, info
        return Observation(self.feedback, [], anchor=("retry", self.turn)), 0.0, False, info


# ----------------------------------------------------------------------------------------------
# example 2: visual grid navigation


_NUMBER_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
_MOVES = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
_SYNONYMS = {"top": "up", "above": "up", "bottom": "down", "below": "down"}
_WORD = re.compile(r"[a-z]+")


def parse_move(text: str, allowed: Sequence[str]) -> str | None:
    """First word of `text` that is an allowed move (synonyms top/above -> up, bottom/below -> down)."""
    for w in _WORD.findall(text.lower()):
        w = _SYNONYMS.get(w, w)
        if w in allowed:
            return w
    return None


@register_env("grid_puzzle")
class GridPuzzleEnv(Env):
    """Move the agent (red square) to the goal (green circle) on a small grid shown as an image.

    ``height=1`` is a number line (actions left/right); otherwise actions are left/right/up/down
    (top/above and bottom/below accepted). Every turn shows the current board; each cell is `cell_px`
    pixels, so with Qwen-VL (28 px per merged token) ``cell_px=28`` gives one image token per cell.
    Reward: +1 on reaching the goal (episode ends, success), else ``-step_penalty`` per move (also for
    an unparsable action, which leaves the agent in place). Ends after `max_turns` moves.
    ``progress_reward=c`` adds c * (distance before - distance after) per move (potential-based shaping,
    Ng et al. 1999, with the Manhattan distance; it keeps the optimal policy): a policy that ignores the
    goal then gains nothing on average, so learning cannot settle on "always the same move".
    State = (agent, goal) positions; it is the observation's anchor, so GiGPO groups the steps taken from
    identical boards across the episodes of one task. ``optimal_action(state)`` moves towards the goal.
    ``say_positions=True`` also states both cells in the text ("The red square is at cell two, the green
    circle at cell four."): the tiny random CPU model cannot learn to read positions from its random
    vision tower within minutes, so the CPU demo uses it; real models get the image only.
    Task: ``reset(seed)`` draws distinct start and goal cells; with `goal_cells` (e.g. ``[[0, 0], [4, 0]]``
    = either end of the line) the goal is ``goal_cells[seed % len(goal_cells)]``, so a batch of consecutive
    seeds holds every goal equally often; or pass ``start=(x, y)``, ``goal=(x, y)``.
    """

    stop_strings = ("<|im_end|>",)

    def __init__(self, width: int = 5, height: int = 1, max_turns: int = 6, step_penalty: float = 0.05,
                 cell_px: int = 28, prompt: str | None = None, feedback: bool = True, say_positions: bool = False,
                 goal_cells: Sequence[Any] | None = None, progress_reward: float = 0.0):
        if width < 2 or height < 1:
            raise ValueError(f"grid_puzzle: expected width >= 2 and height >= 1, got {width}x{height}")
        self.width, self.height, self.max_turns = int(width), int(height), int(max_turns)
        self.step_penalty, self.cell_px, self.feedback = float(step_penalty), int(cell_px), bool(feedback)
        self.say_positions, self.progress_reward = bool(say_positions), float(progress_reward)
        self.goal_cells = None
        if goal_cells is not None:
            self.goal_cells = [(int(c), 0) if isinstance(c, int) else tuple(int(v) for v in c) for c in goal_cells]
            bad = [c for c in self.goal_cells if not (0 <= c[0] < self.width and 0 <= c[1] < self.height)]
            if bad or not self.goal_cells:
                raise ValueError(f"grid_puzzle goal_cells: expected cells inside the {self.width}x{self.height} grid, "
                                 f"got {list(goal_cells)!r}")
        if self.say_positions and max(self.width, self.height) > len(_NUMBER_WORDS):
            raise ValueError(f"grid_puzzle say_positions: at most {len(_NUMBER_WORDS)} cells per side")
        self.actions = ("left", "right") if self.height == 1 else ("left", "right", "up", "down")
        self.prompt = prompt or (
            "Move the red square to the green circle. Answer " + " or ".join(self.actions) + "."
        )
        self.agent: tuple[int, int] | None = None
        self.goal: tuple[int, int] | None = None
        self.turn = 0

    # ---------------------------------------------------------------- state helpers
    @property
    def state(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return (self.agent, self.goal)

    @staticmethod
    def optimal_action(state: tuple[tuple[int, int], tuple[int, int]]) -> str:
        """A shortest-path move from state (agent, goal): horizontal first, then vertical."""
        (ax, ay), (gx, gy) = state
        if gx != ax:
            return "right" if gx > ax else "left"
        if gy != ay:
            return "down" if gy > ay else "up"
        raise ValueError(f"grid_puzzle optimal_action: agent already on the goal {state}")

    def format_example(self, rng: random.Random) -> str:
        return rng.choice(self.actions)

    def render(self) -> Image.Image:
        c = self.cell_px
        im = Image.new("RGB", (self.width * c, self.height * c), (235, 235, 235))
        d = ImageDraw.Draw(im)
        for x in range(1, self.width):
            d.line([(x * c, 0), (x * c, self.height * c)], fill=(160, 160, 160))
        for y in range(1, self.height):
            d.line([(0, y * c), (self.width * c, y * c)], fill=(160, 160, 160))
        m = max(2, c // 6)
        gx, gy = self.goal
        d.ellipse([gx * c + m, gy * c + m, (gx + 1) * c - m - 1, (gy + 1) * c - m - 1], fill=(30, 170, 50))
        ax, ay = self.agent
        d.rectangle([ax * c + m, ay * c + m, (ax + 1) * c - m - 1, (ay + 1) * c - m - 1], fill=(220, 30, 30))
        return im

    def _where(self, p: tuple[int, int]) -> str:
        col = _NUMBER_WORDS[p[0]]
        return f"cell {col}" if self.height == 1 else f"column {col} row {_NUMBER_WORDS[p[1]]}"

    def _obs(self, text: str) -> Observation:
        if self.say_positions:
            where = f"The red square is at {self._where(self.agent)}, the green circle at {self._where(self.goal)}. "
            text = where + text
        return Observation(text, [self.render()], anchor=self.state)

    # ---------------------------------------------------------------- API
    def reset(self, seed: int, start: Sequence[int] | None = None, goal: Sequence[int] | None = None) -> Observation:
        rng = random.Random(seed)
        cells = [(x, y) for y in range(self.height) for x in range(self.width)]
        if start is None and goal is None and self.goal_cells:
            self.goal = self.goal_cells[seed % len(self.goal_cells)]  # consecutive seeds balance the goals
            self.agent = rng.choice([c for c in cells if c != self.goal])
        elif start is None and goal is None:
            self.agent, self.goal = tuple(rng.sample(cells, 2))
        else:
            if start is None or goal is None:
                raise ValueError("grid_puzzle reset: give both 'start' and 'goal' or neither")
            self.agent, self.goal = tuple(int(v) for v in start), tuple(int(v) for v in goal)
            for name, p in (("start", self.agent), ("goal", self.goal)):
                if p not in cells:
                    raise ValueError(f"grid_puzzle reset: {name} {p} is outside the {self.width}x{self.height} grid")
            if self.agent == self.goal:
                raise ValueError(f"grid_puzzle reset: start and goal are the same cell {self.agent}")
        self.turn = 0
        return self._obs(self.prompt)

    def step(self, action_text: str) -> tuple[Observation, float, bool, dict]:
        if self.agent is None:
            raise RuntimeError("grid_puzzle: step() before reset()")
        self.turn += 1
        move = parse_move(action_text, self.actions)
        info: dict = {"action": move, "invalid": move is None, "turn": self.turn}
        before = self.distance
        if move is not None:
            dx, dy = _MOVES[move]
            x, y = self.agent[0] + dx, self.agent[1] + dy
            if 0 <= x < self.width and 0 <= y < self.height:
                self.agent = (x, y)
        shaping = self.progress_reward * (before - self.distance)
        if self.agent == self.goal:
            info["success"] = True
            return Observation(""), 1.0 + shaping, True, info
        info["success"] = False
        if self.turn >= self.max_turns:
            info["max_turns"] = True
            return Observation(""), -self.step_penalty + shaping, True, info
        text = self.prompt if not self.feedback else (
            f"You moved {move}. " + self.prompt if move else "Invalid move. " + self.prompt)
        return self._obs(text), -self.step_penalty + shaping, False, info

    @property
    def distance(self) -> int:
        """Manhattan distance from the agent to the goal."""
        return abs(self.agent[0] - self.goal[0]) + abs(self.agent[1] - self.goal[1])
