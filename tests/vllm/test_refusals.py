"""Bad input around vLLM gets one clear line (head size vLLM's CPU attention does not take, a vLLM build that finds
no device, a torchvision that does not import, temperatures vLLM refuses, a multiprocess engine without mmrl's
worker extension), and the multiprocess engine (vLLM's default) works: weights synced through the worker extension
give the policy's log-probs. The environment failures are reproduced in child processes: a build without a device
by removing vLLM's CPU platform plugin before it is resolved, a broken torchvision by blocking its import."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]


def _child(code: str, *args: str, timeout: int = 900, **env: str) -> subprocess.CompletedProcess:
    from mmrl.testing import child_env

    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=child_env(VLLM_CPU_KVCACHE_SPACE="1",
                                                                  VLLM_CPU_OMP_THREADS_BIND="nobind", **env))


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("mmrl: error: ")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def _train_argv(tmp_path, model_path, *overrides):
    return ["train", str(ROOT / "configs/vlm/grpo_tiny_shapes.yaml"), f"output_dir={tmp_path / 'run'}",
            f"model.path={model_path}", "rollout.engine=vllm", "train.max_steps=1", *overrides]


def test_unsupported_head_size_is_refused_before_the_engine_starts(tmp_path, capsys, monkeypatch):
    """The default tiny Qwen2-VL has head_dim 16: vLLM's CPU attention would kill the engine at its first generate."""
    from mmrl import cli
    from mmrl.tiny import build_tiny_qwen2_vl

    import vllm

    started = []
    monkeypatch.setattr(vllm, "LLM", lambda *a, **k: started.append(1))  # must never be reached
    path = build_tiny_qwen2_vl(tmp_path / "h16", seed=0)
    assert cli.main(_train_argv(tmp_path, path)) == 2
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if ln.startswith("mmrl: error: ")]
    assert len(line) == 1 and "Traceback" not in err, err
    assert f"model.path={path}: the text decoder's head size is 16 (hidden_size 64 / 4 heads)" in line[0]
    assert "32, 64, 80" in line[0] and "--head-dim 64" in line[0]
    assert not started


def test_a_glm4v_config_without_attention_bias_is_refused_before_the_engine_starts(tmp_path, capsys, monkeypatch,
                                                                                   family32):
    """transformers' GLM-4.1V has q/k/v biases whatever the config says; vLLM's Glm4 builds them only with
    text_config.attention_bias (the tiny checkpoint without it: a synced bias moved log-probs by 0.33 in vLLM)."""
    import json
    import shutil

    from mmrl import cli

    import vllm

    started = []
    monkeypatch.setattr(vllm, "LLM", lambda *a, **k: started.append(1))  # must never be reached
    path = tmp_path / "glm"
    shutil.copytree(family32("glm4v"), path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["text_config"]["attention_bias"]
    (path / "config.json").write_text(json.dumps(cfg))
    assert cli.main(_train_argv(tmp_path, path)) == 2
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if ln.startswith("mmrl: error: ")]
    assert len(line) == 1 and "Traceback" not in err, err
    assert f"model.path={path}: config.json's text_config lacks \"attention_bias\": true" in line[0]
    assert not started


def test_temperature_above_two_is_refused_before_any_model_loads(tmp_path, capsys, tiny32):
    from mmrl import cli

    assert cli.main(_train_argv(tmp_path, tiny32, "rollout.temperature=3")) == 2
    err = capsys.readouterr().err
    assert "mmrl: error: rollout.temperature: vLLM samples at temperatures 0..2, got 3.0" in err
    assert not (tmp_path / "run").exists()


def test_a_vllm_that_finds_no_device_is_one_line(tmp_path, tiny32):
    """What the CUDA build of vLLM does on a machine without a GPU: no platform resolves."""
    code = """
        import sys
        import vllm.platforms as platforms
        platforms.builtin_platform_plugins["cpu"] = lambda: None  # as if this were not vLLM's CPU build
        from mmrl import cli
        sys.exit(cli.main(sys.argv[1:]))
    """
    line = _one_line(_child(code, *_train_argv(tmp_path, tiny32), timeout=300))
    assert "rollout.engine=vllm: the installed vLLM 0.32.0 finds no device it was built for" in line
    assert not (tmp_path / "run").exists()  # refused with the config, before the run directory exists


