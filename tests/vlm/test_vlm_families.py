"""VLM policy families beyond Qwen (`mmrl.vlm.families`): GLM-4.1V (`Glm4vForConditionalGeneration`, 3-D M-RoPE)
and InternVL (`InternVLForConditionalGeneration`, 1-D positions, tiles). Each: a tiny random checkpoint saved with
save_pretrained + its processor and loaded through `load_policy` (from_pretrained); placeholders, position ids,
log-probs, vision-feature reuse (GLM) / pass-through (InternVL), packing and greedy rollouts against transformers' own
model; LoRA on the language model; a 2-step vlm_grpo run and its exact resume. InternVL 3.5 (a Qwen3 decoder):
log-probs, LoRA names and FSDP blocks. Multi-turn: a 2-turn trajectory equals the chat template's tokens."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from mmrl.config import load_config
from mmrl.testing import RESUMED_RUN, assert_same_path, metrics_rows
from mmrl.vlm import grpo
from mmrl.vlm.batch import RolloutBatch
from mmrl.vlm.common import (VisionCache, compute_logprobs, encode_prompt, language_block_types, load_policy,
                             messages_from_text, render_prompt)
from mmrl.vlm.envs import Observation
from mmrl.vlm.episodes import ChatFormat, encode_observation
from mmrl.vlm.families import GLM4V, INTERNVL, family_of_config, family_of_processor
from mmrl.vlm.policy import build_policy
from mmrl.vlm.rollout import GenRequest, HFRolloutEngine, SamplingParams


FAMILIES = {"glm4v": GLM4V, "internvl": INTERNVL}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def glm_path(request, tmp_path_factory):
    import mmrl.tiny as tiny

    return getattr(tiny, f"build_tiny_{request.param}")(tmp_path_factory.mktemp(request.param) / "model", seed=0)


@pytest.fixture(scope="module")
def policy(glm_path):
    return load_policy(glm_path)


def _family(model):
    return FAMILIES[model.config.model_type]


def _image(h, w, seed):
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).byte().numpy())


def _prompts(processor):
    # non-square sizes other than the builder's 56x56: 60x90 -> grid [1, 4, 6] (6 tokens), 84x140, none
    items = [("<image>What color?", [_image(60, 90, 0)]),
             ("Hello <image> and <image> which one?", [_image(56, 56, 1), _image(84, 140, 2)]),
             ("no image here", [])]
    return [encode_prompt(processor, render_prompt(processor, messages_from_text(t)), ims) for t, ims in items], items


def _types(model, ids):
    """GLM-4.1V's forward takes mm_token_type_ids; InternVL's generate refuses them."""
    return {"mm_token_type_ids": (ids == model.config.image_token_id).long()} if _family(model) is GLM4V else {}


def _plain_logprobs(model, enc, response):
    """transformers' own forward (it computes the rope index itself) on one unpadded row."""
    ids = torch.tensor([enc.input_ids + response])
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), **_types(model, ids), **enc.mm)
    with torch.no_grad():
        logits = model(**kw).logits[0, len(enc.input_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_checkpoint_placeholders_positions_and_logprobs_equal_transformers(policy):
    model, processor = policy
    fam = _family(model)
    assert type(model).__name__ == {"glm4v": "Glm4vForConditionalGeneration",
                                    "internvl": "InternVLForConditionalGeneration"}[fam.name]
    assert family_of_config(model.config, strict=True) is fam and family_of_processor(processor) is fam
    encs, _ = _prompts(processor)
    image_id = model.config.image_token_id
    if fam is GLM4V:  # <|begin_of_image|> + 6 x <|image|> + <|end_of_image|>
        assert encs[0].mm["image_grid_thw"].tolist() == [[1, 4, 6]]
        n0, begin_id, end_id = 6, model.config.image_start_token_id, model.config.image_end_token_id
        assert encs[1].input_ids.count(image_id) == sum(int(g.prod()) // 4 for g in encs[1].mm["image_grid_thw"])
    else:  # 60x90: 2 tiles + a thumbnail of 56x56, 4 tokens each: <img> + 12 x <IMG_CONTEXT> + </img>
        assert tuple(encs[0].mm["pixel_values"].shape) == (3, 3, 56, 56) and "image_grid_thw" not in encs[0].mm
        n0, begin_id, end_id = 12, processor.start_image_token_id, processor.end_image_token_id
        assert encs[1].input_ids.count(image_id) == 4 * encs[1].mm["pixel_values"].shape[0]
    assert encs[0].input_ids.count(image_id) == n0
    begin = encs[0].input_ids.index(begin_id)
    ids0 = encs[0].input_ids
    assert ids0[begin + 1:begin + 1 + n0] == [image_id] * n0 and ids0[begin + 1 + n0] == end_id

    responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    mm = [e.mm for e in encs]
    pad = processor.tokenizer.pad_token_id
    batch = RolloutBatch.build(model, [e.input_ids for e in encs], responses, mm, pad)
    keep = batch.attention_mask.bool()
    if fam is GLM4V:
        grids = torch.cat([m["image_grid_thw"] for m in mm if m])
        ref_pos, _ = model.model.get_rope_index(batch.input_ids, batch.mm_token_type_ids, image_grid_thw=grids,
                                                attention_mask=batch.attention_mask)
    else:  # 1-D: what generate derives from a left-padded mask (cumsum - 1), in 3 equal rows
        ref_pos = (batch.attention_mask.cumsum(-1) - 1).expand(3, -1, -1)
    assert torch.equal(ref_pos[:, keep], batch.position_ids[:, keep])  # left-padded batch: positions exact

    lps, _ = compute_logprobs(model, [e.input_ids for e in encs], responses, mm, pad, micro_batch_size=2)
    plain = [_plain_logprobs(model, e, r) for e, r in zip(encs, responses)]
    diff = max((a - b).abs().max().item() for a, b in zip(lps, plain))
    assert diff < 2e-6, diff  # measured 4.8e-7

    cache = VisionCache(model)
    cached, _ = compute_logprobs(model, [e.input_ids for e in encs], responses, mm, pad, micro_batch_size=2,
                                 vision_cache=cache)
    # GLM: one vision call for all images; InternVL: features cannot be handed in, the cache passes batches through
    assert cache.vision_calls == (1 if fam.vision_cache else 0)
    assert all(torch.equal(a, b) for a, b in zip(lps, cached))
    packed = batch.replace(packed=True).logprobs(model, 8)  # padding-free rows: 4 x [rows, width] positions
    dense = batch.logprobs(model, 8)
    assert (packed - dense)[batch.response_mask].abs().max().item() < 2e-6


def test_internvl35_qwen3_decoder_logprobs_lora_and_fsdp_blocks(tmp_path):
    """InternVL 3.5 is InternVL 3 with a Qwen3 decoder (q/k norms per head): the same family row serves it. Log-probs
    (padded and packed) equal transformers' own forward, LoRA lands on the decoder's projections, and FSDP shards
    the Qwen3 decoder layers."""
    from mmrl.tiny import build_tiny_internvl

    path = build_tiny_internvl(tmp_path / "m", seed=0, decoder="qwen3")
    model, processor = load_policy(path)
    assert type(model.model.language_model).__name__ == "Qwen3Model"
    assert family_of_config(model.config, strict=True) is INTERNVL and family_of_processor(processor) is INTERNVL
    assert language_block_types(model) == ["Qwen3DecoderLayer"]
    encs, _ = _prompts(processor)
    responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    mm, pad = [e.mm for e in encs], processor.tokenizer.pad_token_id
    lps, _ = compute_logprobs(model, [e.input_ids for e in encs], responses, mm, pad, micro_batch_size=2)
    plain = [_plain_logprobs(model, e, r) for e, r in zip(encs, responses)]
    diff = max((a - b).abs().max().item() for a, b in zip(lps, plain))
    assert diff < 2e-6, diff
    batch = RolloutBatch.build(model, [e.input_ids for e in encs], responses, mm, pad)
    packed, dense = batch.replace(packed=True).logprobs(model, 8), batch.logprobs(model, 8)
    assert (packed - dense)[batch.response_mask].abs().max().item() < 2e-6

    states, _ = build_policy(_cfg(path, tmp_path).model, torch.device("cpu"), torch.float32, keep_ref=False)
    names = [n for n, _ in states.named_trainable_parameters()]
    assert names and all(".language_model." in n and "lora_" in n for n in names)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.parametrize("family", ["qwen2_vl", "glm4v", "internvl"])
def test_two_turn_trajectory_equals_the_chat_template(tmp_path, family):
    """A 2-turn trajectory as vlm_multiturn builds it (first prompt + the policy's response ending in the family's
    turn-end token + the environment segment, each tokenised on its own) is token for token the processor's
    tokenisation of the chat template's rendering of the whole conversation, with the same vision tensors.
    GLM-4.1V ends a turn on <|user|>, which is also the next user turn's header: the segment must not repeat it."""
    from transformers import AutoProcessor

    import mmrl.tiny as tiny

    processor = AutoProcessor.from_pretrained(getattr(tiny, f"build_tiny_{family}")(tmp_path / "m", seed=0))
    tok, fmt = processor.tokenizer, ChatFormat(processor)
    turn_end = tok.convert_tokens_to_ids(family_of_processor(processor).turn_end)
    obs = [Observation("Where next?", [_image(56, 56, 0)]), Observation("Moved. Next?", [_image(60, 90, 1)])]
    answer = "<think>go</think>left"
    response = tok(answer, add_special_tokens=False)["input_ids"] + [turn_end]
    first = encode_prompt(processor, fmt.first_prompt(obs[0]), obs[0].images)
    segment, cut = encode_observation(fmt, obs[1], False, response, budget=10_000)
    assert not cut

    chat = [ChatFormat._user(obs[0]), {"role": "assistant", "content": answer}, ChatFormat._user(obs[1])]
    text = render_prompt(processor, chat)
    whole = encode_prompt(processor, text, obs[0].images + obs[1].images)
    assert first.input_ids + response + segment.input_ids == whole.input_ids
    for key, value in whole.mm.items():
        assert torch.equal(torch.cat([first.mm[key], segment.mm[key]]), value)
    if family == "glm4v":  # the layout of GLM-4.1V-9B-Thinking's own chat_template (revision 3c1471e) for this chat
        image = "<|begin_of_image|><|image|><|end_of_image|>"
        assert text == (f"[gMASK]<sop><|user|>\n{image}Where next?<|assistant|>\n{answer}"
                        f"<|user|>\n{image}Moved. Next?<|assistant|>\n")


def test_greedy_rollout_equals_generate(policy):
    model, processor = policy
    fam = _family(model)
    encs, items = _prompts(processor)
    engine = HFRolloutEngine(model, processor)
    assert {processor.tokenizer.convert_tokens_to_ids(t) for t in fam.vision_tokens} <= set(engine.banned)
    res = engine.generate([GenRequest(prompt_text=e.text, images=ims) for e, (_, ims) in zip(encs, items)],
                          SamplingParams(temperature=0.0, max_new_tokens=6))
    for r, e in zip(res, encs):
        ids = torch.tensor([e.input_ids])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **e.mm, **_types(model, ids),
                             do_sample=False,
                             max_new_tokens=6, bad_words_ids=[[b] for b in engine.banned])
        ref = out[0, ids.shape[1]:].tolist()
        stop = [i for i, t in enumerate(ref) if t in engine.eos]
        assert r.response_ids == (ref[:stop[0] + 1] if stop else ref)


def test_vllm_prompts_carry_the_family_placeholder_unexpanded(policy):
    """What VLLMRolloutEngine hands vLLM, which expands every image placeholder itself: text prompts with the
    family's image markup (also for a raw ``<image>``), and token-in prompts whose expanded placeholders (InternVL's
    with the <img> ... </img> around them) are collapsed back to the tokens of the chat text."""
    from mmrl.vlm.vllm_engine import VLLMRolloutEngine

    model, processor = policy
    fam = _family(model)
    encs, items = _prompts(processor)
    engine = VLLMRolloutEngine("unused", processor, llm=object())  # no vLLM needed to build its inputs
    reqs = [GenRequest(prompt_text=e.text, images=ims) for e, (_, ims) in zip(encs, items)]
    for text_in, token_in, e, (_, ims) in zip(engine.build_inputs(reqs), engine.build_inputs(reqs, encs), encs, items):
        assert text_in["prompt"] == e.text and text_in.get("multi_modal_data", {}).get("image", []) == ims
        assert token_in["prompt_token_ids"] == processor.tokenizer(e.text)["input_ids"]
    raw = engine.build_inputs([GenRequest(prompt_text="<image>What color?", images=items[0][1])])
    assert raw[0]["prompt"] == fam.chat_image + "What color?"


def test_a_full_vllm_sync_sends_every_name_of_a_tied_tensor(glm_path):
    """The tiny InternVL's lm_head is its embed_tokens (named_parameters lists it once): the sync sends the tensor
    under both names, as vLLM's CPU build keeps a separate copy for its output layer."""
    from mmrl.adapters import PolicyStates
    from mmrl.vlm.vllm_sync import VLLMWeightSyncer

    model, _ = load_policy(glm_path)
    sent = dict(VLLMWeightSyncer(None, PolicyStates(model, None), load_fn=lambda chunk: None).named_weights(True))
    assert set(sent) == {n for n, _ in model.named_parameters(remove_duplicate=False)}
    embed = "model.language_model.embed_tokens.weight"
    assert (sent["lm_head.weight"] is sent[embed]) == (_family(model) is INTERNVL)


def _cfg(glm_path, out, *overrides):
    base = {
        "algorithm": "vlm_grpo", "output_dir": str(out), "device": "cpu", "seed": 3,
        "model": {"path": str(glm_path), "lora": {"rank": 4}},
        "data": {"kind": "shapes", "template": "{question}", "colors": ["red", "green", "blue", "yellow"],
                 "shape_size": [0.5, 0.7], "eval_size": 4},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        "reward": {"name": "exact_match"}, "algo": {"kl": {"coef": 0.05}},
        "update": {"micro_batch_size": 3},
        "warm_start": {"steps": 2, "batch_size": 4, "lr": 1e-2, "params": []},
        "log": {"sample_every": 0, "eval_every": 0},
        "train": {"max_steps": 2, "save_every": 1}, "optim": {"lr": 5e-3},
    }
    return load_config(base, list(overrides))


def test_lora_on_the_language_model(glm_path, tmp_path):
    cfg = _cfg(glm_path, tmp_path)
    states, _ = build_policy(cfg.model, torch.device("cpu"), torch.float32, keep_ref=True)
    names = [n for n, _ in states.named_trainable_parameters()]
    assert names and all(".language_model." in n for n in names)
    mlp = "gate_up_proj" if "glm4v" in str(glm_path) else "gate_proj"  # GLM's fused MLP too
    assert any(mlp in n for n in names) and any("q_proj" in n for n in names)
    cfg = _cfg(glm_path, tmp_path, "model.train_vision=true")
    states, _ = build_policy(cfg.model, torch.device("cpu"), torch.float32, keep_ref=True)
    vision = ".visual.blocks." if "glm4v" in str(glm_path) else ".vision_tower.encoder.layer."
    assert any(vision in n and "lora_" in n for n, _ in states.named_trainable_parameters())
    cfg = _cfg(glm_path, tmp_path, "model.lora.rank=0")  # full fine-tuning: the vision tower stays frozen
    states, _ = build_policy(cfg.model, torch.device("cpu"), torch.float32, keep_ref=False)
    names = [n for n, _ in states.named_trainable_parameters()]
    assert names and not any(vision.split(".")[1] in n for n in names)


def test_vlm_grpo_two_steps_and_exact_resume(glm_path, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    grpo.train(_cfg(glm_path, full))
    grpo.train(_cfg(glm_path, part, "train.max_steps=1"))
    grpo.train(_cfg(glm_path, part))  # resumes from step_1

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "eval/", "perf/"))} for r in rows]

    a, b = strip(metrics_rows(full)), strip(metrics_rows(part))
    assert [r["step"] for r in b] == [1, 2]
    assert_same_path(a, b, why=RESUMED_RUN)
    assert all(r["policy/grad_norm"] > 0 and r["diag/logprob_drift"] < 1e-5 for r in a)
    # the LoRA recipe reused GLM's vision features; InternVL's forwards run the tower (no cache)
    assert all((r["rollout/vision_cache/calls"] > 0) == ("glm4v" in str(glm_path)) for r in a)


