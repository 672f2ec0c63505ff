"""Tiny, randomly initialised models of the real architectures, saved in the standard formats.

Every builder seeds torch, builds the genuine diffusers / transformers / open_clip class with
very small sizes, saves it with ``save_pretrained`` (or open_clip's files) and returns the path.
Loading back is exactly what a real checkpoint uses (``StableDiffusion3Pipeline.from_pretrained``,
``AutoProcessor.from_pretrained``, ...), so tests and the CPU demo exercise the real code paths.

Tokenizers are built locally (no network): small byte-level BPE vocabularies trained here, with a
deterministic trainer, on a fixed corpus covering the synthetic prompts and visual-QA tasks
(colours, shapes, positions, counts). The generated files are stored in ``assets/tokenizers/``
(``clip/``, ``t5/``, ``qwen/``); ``build_tokenizer_assets()`` regenerates them byte for byte.

What is simplified away: the weights are random (see ``CALIBRATION.md``), the vocabularies are a
few hundred to a thousand tokens instead of 49k-152k.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizers"

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


def build_tokenizer_assets(root: str | os.PathLike = ASSETS_DIR) -> Path:
    """(Re)generate ``clip/``, ``t5/`` and ``qwen/`` tokenizer files under ``root``; returns root."""
    root = Path(root)
    for name, make in (("clip", make_clip_tokenizer), ("t5", make_t5_tokenizer),
                       ("qwen", make_qwen_tokenizer)):
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
    make = {"clip": make_clip_tokenizer, "t5": make_t5_tokenizer, "qwen": make_qwen_tokenizer}[name]
    return make()


# ----------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------
def count_parameters(module: torch.nn.Module) -> int:
    """Number of parameters of ``module`` (trainable or not)."""
    return sum(p.numel() for p in module.parameters())


def _tiny_vae(seed: int):
    """AutoencoderKL with 3 blocks (16/32/32 channels): 64x64x3 image <-> 4x16x16 latent.

    SD3-style: no quant convs; scaling 1, shift 0 so latents are the raw posterior.
    """
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 32), layers_per_block=1, norm_num_groups=8, sample_size=64,
        scaling_factor=1.0, shift_factor=0.0, use_quant_conv=False, use_post_quant_conv=False,
    )


def _tiny_clip_text(tokenizer, seed: int, hidden: int, projection_dim: int | None, with_projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        projection_dim=projection_dim or hidden, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=77, hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return cls(cfg).eval()


def _tiny_t5_encoder(tokenizer, seed: int, d_model: int = 32):
    """T5 v1.1-style encoder (gated-gelu, like SD3's / FLUX's T5-XXL) with d_model 32."""
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(
        vocab_size=len(tokenizer), d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu", dropout_rate=0.0, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return T5EncoderModel(cfg).eval()


def _prepare_dir(path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


# ----------------------------------------------------------------------------------------------
# Diffusion pipelines
# ----------------------------------------------------------------------------------------------
def build_tiny_sd3(path, seed: int = 0, sample_size: int = 16) -> Path:
    """Tiny ``StableDiffusion3Pipeline`` (transformer, VAE, 2 CLIP encoders, T5 encoder) at ``path``.

    Sizes (CALIBRATION.md): SD3Transformer2DModel patch 2, 4 in/out channels, 2 layers, 2 heads x 16,
    joint_attention_dim = caption_projection_dim = pooled_projection_dim = 32. The two CLIP text
    encoders have hidden 16 and projection 16 each, so the concatenated CLIP prompt embeds (16 + 16
    channels) and pooled embeds (16 + 16) are exactly 32 wide; the T5 encoder has d_model 32 = joint_attention_dim
    (it is included because ``from_pretrained`` of a directory without it fails unless the caller
    passes ``text_encoder_3=None, tokenizer_3=None``). 64x64 images <-> 4x16x16 latents.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    if sample_size <= 0 or sample_size % 2:
        raise ValueError(f"build_tiny_sd3: sample_size (latent side) must be a positive multiple of the "
                         f"patch size 2, got {sample_size}")
    path = _prepare_dir(path)
    tok, t5_tok = _load_tokenizer("clip"), _load_tokenizer("t5")
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=sample_size, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
        pooled_projection_dim=32, out_channels=4, pos_embed_max_size=max(32, sample_size // 2),
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=_tiny_vae(seed + 1),
        text_encoder=_tiny_clip_text(tok, seed + 2, 16, 16, with_projection=True),
        tokenizer=tok,
        text_encoder_2=_tiny_clip_text(tok, seed + 3, 16, 16, with_projection=True),
        tokenizer_2=tok,
        text_encoder_3=_tiny_t5_encoder(t5_tok, seed + 4, d_model=32),
        tokenizer_3=t5_tok,
    )
    pipe.save_pretrained(path)
    return path


