"""EditReward on a tiny Qwen2.5-VL checkpoint written in the authors' layout (mmrl.tiny.build_tiny_edit_reward): loading,
the authors' two-instruction input (source image first), the mean of the two heads as the score with sigma and each
head's mu in the details, batching, the source image read from the metadata, one-line errors. Scores equal to the
authors' own code: benchmarks/parity/edit_reward.py (numbers in docs/rewards.md)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmrl.rewards import available, load
from mmrl.rewards.image.edit_reward import (
    INSTRUCTION_FOLLOWING,
    INSTRUCTION_QUALITY,
    REWARD_PROMPT,
)
from mmrl.tiny.hpsv3 import build_tiny_edit_reward

PROMPTS = ["make the circle red", "add a dog", "turn the sky blue", "remove the star"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_edit_reward(tmp_path_factory.mktemp("edit_reward") / "tiny")


@pytest.fixture(scope="module")
def reward(tiny):
    torch.set_num_threads(1)
    return load("edit_reward", weights=tiny / "checkpoint", processor=tiny / "base", dtype="float32", device="cpu")


def _images(n, h=64, w=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, h, w, generator=g)


def _meta(sources):
    return [{"source_image": s} for s in sources]


def test_registered_and_scores_the_mean_of_both_heads(reward):
    assert "edit_reward" in available()
    src, edit = _images(2, seed=1), _images(2)
    out = reward(edit, PROMPTS[:2], _meta(src))
    assert out.scores.shape == (2,) and set(out.details) == {"sigma", "following", "quality"}
    # by hand: head 0 on the following instruction, head 1 on the quality one, each over (source, edit, text)
    bb = reward.backbone
    pair = [im for s, e in zip(bb.resize(src, 200704, 200704), bb.resize(edit, 200704, 200704)) for im in (s, e)]
    raw = []
    for head, instruction in zip(("rm_heads.head_0.", "rm_heads.head_1."), (INSTRUCTION_FOLLOWING, INSTRUCTION_QUALITY)):
        texts = bb.chat_texts([[{"type": "image"}, {"type": "image"},
                                {"type": "text", "text": instruction.format(text_prompt=p) + REWARD_PROMPT}]
                               for p in PROMPTS[:2]])
        raw.append(bb.heads[head](bb.token_hidden(bb.encode(texts, images=pair))[:, 0]))
    raw = torch.stack(raw)
    torch.testing.assert_close(out.details["following"], raw[0, :, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(out.details["quality"], raw[1, :, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(out.scores, raw[:, :, 0].mean(0), rtol=0, atol=1e-6)
    torch.testing.assert_close(out.details["sigma"], raw[:, :, 1].mean(0).exp(), rtol=0, atol=1e-6)
    # the source is read: another source changes the score; swapping source and edit too (order is part of the input)
    assert reward(edit, PROMPTS[:2], _meta(_images(2, seed=5))).scores.tolist() != out.scores.tolist()
    assert reward(src, PROMPTS[:2], _meta(edit)).scores.tolist() != out.scores.tolist()


def test_chat_input_is_the_authors(reward):
    bb = reward.backbone
    text = bb.chat_texts([[{"type": "image"}, {"type": "image"},
                           {"type": "text", "text": INSTRUCTION_FOLLOWING.format(text_prompt="add a dog") + REWARD_PROMPT}]])[0]
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                           "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>\n"
                           "You are tasked with evaluating an edited image **in comparison with the original source "
                           "image** based on **Instruction Following & Semantic Fidelity**")
    assert text.endswith("Text instruction - add a dog\n\nPlease provide the overall ratings of this image: <|Reward|>"
                         "\n\nEND\n<|im_end|>\n<|im_start|>assistant\n")


def test_batched_equals_one_by_one_with_sources_of_other_sizes(reward):
    edit = _images(4)
    src = [_images(1, 64, 80, seed=1)[0], _images(1, 96, 64, seed=2)[0], _images(1, 32, 32, seed=3)[0],
           _images(1, 64, 80, seed=4)[0]]
    batched = reward(edit, PROMPTS, _meta(src))
    single = [reward(edit[i:i + 1], PROMPTS[i:i + 1], _meta(src[i:i + 1])) for i in range(4)]
    for key in ("following", "quality", "sigma"):
        torch.testing.assert_close(batched.details[key], torch.cat([o.details[key] for o in single]), rtol=0, atol=1e-5)
    torch.testing.assert_close(batched.scores, torch.cat([o.scores for o in single]), rtol=0, atol=1e-5)


def test_missing_source_is_the_edit_rewards_one_line(reward):
    with pytest.raises(ValueError, match=r"^reward 'edit_reward' compares an edit with its source: pass "
                                         r"metadata=\[\{'source_image': \.\.\.\}\]"):
        reward(_images(1), PROMPTS[:1])
    with pytest.raises(ValueError, match="reward 'edit_reward' needs prompts"):
        reward(_images(1), metadata=_meta(_images(1)))


def test_wrong_paths_and_layouts_are_one_line_errors(tiny, tmp_path):
    base = tiny / "base"
    with pytest.raises(FileNotFoundError) as ei:
        load("edit_reward", weights=tmp_path, processor=base, dtype="float32")
    assert str(ei.value).startswith(f"edit_reward: no checkpoint in '{tmp_path}': expected one of ['model.pth', "
                                    f"'model.safetensors'] there (or pass the file itself as weights=)")
    with pytest.raises(FileNotFoundError, match="^edit_reward processor: no weights path given; download the config "
                                                "and processor files of 'Qwen/Qwen2.5-VL-7B-Instruct'"):
        load("edit_reward", weights=tiny / "checkpoint", dtype="float32")
    # a Qwen2-VL base (HPSv3's) for a Qwen2.5-VL checkpoint
    qwen2 = tmp_path / "qwen2"
    qwen2.mkdir()
    for f in base.iterdir():
        (qwen2 / f.name).write_bytes(f.read_bytes())
    (qwen2 / "config.json").write_text(json.dumps({**json.loads((base / "config.json").read_text()),
                                                   "model_type": "qwen2_vl"}))
    with pytest.raises(ValueError, match=r"^edit_reward: base model '.*qwen2' is a qwen2_vl, expected qwen2_5_vl"):
        load("edit_reward", weights=tiny / "checkpoint", processor=qwen2, dtype="float32")
    # a single-head checkpoint (rm_head.*), and one whose head is not 2 outputs wide
    state = load_file(str(tiny / "checkpoint" / "model.safetensors"))
    one = {k: v for k, v in state.items() if not k.startswith("rm_heads.head_1.")}
    save_file(one, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"^edit_reward head 'rm_heads.head_1.\*': checkpoint '.*model.safetensors' "
                                         r"has no reward head weights$"):
        load("edit_reward", weights=tmp_path, processor=base, dtype="float32")
    wide = dict(state, **{f"rm_heads.head_{i}.5.{p}": torch.zeros((3, 16) if p == "weight" else (3,))
                          for i in range(2) for p in ("weight", "bias")})
    save_file(wide, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"head 'rm_heads.head_0.\*' predicts 3 values, expected 2 \(mu, log sigma"):
        load("edit_reward", weights=tmp_path / "model.safetensors", processor=base, dtype="float32")
