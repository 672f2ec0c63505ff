"""Tiny real-architecture builders: save, reload through the standard loaders, run, determinism."""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmrl import tiny
from mmrl.testing import assert_same_path

MAX_PARAMS = 2_000_000


def _state_dicts_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _weights(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file under ``root``, keyed by relative file and name."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(root.rglob("*.safetensors")):
        for k, v in load_file(f).items():
            out[f"{f.relative_to(root)}:{k}"] = v
    return out


def _vqa_messages(text="Which colour is the square?"):
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


# ----------------------------------------------------------------------------------------------
# tokenizers
# ----------------------------------------------------------------------------------------------
def test_tokenizer_assets_regenerate_identically(tmp_path):
    tiny.build_tokenizer_assets(tmp_path)
    for name in ("clip", "t5", "qwen", "qwen_image"):
        stored = sorted(p.name for p in (tiny.ASSETS_DIR / name).iterdir())
        fresh = sorted(p.name for p in (tmp_path / name).iterdir())
        assert stored == fresh, name
        for f in stored:
            assert (tiny.ASSETS_DIR / name / f).read_bytes() == (tmp_path / name / f).read_bytes(), (name, f)


def test_clip_tokenizer_covers_synthetic_prompts():
    tok = tiny._load_tokenizer("clip")
    prompt = "A red circle on a blue background, top left; 3 yellow triangles with a white square"
    ids = tok(prompt).input_ids
    toks = tok.convert_ids_to_tokens(ids)
    assert toks[0] == "<|startoftext|>" and toks[-1] == "<|endoftext|>"
    # every word is one token (lower-cased, with the CLIP end-of-word marker), no unknowns
    assert toks[1:6] == ["a</w>", "red</w>", "circle</w>", "on</w>", "a</w>"]
    assert toks[1:-1].count("<|endoftext|>") == 0  # unk_token is <|endoftext|> in CLIP
    assert len(ids) == 2 + 18  # 15 words, ",", ";" and "3"
    assert tok.decode(ids, skip_special_tokens=True) == prompt.lower().replace(",", " ,").replace(";", " ;")


def test_t5_tokenizer_layout():
    tok = tiny._load_tokenizer("t5")
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    ids = tok("a red circle").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["▁a", "▁red", "▁circle", "</s>"]


def test_qwen_tokenizer_special_tokens_and_single_token_answers():
    tok = tiny._load_tokenizer("qwen")
    specials = tiny.QWEN_SPECIAL_TOKENS + tiny.QWEN_NORMAL_ADDED_TOKENS
    ids = [tok.convert_tokens_to_ids(t) for t in specials]
    # fixed, consecutive ids at the end of the vocabulary, in Qwen's order
    assert ids == list(range(len(tok) - len(specials), len(tok)))
    for t, i in zip(specials, ids):
        assert tok(t, add_special_tokens=False).input_ids == [i], t
    for answer in ["red", "blue", "3", "7", "square", "circle", "left", "yes", "no", "two"]:
        assert len(tok(answer).input_ids) == 1, answer
        if not answer.isdigit():  # Qwen's pre-tokenizer splits " 3" into " " and "3", as the real one does
            assert len(tok(" " + answer).input_ids) == 1, answer
    enc = tok("<answer>red</answer>").input_ids
    assert tok.convert_ids_to_tokens(enc) == ["<answer>", "red", "</answer>"]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_qwen_chat_template_renders_qwen_layout():
    tok = tiny._load_tokenizer("qwen")
    text = tok.apply_chat_template(_vqa_messages("How many circles?"), add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many circles?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n")


def test_train_bpe_merges_every_word_to_one_symbol():
    merges = tiny.train_bpe([("a", "b", "c"), ("a", "b"), ("a", "b")])
    # ("a","b") occurs 3 times -> first; then ("ab","c") once
    assert merges == [("a", "b"), ("ab", "c")]


# ----------------------------------------------------------------------------------------------
# diffusion pipelines
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return tiny.build_tiny_sd3(tmp_path_factory.mktemp("sd3"), seed=0)


def test_sd3_reload_and_run(sd3_dir):
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_dir)
    assert isinstance(pipe.transformer, SD3Transformer2DModel)
    assert pipe.vae_scale_factor == 4 and pipe.scheduler.config.shift == 3.0
    n = sum(tiny.count_parameters(getattr(pipe, c)) for c in
            ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"))
    assert n < MAX_PARAMS
    out = pipe("a red circle on a blue background", num_inference_steps=2, height=64, width=64,
               output_type="pt", generator=torch.Generator().manual_seed(0))
    assert out.images.shape == (1, 3, 64, 64)
    assert torch.isfinite(out.images).all()
    pe, _, pooled, _ = pipe.encode_prompt("a red circle", None, None, do_classifier_free_guidance=False,
                                          max_sequence_length=16)
    assert pe.shape == (1, 77 + 16, 32) and pooled.shape == (1, 32)
    with torch.no_grad():
        latents = pipe.vae.encode(torch.rand(1, 3, 64, 64) * 2 - 1).latent_dist.mean
    assert latents.shape == (1, 4, 16, 16)


def test_sd3_rejects_odd_sample_size(tmp_path):
    with pytest.raises(ValueError, match="sample_size"):
        tiny.build_tiny_sd3(tmp_path, sample_size=15)


# ----------------------------------------------------------------------------------------------
# vision-language models
# ----------------------------------------------------------------------------------------------
def _check_qwen_vl(path, model_cls, processor_cls):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    model = model_cls.from_pretrained(path).eval()
    assert isinstance(processor, processor_cls)
    assert tiny.count_parameters(model) < MAX_PARAMS
    tok = processor.tokenizer
    cfg = model.config
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>") == processor.image_token_id
    assert cfg.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert cfg.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
    assert cfg.text_config.vocab_size == len(tok)

    text = processor.apply_chat_template(_vqa_messages(), add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    inputs = processor(text=[text], images=[Image.new("RGB", (64, 64), (200, 30, 30))], return_tensors="pt")
    n_img = int((inputs["input_ids"] == cfg.image_token_id).sum())
    merge = processor.image_processor.merge_size
    assert n_img == int(inputs["image_grid_thw"].prod()) // merge**2 > 0
    assert "mm_token_type_ids" in inputs
    with torch.no_grad():
        out = model(**inputs)
    assert out.logits.shape == (1, inputs["input_ids"].shape[1], len(tok))
    gen = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert gen.shape[1] <= inputs["input_ids"].shape[1] + 3
    return model


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    return tiny.build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"), seed=0)


def test_qwen2_vl_reload_and_run(qwen2_vl_dir):
    from transformers import Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    model = _check_qwen_vl(qwen2_vl_dir, Qwen2VLForConditionalGeneration, Qwen2VLProcessor)
    assert model.config.text_config.rope_parameters["mrope_section"] == [2, 3, 3]


def test_qwen2_vl_mrope_section(qwen2_vl_dir):
    cfg = json.loads((qwen2_vl_dir / "config.json").read_text())
    assert cfg["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]  # sums to head_dim / 2


@pytest.mark.parametrize("build", ["build_tiny_qwen2_vl", "build_tiny_qwen25_vl"])
def test_qwen_vl_head_dim_option(build, tmp_path):
    """head_dim 32 (what vLLM's CPU attention takes; the default 16 it does not): 4 heads of 32, hidden 128, the
    vision merger projecting to 128, M-RoPE sections summing to 16; the default build stays as it was."""
    from transformers import AutoModelForImageTextToText

    path = getattr(tiny, build)(tmp_path / "h32", seed=0, head_dim=32)
    cfg = json.loads((path / "config.json").read_text())["text_config"]
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (128, 4, 2)
    assert cfg["rope_parameters"]["mrope_section"] == [4, 6, 6]
    model = AutoModelForImageTextToText.from_pretrained(path)
    attn = model.model.language_model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (128, 128) and attn.k_proj.weight.shape == (64, 128)  # 2 kv heads of 32
    default = json.loads((getattr(tiny, build)(tmp_path / "h16", seed=0) / "config.json").read_text())["text_config"]
    assert default["hidden_size"] == 64 and default["rope_parameters"]["mrope_section"] == [2, 3, 3]
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16"):
        getattr(tiny, build)(tmp_path / "bad", head_dim=24)


def test_qwen25_vl_reload_and_run(tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    path = tiny.build_tiny_qwen25_vl(tmp_path, seed=0)
    model = _check_qwen_vl(path, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor)
    assert model.config.vision_config.fullatt_block_indexes == [1]


def test_qwen3_vl_reload_and_run(tmp_path):
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    path = tiny.build_tiny_qwen3_vl(tmp_path, seed=0)
    model = _check_qwen_vl(path, Qwen3VLForConditionalGeneration, Qwen3VLProcessor)
    assert model.config.text_config.rope_parameters["mrope_section"] == [4, 2, 2]
    processor = __import__("transformers").AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(_vqa_messages("Q"), add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\n")  # Qwen3-VL adds no default system turn


def test_flux_reload_and_run(tmp_path):
    from diffusers import FluxPipeline, FluxTransformer2DModel

    path = tiny.build_tiny_flux(tmp_path, seed=0)
    pipe = FluxPipeline.from_pretrained(path)
    assert isinstance(pipe.transformer, FluxTransformer2DModel)
    assert pipe.transformer.config.in_channels == 4 * pipe.vae.config.latent_channels
    assert pipe.transformer.config.guidance_embeds
    n = sum(tiny.count_parameters(getattr(pipe, c)) for c in ("transformer", "vae", "text_encoder", "text_encoder_2"))
    assert n < MAX_PARAMS
    out = pipe("a red circle on a blue background", num_inference_steps=2, height=64, width=64,
               output_type="pt", max_sequence_length=32, generator=torch.Generator().manual_seed(0))
    assert out.images.shape == (1, 3, 64, 64) and torch.isfinite(out.images).all()


def test_clip_reload_and_run(tmp_path):
    from transformers import AutoProcessor, CLIPModel, CLIPProcessor

    path = tiny.build_tiny_clip(tmp_path, seed=0)
    model = CLIPModel.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    assert isinstance(processor, CLIPProcessor)
    assert tiny.count_parameters(model) < MAX_PARAMS
    inputs = processor(text=["a red circle", "a blue square on a white background"],
                       images=[Image.new("RGB", (64, 48), (255, 0, 0))], return_tensors="pt", padding=True)
    assert inputs["pixel_values"].shape == (1, 3, 32, 32)
    # pure red pixel normalised with CLIP's mean/std: (1 - 0.48145466) / 0.26862954 = 1.93034
    expected = (torch.tensor([1.0, 0.0, 0.0]) - torch.tensor(tiny.CLIP_MEAN)) / torch.tensor(tiny.CLIP_STD)
    torch.testing.assert_close(inputs["pixel_values"][0, :, 16, 16], expected, atol=1e-4, rtol=0)
    with torch.no_grad():
        out = model(**inputs)
    assert out.logits_per_image.shape == (1, 2) and out.text_embeds.shape == (2, 16)


def test_open_clip_load_and_hps_state_dict(tmp_path):
    import open_clip

    path = tiny.build_tiny_open_clip(tmp_path, seed=0)
    model, preprocess, tokenizer = tiny.load_open_clip(path)
    assert isinstance(model, open_clip.CLIP)
    assert tiny.count_parameters(model) < MAX_PARAMS
    saved = _weights(path)
    for k, v in model.state_dict().items():  # weights really came from the file, not a fresh init
        assert_same_path(v, saved[f"open_clip_model.safetensors:{k}"], why="weights loaded from this file")
    x = preprocess(Image.new("RGB", (64, 48), (255, 0, 0))).unsqueeze(0)
    assert x.shape == (1, 3, 32, 32)
    with torch.no_grad():
        img = model.encode_image(x)
        txt = model.encode_text(tokenizer(["a red circle on a blue background"]))
    assert img.shape == txt.shape == (1, 16)
    # HPS-style checkpoint: {"state_dict": ...} loads strictly into a model built from the config
    fresh = open_clip.create_model(f"local-dir:{path}", load_weights=False)
    fresh.load_state_dict(torch.load(path / "hps_style.pt", weights_only=True)["state_dict"], strict=True)
    with pytest.raises(ValueError, match="unknown arch"):
        tiny.build_tiny_open_clip(tmp_path / "x", arch="huge")
    with pytest.raises(FileNotFoundError, match="open_clip_config.json"):
        tiny.load_open_clip(tmp_path / "missing")


@pytest.mark.parametrize("name", sorted(tiny.BUILDERS))
def test_builders_are_deterministic(name, tmp_path):
    build = tiny.BUILDERS[name]
    a, b, c = _weights(build(tmp_path / "a", seed=0)), _weights(build(tmp_path / "b", seed=0)), None
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.equal(a[k], b[k]) for k in a), name
    c = _weights(build(tmp_path / "c", seed=1))
    assert any(not torch.equal(a[k], c[k]) for k in a), name


@pytest.mark.parametrize("name", sorted(tiny.BUILDERS))
def test_builders_leave_the_callers_random_state_alone(name, tmp_path):
    """Building draws from a private generator: after a build, torch's, Python's and numpy's global generators give
    the numbers they would have given without it (a recipe that builds its missing tiny model after seeding then
    trains exactly like a later run that finds the model on disk)."""
    import random

    import numpy as np

    def draws():
        return torch.rand(4).tolist(), random.random(), np.random.rand()

    torch.manual_seed(1234), random.seed(1234), np.random.seed(1234)
    want = draws()
    torch.manual_seed(1234), random.seed(1234), np.random.seed(1234)
    tiny.BUILDERS[name](tmp_path / name, seed=0)
    assert draws() == want, f"building {name} changed the caller's random state"


@pytest.mark.slow
def test_build_all(tmp_path):
    paths = tiny.build_all(tmp_path)
    assert set(paths) == set(tiny.BUILDERS)
    assert (paths["sd3"] / "model_index.json").is_file() and (paths["open_clip"] / "hps_style.pt").is_file()


def test_tokenizers_cover_synthetic_shapes_data():
    """Every word of the synthetic captions / questions is one token; every answer is one Qwen token."""
    import random

    from mmrl.pipelines import shapes  # shipped module: fail, never skip, if it goes missing
    clip, t5, qwen = tiny._load_tokenizer("clip"), tiny._load_tokenizer("t5"), tiny._load_tokenizer("qwen")
    rng = random.Random(0)
    for _ in range(100):
        scene = shapes.sample_scene(rng, n_shapes=(1, 3))
        words = scene.caption.replace(",", " ,").split()
        assert len(clip(scene.caption).input_ids) == len(words) + 2, scene.caption
        assert t5.unk_token_id not in t5(scene.caption).input_ids, scene.caption
        for kind in shapes.QA_KINDS:
            question, answer = shapes.qa_for_scene(scene, kind, rng)
            assert len(qwen(answer).input_ids) == 1, answer
            assert len(qwen(question).input_ids) == len(question.replace("?", " ?").split()), question
