"""VLM GRPO under FSDP2 (LoRA): `torchrun --nproc_per_node 2 -m mmrl.cli train configs/vlm/grpo_tiny_shapes.yaml
model.lora.rank=4 ... dist.strategy=fsdp` gives the same adapters, optimizer moments and metrics as the same run
with dist.strategy=ddp; a 1-process run resumes from the FSDP checkpoint (and ends where the 1-process resume of
the DDP checkpoint ends). Responses stop at a stop string, so ranks finish decoding at different steps (the
finished rank runs masked decode forwards: HFRolloutEngine.step_sync); the overlong penalty gives varied rewards;
DAPO dynamic sampling is on (uneven kept rows under FSDP are covered row-exactly by
tests/vlm/test_grpo.py::test_two_rank_policy_update_under_fsdp_equals_one_rank).
Also: the masked extra decode forwards leave the sampled results unchanged, and full fine-tuning is refused."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mmrl.pipelines.shapes_qa import ShapesQA
from mmrl.run.consolidate import checkpoint_optimizer_state, checkpoint_weights
from mmrl.testing import child_env, metrics_rows, run_torchrun
from mmrl.vlm.config import DataConfig
from mmrl.vlm.rollout_collect import check_fsdp_images, to_request

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not in the venv")]


def _args(out: Path, tiny: Path, *extra: str) -> list[str]:
    return ["train", str(ROOT / "configs/vlm/grpo_tiny_shapes.yaml"), f"output_dir={out}", f"model.path={tiny}",
            "model.lora.rank=4", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_new_tokens=6", "rollout.stop=[e]", "reward.overlong_buffer=5", "data.eval_size=4",
            "warm_start.steps=0", "log.sample_every=0", "log.eval_every=0", "update.micro_batch_size=2",
            "update.mini_batch_size=8", "algo.kl.coef=0.05", "optim.lr=1e-3", "algo.dynamic_sampling=true",
            "algo.max_gen_batches=2", *extra]


def _env() -> dict:
    return child_env()


def _torchrun(args: list[str]) -> None:
    proc = run_torchrun(["-m", "mmrl.cli", *args], cwd=ROOT, env=_env())
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _one_process(args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "mmrl.cli", *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"1-process run failed:\n{proc.stderr[-6000:]}"
    return proc


def _adapters(out: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "checkpoints" / f"step_{step}" / "adapters" / "default" / "adapter_model.safetensors"))


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)



def test_fsdp_equals_ddp_and_resumes_on_one_process(tmp_path):
    from mmrl.tiny import build_tiny_qwen2_vl

    # built once before both runs (a run that builds it draws random numbers before the LoRA initialisation)
    tiny = build_tiny_qwen2_vl(tmp_path / "tiny", seed=0)
    t0 = time.perf_counter()
    _torchrun(_args(tmp_path / "fsdp", tiny, "train.max_steps=2", "dist.strategy=fsdp"))
    t_fsdp = time.perf_counter() - t0
    _torchrun(_args(tmp_path / "ddp", tiny, "train.max_steps=2", "dist.strategy=ddp"))
    fs, dd = _adapters(tmp_path / "fsdp", 2), _adapters(tmp_path / "ddp", 2)
    diff = _max_diff(fs, dd)
    moved = max(float(v.abs().max()) for k, v in dd.items() if "lora_B" in k)  # B starts at 0
    assert moved > 1e-4 and diff < 1e-5, (moved, diff)
    s_f = checkpoint_optimizer_state(tmp_path / "fsdp/checkpoints/step_2")["state"]  # sharded by default, read whole
    s_d = checkpoint_optimizer_state(tmp_path / "ddp/checkpoints/step_2")["state"]
    assert s_f.keys() == s_d.keys() and all(not hasattr(v, "device_mesh") for st in s_f.values() for v in st.values())
    opt_diff = max(float((s_f[i][k] - s_d[i][k]).abs().max()) for i in s_f for k in ("exp_avg", "exp_avg_sq"))
    assert opt_diff < 1e-5
    rf, rd = metrics_rows(tmp_path / "fsdp"), metrics_rows(tmp_path / "ddp")
    assert [r["step"] for r in rf] == [1, 2]
    for key in ("reward/mean", "rollout/response_length/mean", "kl/ref", "policy/loss", "policy/grad_norm"):
        for a, b in zip(rf, rd):
            assert abs(a[key] - b[key]) < 1e-5, (key, a[key], b[key])
    assert any(r["rollout/response_length/mean"] < 6 for r in rf)  # stop strings: lengths differ (ranks idle in decode)
    assert "eval/accuracy" in rf[-1]
    # a plain process resumes from each checkpoint to step 3: both continue identically
    t1 = time.perf_counter()
    for name in ("fsdp", "ddp"):
        proc = _one_process(_args(tmp_path / name, tiny, "train.max_steps=3", "dist.strategy=none"))
        assert "eval accuracy before RL" not in proc.stdout  # resumed, not restarted
        assert [r["step"] for r in metrics_rows(tmp_path / name)] == [1, 2, 3]
    resumed = _max_diff(_adapters(tmp_path / "fsdp", 3), _adapters(tmp_path / "ddp", 3))
    assert resumed < 1e-5
    print(f"[test_fsdp_vlm] fsdp 2 steps {t_fsdp:.1f}s; adapters fsdp vs ddp {diff:.2e} (lora_B max {moved:.3g}), "
          f"adam moments {opt_diff:.2e}; 1-process resumes {time.perf_counter() - t1:.1f}s, step-3 diff {resumed:.2e}")


def test_idle_decode_steps_leave_results_unchanged(tmp_path):
    """A rank that is done keeps running masked decode forwards while step_sync says another rank generates:
    its results are those of the plain engine."""
    from mmrl.tiny import build_tiny_qwen2_vl
    from mmrl.vlm.common import load_policy
    from mmrl.vlm.rollout import HFRolloutEngine, SamplingParams

    model, proc = load_policy(build_tiny_qwen2_vl(tmp_path / "tiny", seed=0))
    items = ShapesQA(DataConfig(), seed=3).next(2)
    reqs = [to_request(it, proc, DataConfig(template="{question}")) for it in items]
    sp = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, stop=["e"], seed=0)
    plain = HFRolloutEngine(model, proc).generate(reqs, sp)
    calls = {"idle": 0, "active": 0}

    def others_run_longer(active: bool) -> bool:  # "another rank" generates until the last step
        calls["active" if active else "idle"] += 1
        return True

    synced = HFRolloutEngine(model, proc, step_sync=others_run_longer).generate(reqs, sp)
    assert max(len(r.response_ids) for r in plain) < 8 and calls["idle"] > 0
    assert calls["idle"] + calls["active"] == 7  # one sync per decode forward: max_new_tokens - 1
    for a, b in zip(plain, synced):
        assert a.response_ids == b.response_ids and a.response_logprobs == b.response_logprobs
        assert a.finish_reason == b.finish_reason


def test_fsdp_full_finetuning_equals_ddp(tmp_path):
    """model.lora.rank=0 (full fine-tuning; vision tower trained too, KL to the "ref" snapshot, sharded like the weights under FSDP):
    one step under FSDP equals the DDP run (later steps are not compared: full-weight Adam turns fp-level gradient
    differences into ~1e-7 weight differences, which can flip a sampled token); FSDP resumes its checkpoint, then one
    process continues."""
    from mmrl.tiny import build_tiny_qwen2_vl

    tiny = build_tiny_qwen2_vl(tmp_path / "tiny", seed=0)
    full = ["model.lora.rank=0", "optim.lr=1e-4", "train.max_steps=1"]
    t0 = time.perf_counter()
    _torchrun(_args(tmp_path / "fsdp", tiny, *full, "dist.strategy=fsdp"))
    t_fsdp = time.perf_counter() - t0
    _torchrun(_args(tmp_path / "ddp", tiny, *full, "dist.strategy=ddp"))
    rf, rd = metrics_rows(tmp_path / "fsdp"), metrics_rows(tmp_path / "ddp")
    for key in ("reward/mean", "rollout/response_length/mean", "kl/ref", "policy/loss", "policy/grad_norm"):
        for a, b in zip(rf, rd):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (key, a[key], b[key])
    w = {n: checkpoint_weights(tmp_path / n / "checkpoints/step_1") for n in ("fsdp", "ddp")}
    ref = checkpoint_weights(tmp_path / "fsdp/checkpoints/step_1", "ref")  # FSDP: sharded by default, read whole
    diff = max(float((w["fsdp"][k] - w["ddp"][k]).abs().max()) for k in w["ddp"])
    moved = max(float((w["ddp"][k] - ref[k]).abs().max()) for k in ref)
    assert moved > 1e-5 and diff < 1e-5, (moved, diff)  # Adam: fp noise on near-zero full-weight gradients
    # the tiny config trains the vision tower too (every prompt shows an image, so every rank has its gradients)
    assert any(".visual." in f".{k}" and float((w["fsdp"][k] - ref[k]).abs().max()) > 0 for k in ref)
    _torchrun(_args(tmp_path / "fsdp", tiny, "model.lora.rank=0", "optim.lr=1e-4", "train.max_steps=2",
                    "dist.strategy=fsdp"))
    _one_process(_args(tmp_path / "fsdp", tiny, "model.lora.rank=0", "optim.lr=1e-4", "train.max_steps=3",
                       "dist.strategy=none"))
    assert [r["step"] for r in metrics_rows(tmp_path / "fsdp")] == [1, 2, 3]
    print(f"[test_fsdp_vlm] full fine-tuning: fsdp 1 step {t_fsdp:.1f}s; weights |fsdp - ddp| {diff:.2e} "
          f"(moved {moved:.3g})")


def test_fsdp_trained_vision_tower_needs_images():
    """Under FSDP with model.train_vision=true the recipe checks each rollout's prompts: a text-only prompt would
    leave the vision tower without gradients on one rank (unpaired reduce-scatter)."""
    from types import SimpleNamespace

    items = ShapesQA(DataConfig(), seed=0).next(3)
    check_fsdp_images(items)  # shapes QA: an image in every prompt
    with pytest.raises(ValueError, match=r"needs an image in every prompt; 1 of 4 prompts have none \(first: index 3\)"):
        check_fsdp_images(items + [SimpleNamespace(images=[], prompt="text only")])
