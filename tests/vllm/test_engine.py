"""VLLMRolloutEngine on vLLM's CPU build against the HF policy it stands for (tiny Qwen2-VL, head_dim 32):
prompt tokens, greedy tokens and log-probs equal the HF engine's; sampled log-probs equal the HF forward's; image,
two-image-size and text-only prompts; text-in and token-in prompts agree; vision tokens are never sampled."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

# vLLM (CPU kernels, its own batching) and the HF forward are different computation paths: equal up to float32
# rounding. Measured max |diff| ~1e-6 on this model; the bound leaves room for other CPUs.
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def setup(tiny32, start_engine):
    from mmrl.vlm.common import load_policy

    model, processor = load_policy(tiny32)
    engine = start_engine(tiny32)
    yield model, processor, engine
    engine.close()


def test_greedy_equals_the_hf_engine_with_images_and_text(setup, vlm_requests, logprob_tools):
    from mmrl.vlm.rollout import HFRolloutEngine, SamplingParams

    model, processor, engine = setup
    sp = SamplingParams(temperature=0.0, max_new_tokens=12)
    got = engine.generate(vlm_requests, sp)
    ref = HFRolloutEngine(model, processor).generate(vlm_requests, sp)
    assert len(got) == len(ref) == 3
    for g, r in zip(got, ref):
        assert g.prompt_ids == r.prompt_ids  # vLLM's tokenisation incl. the expanded image placeholders = HF's
        assert g.response_ids == r.response_ids and g.finish_reason == r.finish_reason
    assert got[0].prompt_ids.count(processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 4  # 56x56 image
    assert got[1].prompt_ids.count(processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 8  # 112x56
    diff = logprob_tools[1](got, [r.response_logprobs for r in ref])
    print(f"[vllm engine] greedy: tokens equal; log-prob max |vLLM - HF| {diff:.1e}")
    assert diff <= LOGPROB_TOL


def test_sampled_logprobs_equal_the_hf_forward(setup, vlm_requests, logprob_tools):
    from mmrl.vlm.rollout import SamplingParams

    model, processor, engine = setup
    hf_logprobs, max_diff = logprob_tools
    pad = processor.tokenizer.pad_token_id
    for temperature in (1.0, 0.7):
        res = engine.generate(vlm_requests, SamplingParams(n=4, temperature=temperature, max_new_tokens=12, seed=11))
        assert [(r.request_index, r.sample_index) for r in res] == [(i, s) for i in range(3) for s in range(4)]
        assert len({tuple(r.response_ids) for r in res[:4]}) > 1  # n samples of one prompt differ
        # vLLM returns raw log-probs: log softmax(logits) at temperature 1, whatever the sampling temperature
        diff = max_diff(res, hf_logprobs(model, res, pad, temperature=1.0))
        print(f"[vllm engine] sampled at T={temperature}: log-prob max |vLLM - HF forward| {diff:.1e} over "
              f"{sum(len(r.response_ids) for r in res)} tokens")
        assert diff <= LOGPROB_TOL
        if temperature != 1.0:  # and they are not the tempered ones (so the recipes recompute old log-probs)
            assert max_diff(res, hf_logprobs(model, res, pad, temperature=temperature)) > 100 * LOGPROB_TOL
    again = engine.generate(vlm_requests, SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=11))
    first = engine.generate(vlm_requests, SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=11))
    assert [r.response_ids for r in again] == [r.response_ids for r in first]  # seeded: reproducible


def test_token_in_prompts_equal_text_prompts(setup, vlm_requests):
    """The multi-turn path: prompt token ids (image placeholders already expanded) + the images."""
    from mmrl.vlm.common import encode_prompt
    from mmrl.vlm.rollout import SamplingParams, _prompt_text

    _, processor, engine = setup
    enc = [encode_prompt(processor, _prompt_text(processor, r), r.images) for r in vlm_requests]
    sp = SamplingParams(temperature=0.0, max_new_tokens=10)
    text_in = engine.generate(vlm_requests, sp)
    token_in = engine.generate(vlm_requests, sp, encoded=enc)
    for a, b, e in zip(text_in, token_in, enc):
        assert b.prompt_ids == e.input_ids == a.prompt_ids
        assert b.response_ids == a.response_ids
        assert b.mm is e.mm  # the trainer's vision tensors are the caller's


def test_vision_tokens_are_never_sampled(setup, vlm_requests):
    """At temperature 2 (vLLM's largest) the tiny model's next-token distribution is nearly uniform over its ~1000 tokens, so without
    the ban its 5 vision special tokens are drawn (checked on the same engine); with it, never."""
    from mmrl.vlm.rollout import SamplingParams
    from mmrl.vlm.vllm_engine import VLLMRolloutEngine

    _, processor, engine = setup
    sp = SamplingParams(n=32, temperature=2.0, max_new_tokens=32, seed=3)
    banned = set(engine.banned)
    tok = processor.tokenizer
    assert {tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")} <= banned
    drawn = [t for r in engine.generate(vlm_requests, sp) for t in r.response_ids]
    unbanned = VLLMRolloutEngine("unused", processor, llm=engine.llm, ban_vision_tokens=False)
    drawn_free = [t for r in unbanned.generate(vlm_requests, sp) for t in r.response_ids]
    hits, hits_free = sum(t in banned for t in drawn), sum(t in banned for t in drawn_free)
    print(f"[vllm engine] vision tokens drawn: {hits} of {len(drawn)} with the ban, {hits_free} of "
          f"{len(drawn_free)} without")
    assert len(drawn) > 2000 and hits == 0
    assert hits_free > 0


def test_sleep_mode_is_refused_on_cpu_in_one_line(setup, tiny32):
    """vLLM's CPU worker ignores sleep() and a generate after it hangs: refused before anything reaches vLLM."""
    from mmrl.adapters import PolicyStates
    from mmrl.vlm.common import load_policy
    from mmrl.vlm.vllm_engine import VLLMRolloutEngine
    from mmrl.vlm.vllm_sync import VLLMWeightSyncer

    model, processor, engine = setup
    syncer = VLLMWeightSyncer(engine.llm, PolicyStates(model, None))
    with pytest.raises(ValueError, match="vLLM's CPU backend has none") as err:
        syncer.sleep(1)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="rollout.vllm_kwargs.enable_sleep_mode: vLLM's CPU backend has no sleep"):
        VLLMRolloutEngine(str(tiny32), processor, enable_sleep_mode=True)
    assert syncer.asleep_level == 0
    from mmrl.vlm.rollout import SamplingParams

    assert engine.generate(_one(processor), SamplingParams(temperature=0.0, max_new_tokens=2))  # still serving


def _one(processor):
    from mmrl.vlm.common import messages_from_text
    from mmrl.vlm.rollout import GenRequest

    return [GenRequest(messages=messages_from_text("red or blue?"))]
