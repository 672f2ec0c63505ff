"""T2I-R1's semantic chain-of-thought on the tiny Janus: the text part equals transformers' `generate` in text mode and
the image part `generate(generation_mode="image")` on the left-padded prompt + CoT inputs (same seed), teacher-forced
log-probs of both equal the sampled ones, padding changes no row, and janus_grpo with `rollout.semantic_cot` runs 2
steps and resumes exactly."""

from __future__ import annotations

import pytest
import torch

from mmrl.ar_image import grpo
from mmrl.ar_image.cot import CoTConfig, SemanticCoT
from mmrl.ar_image.janus import JanusPolicy, load_janus
from mmrl.config import load_config
from mmrl.testing import RESUMED_RUN, assert_same_path, metrics_rows
from mmrl.tiny import build_tiny_janus

# the tiny tokenizer knows the shapes corpus' words only (others become <unk>, which is fine too)
TEMPLATE = "system : describe the image . user : {prompt} . assistant :"
IMAGE_TEMPLATE = "{prompt} . {cot}"
PROMPT = "a red circle on a blue background"


def _favour_eos(model) -> None:
    """The random tiny model gives EOS ~1/200 per token; a larger EOS row of the lm_head makes it likely in some
    contexts, so a group's CoTs end at different lengths (the masks and the padding are exercised)."""
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        model.lm_head.weight[eos] *= 30


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = build_tiny_janus(tmp_path_factory.mktemp("janus") / "janus", seed=0)
    model, _ = load_janus(path, torch.device("cpu"), torch.float32)
    _favour_eos(model)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("image_size", [32, 24])  # 16 and 9 image tokens
def test_cot_rollout_equals_generate_and_teacher_forced_logprobs(tmp_path, image_size):
    path = build_tiny_janus(tmp_path / "janus", seed=1, image_size=image_size)  # an independent checkpoint
    model, processor = load_janus(path, torch.device("cpu"), torch.float32)
    _favour_eos(model)
    policy = JanusPolicy(model, processor, guidance_scale=4.0)
    cot = SemanticCoT(policy, CoTConfig(template=TEMPLATE, image_template=IMAGE_TEMPLATE, max_tokens=8,
                                        temperature=0.7, top_k=20))
    ids = cot.text_ids(PROMPT)
    assert ids[0, 0] == policy.bos
    lengths, padded = set(), False
    for seed in range(3):
        torch.manual_seed(seed)
        text = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_mode="text",
                              do_sample=True, temperature=0.7, top_k=20, max_new_tokens=8,
                              num_return_sequences=4)[:, ids.shape[1]:]
        image_ids, image_mask = cot.image_inputs(PROMPT, text, cot.cot_mask(text))
        image = model.generate(input_ids=image_ids, attention_mask=image_mask, generation_mode="image",
                               do_sample=True, guidance_scale=4.0, top_k=0)
        torch.manual_seed(seed)
        g = cot.rollout(PROMPT, 4)
        assert torch.equal(g.cot, text) and torch.equal(g.tokens, image)
        assert torch.equal(g.image_ids, image_ids) and (g.image_ids[:, -1] == policy.boi).all()
        assert (cot.text_logprobs(ids, g.cot, g.cot_mask) - g.cot_logp).abs().max() < 1e-5
        tf, _ = policy.guided_logprobs(g.image_ids, g.tokens, attention_mask=g.image_mask)
        assert (tf - g.image_logp).abs().max() < 1e-5
        for i in range(4):  # each row alone, unpadded: the padding and its mask change nothing
            alone, _ = policy.guided_logprobs(g.image_ids[i:i + 1, g.image_mask[i] > 0], g.tokens[i:i + 1])
            assert (alone[0] - g.image_logp[i]).abs().max() < 1e-5
        lengths |= set(g.cot_mask.sum(1).tolist())
        padded |= bool((g.image_mask == 0).any())
    assert len(lengths) > 1 and min(lengths) < 8 and padded  # CoTs of different lengths, some ended by EOS
    # the recipe's rows: CoT (zero-padded to max_tokens) then the image tokens, one differentiable vector per sample
    model.lm_head.weight.requires_grad_(True)
    rows = torch.tensor([3, 1])
    logp, entropy, mask = cot.logprobs(g, rows)
    assert logp.shape == mask.shape == (2, 8 + g.tokens.shape[1]) and entropy.shape == (2, g.tokens.shape[1])
    assert torch.equal(mask[:, :g.cot.shape[1]], g.cot_mask[rows]) and (mask[:, 8:] == 1).all()
    assert torch.allclose(logp[:, 8:], g.image_logp[rows], atol=1e-5)
    (logp * mask).sum().backward()
    assert model.lm_head.weight.grad.abs().sum() > 0  # the text part reaches the text head


