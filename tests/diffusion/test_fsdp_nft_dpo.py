"""FSDP2 (`dist.strategy: fsdp`, LoRA and full fine-tuning) for DiffusionNFT and online Diffusion-DPO on 2 real CPU processes (gloo).

For each recipe: ``torchrun --nproc_per_node 2 -m mmrl.cli train <tiny config> model.lora.rank=32 ...`` for 2 steps
under ``dist.strategy=fsdp`` gives the same adapters (and AdamW moments, rewards, losses) as the same run under
``dist.strategy=ddp`` (within 1e-6); the run covers padding micro-steps (micro-batch 3 does not divide the
rows), the NFT "old" EMA and the reference passes, evaluation on every rank and the collective save. A
1-process run (``dist.strategy=none``) then resumes from the FSDP checkpoint and continues. NFT with full
fine-tuning (full-weight "old"/"ref" snapshots sharded by FSDP) equals DDP too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mmrl.run.consolidate import checkpoint_optimizer_state, checkpoint_weights
from mmrl.testing import child_env, run_torchrun

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"

pytestmark = pytest.mark.slow

COMMON = ["model.lora.rank=32", "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.num_steps=4",
          "rollout.eval_num_steps=2", "log.eval_every=2", "log.eval_max_prompts=2", "log.sample_every=0",
          "update.micro_batch_size=3", "train.save_every=2"]
RECIPES = {
    "nft": ("configs/diffusion/nft_tiny.yaml", ["default", "old"],
            ["update.mini_batch_size=4", "algo.kl.coef=0.01", "algo.ema_schedule=linear"],  # 2 updates of 4 of 8
            ("reward/mean", "policy/loss", "kl/ref", "policy/grad_norm")),
    "dpo": ("configs/diffusion/dpo_tiny_online.yaml", ["default"], ["algo.max_pairs_per_step=5"],
            ("reward/mean", "policy/loss", "policy/implicit_acc", "policy/grad_norm")),
}


def _env():
    return child_env()


def _train(recipe: str, out: Path, strategy: str, max_steps: int, nproc: int = 2, more: tuple = ()) -> float:
    config, _, extra, _ = RECIPES[recipe]
    args = ["-m", "mmrl.cli", "train", config, f"output_dir={out}", f"dist.strategy={strategy}",
            f"train.max_steps={max_steps}", *COMMON, *extra, *more]
    t0 = time.perf_counter()
    proc = (run_torchrun(args, nproc, cwd=ROOT, env=_env(), timeout=180) if nproc > 1 else
            subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180))
    assert proc.returncode == 0, \
        f"{recipe} {strategy} x{nproc} failed:\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-6000:]}"
    return time.perf_counter() - t0


def _adapters(ckpt: Path, names) -> dict:
    from safetensors.torch import load_file

    return {n: load_file(str(ckpt / "adapters" / n / "adapter_model.safetensors")) for n in names}


def _metrics(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    for n in a:
        assert sorted(a[n]) == sorted(b[n]), n
    return max((a[n][k] - b[n][k]).abs().max().item() for n in a for k in a[n])


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not in the venv")
@pytest.mark.parametrize("recipe", ["nft", "dpo"])
def test_fsdp_equals_ddp_and_resumes(recipe, tmp_path):
    names, keys = RECIPES[recipe][1], RECIPES[recipe][3]
    fsdp, ddp = tmp_path / "fsdp", tmp_path / "ddp"
    walls = {"fsdp": _train(recipe, fsdp, "fsdp", 2), "ddp": _train(recipe, ddp, "ddp", 2)}
    ck_f, ck_d = fsdp / "checkpoints" / "step_2", ddp / "checkpoints" / "step_2"
    assert (ck_f / "COMPLETE").is_file()
    a_f, a_d = _adapters(ck_f, names), _adapters(ck_d, names)
    diff = _max_diff(a_f, a_d)
    moved = max(v.abs().max().item() for v in a_f["default"].values() if v.abs().max() > 0)
    print(f"[test_fsdp_{recipe}] step 2 adapters max |fsdp - ddp| {diff:.2e} (max |param| {moved:.3g})")
    assert diff < 1e-6
    m_f, m_d = _metrics(fsdp), _metrics(ddp)
    assert [m["step"] for m in m_f] == [1, 2]
    for mf, md in zip(m_f, m_d):
        for key in keys:
            assert abs(mf[key] - md[key]) <= 1e-6 * max(1.0, abs(md[key])), (key, mf[key], md[key])
    assert abs(m_f[1]["eval/reward/mean"] - m_d[1]["eval/reward/mean"]) < 1e-6
    opt_f = checkpoint_optimizer_state(ck_f)  # FSDP: sharded by default (dist.checkpoint: auto), read whole
    opt_d = checkpoint_optimizer_state(ck_d)
    assert sorted(opt_f["state"]) == sorted(opt_d["state"]) and opt_f["state"]
    for i, st in opt_f["state"].items():  # full (gathered) AdamW tensors, as DDP writes them
        assert type(st["exp_avg"]) is torch.Tensor
        assert (st["exp_avg"] - opt_d["state"][i]["exp_avg"]).abs().max() < 1e-6
        assert (st["exp_avg_sq"] - opt_d["state"][i]["exp_avg_sq"]).abs().max() < 1e-6

    # one process (no FSDP) resumes from the FSDP checkpoint and continues
    walls["single_resume"] = _train(recipe, fsdp, "none", 3, nproc=1)
    assert (fsdp / "checkpoints" / "step_3" / "COMPLETE").is_file()
    assert [m["step"] for m in _metrics(fsdp)] == [1, 2, 3]
    assert _metrics(fsdp)[1] == m_f[1]  # steps before the resume point untouched
    assert _max_diff(_adapters(fsdp / "checkpoints" / "step_3", names), a_f) > 0  # it trained on
    print(f"[test_fsdp_{recipe}] walls " + ", ".join(f"{k} {v:.1f}s" for k, v in walls.items()))


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not in the venv")
def test_nft_full_finetuning_fsdp_equals_ddp(tmp_path):
    """model.lora.rank=0: the "old" EMA and the KL "ref" are full-weight snapshots that FSDP shards like the weights
    (PolicyStates.refresh). One step under FSDP equals the DDP run (after it, full-weight Adam turns fp-level
    gradient differences into ~1e-9 weight differences, enough to flip a JPEG-size reward: later steps are not
    compared); FSDP resumes its checkpoint, then one process resumes the FSDP run."""
    from safetensors.torch import load_file

    full = ("model.lora.rank=0", "optim.lr=1e-4", "train.save_every=1")
    fsdp, ddp = tmp_path / "fsdp", tmp_path / "ddp"
    walls = {"fsdp": _train("nft", fsdp, "fsdp", 1, more=full), "ddp": _train("nft", ddp, "ddp", 1, more=full)}
    w = {n: {s: checkpoint_weights(out / "checkpoints/step_1", s) for s in ("default", "old")}  # FSDP: sharded
         for n, out in (("fsdp", fsdp), ("ddp", ddp))}
    diff = _max_diff(w["fsdp"], w["ddp"])
    base = load_file(str(ROOT / "assets/tiny_sd3_shapes/transformer/diffusion_pytorch_model.safetensors"))
    moved = max((w["ddp"]["default"][k] - base[k]).abs().max().item() for k in w["ddp"]["default"])
    print(f"[test_fsdp_nft] full fine-tuning step 1: weights max |fsdp - ddp| {diff:.2e} (moved {moved:.3g})")
    assert moved > 1e-4 and diff < 1e-6
    mf, md = _metrics(fsdp)[0], _metrics(ddp)[0]
    for key in RECIPES["nft"][3]:
        assert abs(mf[key] - md[key]) <= 1e-6 * max(1.0, abs(md[key])), (key, mf[key], md[key])
    walls["fsdp_resume"] = _train("nft", fsdp, "fsdp", 2, more=full)
    walls["single_resume"] = _train("nft", fsdp, "none", 3, nproc=1, more=full)
    assert [m["step"] for m in _metrics(fsdp)] == [1, 2, 3] and _metrics(fsdp)[0] == mf
    print(f"[test_fsdp_nft] full fine-tuning walls " + ", ".join(f"{k} {v:.1f}s" for k, v in walls.items()))
