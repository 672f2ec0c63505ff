"""GLM-4.1V, InternVL 3 and InternVL 3.5 (transformers-format tiny checkpoints with head_dim 32) on vLLM's CPU
build: the engine loads each checkpoint; prompt ids and greedy tokens equal the HF engine's for image, two-size and
text-only prompts, sent as text and as token ids (the placeholder collapsed to one, InternVL's <img>/</img> with
it); after a weight sync (merged LoRA on the language model and the vision tower, then full fine-tuning of every
weight) the greedy tokens equal the HF engine's on the updated policy again. The family's HF -> vLLM name map
(``VLLM_PREFIX_MAPS``) names parameters the engine's model has."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

LOGPROB_TOL = 1e-4  # vLLM's CPU kernels vs the HF forward on the same weights, as test_engine.py
LM = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|gate_up_proj|down_proj)"


@pytest.fixture(scope="module")
def setup(family_name, family32, start_engine):
    from mmrl.vlm.common import load_policy

    path = family32(family_name)
    _, processor = load_policy(path)
    engine = start_engine(path)
    yield path, processor, engine
    engine.close()


def _greedy_equal(engine, model, processor, requests, logprob_tools, token_in=False):
    """vLLM's greedy rollouts vs the HF engine's on `model`: same prompt and response ids; returns (results, max
    log-prob diff)."""
    from mmrl.vlm.common import encode_prompt
    from mmrl.vlm.rollout import HFRolloutEngine, SamplingParams, _prompt_text

    sp = SamplingParams(temperature=0.0, max_new_tokens=10)
    ref = HFRolloutEngine(model, processor).generate(requests, sp)
    enc = [encode_prompt(processor, _prompt_text(processor, r), r.images) for r in requests] if token_in else None
    got = engine.generate(requests, sp, encoded=enc)
    for g, r in zip(got, ref):
        assert g.prompt_ids == r.prompt_ids  # vLLM's expanded placeholders = the HF processor's
        assert g.response_ids == r.response_ids and g.finish_reason == r.finish_reason
    return got, logprob_tools[1](got, [r.response_logprobs for r in ref])


def test_engine_loads_the_checkpoint_and_greedy_equals_the_hf_engine(setup, family_name, vlm_requests,
                                                                     logprob_tools):
    from mmrl.vlm.common import load_policy
    from mmrl.vlm.families import family_of_processor

    path, processor, engine = setup
    model, _ = load_policy(path)
    fam = family_of_processor(processor)
    assert fam.name == family_name[:len(fam.name)] and fam.name in ("glm4v", "internvl")
    got, diff = _greedy_equal(engine, model, processor, vlm_requests, logprob_tools)
    pad = processor.tokenizer.convert_tokens_to_ids(fam.image_pad)
    # 56x56 and 56x112 images: GLM 4 and 8 <|image|>; InternVL 1 tile and 2 tiles + thumbnail, 4 tokens each
    assert [r.prompt_ids.count(pad) for r in got] == ([4, 8, 0] if fam.name == "glm4v" else [4, 12, 0])
    _, diff_tokens = _greedy_equal(engine, model, processor, vlm_requests, logprob_tools, token_in=True)
    print(f"[vllm families] {family_name}: greedy tokens equal the HF engine's (text-in and token-in); log-prob max "
          f"|vLLM - HF| {max(diff, diff_tokens):.1e}")
    assert max(diff, diff_tokens) <= LOGPROB_TOL
    from mmrl.vlm.vllm_sync import to_vllm_name

    # every checkpoint tensor's layer is a module of vLLM's model under the mapped name (or its fused q/k/v, gate/up
    # layer); layers, not parameters: vLLM's CPU build repacks linears and drops their bias parameters
    vllm_modules = dict(engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()
                        .named_modules())
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"}
    for name, _ in model.named_parameters():
        layer = to_vllm_name(name, model.config.model_type).rpartition(".")[0]
        parent, _, leaf = layer.rpartition(".")
        assert layer in vllm_modules or f"{parent}.{fused.get(leaf, leaf)}" in vllm_modules, (name, layer)


def _perturb(params, scale, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_greedy_equals_the_hf_engine_after_a_weight_sync(setup, family_name, mode, vlm_requests, logprob_tools):
    """LoRA: random adapters on the decoder's and the vision tower's linears, sent merged (whole fused units);
    full: every weight moved, vision tower included. The engine then answers as the moved policy, not the base."""
    from peft import LoraConfig

    from mmrl.adapters import PolicyStates
    from mmrl.vlm.common import load_policy
    from mmrl.vlm.families import family_of_config
    from mmrl.vlm.rollout import SamplingParams
    from mmrl.vlm.vllm_sync import VLLMWeightSyncer

    path, processor, engine = setup
    base, _ = load_policy(path)
    VLLMWeightSyncer(engine.llm, PolicyStates(base, None)).sync(full=True)  # the engine back on the base weights
    before = engine.generate(vlm_requests, SamplingParams(temperature=0.0, max_new_tokens=10))  # fills the caches
    model, _ = load_policy(path)
    if mode == "lora":
        targets = LM + "|" + family_of_config(model.config).vision_lora
        states = PolicyStates(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
        _perturb(states.trainable_parameters(), 0.3, seed=1)
    else:
        states = PolicyStates(model, None)
        _perturb(states.trainable_parameters(), 0.05, seed=1)
    states.model.eval()
    m = VLLMWeightSyncer(engine.llm, states).sync()
    got, diff = _greedy_equal(engine, states.model, processor, vlm_requests, logprob_tools)
    changed = sum(a.response_ids != b.response_ids for a, b in zip(got, before))
    print(f"[vllm families] {family_name} {mode}: sent {m['rollout/weight_sync/tensors']} tensors; greedy tokens "
          f"equal the HF engine's on the moved policy ({changed} of 3 responses changed from the base); log-prob max "
          f"|vLLM - HF| {diff:.1e}")
    assert changed >= 2  # the sync really changed what the engine answers
    assert diff <= LOGPROB_TOL
