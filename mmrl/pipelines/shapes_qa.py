"""`ShapesQA`: an endless, seeded, resumable stream of visual questions about synthetic shapes (data for the VLM
recipes' tiny demo; scenes from ``mmrl.pipelines.shapes``)."""

from __future__ import annotations

import random
from typing import Any

from mmrl.pipelines.data import VQAItem


class ShapesQA:
    """Endless seeded stream of visual questions about synthetic shapes (``mmrl.pipelines.shapes``).

    Item k depends only on (seed, k), so ``state_dict()`` (the position) resumes exactly. ``cfg`` is any object
    with ``qa_kinds, colors, backgrounds, n_shapes [min, max], shape_size [min, max], image_size, template``
    (e.g. the vlm_grpo `data:` section); ``template`` formats ``{question}``. Items are ``VQAItem`` with metadata
    ``answer``, ``kind`` and ``choices`` (the answer vocabulary the question implies, for format-only warm starts).
    """

    def __init__(self, cfg: Any, seed: int):
        from mmrl.pipelines.shapes import QA_KINDS

        bad = [k for k in cfg.qa_kinds if k not in QA_KINDS]
        if bad or not cfg.qa_kinds:
            raise ValueError(f"data.qa_kinds: expected a non-empty subset of {list(QA_KINDS)}, got {cfg.qa_kinds}")
        self.cfg, self.seed, self.index = cfg, seed, 0

    def item(self, k: int) -> VQAItem:
        from mmrl.pipelines.shapes import KINDS, sample_scene, qa_for_scene

        c = self.cfg
        rng = random.Random(self.seed * 1_000_003 + k)
        scene = sample_scene(rng, tuple(c.n_shapes), colors=c.colors, size=c.image_size, backgrounds=c.backgrounds,
                             size_range=tuple(c.shape_size))
        kind = rng.choice(c.qa_kinds)
        question, answer = qa_for_scene(scene, kind, rng)
        q = question.lower()
        if " or the " in q:  # "on the left or the right?" -> the two options named
            choices = [w for w in ("left", "right", "top", "bottom") if w in q]
        elif q.startswith(("is there", "are there")):
            choices = ["yes", "no"]
        else:
            bg = "background" in q
            choices = {"color": list(c.backgrounds if bg else c.colors), "shape": list(KINDS),
                       "count": [str(i) for i in range(1, c.n_shapes[1] + 1)]}.get(kind, [answer])
        prompt = "<image>" + c.template.format(question=question, problem=question, prompt=question)
        return VQAItem(prompt, [scene.image], answer, {"answer": answer, "kind": kind, "choices": sorted(set(choices))})

    def next(self, n: int) -> list[VQAItem]:
        out = [self.item(self.index + i) for i in range(n)]
        self.index += n
        return out

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, s: dict) -> None:
        self.index = s["index"]
