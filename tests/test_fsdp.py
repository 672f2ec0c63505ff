"""FSDP2 (`dist.strategy: fsdp`) for PolicyStates and Flow-GRPO with LoRA, on 2 real CPU processes (gloo).

* PolicyStates on a tiny SD3 transformer sharded with ``DistContext.wrap_model(.., "fsdp")`` + ``refresh()``:
  load_state_dict of full tensors, ema and copy on the shards equal the same calls in one process (exactly),
  state_dict gathers full tensors, and ``save`` from 2 ranks (rank 0 writes) loads in one process identically.
* The Flow-GRPO recipe under ``torchrun --nproc_per_node 2 ... dist.strategy=fsdp`` (EMA "old" state, KL
  reference, 2 inner epochs, 2 updates per step, ODE evaluation) gives the same adapters ("default" and the EMA
  "old"), rewards and losses as the DDP run of the same config (within 1e-6); resumed under FSDP it matches
  the resumed DDP run; a 1-process run (dist.strategy=none) resumes from the FSDP checkpoint and continues.

Run the 2-rank part by hand: ``torchrun --standalone --nproc_per_node 2 tests/test_fsdp.py OUT_DIR``.
"""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mmrl.run.consolidate import checkpoint_optimizer_state
from mmrl.testing import child_env, run_torchrun

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
DECAY = 0.7

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not in the venv")]


def build_states(full: bool = False):
    """Tiny SD3 transformer with LoRA "default"/"old" (adapters-off "ref"), or full fine-tuning with "old" and
    "ref" snapshots."""
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    from mmrl.adapters import PolicyStates

    torch.manual_seed(0)
    tr = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
                               num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                               pooled_projection_dim=32, out_channels=4, pos_embed_max_size=32).eval()
    if full:
        return PolicyStates(tr, None, old=True, keep_ref_copy=True)
    cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                     target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    return PolicyStates(tr, cfg, old=True)


def _inputs() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"hidden_states": torch.randn(2, 4, 8, 8, generator=g),
            "encoder_hidden_states": torch.randn(2, 5, 32, generator=g),
            "pooled_projections": torch.randn(2, 32, generator=g), "timestep": torch.tensor([100.0, 700.0])}


def full_mode_script(states, shard=None) -> dict:
    """Full fine-tuning states through a training-like sequence; forwards with every state. `shard(states)` wraps
    with FSDP after the snapshots exist (as the recipes do). Returns gathered states and forward outputs."""
    x = _inputs()
    if shard is not None:
        shard(states)
    res = {}
    with torch.no_grad():
        res["fwd_default0"] = states.model(**x).sample
        sd = states.state_dict()
        g = torch.Generator().manual_seed(2)  # an "optimizer step": new default weights
        new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in sd["states"]["default"].items()}
        states.load_state_dict({"mode": "full", "states": {**sd["states"], "default": new}})
        res["fwd_default1"] = states.model(**x).sample  # (the root unit was left unsharded by the forward above)
        with states.use("ref"):
            res["fwd_ref"] = states.model(**x).sample
        states.ema("default", "old", DECAY)
        with states.use("old"):
            res["fwd_old"] = states.model(**x).sample
            states.copy("default", "ref")  # "default" is not loaded here: its values come from the side store
        res["fwd_default2"] = states.model(**x).sample
    res["states"] = states.state_dict()["states"]
    return res


def _full_worker(out: str, ctx) -> None:
    def shard(states):
        ctx.wrap_model(states.model, "fsdp")
        states.refresh()

    states = build_states(full=True)
    res = full_mode_script(states, shard)
    res["sharded_snapshots"] = all(hasattr(s, "device_mesh") for s in states._store["ref"])
    states.save(Path(out) / "saved_full" if ctx.is_main else None)
    torch.save(res, Path(out) / f"full_rank{ctx.rank}.pt")


def new_default(states) -> dict:
    g = torch.Generator().manual_seed(1)
    return {k: torch.randn(v.shape, generator=g) for k, v in states.state_dict()["states"]["default"].items()}


