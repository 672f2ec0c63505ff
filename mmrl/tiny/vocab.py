"""Local tokenizers of the tiny models (no network): a fixed corpus, a deterministic byte-level BPE trainer, and
CLIP / T5 / Qwen2 tokenizers built from them; ``build_tokenizer_assets()`` regenerates ``assets/tokenizers/``
byte for byte.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Iterable

ASSETS_DIR = Path(__file__).resolve().parents[2] / "assets" / "tokenizers"

# ----------------------------------------------------------------------------------------------
# Corpus: every word here becomes a single token (with and without a leading space for Qwen).
# ----------------------------------------------------------------------------------------------
COLOURS = ["red", "green", "blue", "yellow", "white", "black", "orange", "purple", "gray", "grey",
           "pink", "brown", "cyan", "magenta"]
SHAPES = ["circle", "square", "triangle", "rectangle", "star", "ellipse", "dot", "line", "cross",
          "circles", "squares", "triangles", "shape", "shapes", "object", "objects"]
POSITIONS = ["left", "right", "top", "bottom", "center", "centre", "middle", "above", "below",
             "next", "side", "corner", "upper", "lower"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
                "eighteen", "nineteen", "twenty"]
COMMON_WORDS = [
    "a", "an", "the", "on", "of", "with", "in", "and", "or", "is", "are", "it", "to", "at", "by",
    "for", "this", "that", "there", "these", "what", "which", "how", "many", "much", "where", "who",
    "colour", "color", "colours", "colors", "background", "image", "picture", "photo", "scene",
    "answer", "question", "yes", "no", "not", "number", "count", "total", "small", "large", "big",
    "tiny", "dark", "light", "bright", "think", "step", "first", "then", "so", "because", "final",
    "please", "describe", "shown", "located", "between", "inside", "outside", "only", "each",
    "both", "all", "same", "different", "more", "less", "than", "most", "least", "biggest",
    "smallest", "do", "does", "you", "see", "can", "be", "as", "has", "have", "its", "your",
    "system", "user", "assistant", "helpful", "reasoning", "process", "format", "put", "inside",
    "tags", "output", "hello", "world", "text", "photo", "painting", "drawing", "simple", "flat",
    "cat", "dog", "sky", "sun", "tree", "house", "car", "bird", "flower", "sea", "mountain",
    "high", "quality", "style", "art", "digital", "detailed", "beautiful", "mmrl",
]
CAPITALISED = ["a", "an", "the", "what", "which", "how", "is", "are", "answer", "question", "yes",
               "no", "there", "you", "count", "describe", "think", "please", "hello", "final", "this",
               "where", "do", "does"] + COLOURS + SHAPES[:5]
CORPUS_WORDS = sorted(set(COLOURS + SHAPES + POSITIONS + NUMBER_WORDS + COMMON_WORDS))

# Qwen special tokens with the real strings, in the real relative order.
# source: Qwen2-VL tokenizer_config.json added_tokens_decoder (ids 151643-151656)
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
QWEN_NORMAL_ADDED_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]

# Renders the same text layout as the Qwen2-VL chat template: default system turn, images as
# <|vision_start|><|image_pad|><|vision_end|>, videos with <|video_pad|>, optional generation prompt.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item or 'image_url' in item %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' or 'video' in item %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in item %}"
    "{{ item['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|im_start|>assistant\n"
    "{% endif %}"
)

# Qwen3-VL renders the same layout but adds no default system turn.
QWEN3_CHAT_TEMPLATE = QWEN_CHAT_TEMPLATE.replace(
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}", "")


def _bytes_to_unicode() -> dict[int, str]:
    """Reversible byte -> printable unicode character map used by byte-level BPE.

    source: GPT-2 encoder.py bytes_to_unicode (printable latin-1 bytes map to themselves, the others
    to 256 + n in order), which is also what ``tokenizers.pre_tokenizers.ByteLevel`` uses.
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def train_bpe(words: Iterable[tuple[str, ...]]) -> list[tuple[str, str]]:
    """Deterministic BPE: merge the most frequent adjacent pair until every word is one symbol.

    ``words`` are words already split into initial symbols (repeats count as frequency). Ties are
    broken by the lexicographically smallest pair, so the result depends only on the input.
    """
    counts: dict[tuple[str, ...], int] = {}
    for w in words:
        counts[tuple(w)] = counts.get(tuple(w), 0) + 1
    merges: list[tuple[str, str]] = []
    while True:
        pairs: dict[tuple[str, str], int] = {}
        for w, c in counts.items():
            for pair in zip(w[:-1], w[1:]):
                pairs[pair] = pairs.get(pair, 0) + c
        if not pairs:
            return merges
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = {}
        for w, c in counts.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + c
        counts = merged


