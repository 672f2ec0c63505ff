"""HF rollout engine against transformers' own generate / forward; vLLM request building and conversion."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from PIL import Image

from mmrl.pipelines.qwen_vl import mm_token_type_ids
from mmrl.testing import assert_same_path
from mmrl.vlm.common import compute_logprobs, load_policy, messages_from_text
from mmrl.vlm.rollout import GenRequest, HFRolloutEngine, SamplingParams, apply_top_k_top_p
from mmrl.vlm.vllm_engine import VLLMRolloutEngine


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from mmrl.tiny import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "qwen2_vl", seed=0)


@pytest.fixture(scope="module")
def policy(tiny_path):
    return load_policy(tiny_path)


def _requests():
    # ragged: different questions and image sizes (4 vs 8 vs 16 image tokens)
    return [
        GenRequest(messages=messages_from_text("<image>What color is the circle?"), images=[Image.new("RGB", (56, 56), "red")]),
        GenRequest(messages=messages_from_text("<image>How many shapes are there in this picture?"),
                   images=[Image.new("RGB", (112, 56), (10, 200, 30))]),
        GenRequest(prompt_text="<|im_start|>user\n<image>Is the square on the left?<|im_end|>\n<|im_start|>assistant\n",
                   images=[Image.new("RGB", (112, 112), "blue")]),
    ]


def _hf_generate(model, engine, enc, max_new_tokens):
    ids = torch.tensor([enc.input_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **enc.mm,
                         mm_token_type_ids=mm_token_type_ids(ids, model.config.image_token_id, model.config.video_token_id),
                         do_sample=False, max_new_tokens=max_new_tokens, bad_words_ids=[[b] for b in engine.banned])
    return out[0, ids.shape[1]:].tolist()


def test_greedy_equals_model_generate(policy):
    model, proc = policy
    engine = HFRolloutEngine(model, proc)
    reqs = _requests()
    res = engine.generate(reqs, SamplingParams(temperature=0.0, max_new_tokens=12))
    for r, enc in zip(res, engine.encode(reqs)):
        ref = _hf_generate(model, engine, enc, 12)
        if engine.eos[0] in ref or any(e in ref for e in engine.eos):  # HF pads after EOS
            k = min(ref.index(e) for e in engine.eos if e in ref) + 1
            ref = ref[:k]
        assert r.response_ids == ref
        assert r.finish_reason == ("stop" if r.response_ids[-1] in engine.eos else "length")


def test_logprobs_equal_recomputed_forward(policy):
    model, proc = policy
    engine = HFRolloutEngine(model, proc)
    res = engine.generate(_requests(), SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=10, seed=1))
    assert [(r.request_index, r.sample_index) for r in res] == [(i, s) for i in range(3) for s in range(3)]
    lps, _ = compute_logprobs(model, [r.prompt_ids for r in res], [r.response_ids for r in res], [r.mm for r in res],
                              engine.pad_id, micro_batch_size=4, temperature=0.7)
    for r, lp in zip(res, lps):
        assert len(r.response_logprobs) == len(r.response_ids) == lp.numel()
        torch.testing.assert_close(torch.tensor(r.response_logprobs), lp, atol=1e-5, rtol=0)
        # filters only remove mass: the sampling distribution gives each drawn token at least its model log-prob
        assert all(s >= m - 1e-5 for s, m in zip(r.sampling_logprobs, r.response_logprobs))


def test_sampling_logprobs_equal_model_logprobs_without_filters(policy):
    model, proc = policy
    engine = HFRolloutEngine(model, proc, ban_vision_tokens=False)
    res = engine.generate(_requests()[:1], SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=0))
    for r in res:
        torch.testing.assert_close(torch.tensor(r.sampling_logprobs), torch.tensor(r.response_logprobs), atol=1e-6, rtol=0)


def test_seeded_sampling_is_reproducible(policy):
    model, proc = policy
    engine = HFRolloutEngine(model, proc)
    sp = SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=123)
    a, b = engine.generate(_requests(), sp), engine.generate(_requests(), sp)
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    assert len({tuple(r.response_ids) for r in a}) > 1  # samples differ from each other


def test_left_padding_ragged_batch_equals_unbatched(policy):
    model, proc = policy
    engine = HFRolloutEngine(model, proc)
    reqs = _requests()
    sp = SamplingParams(temperature=0.0, max_new_tokens=10)
    batched = engine.generate(reqs, sp)
    assert len({len(r.prompt_ids) for r in batched}) == 3  # really ragged
    for req, b in zip(reqs, batched):
        (single,) = engine.generate([req], sp)
        assert single.response_ids == b.response_ids
        torch.testing.assert_close(torch.tensor(single.response_logprobs), torch.tensor(b.response_logprobs),
                                   atol=1e-5, rtol=0)


def test_vision_tokens_never_sampled(tiny_path):
    model, proc = load_policy(tiny_path)
    engine = HFRolloutEngine(model, proc)
    # give every vision special token a +30 logit bias: unbanned, they would be nearly all that is sampled
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[engine.banned] = 30.0
    model.lm_head = head
    sp = SamplingParams(n=8, temperature=1.0, max_new_tokens=8, seed=0)
    unbanned = HFRolloutEngine(model, proc, ban_vision_tokens=False).generate(_requests()[:2], sp)
    share = sum(t in engine.banned for r in unbanned for t in r.response_ids) / sum(len(r.response_ids) for r in unbanned)
    assert share > 0.9
    banned = engine.generate(_requests()[:2], sp)
    assert all(t not in engine.banned for r in banned for t in r.response_ids)
    assert all(math.isfinite(x) for r in banned for x in r.sampling_logprobs)


def test_stop_string_truncates(policy):
    model, proc = policy
    engine = HFRolloutEngine(model, proc)
    req = _requests()[:1]
    (full,) = engine.generate(req, SamplingParams(temperature=0.0, max_new_tokens=12))
    tok = engine.tokenizer
    # a stop string = the text of the 4th generated token (stripped), which must first appear there
    pieces = [tok.decode(full.response_ids[:k]) for k in range(1, len(full.response_ids) + 1)]
    stop = tok.decode(full.response_ids[3:4]).strip() or tok.decode(full.response_ids[3:4])
    k = next(i for i, p in enumerate(pieces) if stop in p) + 1
    (cut,) = engine.generate(req, SamplingParams(temperature=0.0, max_new_tokens=12, stop=[stop, "never-there"]))
    assert cut.response_ids == full.response_ids[:k]
    assert cut.response_logprobs == full.response_logprobs[:k]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert stop in cut.text and cut.text == tok.decode(full.response_ids[:k], skip_special_tokens=True)


def test_length_finish_reason(policy):
    model, proc = policy
    engine = HFRolloutEngine(model, proc, eos_token_ids=[0])  # token 0 is never the argmax here: runs to the limit
    (r,) = engine.generate(_requests()[:1], SamplingParams(temperature=0.0, max_new_tokens=5))
    assert len(r.response_ids) == 5 and r.finish_reason == "length" and r.stop_reason is None


def test_top_k_top_p_by_hand():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    # softmax = [0.6439, 0.2369, 0.0871, 0.0321]; mass of strictly better tokens = [0, .644, .881, .968]
    out = apply_top_k_top_p(logits, top_p=0.7)
    assert torch.isinf(out[0, 2:]).all() and torch.isfinite(out[0, :2]).all()
    out = apply_top_k_top_p(logits, top_p=0.6)  # the best token alone has 0.644 >= 0.6
    assert torch.isfinite(out[0, 0]) and torch.isinf(out[0, 1:]).all()
    out = apply_top_k_top_p(logits, top_k=3)
    assert torch.isinf(out[0, 3]) and torch.isfinite(out[0, :3]).all()
    assert torch.equal(apply_top_k_top_p(logits), logits)


# ------------------------------------------------------------------ vLLM (stand-ins shaped like vllm.outputs)


@dataclass
class Logprob:  # vllm.sequence.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:  # vllm.outputs.CompletionOutput
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float | None
    logprobs: list | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:  # vllm.outputs.RequestOutput (fields used)
    request_id: str
    prompt: str
    prompt_token_ids: list
    outputs: list = field(default_factory=list)
    finished: bool = True


def test_vllm_request_building_and_conversion(policy):
    _, proc = policy
    engine = VLLMRolloutEngine("unused", proc, llm=object())
    reqs = _requests()[:2]
    inputs = engine.build_inputs(reqs)
    assert inputs[0]["prompt"].count("<|vision_start|><|image_pad|><|vision_end|>") == 1
    assert inputs[0]["prompt"].endswith("<|im_start|>assistant\n")
    assert isinstance(inputs[1]["multi_modal_data"]["image"][0], Image.Image)
    assert inputs[1]["multi_modal_data"]["image"][0].size == (112, 56)
    kw = engine.sampling_kwargs(SamplingParams(n=5, temperature=1.0, top_p=0.99, top_k=0, max_new_tokens=2048,
                                               stop=["</answer>"]), 5)
    assert kw["n"] == 5 and kw["top_k"] == -1 and kw["max_tokens"] == 2048 and kw["logprobs"] == 0
    assert kw["stop"] == ["</answer>"] and kw["top_p"] == 0.99
    assert set(kw["logit_bias"]) == set(engine.banned) and all(v == -100.0 for v in kw["logit_bias"].values())

    from mmrl.vlm.common import encode_prompt

    enc = [encode_prompt(proc, i["prompt"], r.images) for i, r in zip(inputs, reqs)]
    outs = [
        RequestOutput("0", inputs[0]["prompt"], enc[0].input_ids, [
            CompletionOutput(1, "blue", [7, 8], -1.5, [{7: Logprob(-1.0)}, {8: Logprob(-0.5), 9: Logprob(-2.0)}], "length"),
            CompletionOutput(0, "red", [5, 6], -0.3, [{5: Logprob(-0.1)}, {6: Logprob(-0.2)}], "stop", 6),
        ]),
        RequestOutput("1", inputs[1]["prompt"], enc[1].input_ids, [
            CompletionOutput(0, "x</answer>", [3], -0.7, [{3: Logprob(-0.7)}], "stop", "</answer>"),
        ]),
    ]
    res = engine.convert(outs, reqs, enc)
    assert [(r.request_index, r.sample_index) for r in res] == [(0, 0), (0, 1), (1, 0)]
    assert res[0].response_ids == [5, 6] and res[0].response_logprobs == [-0.1, -0.2] and res[0].finish_reason == "stop"
    assert res[1].response_logprobs == [-1.0, -0.5] and res[1].finish_reason == "length"
    assert res[2].stop_reason == "</answer>" and res[2].text == "x</answer>"
    assert res[0].prompt_ids == enc[0].input_ids and torch.equal(res[0].mm["image_grid_thw"], enc[0].mm["image_grid_thw"])
    with pytest.raises(ValueError, match="logprobs"):
        engine.convert([RequestOutput("0", "", [1], [CompletionOutput(0, "", [1], None, None, "stop")])], reqs[:1], enc[:1])
    # token-in (multi-turn): each image's expanded placeholder goes in as one <|image_pad|> (vLLM expands it again)
    pad = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    token_in = engine.build_inputs(reqs, enc)
    for t, e, r in zip(token_in, enc, reqs):
        assert e.input_ids.count(pad) > len(r.images) and t["prompt_token_ids"].count(pad) == len(r.images)
        assert [i for i in t["prompt_token_ids"] if i != pad] == [i for i in e.input_ids if i != pad]
        assert len(t["multi_modal_data"]["image"]) == len(r.images)
    # per-request seeds: equal prompts in one call still sample differently
    assert [engine.sampling_kwargs(SamplingParams(seed=7), 1, i)["seed"] for i in range(3)] == [7, 8, 9]
    assert engine.sampling_kwargs(SamplingParams(), 1, 2)["seed"] is None


@pytest.mark.parametrize("kind", ["qwen25_vl", "qwen3_vl"])
def test_other_qwen_vl_families(kind, tmp_path):
    """Greedy = model.generate and log-probs = forward for tiny Qwen2.5-VL / Qwen3-VL as well."""
    from mmrl import tiny

    path = getattr(tiny, f"build_tiny_{kind}")(tmp_path / kind, seed=0)
    model, proc = load_policy(path)
    engine = HFRolloutEngine(model, proc)
    reqs = [GenRequest(messages=messages_from_text("<image>What color is the circle?"), images=[Image.new("RGB", (64, 64), "red")]),
            GenRequest(messages=messages_from_text("<image>How many shapes?"), images=[Image.new("RGB", (128, 64), "blue")])]
    res = engine.generate(reqs, SamplingParams(temperature=0.0, max_new_tokens=8))
    for r, enc in zip(res, engine.encode(reqs)):
        ref = _hf_generate(model, engine, enc, 8)
        hits = [ref.index(e) for e in engine.eos if e in ref]
        assert r.response_ids == (ref[:min(hits) + 1] if hits else ref)
    res = engine.generate(reqs, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=0))
    lps, _ = compute_logprobs(model, [r.prompt_ids for r in res], [r.response_ids for r in res], [r.mm for r in res],
                              engine.pad_id)
    for r, lp in zip(res, lps):
        torch.testing.assert_close(torch.tensor(r.response_logprobs), lp, atol=1e-5, rtol=0)


# ------------------------------------------------------------------ vision feature reuse (VisionCache)


def _multi_image_rollouts(model, proc, n=3):
    """3 prompts (one with two images of different sizes), n sampled responses each, request-major."""
    reqs = [GenRequest(messages=messages_from_text("<image>What color is the circle?"), images=[Image.new("RGB", (56, 56), "red")]),
            GenRequest(messages=messages_from_text("<image> and <image>: same colour?"),
                       images=[Image.new("RGB", (112, 56), (10, 200, 30)), Image.new("RGB", (56, 84), "blue")]),
            GenRequest(messages=messages_from_text("<image>How many shapes?"), images=[Image.new("RGB", (84, 84), "green")])]
    return HFRolloutEngine(model, proc).generate(reqs, SamplingParams(n=n, temperature=1.0, max_new_tokens=5, seed=0))


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen25_vl", "qwen3_vl"])
def test_vision_cache_logprobs_equal_plain_path(kind, tmp_path):
    """Log-probs with each prompt's images encoded once = the plain path (vision tower in every forward), for
    n=3 responses per prompt, a two-image prompt, micro-batches that cut through groups; Qwen3-VL's deepstack
    features go through the cache as well."""
    from mmrl import tiny
    from mmrl.vlm.common import VisionCache

    model, proc = load_policy(tiny.BUILDERS[kind](tmp_path / kind, seed=0))
    res = _multi_image_rollouts(model, proc)
    args = ([r.prompt_ids for r in res], [r.response_ids for r in res], [r.mm for r in res], proc.tokenizer.pad_token_id)
    plain, _ = compute_logprobs(model, *args, micro_batch_size=4)
    cache = VisionCache(model)
    cached, _ = compute_logprobs(model, *args, micro_batch_size=4, vision_cache=cache)
    for a, b in zip(plain, cached):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    # 9 rows in micro-batches of 4: rows 0-3 = prompts 0, 1 (encoded, vision call 1), rows 4-7 = prompts 1 (reused),
    # 2 (encoded, call 2), row 8 = prompt 2 (reused)
    assert (cache.misses, cache.hits, cache.vision_calls) == (3, 2, 2)
    again, _ = compute_logprobs(model, *args, micro_batch_size=4, vision_cache=cache)  # a second pass: no vision call
    assert cache.vision_calls == 2 and all(torch.equal(a, b) for a, b in zip(cached, again))
    # the training forward through the cache gives the same log-probs and the same gradients (vision frozen)
    from mmrl.vlm.common import collate, response_logprobs

    for p in model.parameters():
        p.requires_grad_(False)
    lm = [p for n, p in model.named_parameters() if "language_model" in n and "layers.0." in n]
    for p in lm:
        p.requires_grad_(True)
    grads = []
    for c in (None, cache):
        model.zero_grad(set_to_none=True)
        batch, P, mask = collate(model, *[a[:5] for a in args[:3]], args[3])
        if c is not None:
            batch = c.apply(batch, args[2][:5])
            assert "pixel_values" not in batch and "mm_encoder_outputs" in batch
        logp, _ = response_logprobs(model, batch, P, batch["input_ids"][:, P:])
        (logp * mask).sum().backward()
        grads.append([p.grad.clone() for p in lm])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_vision_cache_bypassed_when_vision_trains_and_cleared_on_update(policy):
    """A trainable vision tower: the grad-enabled forward ignores the cache (gradients reach the vision weights,
    equal to the plain path's); an in-place update of a vision weight (an optimizer step) empties the cache."""
    from mmrl.vlm.common import VisionCache, collate, response_logprobs, vision_tower, vision_tower_trainable

    model, proc = policy
    res = _multi_image_rollouts(model, proc, n=2)
    rows = ([r.prompt_ids for r in res], [r.response_ids for r in res], [r.mm for r in res])
    pad = proc.tokenizer.pad_token_id
    cache = VisionCache(model)
    compute_logprobs(model, *rows, pad, vision_cache=cache)  # filled, as by the old-log-prob pass
    calls = cache.vision_calls
    w = vision_tower(model).blocks[0].attn.qkv.weight
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        w.requires_grad_(True)
        assert vision_tower_trainable(model)
        grads = []
        for c in (None, cache):
            model.zero_grad(set_to_none=True)
            batch, P, mask = collate(model, *rows, pad)
            if c is not None:
                batch = c.apply(batch, rows[2])
                assert "pixel_values" in batch and "mm_encoder_outputs" not in batch  # bypassed
            logp, _ = response_logprobs(model, batch, P, batch["input_ids"][:, P:])
            (logp * mask).sum().backward()
            grads.append(w.grad.clone())
        assert grads[1].abs().sum() > 0
        assert_same_path(grads[1], grads[0], why="the bypassed cache hands back the batch unchanged: same forward")
        assert cache.vision_calls == calls
        with torch.no_grad():  # no-grad passes may use the cache while the weights are unchanged
            batch, _, _ = collate(model, *rows, pad)
            assert "mm_encoder_outputs" in cache.apply(batch, rows[2]) and cache.vision_calls == calls
            w.add_(1e-3)  # what optimizer.step() does: in place, bumps the version counter
            cache.apply(batch, rows[2])
        assert cache.vision_calls == calls + 1  # refilled with the new weights
        with torch.no_grad():
            w.sub_(1e-3)
    finally:
        model.zero_grad(set_to_none=True)
        for p in model.parameters():
            p.requires_grad_(True)


def test_decoding_uses_the_cache_argument_and_prints_no_deprecation(policy, monkeypatch, caplog):
    """The loop passes the KV cache as `cache` where transformers renamed it (it deprecates `past_key_values`, removal
    in 5.40, with a warning on every use); the results equal those of the old argument name, token for token."""
    import logging

    from transformers.utils import logging as hf_logging

    from mmrl.vlm import rollout

    model, proc = policy
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)

    def run():
        hf_logging.warning_once.cache_clear()  # warning_once: once per process; every run here must be able to warn
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            results = HFRolloutEngine(model, proc).generate(_requests(), sp)
        return results, [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]

    new, warned = run()
    assert warned == []
    if rollout.cache_argument(model) == "past_key_values":
        pytest.skip("this transformers version has no `cache` argument yet")
    monkeypatch.setattr(rollout, "cache_argument", lambda m: "past_key_values")
    old, warned_old = run()
    assert warned_old, "the deprecated name warns (so the check above can fail)"
    assert [r.response_ids for r in new] == [r.response_ids for r in old]
    assert [r.response_logprobs for r in new] == [r.response_logprobs for r in old]