def test_a_torchvision_that_does_not_import_is_one_line(tmp_path, tiny32):
    """The registry's torchvision beside a +cpu torch fails at import ("operator torchvision::nms does not exist");
    vLLM's Qwen2-VL cannot load without it."""
    code = """
        import sys
        sys.modules["torchvision"] = None  # import torchvision now raises ImportError
        from mmrl import cli
        sys.exit(cli.main(sys.argv[1:]))
    """
    line = _one_line(_child(code, *_train_argv(tmp_path, tiny32), timeout=300))
    assert "rollout.engine=vllm: vLLM's Qwen-VL models need torchvision, which fails to import here" in line


def test_a_multiprocess_engine_without_the_worker_extension_is_refused(tiny32):
    from types import SimpleNamespace

    from mmrl.vlm.vllm_sync import vllm_weight_loader

    cfg = SimpleNamespace(parallel_config=SimpleNamespace(worker_extension_cls=""))
    engine = SimpleNamespace(model_executor=None, vllm_config=cfg)  # what a multiprocess LLM shows the trainer
    llm = SimpleNamespace(llm_engine=engine, collective_rpc=lambda *a, **k: None)
    with pytest.raises(ValueError, match=r"multiprocess vLLM engine needs LLM\(worker_extension_cls='mmrl.vlm"):
        vllm_weight_loader(llm)


MULTIPROCESS = """
import json, sys
import torch
from peft import LoraConfig
from mmrl.adapters import PolicyStates
from mmrl.vlm.batch import RolloutBatch
from mmrl.vlm.common import load_policy, messages_from_text
from mmrl.vlm.rollout import GenRequest, SamplingParams
from mmrl.vlm.vllm_engine import VLLMRolloutEngine
from mmrl.vlm.vllm_sync import VLLMWeightSyncer

if __name__ == "__main__":  # vLLM's engine process is spawned: this module is imported again there
    path = sys.argv[1]
    model, proc = load_policy(path)
    engine = VLLMRolloutEngine(path, proc, dtype="float32", enforce_eager=True, max_model_len=512, seed=0)
    assert getattr(engine.llm.llm_engine, "model_executor", None) is None  # the engine core is another process
    states = PolicyStates(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                            target_modules=r".*language_model.*\\.(q_proj|v_proj)"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in states.trainable_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    reqs = [GenRequest(messages=messages_from_text("Name a colour."))]
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=1)
    base = engine.generate(reqs, sp)
    m = VLLMWeightSyncer(engine.llm, states).sync()
    res = engine.generate(reqs, sp)
    b = RolloutBatch.build(model, [r.prompt_ids for r in res], [r.response_ids for r in res], [r.mm for r in res],
                           proc.tokenizer.pad_token_id)
    lp = b.logprobs(model, 8, 1.0)
    diff = max(abs(a - float(lp[i, j])) for i, r in enumerate(res) for j, a in enumerate(r.response_logprobs))
    print("RESULT " + json.dumps({"diff": diff, "tensors": m["rollout/weight_sync/tensors"],
                                  "changed": [r.response_logprobs for r in base] != [r.response_logprobs for r in res]}))
    engine.close()
"""


def test_the_multiprocess_engine_syncs_through_the_worker_extension(tiny32, tmp_path):
    script = tmp_path / "multiprocess_sync.py"
    script.write_text(MULTIPROCESS)
    from mmrl.testing import child_env

    proc = subprocess.run([sys.executable, str(script), str(tiny32)], capture_output=True, text=True, timeout=900,
                          cwd=ROOT, env=child_env(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_KVCACHE_SPACE="1",
                                                  VLLM_CPU_OMP_THREADS_BIND="nobind"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    print(f"[vllm multiprocess] LoRA q/v synced through files: {res['tensors']} tensors, log-prob max |diff| "
          f"{res['diff']:.1e}")
    assert res["tensors"] == 12 and res["changed"] and res["diff"] <= 1e-4