def _cfg(path, out, *overrides, semantic_cot=True):
    cot = {"semantic_cot": True, "cot": {"template": TEMPLATE, "image_template": IMAGE_TEMPLATE, "max_tokens": 6}}
    base = {"algorithm": "janus_grpo", "output_dir": str(out), "device": "cpu", "seed": 2,
            "model": {"path": str(path), "lora": {"rank": 4, "alpha": 8}},
            "rollout": {"prompts_per_step": 2, "group_size": 3, **(cot if semantic_cot else {})},
            "reward": {"components": {"prompt_color": 1.0}}, "optim": {"lr": 3e-2},
            "update": {"micro_batch_size": 4, "mini_batch_size": 3},
            "algo": {"kl": {"coef": 0.1}}, "train": {"max_steps": 2, "save_every": 1}}
    return load_config(base, list(overrides))


def test_cot_two_steps_then_exact_resume(tiny_path, tmp_path):
    """The uninterrupted run also draws grids and evaluates (each image after its own CoT) every step: the
    training rows still equal the resumed run's without them."""
    full, part = tmp_path / "full", tmp_path / "part"
    grpo.train(_cfg(tiny_path, full, "log.sample_every=1", "log.num_samples=2", "log.eval_every=1",
                    "log.eval_images=2", "log.eval_max_prompts=2", "data.eval_prompts=assets/prompts/shapes_eval.txt"))
    grpo.train(_cfg(tiny_path, part, "train.max_steps=1", "log.sample_every=0"))
    grpo.train(_cfg(tiny_path, part, "log.sample_every=0"))  # resumes from step 1 (train.resume=auto)
    assert all(0 <= r["eval/reward/mean"] <= 1 for r in metrics_rows(full))

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "eval/"))} for r in rows]

    a, b = strip(metrics_rows(full)), strip(metrics_rows(part))
    assert [r["step"] for r in b] == [1, 2]
    assert_same_path(a, b, why=RESUMED_RUN)
    assert all(r["policy/grad_norm"] > 0 and r["kl/ref"] >= 0 and 1 <= r["cot/length"] <= 6 for r in a)
    assert all(r["policy/loss"] is not None and 0 <= r["cot/truncated"] <= 1 for r in a)  # no skipped update


def test_first_update_ratio_is_one_with_the_cot(tiny_path, tmp_path):
    """One update over all 6 rows in the update's shuffled order: each row's CoT + image log-probs meet its own old
    log-probs and advantage (ratio exactly 1, nothing clipped); sorted by row id instead, they met another row's."""
    grpo.train(_cfg(tiny_path, tmp_path / "run", "train.max_steps=1", "update.micro_batch_size=6",
                    "update.mini_batch_size=0", "log.sample_every=0"))
    (row,) = metrics_rows(tmp_path / "run")
    assert row["policy/grad_norm"] > 0 and row["policy/clipfrac"] == 0


def test_full_fine_tuning_with_the_cot_trains_the_text_head(tmp_path):
    import json

    # untied: the tiny Janus ties lm_head to the input embeddings (JanusConfig's default), which the decoder trains
    path = build_tiny_janus(tmp_path / "janus", seed=0)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    trains = {}
    for semantic_cot in (True, False):
        cfg = _cfg(path, tmp_path / "run", "model.lora.rank=0", semantic_cot=semantic_cot)
        states, _ = grpo.build_states(cfg, torch.device("cpu"), torch.float32)
        assert states.model.lm_head.weight is not states.model.get_input_embeddings().weight
        trains[semantic_cot] = states.model.lm_head.weight.requires_grad
    assert trains == {True: True, False: False}


@pytest.mark.parametrize("override, message", [
    ("rollout.cot.template=describe",
     r"rollout.cot.template: expected exactly one placeholder \{prompt\}, got \[\] in 'describe'$"),
    ("rollout.cot.template=describe {prompt} {x}",
     r"rollout.cot.template: expected exactly one placeholder \{prompt\}, got \['prompt', 'x'\] in "
     r"'describe \{prompt\} \{x\}'$"),
    ("rollout.cot.template=describe {prompt} {prompt}",
     r"rollout.cot.template: expected exactly one placeholder \{prompt\}, got \['prompt', 'prompt'\] in "
     r"'describe \{prompt\} \{prompt\}'$"),
    ("rollout.cot.template=describe {prompt",
     (r"rollout.cot.template: not a format string \(expected '\}' before end of string\); write a literal brace "
      r"as \{\{ or \}\}$")),
    ("rollout.cot.image_template=a {prompt}",
     r"rollout.cot.image_template: expected the placeholder \{cot\} \(and optionally \{prompt\}\), got \['prompt'\]$"),
    ("rollout.cot.max_tokens=0", r"rollout.cot.max_tokens: expected >= 1, got 0$"),
    ("rollout.cot.temperature=0", r"rollout.cot.temperature: expected > 0, got 0.0$"),
    ("rollout.cot.top_k=-1", r"rollout.cot.top_k: expected >= 0 \(0 = no top-k\), got -1$"),
    ("rollout.semantic_cot=false", (r"rollout.cot: set while rollout.semantic_cot is false; set "
                                    r"rollout.semantic_cot: true to use it, or drop rollout.cot$")),
    ("rollout.prompt_template={prompt}", (r"rollout.prompt_template: not used with rollout.semantic_cot: true \(the "
                                          r"image prompt is rollout.cot.image_template\); set that one instead, or "
                                          r"drop rollout.prompt_template$")),
])
def test_cot_settings_are_checked(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        _cfg(tmp_path / "model", tmp_path / "run", override)