def build_tiny_flux(path, seed: int = 0) -> Path:
    """Tiny ``FluxPipeline`` (FLUX.1-dev layout) at ``path``.

    FluxTransformer2DModel: in_channels 16 (4 latent channels x 2x2 packing), 1 double + 1 single
    block, 2 heads x 16 (rope axes 4+6+6), joint_attention_dim 32 = T5 d_model, pooled_projection_dim
    32 = CLIP hidden, ``guidance_embeds=True`` like FLUX.1-dev (the guidance-distilled model RL papers
    fine-tune; pass ``guidance_scale``). Scheduler: FLUX.1-dev's dynamic-shift flow-matching Euler.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    path = _prepare_dir(path)
    tok, t5_tok = _load_tokenizer("clip"), _load_tokenizer("t5")
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )
    # source: black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        scheduler=scheduler, vae=_tiny_vae(seed + 1),
        text_encoder=_tiny_clip_text(tok, seed + 2, 32, None, with_projection=False), tokenizer=tok,
        text_encoder_2=_tiny_t5_encoder(t5_tok, seed + 3, d_model=32), tokenizer_2=t5_tok,
        transformer=transformer,
    )
    pipe.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------------------------
# Vision-language models
# ----------------------------------------------------------------------------------------------
QWEN_MIN_PIXELS = 56 * 56
QWEN_MAX_PIXELS = 224 * 224


def _qwen_token_ids(tok) -> dict[str, int]:
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    ids["eos_token_id"] = tok.convert_tokens_to_ids("<|im_end|>")
    ids["pad_token_id"] = tok.convert_tokens_to_ids("<|endoftext|>")
    ids["bos_token_id"] = tok.convert_tokens_to_ids("<|endoftext|>")
    return ids


def _qwen_text_config(tok, ids: dict[str, int]) -> dict:
    """Text decoder: hidden 64, 2 layers, 4 heads (head_dim 16), 2 kv heads, intermediate 128.

    mrope_section [2, 3, 3] sums to head_dim / 2 = 8 (same 2:3:3 split as Qwen2-VL's [16, 24, 24]).
    """
    return dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-6, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"],
    )


def _qwen_processor(processor_cls, tok, patch_size: int = 14):
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    size = {"shortest_edge": QWEN_MIN_PIXELS, "longest_edge": QWEN_MAX_PIXELS}
    image_processor = Qwen2VLImageProcessor(size=size, patch_size=patch_size, merge_size=2,
                                            temporal_patch_size=2)
    # cap_pixels_per_frame: the qwen-vl-utils reference behaviour (and silences transformers' warning)
    video_processor = Qwen2VLVideoProcessor(size=size, patch_size=patch_size, merge_size=2,
                                            temporal_patch_size=2, cap_pixels_per_frame=True)
    return processor_cls(image_processor=image_processor, tokenizer=tok,
                         video_processor=video_processor, chat_template=tok.chat_template)


def _save_vlm(model, processor, ids: dict[str, int], path: Path) -> Path:
    model.generation_config.eos_token_id = [ids["eos_token_id"], ids["pad_token_id"]]
    model.generation_config.pad_token_id = ids["pad_token_id"]
    model.generation_config.bos_token_id = ids["bos_token_id"]
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def build_tiny_qwen2_vl(path, seed: int = 0) -> Path:
    """Tiny ``Qwen2VLForConditionalGeneration`` + ``Qwen2VLProcessor`` at ``path``.

    Vision tower: depth 2, embed 32, 2 heads, patch 14, merge 2 (a 56x56 image = 4 image tokens).
    Images are resized into [56*56, 224*224] pixels by the processor.
    """
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    path = _prepare_dir(path)
    tok = _load_tokenizer("qwen")
    ids = _qwen_token_ids(tok)
    cfg = Qwen2VLConfig(
        text_config=_qwen_text_config(tok, ids),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"], vision_end_token_id=ids["vision_end_token_id"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    return _save_vlm(model, _qwen_processor(Qwen2VLProcessor, tok), ids, path)


def build_tiny_qwen25_vl(path, seed: int = 0) -> Path:
    """Tiny ``Qwen2_5_VLForConditionalGeneration`` + ``Qwen2_5_VLProcessor`` at ``path``.

    Same text decoder and tokenizer as :func:`build_tiny_qwen2_vl`; the Qwen2.5-VL vision tower
    (RMSNorm, SwiGLU MLP, window attention) with depth 2, width 32, window 112, the last block full
    attention, out_hidden_size 64.
    """
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    path = _prepare_dir(path)
    tok = _load_tokenizer("qwen")
    ids = _qwen_token_ids(tok)
    cfg = Qwen2_5_VLConfig(
        text_config=_qwen_text_config(tok, ids),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           window_size=112, fullatt_block_indexes=[1], tokens_per_second=2),
        image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"], vision_end_token_id=ids["vision_end_token_id"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    return _save_vlm(model, _qwen_processor(Qwen2_5_VLProcessor, tok), ids, path)


def build_tiny_qwen3_vl(path, seed: int = 0) -> Path:
    """Tiny ``Qwen3VLForConditionalGeneration`` + ``Qwen3VLProcessor`` at ``path``.

    Text: hidden 64, 2 layers, 4 heads x 16, 2 kv heads, interleaved mrope_section [4, 2, 2] (sums to
    head_dim / 2). Vision: depth 2, width 32, patch 16, 8x8 learned position grid, deepstack from
    block 0. Chat template without the default system turn, as Qwen3-VL's.
    """
    from transformers import (Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration,
                              Qwen3VLProcessor, Qwen3VLVideoProcessor)

    path = _prepare_dir(path)
    tok = _load_tokenizer("qwen")
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    ids = _qwen_token_ids(tok)
    text = _qwen_text_config(tok, ids)
    text.update(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                              "mrope_section": [4, 2, 2], "mrope_interleaved": True})
    text.pop("bos_token_id")
    cfg = Qwen3VLConfig(
        text_config=text,
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           num_position_embeddings=64, deepstack_visual_indexes=[0]),
        image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"], vision_end_token_id=ids["vision_end_token_id"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(cfg).eval()
    # source: Qwen/Qwen3-VL-2B-Instruct preprocessor_config.json (patch 16, mean = std = 0.5)
    size = {"shortest_edge": 64 * 64, "longest_edge": 256 * 256}
    common = dict(size=size, patch_size=16, merge_size=2, temporal_patch_size=2,
                  image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**common), tokenizer=tok,
        video_processor=Qwen3VLVideoProcessor(**common, cap_pixels_per_frame=True),
        chat_template=tok.chat_template,
    )
    return _save_vlm(model, processor, ids, path)


# ----------------------------------------------------------------------------------------------
# CLIP-family reward backbones
# ----------------------------------------------------------------------------------------------
# source: OpenAI CLIP preprocessing constants (also transformers OPENAI_CLIP_MEAN / _STD)
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def build_tiny_clip(path, seed: int = 0) -> Path:
    """Tiny transformers ``CLIPModel`` + ``CLIPProcessor`` at ``path`` (PickScore / CLIP-score layout).

    Text and vision towers: hidden 32, 2 layers, 2 heads; 32x32 images in 8x8 patches; projection 16.
    The processor resizes the shortest edge to 32, centre-crops 32x32 and normalises with CLIP's
    real mean/std; the tokenizer is the local CLIP BPE.
    """
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    path = _prepare_dir(path)
    tok = _load_tokenizer("clip")
    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=16,
    )
    torch.manual_seed(seed)
    model = CLIPModel(cfg).eval()
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                         do_center_crop=True, image_mean=CLIP_MEAN, image_std=CLIP_STD)
    model.save_pretrained(path)
    CLIPProcessor(image_processor=image_processor, tokenizer=tok).save_pretrained(path)
    return path


# open_clip model configs (the same schema as open_clip/model_configs/*.json)
OPEN_CLIP_CONFIGS = {
    "tiny": {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
        # open_clip's own SimpleTokenizer (BPE file shipped in the wheel) has 49408 tokens: keep width tiny
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 2},
    },
}


def build_tiny_open_clip(path, seed: int = 0, arch: str = "tiny") -> Path:
    """Tiny open_clip ``CLIP`` at ``path`` in open_clip's local-dir format, plus an HPS-style copy.

    Writes ``open_clip_config.json`` (``{"model_cfg", "preprocess_cfg"}``), ``open_clip_model.safetensors``
    and ``hps_style.pt`` = ``{"state_dict": state_dict}`` (how HPSv2 checkpoints are stored).
    Load with :func:`load_open_clip` or ``open_clip.create_model_and_transforms("local-dir:" + path)``.
    """
    import open_clip
    from safetensors.torch import save_file

    if arch not in OPEN_CLIP_CONFIGS:
        raise ValueError(f"build_tiny_open_clip: unknown arch {arch!r}; expected one of {sorted(OPEN_CLIP_CONFIGS)}")
    path = _prepare_dir(path)
    model_cfg = json.loads(json.dumps(OPEN_CLIP_CONFIGS[arch]))
    preprocess_cfg = {"size": model_cfg["vision_cfg"]["image_size"], "mean": CLIP_MEAN, "std": CLIP_STD,
                      "interpolation": "bicubic", "resize_mode": "shortest"}
    torch.manual_seed(seed)
    model = open_clip.CLIP(**json.loads(json.dumps(model_cfg)))
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    (path / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}, indent=2) + "\n")
    save_file(sd, str(path / "open_clip_model.safetensors"))
    torch.save({"state_dict": sd}, path / "hps_style.pt")
    return path


def load_open_clip(path, device: str | torch.device = "cpu"):
    """Load a model written by :func:`build_tiny_open_clip` with open_clip's own functions.

    Returns ``(model, preprocess_val, tokenizer)``; nothing is downloaded.
    """
    import open_clip

    path = Path(path)
    if not (path / "open_clip_config.json").is_file():
        raise FileNotFoundError(f"load_open_clip: {path / 'open_clip_config.json'} not found "
                                "(expected a directory written by build_tiny_open_clip)")
    name = f"local-dir:{path}"
    model, _, preprocess_val = open_clip.create_model_and_transforms(name, device=device)
    return model.eval(), preprocess_val, open_clip.get_tokenizer(name)


# ----------------------------------------------------------------------------------------------
BUILDERS = {
    "sd3": build_tiny_sd3,
    "flux": build_tiny_flux,
    "qwen2_vl": build_tiny_qwen2_vl,
    "qwen25_vl": build_tiny_qwen25_vl,
    "qwen3_vl": build_tiny_qwen3_vl,
    "clip": build_tiny_clip,
    "open_clip": build_tiny_open_clip,
}


def build_all(root, seed: int = 0) -> dict[str, Path]:
    """Build every tiny model into ``root/<name>`` (names as in ``BUILDERS``); returns name -> path."""
    root = Path(root)
    return {name: build(root / name, seed=seed) for name, build in BUILDERS.items()}
