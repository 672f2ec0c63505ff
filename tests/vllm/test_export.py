"""`mmrl export --format transformers` served by vLLM: a LoRA run of vlm_grpo on the tiny Qwen2-VL (head_dim 32)
is exported (adapter merged by peft, config, processor, tokenizer, generation config) and the export directory is
loaded by vLLM's CPU engine exactly as `vllm serve DIR` loads it. Greedy tokens equal transformers'
`from_pretrained(DIR)` (through the HF rollout engine), and vLLM's log-probs equal that model's forward."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

LOGPROB_TOL = 1e-4  # vLLM's CPU kernels vs the HF forward on the same weights (measured ~1e-6), as test_engine.py


def test_transformers_export_of_a_lora_run_is_served_by_vllm(tiny32, start_engine, vlm_requests, logprob_tools,
                                                             tmp_path):
    from mmrl.config import load_config
    from mmrl.export import export
    from mmrl.vlm import grpo
    from mmrl.vlm.common import load_policy
    from mmrl.vlm.rollout import HFRolloutEngine, SamplingParams

    run = tmp_path / "run"
    cfg = load_config({
        "algorithm": "vlm_grpo", "output_dir": str(run), "device": "cpu", "seed": 5,
        "model": {"path": str(tiny32), "lora": {"rank": 4, "alpha": 8}},
        "data": {"kind": "shapes", "template": "{question}", "colors": ["red", "green", "blue", "yellow"],
                 "shape_size": [0.5, 0.7], "eval_size": 4},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        "update": {"micro_batch_size": 4}, "algo": {"entropy_coef": 0.05},  # a gradient even if rewards tie
        "log": {"sample_every": 0, "eval_every": 0}, "train": {"max_steps": 2, "save_every": 1},
        "optim": {"lr": 5e-2},
    })
    grpo.train(cfg)
    meta = export(run, "transformers", tmp_path / "merged")
    out = tmp_path / "merged"
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()
    assert meta["source"]["mode"] == "lora"

    exported, processor = load_policy(out)  # transformers' from_pretrained on the export directory
    base, _ = load_policy(tiny32)
    trained = max(float((p - q).abs().max()) for p, q in zip(exported.state_dict().values(),
                                                             base.state_dict().values()))
    assert trained > 1e-4  # the merged adapter changed the weights: the export is not the base model

    engine = start_engine(out)
    try:
        sp = SamplingParams(temperature=0.0, max_new_tokens=8)
        got = engine.generate(vlm_requests, sp)
        ref = HFRolloutEngine(exported, processor).generate(vlm_requests, sp)
        for g, r in zip(got, ref):
            assert g.prompt_ids == r.prompt_ids and g.response_ids == r.response_ids
        sampled = engine.generate(vlm_requests, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3))
    finally:
        engine.close()
    hf_logprobs, max_diff = logprob_tools
    diff = max_diff(sampled, hf_logprobs(exported, sampled, processor.tokenizer.pad_token_id))
    print(f"[vllm export] merged LoRA export served by vLLM: greedy tokens equal transformers'; sampled log-prob "
          f"max |vLLM - HF| {diff:.1e} (weights moved {trained:.1e} from the base)")
    assert diff <= LOGPROB_TOL
