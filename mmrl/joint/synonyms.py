"""Demo data of the prompt-rewriter recipe: user prompts that name colours with words the tiny renderer never saw.

The shapes-pretrained tiny SD3 (assets/tiny_sd3_shapes) was trained on captions "a red circle on a blue background"
with the eight colours of `mmrl.pipelines.shapes.COLORS`; its tokenizers split an unknown word such as "crimson" into
pieces it has no meaning for. A user prompt here says "a crimson circle on a navy background"; its intent (metadata
`intent`) is the caption the renderer understands, "a red circle on a blue background". Rendering the user prompt as
it is draws the wrong colours; a rewriter that names the renderer's colours gets the scene right: the reward (the
shapes detector's colour and background checks against the intent) rises for that reason only.

    python -m mmrl.joint.synonyms assets/prompts    # writes rewriter_train.jsonl, rewriter_eval.jsonl (tested)

Split: an intent (shape colour c, kind k, background b) is held out when (c + 2 k + 3 b) % 7 == 3 (indices into
COLORS / KINDS): every background and shape colour appears in both splits, and evaluation asks for combinations never
seen together in training. The evaluation file lists one synonym variant of every held-out intent before the next
variant, so its first N prompts (`log.eval_max_prompts`) cover N different intents; a rewriter that names one colour
for every prompt scores about 1/7 of what naming the right one does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mmrl.pipelines.shapes import COLORS, KINDS

__all__ = ["SYNONYMS", "held_out", "intents", "user_prompts", "write_files"]

# two words per renderer colour, none of them in the tiny tokenizers' vocabulary (mmrl.tiny.vocab.CORPUS_WORDS)
SYNONYMS: dict[str, tuple[str, str]] = {
    "red": ("crimson", "scarlet"), "green": ("emerald", "jade"), "blue": ("navy", "azure"),
    "yellow": ("golden", "lemon"), "white": ("snowy", "ivory"), "black": ("ebony", "inky"),
    "orange": ("amber", "tangerine"), "purple": ("violet", "plum"),
}


def intents() -> list[tuple[str, str, str]]:
    """Every (shape colour, kind, background colour) with different colours, sorted."""
    return sorted((c, k, b) for c in COLORS for k in KINDS for b in COLORS if b != c)


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def user_prompts(split: str) -> list[dict]:
    """Rows {"prompt": user prompt, "intent": renderer caption} of `split` ("train" | "eval"): each intent of the
    split with the four combinations of its colours' synonyms."""
    if split not in ("train", "eval"):
        raise ValueError(f"split: expected 'train' or 'eval', got {split!r}")
    variants: list[list[dict]] = [[], [], [], []]  # one list per synonym combination
    for c, k, b in intents():
        if (held_out(c, k, b)) != (split == "eval"):
            continue
        intent = f"{_article(c)} {c} {k} on {_article(b)} {b} background"
        for j, (sc, sb) in enumerate((sc, sb) for sc in SYNONYMS[c] for sb in SYNONYMS[b]):
            variants[j].append({"prompt": f"{_article(sc)} {sc} {k} on {_article(sb)} {sb} background",
                                "intent": intent})
    return [row for rows in variants for row in rows]


def held_out(colour: str, kind: str, background: str) -> bool:
    """Whether the intent (colour, kind, background) is in the evaluation split (module docstring)."""
    colours, kinds = list(COLORS), list(KINDS)
    return (colours.index(colour) + 2 * kinds.index(kind) + 3 * colours.index(background)) % 7 == 3


def write_files(folder: str | Path) -> list[Path]:
    """rewriter_train.jsonl and rewriter_eval.jsonl in `folder` (one JSON object per line)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for split in ("train", "eval"):
        path = folder / f"rewriter_{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in user_prompts(split)))
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write_files(sys.argv[1] if len(sys.argv) > 1 else "assets/prompts"):
        print(p)
