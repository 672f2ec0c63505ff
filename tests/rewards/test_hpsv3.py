"""HPSv3 on a tiny Qwen2-VL checkpoint written in the authors' layout (mmrl.tiny.build_tiny_hpsv3): loading, the
authors' chat input, scores (mu) with the uncertainty (sigma) in the details, batching, both checkpoint key layouts,
one-line errors, and `mmrl reward score`. Scores equal to the authors' own code: benchmarks/parity/hpsv3.py
(numbers in docs/rewards.md)."""

from __future__ import annotations

import argparse
import csv
import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from mmrl.rewards import available, load
from mmrl.tiny.hpsv3 import build_tiny_hpsv3

PROMPTS = ["a red circle", "a blue square on the left", "a photo of a cat", "two yellow stars", "a dog"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_hpsv3(tmp_path_factory.mktemp("hpsv3") / "tiny")


@pytest.fixture(scope="module")
def reward(tiny):
    torch.set_num_threads(1)
    return load("hpsv3", weights=tiny, processor=tiny / "base", dtype="float32", device="cpu")


def _images(n, h=64, w=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, h, w, generator=g)


def test_registered_and_scores_mu_with_sigma_details(reward):
    assert "hpsv3" in available()
    out = reward(_images(3), PROMPTS[:3])
    assert out.scores.shape == (3,) and out.scores.dtype == torch.float32
    sigma = out.details["sigma"]
    assert sigma.shape == (3,) and bool((sigma > 0).all())
    # by hand: the head on the final hidden state at <|Reward|> gives (mu, log sigma)
    bb = reward.backbone
    texts = bb.chat_texts([[{"type": "image"}, {"type": "text", "text": reward_text(p)}] for p in PROMPTS[:3]])
    hidden = bb.token_hidden(bb.encode(texts, images=bb.resize(_images(3), 200704, 200704)))
    raw = bb.heads["rm_head."](hidden[:, 0])
    torch.testing.assert_close(out.scores, raw[:, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sigma, raw[:, 1].exp(), rtol=0, atol=1e-6)
    assert reward(_images(1), ["a green triangle"]).scores.item() != out.scores[0].item()  # the prompt is read


def reward_text(prompt):
    from mmrl.rewards.image.hpsv3 import INSTRUCTION, REWARD_PROMPT

    return INSTRUCTION.format(text_prompt=prompt) + REWARD_PROMPT


def test_chat_input_is_the_authors(reward):
    """Qwen2-VL's template around one image then the instruction with the prompt, <|Reward|> once, generation prompt;
    images resized to 256*28*28 pixels in multiples of 28 (a 64x80 image -> 420x504 = 15x18 merged tokens)."""
    bb = reward.backbone
    text = bb.chat_texts([[{"type": "image"}, {"type": "text", "text": reward_text("a dog")}]])[0]
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                           "<|vision_start|><|image_pad|><|vision_end|>\nYou are tasked with evaluating a generated")
    assert text.endswith("Textual prompt - a dog\n\n\n\nPlease provide the overall ratings of this image: <|Reward|>"
                         "\n\nEND\n<|im_end|>\n<|im_start|>assistant\n")
    assert [im.size for im in bb.resize(_images(1), 200704, 200704)] == [(504, 420)]
    batch = bb.encode([text], images=bb.resize(_images(1), 200704, 200704))
    assert batch["image_grid_thw"].tolist() == [[1, 30, 36]]
    assert int((batch["input_ids"] == bb.token_ids[0]).sum()) == 1 and bb.processor.tokenizer.padding_side == "right"


def test_batched_equals_one_by_one_and_mixed_sizes(reward):
    imgs = _images(4)
    batched = reward(imgs, PROMPTS[:4])
    single = [reward(imgs[i:i + 1], PROMPTS[i:i + 1]) for i in range(4)]
    torch.testing.assert_close(batched.scores, torch.cat([o.scores for o in single]), rtol=0, atol=1e-5)
    torch.testing.assert_close(batched.details["sigma"], torch.cat([o.details["sigma"] for o in single]),
                               rtol=0, atol=1e-5)
    mixed = reward([imgs[0], _images(1, 96, 50, seed=1)[0], imgs[1]], [PROMPTS[0], PROMPTS[4], PROMPTS[1]])
    torch.testing.assert_close(mixed.scores[[0, 2]], batched.scores[:2], rtol=0, atol=1e-5)


def test_checkpoint_in_newer_transformers_key_names_scores_the_same(tiny, reward, tmp_path):
    """The same weights keyed `model.visual.*` / `model.language_model.*` (transformers >= 4.52 state dicts)."""
    state = load_file(str(tiny / "HPSv3.safetensors"))
    renamed = {("model." + k if k.startswith("visual.") else
                "model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in state.items()}
    save_file(renamed, str(tmp_path / "HPSv3.safetensors"))
    other = load("hpsv3", weights=tmp_path / "HPSv3.safetensors", processor=tiny / "base", dtype="float32")
    imgs = _images(2)
    assert torch.equal(other(imgs, PROMPTS[:2]).scores, reward(imgs, PROMPTS[:2]).scores)


def test_bfloat16_default_runs_close_to_float32(tiny, reward):
    bf16 = load("hpsv3", weights=tiny / "HPSv3.safetensors", processor=tiny / "base")
    assert bf16.dtype == torch.bfloat16 and next(iter(bf16.backbone.heads.values()))[0].weight.dtype == torch.float32
    imgs = _images(2)
    assert (bf16(imgs, PROMPTS[:2]).scores - reward(imgs, PROMPTS[:2]).scores).abs().max() < 0.05


def test_wrong_paths_and_layouts_are_one_line_errors(tiny, tmp_path):
    base = tiny / "base"
    only_config = tmp_path / "only_config"
    only_config.mkdir()
    (only_config / "config.json").write_bytes((base / "config.json").read_bytes())
    cases = [
        (dict(weights=None, processor=base), FileNotFoundError, "hpsv3: no weights path given; download "
         "'HPSv3.safetensors' from 'MizzenAI/HPSv3' yourself"),
        (dict(weights=tmp_path / "nope.safetensors", processor=base), FileNotFoundError,
         f"hpsv3: weights path '{tmp_path / 'nope.safetensors'}' does not exist"),
        (dict(weights=tmp_path, processor=base), FileNotFoundError,
         f"hpsv3: no checkpoint in '{tmp_path}': expected one of ['HPSv3.safetensors'] there"),
        (dict(weights=tiny, processor=None), FileNotFoundError, "hpsv3 processor: no weights path given; download "
         "the config and processor files of 'Qwen/Qwen2-VL-7B-Instruct'"),
        (dict(weights=tiny, processor=tmp_path), FileNotFoundError,
         f"hpsv3: no config.json in the base model directory '{tmp_path}'"),
        (dict(weights=tiny, processor=only_config), FileNotFoundError,
         f"hpsv3: no qwen2_vl processor in '{only_config}'"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc) as ei:
            load("hpsv3", dtype="float32", **kw)
        assert msg in str(ei.value) and "\n" not in str(ei.value), str(ei.value)
    # a Qwen2.5-VL base for a Qwen2-VL checkpoint
    cfg = json.loads((base / "config.json").read_text())
    other = tmp_path / "base25"
    other.mkdir()
    for f in base.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2_5_vl"}))
    with pytest.raises(ValueError, match=r"^hpsv3: base model '.*base25' is a qwen2_5_vl, expected qwen2_vl "
                                         r"\(config.json model_type\)$"):
        load("hpsv3", weights=tiny, processor=other, dtype="float32")
    # a checkpoint lacking a layer, and one without the <|Reward|> row
    state = load_file(str(tiny / "HPSv3.safetensors"))
    save_file({k: v for k, v in state.items() if "layers.1." not in k}, str(tmp_path / "HPSv3.safetensors"))
    with pytest.raises(ValueError, match=r"^hpsv3 backbone \(qwen2_vl\): checkpoint '.*' does not fit the model: "
                                         r"\d+ missing keys \(e.g. \['language_model.layers.1"):
        load("hpsv3", weights=tmp_path, processor=base, dtype="float32")
    short = dict(state, **{"model.embed_tokens.weight": state["model.embed_tokens.weight"][:-1]})
    save_file(short, str(tmp_path / "HPSv3.safetensors"))
    n = state["model.embed_tokens.weight"].shape[0]
    with pytest.raises(ValueError, match=rf"has {n - 1} token embeddings, the tokenizer in '.*base' with "
                                         rf"\['<\|Reward\|>'\] added has {n}; pass processor= the base model"):
        load("hpsv3", weights=tmp_path, processor=base, dtype="float32")


def test_prompt_holding_the_reward_token_is_refused(reward):
    with pytest.raises(ValueError, match=r"^hpsv3: row 0 holds 2 reward tokens, expected 1; a prompt must not "
                                         r"contain the reward token text itself$"):
        reward(_images(1), ["a sign saying <|Reward|>"])


def test_reward_score_cli(tiny, reward, tmp_path):
    from mmrl.rewards.cli import add_reward_subparsers

    paths = []
    for i, im in enumerate(_images(2)):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray((im.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)).save(paths[-1])
    (tmp_path / "p.txt").write_text("a red circle\na dog\n")
    parser = argparse.ArgumentParser(prog="mmrl")
    add_reward_subparsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["reward", "score", "hpsv3", "--kw", f"weights={tiny}", "--kw", f"processor={tiny / 'base'}",
                              "--kw", "dtype=float32", "--images", *map(str, paths), "--prompts", str(tmp_path / "p.txt"),
                              "--out", str(tmp_path / "s.csv"), "--device", "cpu", "--no-progress"])
    assert args.func(args) == 0
    with open(tmp_path / "s.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["path", "prompt", "score", "sigma"]
    local = reward([str(p) for p in paths], ["a red circle", "a dog"])
    assert [float(r["score"]) for r in rows] == pytest.approx(local.scores.tolist(), abs=1e-6)
    assert [float(r["sigma"]) for r in rows] == pytest.approx(local.details["sigma"].tolist(), abs=1e-6)
