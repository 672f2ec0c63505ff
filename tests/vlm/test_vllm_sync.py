"""mmrl.vlm.vllm_sync: the pure parts (merge, names, chunking, the syncer's streaming) on a tiny Qwen2-VL.

The peer for the merge is peft itself: the same adapter loaded into ``get_peft_model`` on a copy of the
base and merged with ``merge_and_unload()``. The "engine" receiving the weights is a second, plain HF
Qwen2-VL (``load_state_dict(strict=False)`` per chunk): after a sync its logits equal the LoRA policy's.
The engine calls themselves run against vLLM's CPU build in tests/vllm (`make test-vllm`).
"""

from __future__ import annotations

import copy

import pytest
import torch

from mmrl.vlm.vllm_sync import (VLLM_PREFIX_MAPS, VLLMWeightSyncer, checkpoint_name, chunk_by_bytes,
                                iter_merged_weights, load_unit, merged_lora_state_dict, to_vllm_name)

TARGETS = (r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
           r"|.*visual\.blocks.*\.(qkv|proj|fc1|fc2)")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from mmrl.tiny import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2vl") / "model")


def _load(path):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)


def _randomise_default(states, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in states.trainable_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.fixture()
def policy(tiny_path):
    from mmrl.adapters import PolicyStates

    base = _load(tiny_path)
    pristine = copy.deepcopy(base)
    states = PolicyStates(base, _lora_config(), old=True)
    _randomise_default(states, 2)  # peft inits B = 0: make the deltas non-zero, and "old" != "default"
    states.copy("default", "old")
    _randomise_default(states, 1)
    return states, pristine


def _peft_merge(pristine, states, adapter):
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    peft_model = get_peft_model(copy.deepcopy(pristine), _lora_config())
    sd = {"base_model.model." + k: v for k, v in get_peft_model_state_dict(states.model, adapter_name=adapter).items()}
    res = set_peft_model_state_dict(peft_model, sd)
    assert not res.unexpected_keys
    return peft_model.merge_and_unload()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_merged_state_dict_equals_peft_merge_and_unload(policy):
    states, pristine = policy
    before = {n: p.detach().clone() for n, p in states.model.named_parameters()}
    for adapter in ("default", "old"):
        ours = merged_lora_state_dict(states.model, adapter)
        ref = dict(_peft_merge(pristine, states, adapter).named_parameters())
        assert list(ours) == list(ref)  # same names, same order
        diff = max((ours[k] - ref[k].detach()).abs().max().item() for k in ref)
        print(f"[vllm_sync] merged vs peft merge_and_unload ({adapter}): max |diff| {diff:.1e} over {len(ref)} tensors")
        assert diff <= 1e-6
        n_lora = sum(1 for k in ref if not torch.equal(ref[k], pristine.state_dict()[k]))
        assert n_lora == 2 * 7 + 2 * 4  # 7 LM linears x 2 layers, 4 vision linears x 2 blocks
    # the policy is untouched: every parameter bitwise equal, nothing merged
    assert all(torch.equal(before[n], p) for n, p in states.model.named_parameters())
    from peft.tuners.lora import LoraLayer

    assert not any(m.merged for m in states.model.modules() if isinstance(m, LoraLayer))


def test_merged_weights_reproduce_the_policy_logits(policy):
    states, pristine = policy
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    plain = copy.deepcopy(pristine)
    plain.load_state_dict(merged_lora_state_dict(states.model), strict=True)
    torch.testing.assert_close(_logits(plain, ids), _logits(states.model, ids), rtol=0, atol=1e-5)
    with states.use("old"):
        old_logits = _logits(states.model, ids)
    plain.load_state_dict(merged_lora_state_dict(states.model, "old"), strict=True)
    torch.testing.assert_close(_logits(plain, ids), old_logits, rtol=0, atol=1e-5)


def test_checkpoint_and_vllm_names(policy):
    states, pristine = policy
    hf_names = [n for n, _ in pristine.named_parameters()]
    mapped = [checkpoint_name(n) for n, _ in states.model.named_parameters()]
    assert [m for m in mapped if m is not None] == hf_names
    assert sum(m is None for m in mapped) == 2 * 2 * 22  # lora_A + lora_B for 2 adapters on 22 layers
    assert checkpoint_name("base_model.model.model.language_model.layers.1.mlp.down_proj.base_layer.weight") == \
        "model.language_model.layers.1.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="modules_to_save"):
        checkpoint_name("lm_head.modules_to_save.default.weight")
    # vLLM's Qwen2-VL prefixes (hf_to_vllm_mapper, see the module docstring for the source)
    assert to_vllm_name("model.language_model.layers.0.self_attn.q_proj.bias") == \
        "language_model.model.layers.0.self_attn.q_proj.bias"
    assert to_vllm_name("model.visual.merger.mlp.0.weight") == "visual.merger.mlp.0.weight"
    assert to_vllm_name("lm_head.weight") == "language_model.lm_head.weight"
    assert to_vllm_name("model.embed_tokens.weight") == "language_model.model.embed_tokens.weight"  # old layout
    tops = {to_vllm_name(n).split(".")[0] + "." + to_vllm_name(n).split(".")[1] for n in hf_names}
    assert tops == {"language_model.model", "language_model.lm_head", "visual.patch_embed", "visual.blocks",
                    "visual.merger"}
    for n in hf_names:  # the map is idempotent: already-mapped names pass through unchanged
        assert to_vllm_name(to_vllm_name(n)) == to_vllm_name(n)
    assert VLLM_PREFIX_MAPS["qwen2_5_vl"] == VLLM_PREFIX_MAPS["qwen2_vl"]
    with pytest.raises(ValueError, match="unknown model family"):
        to_vllm_name("lm_head.weight", "llava")
    assert to_vllm_name("a.b", [("a.", "z.")]) == "z.b"


def test_chunk_by_bytes():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 300, 5, 5, 1000, 1, 2])]  # float32: 4 B each
    for budget in (1, 40, 100, 1300, 10**9):
        chunks = list(chunk_by_bytes(iter(tensors), budget))
        assert [x for c in chunks for x in c] == tensors  # order and content kept for every budget
        for c in chunks:
            assert len(c) == 1 or sum(t.numel() * 4 for _, t in c) <= budget
    # bytes 40, 1200, 20, 20, 4000, 4, 8 with budget 1300: 40+1200+20+20 | 4000 alone | 4+8
    assert [len(c) for c in chunk_by_bytes(tensors, 1300)] == [4, 1, 2]
    assert len(list(chunk_by_bytes(tensors, 10**9))) == 1
    with pytest.raises(ValueError, match="max_bytes"):
        list(chunk_by_bytes(tensors, 0))