def _vocab_from_merges(base: list[str], merges: list[tuple[str, str]]) -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(base)}
    for a, b in merges:
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
    return vocab


# ----------------------------------------------------------------------------------------------
# Tokenizer generators (in memory) and asset IO
# ----------------------------------------------------------------------------------------------
def make_clip_tokenizer():
    """CLIP-style BPE (lower-case, ``</w>`` word ends, byte-level alphabet) as a ``CLIPTokenizer``.

    Layout follows OpenAI CLIP: 256 byte symbols, the same with ``</w>``, merges, then
    ``<|startoftext|>`` and ``<|endoftext|>`` last.
    """
    from transformers import CLIPTokenizer

    b2u = _bytes_to_unicode()
    chars = [b2u[b] for b in range(256)]
    words = []
    for w in CORPUS_WORDS:
        sym = [b2u[b] for b in w.encode("utf-8")]
        sym[-1] = sym[-1] + "</w>"
        words.append(tuple(sym))
    merges = train_bpe(words)
    vocab = _vocab_from_merges(chars + [c + "</w>" for c in chars], merges)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=list(merges), model_max_length=77)


def make_t5_tokenizer():
    """T5-style Unigram tokenizer (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2; ``▁word`` pieces)."""
    from transformers import T5Tokenizer

    chars = sorted({c for w in CORPUS_WORDS + [x.capitalize() for x in CAPITALISED] for c in w}
                   | set("0123456789.,:;!?'\"-()[]/"))
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -4.0)]
    pieces += [(c, -10.0) for c in chars] + [("▁" + c, -9.0) for c in chars]
    seen = {p for p, _ in pieces}
    for w in CORPUS_WORDS + [x.capitalize() for x in CAPITALISED]:
        if "▁" + w not in seen:
            seen.add("▁" + w)
            pieces.append(("▁" + w, -3.0))
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