def _worker(out: str) -> None:
    """Run under torchrun (2 ranks): every PolicyStates operation on the FSDP2-sharded model."""
    from mmrl.distributed import DistContext

    ctx = DistContext.init("gloo")
    assert ctx.world_size == 2
    states = build_states()
    init = states.state_dict()
    new = new_default(states)
    ctx.wrap_model(states.model, "fsdp")
    states.refresh()
    res = {"sharded": all(hasattr(p, "device_mesh") for p in states.trainable_parameters()),
           "local_numel": sum(p.to_local().numel() for p in states.trainable_parameters()),
           "full_numel": sum(p.numel() for p in states.trainable_parameters())}
    res["init"] = states.state_dict()  # gathered
    states.load_state_dict({"mode": "lora", "states": {"default": new, "old": init["states"]["old"]}})
    res["loaded"] = states.state_dict()
    states.ema("default", "old", DECAY)
    res["ema"] = states.state_dict()
    states.save(Path(out) / "saved" if ctx.is_main else None)  # collective; rank 0 writes
    states.copy("default", "old")
    res["copied"] = states.state_dict()
    torch.save(res, Path(out) / f"states_rank{ctx.rank}.pt")
    _full_worker(out, ctx)
    ctx.barrier()
    ctx.close()


def _exact(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert sorted(a[name]) == sorted(b[name])
        for k in a[name]:
            assert torch.equal(a[name][k], b[name][k]), (name, k)


def _env():
    return child_env()


def test_policy_states_under_fsdp(tmp_path):
    t0 = time.perf_counter()
    proc = run_torchrun([__file__, str(tmp_path)], cwd=ROOT, env=_env(), timeout=120)
    assert proc.returncode == 0, f"STDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-6000:]}"
    print(f"[test_fsdp] PolicyStates 2 ranks: {time.perf_counter() - t0:.1f}s")
    res = [torch.load(tmp_path / f"states_rank{r}.pt", weights_only=False) for r in range(2)]
    for r in res:
        assert r["sharded"] and 0 < r["local_numel"] < r["full_numel"]
    assert res[0]["local_numel"] + res[1]["local_numel"] == res[0]["full_numel"]

    # the same operations in one process
    ref = build_states()
    init = ref.state_dict()
    ref.load_state_dict({"mode": "lora", "states": {"default": new_default(ref), "old": init["states"]["old"]}})
    loaded = ref.state_dict()
    ref.ema("default", "old", DECAY)
    ema = ref.state_dict()
    ref.copy("default", "old")
    copied = ref.state_dict()
    assert not torch.equal(ema["states"]["old"][next(iter(ema["states"]["old"]))],
                           loaded["states"]["old"][next(iter(loaded["states"]["old"]))])  # ema changed something
    for r in res:  # gathered on every rank, equal to one process exactly
        _exact(r["init"]["states"], init["states"])
        _exact(r["loaded"]["states"], loaded["states"])
        _exact(r["ema"]["states"], ema["states"])
        _exact(r["copied"]["states"], copied["states"])

    # written by rank 0 from the shards, loaded in one process
    fresh = build_states()
    fresh.load(tmp_path / "saved")
    _exact(fresh.state_dict()["states"], ema["states"])
    # peft's own loader reads the same file
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    other = build_states()
    set_peft_model_state_dict(other.model, load_file(str(tmp_path / "saved" / "old" / "adapter_model.safetensors")),
                              adapter_name="default")
    sd = get_peft_model_state_dict(other.model, adapter_name="default")
    for k, v in ema["states"]["old"].items():
        assert torch.equal(sd[k], v), k

    # full fine-tuning with "old"/"ref" snapshots: sharded like the parameters, switches reach the forward
    one = full_mode_script(build_states(full=True))
    assert not torch.allclose(one["fwd_default1"], one["fwd_ref"])  # the states really differ
    assert torch.equal(one["fwd_default0"], one["fwd_ref"]) and torch.equal(one["fwd_default1"], one["fwd_default2"])
    for r in range(2):
        full = torch.load(tmp_path / f"full_rank{r}.pt", weights_only=False)
        assert full["sharded_snapshots"]
        for key in ("fwd_default0", "fwd_default1", "fwd_ref", "fwd_old", "fwd_default2"):
            torch.testing.assert_close(full[key], one[key], atol=1e-6, rtol=0, msg=f"rank {r} {key}")
        _exact(full["states"], one["states"])
    reloaded = build_states(full=True)
    reloaded.load(tmp_path / "saved_full")
    _exact(reloaded.state_dict()["states"], one["states"])


# ---------------------------------------------------------------------------------------------- the recipe

OVERRIDES = ["rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.num_steps=4", "rollout.eval_num_steps=2",
             "log.eval_every=2", "log.eval_max_prompts=2", "log.sample_every=0", "algo.ema=true",
             "update.micro_batch_size=3", "update.mini_batch_size=4", "update.epochs=2", "train.save_every=2"]


def _train(out: Path, strategy: str, max_steps: int, nproc: int = 2) -> float:
    args = ["-m", "mmrl.cli", "train", "configs/diffusion/flow_grpo_tiny.yaml", f"output_dir={out}",
            f"dist.strategy={strategy}", f"train.max_steps={max_steps}", *OVERRIDES]
    t0 = time.perf_counter()
    proc = (run_torchrun(args, nproc, cwd=ROOT, env=_env(), timeout=180) if nproc > 1 else
            subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180))
    assert proc.returncode == 0, \
        f"{strategy} x{nproc} failed:\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-6000:]}"
    return time.perf_counter() - t0


