"""Environment interface, the two example environments and the concurrent EnvManager."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from mmrl.vlm.envs import (ENVS, FEEDBACK_TEXT, Env, EnvManager, GridPuzzleEnv, MathFeedbackEnv, Observation,
                           available_envs, make_env, parse_move, register_env, turn_discounted_return)


# ---------------------------------------------------------------------------------------------- registry

def test_registry_lists_examples_and_rejects_unknown():
    assert {"math_feedback", "grid_puzzle"} <= set(available_envs())
    with pytest.raises(ValueError, match="unknown environment 'nope'.*grid_puzzle"):
        make_env("nope")


def test_register_custom_env():
    @register_env("_test_echo")
    class Echo(Env):
        max_turns = 2

        def reset(self, seed, **task):
            return Observation(f"seed {seed}", anchor=seed)

        def step(self, action_text):
            return Observation(action_text), 0.5, True, {}

    env = make_env("_test_echo")
    assert env.reset(3).text == "seed 3" and Echo.name == "_test_echo"
    assert env.step("hi") == (Observation("hi"), 0.5, True, {})
    ENVS.pop("_test_echo")


# ---------------------------------------------------------------------------------------------- grid puzzle

def test_grid_number_line_rewards_by_hand():
    env = GridPuzzleEnv(width=5, height=1, max_turns=6, step_penalty=0.05)
    obs = env.reset(0, start=(0, 0), goal=(2, 0))
    assert obs.anchor == ((0, 0), (2, 0)) and len(obs.images) == 1
    assert obs.images[0].size == (5 * 28, 28)
    # pixel at the agent cell centre is red, the goal cell centre green
    assert obs.images[0].getpixel((14, 14)) == (220, 30, 30)
    assert obs.images[0].getpixel((2 * 28 + 14, 14)) == (30, 170, 50)
    obs, r, done, info = env.step("left")  # wall: stays at 0
    assert (r, done, env.agent) == (-0.05, False, (0, 0)) and obs.anchor == ((0, 0), (2, 0))
    obs, r, done, info = env.step("jump")  # invalid
    assert info["invalid"] and r == -0.05 and obs.text.startswith("Invalid move.")
    obs, r, done, info = env.step("right")
    assert (r, done, obs.anchor) == (-0.05, False, ((1, 0), (2, 0))) and obs.text.startswith("You moved right.")
    obs, r, done, info = env.step(" right")
    assert (r, done, info["success"]) == (1.0, True, True)


def test_grid_say_positions_text():
    env = GridPuzzleEnv(width=5, say_positions=True)
    obs = env.reset(0, start=(1, 0), goal=(3, 0))
    assert obs.text == ("The red square is at cell two, the green circle at cell four. "
                        "Move the red square to the green circle. Answer left or right.")
    obs, *_ = env.step("right")
    assert obs.text.startswith("The red square is at cell three, the green circle at cell four. You moved right.")
    env = GridPuzzleEnv(width=3, height=3, say_positions=True)
    assert "at column one row three" in env.reset(0, start=(0, 2), goal=(1, 1)).text
    assert "left or right or up or down" in env.prompt


def test_grid_goal_cells():
    env = GridPuzzleEnv(width=5, goal_cells=[[0, 0], 4])
    assert [env.reset(s).anchor[1] for s in range(4)] == [(0, 0), (4, 0), (0, 0), (4, 0)]
    assert all(env.reset(s).anchor[0] != env.reset(s).anchor[1] for s in range(20))
    with pytest.raises(ValueError, match="goal_cells"):
        GridPuzzleEnv(width=3, goal_cells=[[5, 0]])


def test_grid_progress_reward_by_hand():
    env = GridPuzzleEnv(width=5, step_penalty=0.05, progress_reward=0.5)
    env.reset(0, start=(2, 0), goal=(4, 0))
    assert env.step("left")[1] == pytest.approx(-0.05 - 0.5)   # away from the goal
    assert env.step("right")[1] == pytest.approx(-0.05 + 0.5)  # back towards it
    assert env.step("up")[1] == pytest.approx(-0.05)           # invalid on a line: no move, no shaping
    assert env.step("right")[1] == pytest.approx(-0.05 + 0.5)
    _, r, done, _ = env.step("right")
    assert done and r == pytest.approx(1.0 + 0.5)


def test_grid_max_turns_and_determinism():
    env = GridPuzzleEnv(width=5, max_turns=2)
    a = env.reset(7)
    b = GridPuzzleEnv(width=5).reset(7)
    assert a.anchor == b.anchor and a.anchor[0] != a.anchor[1]
    env.reset(0, start=(0, 0), goal=(4, 0))
    assert env.step("right")[2] is False
    _, r, done, info = env.step("right")
    assert done and info["max_turns"] and not info["success"] and r == -0.05


@pytest.mark.parametrize("w,h", [(5, 1), (3, 3)])
def test_optimal_policy_solves_every_board(w, h):
    env = GridPuzzleEnv(width=w, height=h, max_turns=w + h)
    cells = [(x, y) for y in range(h) for x in range(w)]
    for start, goal in itertools.permutations(cells, 2):
        env.reset(0, start=start, goal=goal)
        dist = abs(start[0] - goal[0]) + abs(start[1] - goal[1])
        for turn in range(1, dist + 1):
            _, r, done, info = env.step(env.optimal_action(env.state))
            assert done == (turn == dist)
        assert info["success"] and r == 1.0


def test_scripted_policy_success_rates():
    """Optimal policy: 100 %; uniform random left/right on a 5-cell line in 4 turns: much lower."""
    def success_rate(policy, n=400):
        wins = 0
        for seed in range(n):
            env = GridPuzzleEnv(width=5, max_turns=4)
            env.reset(seed)
            rng = random.Random(seed)
            done = False
            while not done:
                _, _, done, info = env.step(policy(env, rng))
            wins += info["success"]
        return wins / n

    assert success_rate(lambda env, rng: env.optimal_action(env.state)) == 1.0
    rand = success_rate(lambda env, rng: rng.choice(["left", "right"]))
    assert 0.2 < rand < 0.7


def test_parse_move_and_bad_reset():
    assert parse_move("I go Top!", ("left", "right", "up", "down")) == "up"
    assert parse_move("down", ("left", "right")) is None
    with pytest.raises(ValueError, match="outside"):
        GridPuzzleEnv(width=3).reset(0, start=(5, 0), goal=(0, 0))
    with pytest.raises(ValueError, match="same cell"):
        GridPuzzleEnv(width=3).reset(0, start=(1, 0), goal=(1, 0))


# ---------------------------------------------------------------------------------------------- math feedback

def test_math_feedback_retry_and_turn_discount():
    env = MathFeedbackEnv(max_turns=3)
    obs = env.reset(0, question="What is 2 + 3?", answer="5")
    assert obs.text == "What is 2 + 3?" and obs.images == [] and obs.anchor == ("question",)
    obs, r, done, info = env.step("It is 4")
    assert (obs.text, r, done, obs.anchor) == (FEEDBACK_TEXT, 0.0, False, ("retry", 1))
    assert obs.text == "Your answer is wrong. Try again."
    obs, r, done, info = env.step("<answer>6</answer>")
    assert (r, done, obs.anchor) == (0.0, False, ("retry", 2))
    obs, r, done, info = env.step(r"so \boxed{5}")
    assert (r, done, info["success"]) == (1.0, True, True)
    # success at turn 3 with gamma 0.9: 0.9^2 = 0.81; at turn 1: 1; never: 0
    assert turn_discounted_return([0, 0, 1], 0.9) == pytest.approx(0.81)
    assert turn_discounted_return([1], 0.9) == 1.0
    assert turn_discounted_return([0, 0, 0], 0.9) == 0.0
    assert turn_discounted_return([0.5, 1.0], 0.5) == pytest.approx(1.0)  # 0.5 + 0.5 * 1


def test_math_feedback_ends_after_max_turns_and_generates_tasks():
    env = MathFeedbackEnv(max_turns=2)
    env.reset(0, question="q", answer="7")
    assert env.step("1")[2] is False
    _, r, done, info = env.step("2")
    assert done and r == 0.0 and info["max_turns"]
    a, b = MathFeedbackEnv().reset(11), MathFeedbackEnv().reset(11)
    assert a.text == b.text and a.text.startswith("What is ")
    env = MathFeedbackEnv(source="shapes", max_turns=2)
    obs = env.reset(4)
    assert len(obs.images) == 1 and obs.images[0].size == (56, 56)
    _, r, done, _ = env.step(env.answer)  # the gold word itself is correct
    assert r == 1.0 and done


# ---------------------------------------------------------------------------------------------- manager

@register_env("_test_slow")
class SlowEnv(Env):
    """Sleeps in step (releases the GIL like real I/O); raises when told to."""

    max_turns = 3
    stop_strings = ("STOP",)

    def reset(self, seed, fail_at=None, delay=0.2):
        self.seed, self.fail_at, self.delay, self.t = seed, fail_at, delay, 0
        return Observation(f"start {seed}", anchor=0)

    def step(self, action_text):
        time.sleep(self.delay)
        self.t += 1
        if self.t == self.fail_at:
            raise ZeroDivisionError("boom in step")
        return Observation(f"{self.seed}:{action_text}", anchor=self.t), float(self.seed), self.t >= 2, {}


def test_manager_thread_concurrency_and_error_isolation():
    specs = [{"task": "_test_slow", "seed": i, "task_kwargs": {"fail_at": 1 if i == 2 else None}} for i in range(4)]
    with EnvManager(max_workers=4, backend="thread") as mgr:
        resets = mgr.reset(specs)
        assert [r.observation.text for r in resets] == [f"start {i}" for i in range(4)]
        assert mgr.stop_strings[0] == ("STOP",) and mgr.max_turns[3] == 3
        t = time.perf_counter()
        out = mgr.step([0, 1, 2, 3], ["a", "b", "c", "d"])
        assert time.perf_counter() - t < 0.6  # 4 x 0.2 s sleeps ran concurrently
        assert [o.observation.text for o in out[:2]] == ["0:a", "1:b"] and out[3].reward == 3.0
        bad = out[2]
        assert bad.done and bad.reward == 0.0 and "ZeroDivisionError: boom in step" in bad.info["error"]
        assert bad.info["index"] == 2 and bad.info["task"] == "_test_slow"
        assert len(mgr.errors) == 1 and mgr.errors[0].index == 2 and mgr.errors[0].phase == "step"
        assert "test_envs.py" in mgr.errors[0].traceback and "in step" in mgr.errors[0].traceback
        out = mgr.step([0, 1, 3], ["x", "y", "z"])  # the others continue
        assert [o.done for o in out] == [True, True, True]


def test_manager_process_backend_reports_failures():
    specs = [{"task": "grid_puzzle", "seed": 0, "task_kwargs": {"start": (0, 0), "goal": (1, 0)}},
             {"task": "grid_puzzle", "seed": 1, "task_kwargs": {"start": (9, 0), "goal": (1, 0)}},  # raises
             {"task": "math_feedback", "seed": 2, "env_kwargs": {"max_turns": 2}}]
    with EnvManager(max_workers=2, backend="process") as mgr:
        res = mgr.reset(specs)
        assert res[0].observation.anchor == ((0, 0), (1, 0)) and res[0].observation.images[0].size == (140, 28)
        assert res[1].done and "outside" in res[1].info["error"] and res[1].info["index"] == 1
        assert res[2].observation.text.startswith("What is ")
        out = mgr.step([0, 2], ["right", "nonsense"])
        assert out[0].reward == 1.0 and out[0].done and out[0].info["success"]
        assert out[1].observation.text == FEEDBACK_TEXT and not out[1].done
        assert [e.index for e in mgr.errors] == [1]