def test_syncer_streams_changed_layers_into_a_receiving_model(policy):
    states, pristine = policy
    receiver = copy.deepcopy(pristine)  # stands for the engine: it loaded the same base checkpoint
    received: list[list[str]] = []

    def load(chunk):
        received.append([n for n, _ in chunk])
        res = receiver.load_state_dict(dict(chunk), strict=False)
        assert not res.unexpected_keys

    syncer = VLLMWeightSyncer(None, states, chunk_bytes=16 << 10, load_fn=load)
    ids = torch.tensor([[11, 12, 13, 14, 15]])
    m = syncer.sync()
    # the adapted layers as whole vLLM load units: per decoder layer q/k/v weights + biases (6), o, gate/up, down;
    # per vision block qkv, proj, fc1, fc2 with their biases (8)
    assert m["rollout/weight_sync/tensors"] == 2 * 10 + 2 * 8 == sum(map(len, received))
    assert m["rollout/weight_sync/chunks"] == len(received) > 1
    assert all("lora" not in n and "base_layer" not in n for c in received for n in c)
    for c in received:  # no unit is split over two calls
        assert not {load_unit(n) for n in c} & {load_unit(n) for o in received if o is not c for n in o}
    torch.testing.assert_close(_logits(receiver, ids), _logits(states.model, ids), rtol=0, atol=1e-5)

    # one training step, then sync again: the receiver follows
    opt = torch.optim.SGD(states.trainable_parameters(), lr=0.5)
    states.model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    syncer.sync()
    torch.testing.assert_close(_logits(receiver, ids), _logits(states.model, ids), rtol=0, atol=1e-5)

    # level-2 sleep drops the engine's weights: the next sync sends every tensor
    syncer.sleep(level=2)
    received.clear()
    with syncer.rollout(sleep_level=None) as m:
        assert m["rollout/weight_sync/tensors"] == len([n for n, _ in pristine.named_parameters()])
    assert syncer.asleep_level == 0 and syncer.engine_has_all
    assert syncer.sync()["rollout/weight_sync/tensors"] == 36
    with pytest.raises(ValueError, match="level"):
        syncer.sleep(3)
    with pytest.raises(ValueError, match="vllm.LLM or load_fn"):
        VLLMWeightSyncer(None, states)