def test_vlm_multiturn_two_steps_and_exact_resume(glm_path, tmp_path):
    """The same policy interface carries vlm_multiturn: 2-turn grid-puzzle episodes, a run interrupted after step 1
    resumes to the metrics of the uninterrupted run."""
    from mmrl.vlm.multiturn import train

    def cfg(out, steps):
        return load_config({
            "algorithm": "vlm_multiturn", "output_dir": str(out), "seed": 0, "device": "cpu", "num_threads": 1,
            "model": {"path": str(glm_path)},
            "env": {"tasks": {"grid_puzzle": {"width": 5, "max_turns": 2}}, "eval_episodes": 2, "max_workers": 2},
            "rollout": {"prompts_per_step": 2, "group_size": 2, "max_turns": 2, "max_new_tokens": 3,
                        "max_seq_len": 256},
            "algo": {"advantage": "turn_grpo", "dynamic_sampling": False}, "optim": {"lr": 0.01},
            "warm_start": {"steps": 1, "batch_size": 4}, "update": {"micro_batch_size": 2, "mini_batch_size": 2},
            "train": {"max_steps": steps, "save_every": 1}})

    train(cfg(tmp_path / "a", 2))
    train(cfg(tmp_path / "b", 1))
    train(cfg(tmp_path / "b", 2))

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]

    a, b = strip(metrics_rows(tmp_path / "a")), strip(metrics_rows(tmp_path / "b"))
    assert [r["step"] for r in b] == [0, 1, 2]
    assert_same_path(a[-1], b[-1], why=RESUMED_RUN)
    assert a[-1]["rollout/episode/turns_mean"] == 2.0  # two policy turns with an observation between them
