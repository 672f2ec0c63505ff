"""Example environment 1: math / visual QA with feedback and retry (``math_feedback``)."""

from __future__ import annotations

import random
from typing import Any, Sequence

from mmrl.vlm.envs.base import Env, Observation, register_env


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