def _adapters(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return {name: load_file(str(ckpt / "adapters" / name / "adapter_model.safetensors")) for name in ("default", "old")}


def _metrics(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((x[k] - y[k]).abs().max().item() for name in a for x, y in [(a[name], b[name])] for k in x)


def test_flow_grpo_fsdp_equals_ddp_and_resumes(tmp_path):
    fsdp, ddp = tmp_path / "fsdp", tmp_path / "ddp"
    walls = {"fsdp": _train(fsdp, "fsdp", 2), "ddp": _train(ddp, "ddp", 2)}
    ck_f, ck_d = fsdp / "checkpoints" / "step_2", ddp / "checkpoints" / "step_2"
    assert (ck_f / "COMPLETE").is_file()
    a_f, a_d = _adapters(ck_f), _adapters(ck_d)
    print(f"[test_fsdp] step 2 adapters max |fsdp - ddp| {_max_diff(a_f, a_d):.2e}")
    assert _max_diff(a_f, a_d) < 1e-6
    assert any(not torch.equal(a_f["default"][k], a_f["old"][k]) for k in a_f["default"])  # EMA lags the policy
    m_f, m_d = _metrics(fsdp), _metrics(ddp)
    assert [m["step"] for m in m_f] == [1, 2]
    for mf, md in zip(m_f, m_d):
        for key in ("reward/mean", "policy/loss", "kl/ref", "policy/grad_norm"):
            assert abs(mf[key] - md[key]) <= 1e-6 * max(1.0, abs(md[key])), (key, mf[key], md[key])
        assert mf["train/updates"] == 4
        # FSDP re-runs the reference forwards of inner epoch 2 (no cache: equal forwards on every rank)
        assert mf["cost/transformer_evals"] > md["cost/transformer_evals"]
    assert abs(m_f[1]["eval/reward/mean"] - m_d[1]["eval/reward/mean"]) < 1e-6
    opt_f = checkpoint_optimizer_state(ck_f)  # FSDP: sharded by default (dist.checkpoint: auto), read whole
    opt_d = checkpoint_optimizer_state(ck_d)
    assert sorted(opt_f["state"]) == sorted(opt_d["state"])
    for i, st in opt_f["state"].items():  # full (gathered) optimizer tensors, as DDP / one process writes them
        assert type(st["exp_avg"]) is torch.Tensor and st["exp_avg"].shape == opt_d["state"][i]["exp_avg"].shape
        assert (st["exp_avg"] - opt_d["state"][i]["exp_avg"]).abs().max() < 1e-6

    # resume under FSDP (full checkpoint -> shards, optimizer state too) == resume under DDP
    fsdp2 = tmp_path / "fsdp_resumed"
    shutil.copytree(fsdp, fsdp2)
    walls["fsdp_resume"] = _train(fsdp2, "fsdp", 3)
    walls["ddp_resume"] = _train(ddp, "ddp", 3)
    d3 = _max_diff(_adapters(fsdp2 / "checkpoints" / "step_3"), _adapters(ddp / "checkpoints" / "step_3"))
    print(f"[test_fsdp] step 3 (resumed) adapters max |fsdp - ddp| {d3:.2e}")
    assert d3 < 1e-6
    assert [m["step"] for m in _metrics(fsdp2)] == [1, 2, 3]

    # one process (no FSDP) resumes from the FSDP checkpoint and continues
    walls["single_resume"] = _train(fsdp, "none", 3, nproc=1)
    assert (fsdp / "checkpoints" / "step_3" / "COMPLETE").is_file()
    assert [m["step"] for m in _metrics(fsdp)] == [1, 2, 3]
    assert m_f[1] == _metrics(fsdp)[1]  # steps before the resume point untouched
    print("[test_fsdp] walls " + ", ".join(f"{k} {v:.1f}s" for k, v in walls.items()))


# ---------------------------------------------------------------------------------------------- one update

def _flow_grpo_tests():
    """tests/diffusion/test_flow_grpo.py as a module (its fixed-rollout equality helpers and scenarios)."""
    import importlib.util

    path = ROOT / "tests" / "diffusion" / "test_flow_grpo.py"
    spec = importlib.util.spec_from_file_location("_mmrl_test_flow_grpo", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _one_update_fsdp(tfg, model_path, scenario, ctx):
    """test_flow_grpo._one_update with the transformer sharded by FSDP2 (wrap, refresh, then the optimizer)."""
    from mmrl.core.prompt_stats import PerPromptStatTracker
    from mmrl.diffusion.common import build_policy_states
    from mmrl.diffusion.grpo_update import train_on_rollout
    from mmrl.diffusion.loop import TrainingParts
    from mmrl.diffusion.models import load_flow_model
    from mmrl.diffusion.sampling import Trajectory, sample_groups
    from mmrl.diffusion.scoring import global_advantages
    from mmrl.runtime import seed_everything

    P, G = tfg.P, tfg.G
    cfg = tfg._scenario_cfg(model_path, scenario)
    cfg.dist.strategy = "fsdp"
    s, t = cfg.rollout, cfg.optim
    model = load_flow_model(model_path)
    seed_everything(0)
    states = build_policy_states(model, cfg.model, old=True, ref=True)
    # the fixed rollout (before sharding: every process computes the global batch with the same noise)
    prompts_all = [x.strip() for x in open(tfg.PROMPTS).read().splitlines()[:P]]
    full = sample_groups(model, model.encode_prompts(prompts_all), G, num_steps=s.num_steps, height=s.height,
                         width=s.width, guidance_scale=s.guidance_scale, noise_level=s.noise_level,
                         timestep_fraction=s.timestep_fraction, generator=torch.Generator().manual_seed(7))
    tfg._scenario_rollout(full, scenario)
    model.transformer = ctx.wrap_model(states.model, "fsdp")
    states.refresh()
    params = states.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    k = P // ctx.world_size
    pi = torch.arange(ctx.rank * k, (ctx.rank + 1) * k)
    rows = torch.arange(ctx.rank * k * G, (ctx.rank + 1) * k * G)
    traj = Trajectory(latents=full.latents[rows], log_probs=full.log_probs[rows], sigmas=full.sigmas,
                      sde_mask=full.sde_mask, train_steps=full.train_steps,
                      prompt_index=full.prompt_index[rows] - ctx.rank * k, embeds=full.embeds.select(pi))
    scores = torch.tensor(tfg.SCENARIOS[scenario]).flatten()[rows]
    prompts = [prompts_all[i] for i in full.prompt_index[rows].tolist()]
    tracker = PerPromptStatTracker("group", history=4)
    adv, keep, adv_metrics = global_advantages(ctx, tracker, prompts, scores, cfg.algo.adv_clip_max, True)
    torch.manual_seed(100 + ctx.rank)
    out = train_on_rollout(TrainingParts(cfg, ctx, model, states, opt, sched, params), 0, traj, adv, keep)
    sd = states.state_dict()["states"]  # gathered
    return {"default": sd["default"], "n_keep": len(keep), "metrics": {**out, **adv_metrics}}


def _update_worker(model_path: str, out: str) -> None:
    from mmrl.distributed import DistContext

    ctx = DistContext.init("gloo")
    tfg = _flow_grpo_tests()
    res = {}
    for name in tfg.SCENARIOS:
        res[name] = _one_update_fsdp(tfg, model_path, name, ctx)
        gc.collect()  # free the scenario's sharded model on every rank before the next one is wrapped
        ctx.barrier()
    torch.save(res, Path(out) / f"update_rank{ctx.rank}.pt")
    ctx.barrier()
    ctx.close()


def test_one_update_under_fsdp_equals_one_process(tmp_path):
    """Fixed rollout batch, per-prompt rewards where zero-advantage groups are dropped: ranks keep 5 + 3 rows
    ("uneven") and 5 + 0 ("idle": rank 1 runs only zero-weight padding micro-steps, forwards included);
    "uneven_mis" / "idle_mis": recomputed pi_old (no-grad forwards of the kept rows, padded to equal counts under
    FSDP: the idle rank runs them on padding rows) with step-level MIS masks."""
    from mmrl.distributed import DistContext
    from mmrl.tiny import build_tiny_sd3

    model_path = build_tiny_sd3(tmp_path / "pipe")
    t0 = time.perf_counter()
    proc = run_torchrun([__file__, "update", str(model_path), str(tmp_path)], cwd=ROOT, env=_env(), timeout=180)
    assert proc.returncode == 0, f"STDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-6000:]}"
    wall = time.perf_counter() - t0
    ranks = [torch.load(tmp_path / f"update_rank{r}.pt", weights_only=False) for r in range(2)]
    tfg = _flow_grpo_tests()
    initial = tfg._initial_params(model_path)
    for name in tfg.SCENARIOS:
        torch.manual_seed(100)
        one = tfg._one_update(model_path, name, DistContext())
        r0, r1 = ranks[0][name], ranks[1][name]
        assert (r0["n_keep"], r1["n_keep"]) == ((5, 3) if name.startswith("uneven") else (5, 0))
        assert r0["metrics"]["train/updates"] == 1
        if name.endswith("_mis"):  # recomputed pi_old under FSDP; 3 of rank 0's 10 kept (sample, step) pairs masked
            assert r0["metrics"]["rollout/correction/rollout_rs_masked_fraction"] == pytest.approx(3 / 10)
        # one["params"] is keyed by parameter name ('...lora_A.default.weight'), the gathered state by peft key
        by_name = one["params"]
        assert max((by_name[k] - p0).abs().max().item() for k, p0 in initial.items()) > 1e-4  # a real update
        keys = sorted(r0["default"])
        assert len(keys) == len(by_name)
        for r in (r0, r1):
            diff = max((r["default"][k] - by_name[_param_name(k)]).abs().max().item() for k in keys)
            print(f"[test_fsdp] [{name}] max |LoRA diff| FSDP 2 ranks vs 1 process {diff:.2e} ({wall:.1f}s)")
            assert diff < 1e-6


def _param_name(key: str) -> str:
    """peft state key '<module>.lora_A.weight' -> parameter name '<module>.lora_A.default.weight'."""
    mod, layer, leaf = key.rsplit(".", 2)
    return f"{mod}.{layer}.default.{leaf}"


if __name__ == "__main__":
    from mmrl.distributed import exit_launched_process

    if sys.argv[1] == "update":
        _update_worker(sys.argv[2], sys.argv[3])
    else:
        _worker(sys.argv[1])
    exit_launched_process(0)
