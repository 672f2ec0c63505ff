"""Example environment 2: visual grid navigation (``grid_puzzle``)."""

from __future__ import annotations

import random
import re
from typing import Any, Sequence

from PIL import Image, ImageDraw

from mmrl.vlm.envs.base import Env, Observation, register_env


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
