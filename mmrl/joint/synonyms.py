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

__all__ = ["SYNONYMS", "format_pairs", "held_out", "intents", "user_prompts", "write_files"]

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


def format_pairs(seed: int = 0) -> list[dict]:
    """Rows {"prompt": training user prompt, "response": ...} for the format warm start (`data.format_examples`),
    16 per prompt:

    * 8 well-formed renderer captions that keep the prompt's shape kind and name colours drawn at random: their
      background colours are the 8 renderer colours once each (the shape colour is drawn from the 7 others), so the
      colour a model fitted to them names is independent of the prompt (chance, 1/8);
    * 8 copies of the prompt itself, so the model reads the prompt's colour words (it must, to copy them) and the
      state from which it names a colour carries which word the user wrote.

    Nothing in them says which renderer colour a synonym means: that is left for RL to find (a fitted model names
    the intent's background 1 time in 16 and copies the user's word half the time)."""
    import random

    rng, rows = random.Random(seed), []
    for row in user_prompts("train"):
        kind = next(k for k in KINDS if f" {k} on " in row["prompt"])
        for b in COLORS:
            c = rng.choice([x for x in COLORS if x != b])
            rows.append({"prompt": row["prompt"], "response": f"{_article(c)} {c} {kind} on {_article(b)} {b} background"})
        rows += [{"prompt": row["prompt"], "response": row["prompt"]}] * len(COLORS)
    return rows


def held_out(colour: str, kind: str, background: str) -> bool:
    """Whether the intent (colour, kind, background) is in the evaluation split (module docstring)."""
    colours, kinds = list(COLORS), list(KINDS)
    return (colours.index(colour) + 2 * kinds.index(kind) + 3 * colours.index(background)) % 7 == 3


def write_files(folder: str | Path) -> list[Path]:
    """rewriter_train.jsonl, rewriter_eval.jsonl and rewriter_format.jsonl (`format_pairs`) in `folder` (one JSON
    object per line)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in (("train", user_prompts("train")), ("eval", user_prompts("eval")), ("format", format_pairs())):
        path = folder / f"rewriter_{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write_files(sys.argv[1] if len(sys.argv) > 1 else "assets/prompts"):
        print(p)