def test_syncer_full_finetuning_sends_trainable_parameters(tiny_path):
    from mmrl.adapters import PolicyStates

    model = _load(tiny_path)
    for n, p in model.named_parameters():
        p.requires_grad_(".language_model." in n)
    states = PolicyStates(model, None)
    got: dict[str, torch.Tensor] = {}
    syncer = VLLMWeightSyncer(None, states, load_fn=lambda chunk: got.update(chunk), vllm_names=True)
    syncer.sync()
    expected = {to_vllm_name(n) for n, p in model.named_parameters() if p.requires_grad}
    assert set(got) == expected and all(k.startswith("language_model.model.") for k in got)
    got.clear()
    syncer.sync(full=True)
    assert len(got) == len(list(model.parameters()))
    # the tensors are the live parameters (no copy) when nothing is merged
    assert got["language_model.model.norm.weight"].data_ptr() == model.model.language_model.norm.weight.data_ptr()


def test_lora_on_q_and_v_only_sends_whole_qkv_and_gate_up_units(tiny_path):
    """vLLM loads q/k/v into one fused parameter (and gate/up): a layer is sent with all its tensors, so LoRA on q and
    v alone still sends k (unchanged) and the biases; untouched layers are not sent."""
    from peft import LoraConfig

    from mmrl.adapters import PolicyStates

    states = PolicyStates(_load(tiny_path), LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                       target_modules=r".*language_model.*\.(q_proj|v_proj|up_proj)"))
    _randomise_default(states, 3)
    sent = dict(iter_merged_weights(states.model, only_lora_layers=True, whole_units=True))
    for i in range(2):
        pre = f"model.language_model.layers.{i}."
        expect = {pre + f"self_attn.{m}_proj.{k}" for m in "qkv" for k in ("weight", "bias")}
        expect |= {pre + f"mlp.{m}_proj.weight" for m in ("gate", "up")}
        assert {n for n in sent if n.startswith(pre)} == expect
    assert len(sent) == 2 * 8
    merged = merged_lora_state_dict(states.model)  # the same tensors as the full merge: k is the base weight
    assert all(torch.equal(sent[n], merged[n]) for n in sent)
    # units stay together in order and are never split by a byte budget
    names = list(sent)
    units = [load_unit(n) for n in names]
    assert all(units.index(u) == i or units[i - 1] == u for i, u in enumerate(units))
    for chunk in chunk_by_bytes(iter(sent.items()), 1, unit=load_unit):
        assert len({load_unit(n) for n, _ in chunk}) == 1
    assert load_unit("model.language_model.layers.0.mlp.down_proj.weight") == "model.language_model.layers.0.mlp.down_proj"
    assert load_unit("language_model.model.layers.0.self_attn.v_proj.weight") == \
        "language_model.model.layers.0.self_attn.q_proj|k_proj|v_proj"  # vLLM-prefixed names too


def test_iter_merged_weights_errors(policy):
    states, _ = policy
    with pytest.raises(ValueError, match="no LoRA layer holds adapter"):
        list(iter_merged_weights(states.model, "nope"))
