"""Janus (Janus-Pro's architecture) as an image-token policy: guided sampling equals transformers'
`generate(generation_mode="image")` for the same seed, teacher-forced guided log-probs equal the sampling
distribution's, and the janus_grpo recipe runs 2 steps and resumes exactly."""

from __future__ import annotations

import pytest
import torch

from mmrl.ar_image import grpo
from mmrl.ar_image.janus import JanusPolicy, load_janus
from mmrl.config import load_config
from mmrl.testing import RESUMED_RUN, assert_same_path, metrics_rows
from mmrl.tiny import build_tiny_janus


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_janus(tmp_path_factory.mktemp("janus") / "janus", seed=0)


@pytest.mark.parametrize("image_size", [32, 24])  # 16 and 9 image tokens (the recipe's tests use 32)
def test_guided_sampling_equals_generate_and_teacher_forced_logprobs(tmp_path, image_size):
    path = build_tiny_janus(tmp_path / "janus", seed=1, image_size=image_size)  # an independent checkpoint
    model, processor = load_janus(path, torch.device("cpu"), torch.float32)
    policy = JanusPolicy(model, processor, guidance_scale=4.0)
    ids = policy.prompt_ids("a red circle on a blue background")
    assert ids[0, -1] == policy.boi and ids[0, 0] == policy.bos
    for seed in range(3):
        torch.manual_seed(seed)  # top_k=0: transformers' default top_k (50) would cut the 64-entry codebook
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_mode="image",
                             do_sample=True, guidance_scale=4.0, top_k=0, num_return_sequences=3)
        torch.manual_seed(seed)
        tokens, logp = policy.sample(ids, 3)
        assert torch.equal(tokens, ref)
        tf, entropy = policy.guided_logprobs(ids, tokens)
        assert (tf - logp).abs().max() < 1e-5
        assert entropy.shape == tokens.shape == (3, (image_size // 8) ** 2)
    images = policy.decode(tokens)
    assert images.shape == (3, 3, image_size, image_size) and 0 <= images.min() and images.max() <= 1


def _cfg(path, out, *overrides):
    base = {"algorithm": "janus_grpo", "output_dir": str(out), "device": "cpu", "seed": 2,
            "model": {"path": str(path), "lora": {"rank": 4, "alpha": 8}},
            "rollout": {"prompts_per_step": 2, "group_size": 3},
            "reward": {"components": {"prompt_color": 1.0}}, "optim": {"lr": 3e-2},
            "update": {"micro_batch_size": 4, "mini_batch_size": 3},
            "algo": {"kl": {"coef": 0.1}}, "train": {"max_steps": 2, "save_every": 1}}
    return load_config(base, list(overrides))


def test_two_steps_then_exact_resume(tiny_path, tmp_path):
    """The uninterrupted run draws sample grids and evaluates every step, the resumed one neither: the training
    rows are equal (grids and evaluation sample from their own random streams)."""
    full, part = tmp_path / "full", tmp_path / "part"
    shown = ["log.sample_every=1", "log.num_samples=2", "log.eval_every=1", "log.eval_images=2",
             "log.eval_max_prompts=2", "data.eval_prompts=assets/prompts/shapes_eval.txt"]
    summary = grpo.train(_cfg(tiny_path, full, *shown))
    grpo.train(_cfg(tiny_path, part, "train.max_steps=1", "log.sample_every=0"))
    grpo.train(_cfg(tiny_path, part, "log.sample_every=0"))  # resumes from step 1 (train.resume=auto)

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "eval/"))} for r in rows]

    a, b = strip(metrics_rows(full)), strip(metrics_rows(part))
    assert [r["step"] for r in b] == [1, 2]
    assert_same_path(a, b, why=RESUMED_RUN)
    assert all(r["policy/grad_norm"] > 0 and r["kl/ref"] >= 0 for r in a)
    rows = metrics_rows(full)
    assert all(0 <= r["eval/reward/mean"] <= 1 and r["eval/reward/std"] >= 0 for r in rows)
    assert summary["eval_reward_last"] == rows[-1]["eval/reward/mean"] and 0 <= summary["eval_reward_first"] <= 1
    assert sorted(p.name for p in (full / "samples").glob("*.png")) == [
        f"{kind}_{s:06d}.png" for kind in ("eval_step", "step") for s in range(3)]
    assert not list((part / "samples").glob("*.png")) if (part / "samples").exists() else True


def test_image_prompts_are_janus_user_turns(tiny_path, tmp_path):
    """The recipe's prompts go into Janus' user turn before begin-of-image (as Janus-Pro's own generation and
    T2I-R1 build them); `{prompt}` alone keeps the bare prompt; a template without the placeholder is refused."""
    model, processor = load_janus(tiny_path, torch.device("cpu"), torch.float32)
    policy = grpo.build_states(_cfg(tiny_path, tmp_path / "run"), torch.device("cpu"), torch.float32)[1]
    text = "<|User|>: a red circle\n\n<|Assistant|>:"
    want = processor(text=[text], generation_mode="image", return_tensors="pt")["input_ids"]
    assert torch.equal(policy.image_prompt_ids("a red circle"), want)
    bare = JanusPolicy(model, processor, 2.0, prompt_template="{prompt}")
    assert torch.equal(bare.image_prompt_ids("a red circle"), bare.prompt_ids("a red circle"))
    with pytest.raises(ValueError, match=r"rollout.prompt_template: expected exactly one placeholder \{prompt\}, "
                                         r"got \[\] in 'a picture'"):
        _cfg(tiny_path, tmp_path / "run", "rollout.prompt_template=a picture")


def test_log_section_is_checked(tiny_path, tmp_path):
    with pytest.raises(ValueError, match=r"log.eval_images: expected >= 1, got 0"):
        _cfg(tiny_path, tmp_path / "run", "log.eval_images=0")


def test_guidance_scale_must_exceed_one(tiny_path, tmp_path):
    with pytest.raises(ValueError, match=r"rollout.guidance_scale: Janus image generation needs classifier-free "
                                         r"guidance > 1, got 1.0"):
        _cfg(tiny_path, tmp_path / "run", "rollout.guidance_scale=1.0")