def make_qwen_tokenizer():
    """Qwen2-style byte-level BPE with Qwen's special tokens (real strings) and chat template."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    b2u = _bytes_to_unicode()
    forms = [w for w in CORPUS_WORDS] + [" " + w for w in CORPUS_WORDS]
    forms += [x.capitalize() for x in CAPITALISED] + [" " + x.capitalize() for x in CAPITALISED]
    forms += ["\n\n", " \n", ".\n", "?\n"]
    words = [tuple(b2u[b] for b in f.encode("utf-8")) for f in forms]
    merges = train_bpe(words)
    vocab = _vocab_from_merges([b2u[b] for b in range(256)], merges)
    for t in QWEN_SPECIAL_TOKENS + QWEN_NORMAL_ADDED_TOKENS:  # fixed ids, in Qwen's order, at the end
        vocab[t] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=list(merges),
                         eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
                         model_max_length=32768, errors="replace")
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS[1:]})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_NORMAL_ADDED_TOKENS])
    tok.chat_template = QWEN_CHAT_TEMPLATE
    return tok


# The prompt templates of diffusers' Qwen-Image pipelines. The pipelines drop a fixed number of leading tokens of
# the text encoder's output (34 for text-to-image, 64 for the edit pipelines): the real Qwen2 tokenizer turns the
# template's system turn into exactly that many tokens, so a tiny tokenizer must too, or template tokens leak into
# the prompt embeddings. Every pre-token of these texts becomes one token of the `qwen_image` tokenizer.
# source: diffusers 0.42 pipelines/qwenimage/pipeline_qwenimage.py, pipeline_qwenimage_edit.py,
# pipeline_qwenimage_edit_plus.py (`prompt_template_encode`)
QWEN_IMAGE_TEMPLATE_TEXTS = [
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n",
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n",
    "Picture 1: ", "<|im_end|>\n<|im_start|>assistant\n",
]
# edit instructions of the synthetic shapes edit task ("make the circle red", ...)
EDIT_WORDS = ["make", "turn", "change", "paint", "recolor", "recolour", "into", "keep", "everything", "else",
              "edit", "instruction", "Make", "Turn", "Change", "Paint"]


def _qwen_pre_tokens(tok, text: str) -> list[str]:
    """`text` split as the Qwen2 tokenizer splits it before BPE: special tokens out, then the Qwen2 regex
    pre-tokenizer; byte-level strings (spaces as 'Ġ')."""
    pieces = re.split("(" + "|".join(re.escape(t) for t in QWEN_SPECIAL_TOKENS) + ")", text)
    pre = tok.backend_tokenizer.pre_tokenizer
    return [p for piece in pieces if piece and piece not in QWEN_SPECIAL_TOKENS
            for p, _ in pre.pre_tokenize_str(piece)]


def make_qwen_image_tokenizer(extra_texts: tuple[str, ...] = ()):
    """The Qwen2-style tokenizer of the tiny Qwen-Image pipelines: ``make_qwen_tokenizer``'s corpus plus every
    pre-token of ``QWEN_IMAGE_TEMPLATE_TEXTS`` and the edit words as single tokens, so the templates' system turns
    tokenize to the 34 / 64 tokens the pipelines drop (as the real tokenizer's do). ``extra_texts``: other
    pipelines' templates whose pre-tokens become single tokens too (HunyuanVideo 1.5's 108-token system turn)."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    b2u = _bytes_to_unicode()
    forms = [w for w in CORPUS_WORDS + EDIT_WORDS] + [" " + w for w in CORPUS_WORDS + EDIT_WORDS]
    forms += [x.capitalize() for x in CAPITALISED] + [" " + x.capitalize() for x in CAPITALISED]
    forms += ["\n\n", " \n", ".\n", "?\n"]
    words = [tuple(b2u[b] for b in f.encode("utf-8")) for f in forms]
    probe = make_qwen_tokenizer()  # only its pre-tokenizer (the Qwen2 regex) is used
    words += [tuple(p) for text in [*QWEN_IMAGE_TEMPLATE_TEXTS, *extra_texts] for p in _qwen_pre_tokens(probe, text)]
    merges = train_bpe(words)
    vocab = _vocab_from_merges([b2u[b] for b in range(256)], merges)
    for t in QWEN_SPECIAL_TOKENS + QWEN_NORMAL_ADDED_TOKENS:
        vocab[t] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=list(merges), eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         unk_token=None, model_max_length=32768, errors="replace")
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS[1:]})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_NORMAL_ADDED_TOKENS])
    tok.chat_template = QWEN_CHAT_TEMPLATE
    return tok


def build_tokenizer_assets(root: str | os.PathLike = ASSETS_DIR) -> Path:
    """(Re)generate ``clip/``, ``t5/``, ``qwen/`` and ``qwen_image/`` tokenizer files under ``root``; returns root."""
    root = Path(root)
    for name, make in (("clip", make_clip_tokenizer), ("t5", make_t5_tokenizer),
                       ("qwen", make_qwen_tokenizer), ("qwen_image", make_qwen_image_tokenizer)):
        out = root / name
        if out.exists():
            shutil.rmtree(out)
        make().save_pretrained(out)
    return root


def _load_tokenizer(name: str):
    """Load stored tokenizer files from assets, or generate them in memory when not shipped."""
    from transformers import AutoTokenizer

    d = ASSETS_DIR / name
    if (d / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(d)
    make = {"clip": make_clip_tokenizer, "t5": make_t5_tokenizer, "qwen": make_qwen_tokenizer,
            "qwen_image": make_qwen_image_tokenizer}[name]
    return make()
