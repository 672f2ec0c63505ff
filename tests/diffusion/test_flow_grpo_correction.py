"""Flow-GRPO rollout correction (issue 13 item 2, diffusion side): a bf16 rollout sampler, recomputed old
log-probs (`algo.old_logprobs: recompute`) and per-step / per-trajectory TIS and MIS (`algo.rollout_correction`)."""

import math
from pathlib import Path

import pytest
import torch

from mmrl.config import load_config
from mmrl.diffusion.flow_grpo import train
from mmrl.testing import metrics_rows

REPO = Path(__file__).resolve().parents[2]
PROMPTS = str(REPO / "assets" / "prompts" / "shapes_train.txt")


def _cfg(out, model_path, **sections):
    d = {
        "algorithm": "flow_grpo", "output_dir": str(out), "seed": 3,
        "model": {"path": str(model_path), "lora": {"rank": 4, "alpha": 8}},
        "data": {"train_prompts": PROMPTS},
        "rollout": {"prompts_per_step": 2, "height": 64, "width": 64, "num_steps": 3, "group_size": 3,
                    "guidance_scale": 1.0, "timestep_fraction": 0.99},
        "train": {"max_steps": 2, "save_every": 0},
        "optim": {"lr": 1e-3},
        "update": {"micro_batch_size": 4, "mini_batch_size": 0, "max_grad_norm": 1e9},
        "algo": {"kl": {"coef": 0.0}, "ema": False},
        "reward": {"components": {"jpeg_compressibility": 1.0}},
        "log": {"sample_every": 0},
    }
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return load_config(d)


def _rollout(model, autocast=None, seed=7):
    from mmrl.diffusion.sampling import sample_groups

    emb = model.encode_prompts(["a red circle", "a blue square"])
    return sample_groups(model, emb, 3, num_steps=3, height=64, width=64, noise_level=0.7, timestep_fraction=0.99,
                         generator=torch.Generator().manual_seed(seed), decode=False, autocast_dtype=autocast)


def _step_kw():
    return dict(guidance_scale=1.0, noise_level=0.7, sde_type="sde", cfg_grad="both")


def _trainer_logp(model, traj):
    """[B, T] log-probs of the rollout's transitions under the current weights in fp32, by hand (zeros off
    the trained steps)."""
    from mmrl.diffusion.sampling import step_log_prob

    b = len(traj)
    out = torch.zeros_like(traj.log_probs)
    with torch.no_grad():
        for j in traj.train_steps.tolist():
            out[:, j] = step_log_prob(model, traj.latents[:, j], traj.latents[:, j + 1], traj.sigmas[j].expand(b),
                                      traj.sigmas[j + 1].expand(b), traj.embeds.select(traj.prompt_index),
                                      **_step_kw()).log_prob
    return out


def test_bf16_rollout_differs_from_the_trainer_and_recompute_is_the_trainer(tmp_path, tiny_sd3):
    from mmrl.diffusion.grpo_update import _old_policy
    from mmrl.runtime import Timer

    fp32, bf16 = _rollout(tiny_sd3), _rollout(tiny_sd3, torch.bfloat16)
    assert torch.equal(fp32.latents[:, 0], bf16.latents[:, 0])  # same noise, different precision
    d32 = (_trainer_logp(tiny_sd3, fp32) - fp32.log_probs)[:, :2]
    d16 = (_trainer_logp(tiny_sd3, bf16) - bf16.log_probs)[:, :2]
    assert float(d32.abs().max()) == 0.0  # same-precision rollout: the trainer reproduces it exactly
    assert 1e-6 < float(d16.abs().max()) < 1e-2  # bf16 rollout: off by more than Flow-GRPO's clip range 1e-4
    cfg = _cfg(tmp_path, "unused", algo={"old_logprobs": "recompute"})
    keep = torch.arange(len(bf16))
    old, w, valid, metrics = _old_policy(cfg, tiny_sd3, bf16, keep, bf16.train_steps.tolist(), _step_kw(), Timer())
    assert torch.allclose(old, _trainer_logp(tiny_sd3, bf16), atol=1e-6, rtol=0)  # micro-batched, same values
    assert w is None and valid is None  # no correction configured: metrics of the mismatch only
    # k1 of KL(rollout || trainer) over every (sample, trained step): mean(rollout - trainer), by hand
    assert metrics["rollout/correction/kl"] == pytest.approx(float(-d16.double().mean()), rel=1e-4, abs=1e-9)
    assert metrics["rollout/correction/k3_kl"] > 0


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_tis_weights_and_mis_mask_by_hand(tmp_path, tiny_sd3, level):
    from mmrl.diffusion.grpo_update import _old_policy
    from mmrl.runtime import Timer

    traj = _rollout(tiny_sd3, torch.bfloat16)
    steps = traj.train_steps.tolist()  # [0, 1] of 3 steps
    # make the mismatch large and known: rollout log-probs lowered by a per-(row, step) amount
    shift = torch.tensor([[0.1, 0.5], [1.9, 0.05], [0.0, 0.0], [0.3, 0.3], [1.2, -0.4], [0.2, 0.7]])
    traj.log_probs[:, steps] = _trainer_logp(tiny_sd3, traj)[:, steps] - shift
    keep = torch.tensor([0, 1, 3, 4, 5])  # row 2 is not trained (e.g. a zero-advantage group)
    cfg = _cfg(tmp_path, "unused", algo={"old_logprobs": "recompute", "rollout_correction": {
        "is_level": level, "is_threshold": 2.0, "rs_level": level, "rs_threshold": 2.5}})
    old, w, valid, metrics = _old_policy(cfg, tiny_sd3, traj, keep, steps, _step_kw(), Timer())
    assert not old[2].any()  # a row outside `keep` is never trained: its pi_old is not computed
    d = (old - traj.log_probs)[:, steps].double()  # = shift up to fp32 rounding on the kept rows
    assert torch.allclose(d[keep], shift[keep].double(), atol=1e-5)
    d[2] = shift[2].double()  # (row 2 is masked below whatever its value)
    if level == "token":
        log_w = d
    elif level == "sequence":
        log_w = d.sum(1, keepdim=True).expand_as(d)
    else:
        log_w = d.mean(1, keepdim=True).expand_as(d)
    want_w = torch.exp(log_w).clamp(max=2.0)
    want_keep = (torch.exp(log_w) <= 2.5) & (torch.exp(log_w) >= 1 / 2.5)
    want_w[2], want_keep[2] = 0.0, False  # rows outside `keep` carry no weight
    assert torch.allclose(w[:, steps].double(), want_w, atol=1e-4)
    assert torch.equal(valid[:, steps], want_keep)
    assert w[:, 2].abs().sum() == 0 and not valid[:, 2].any()  # the untrained last step
    assert 0 < int(valid.sum()) < 10  # the shifts reject some pairs at every level
    assert metrics["rollout/correction/rollout_rs_masked_fraction"] == pytest.approx(1 - float(want_keep.sum()) / 10)
    assert metrics["rollout/correction/rollout_is_max"] == pytest.approx(float(torch.exp(log_w[keep]).max()), rel=1e-4)


def _one_update(cfg, model_path, traj_fn, keep=None, adv_scale=1.0):
    """One Flow-GRPO update with SGD (gradient-proportional) on a fixed bf16 rollout; returns the LoRA deltas."""
    from mmrl.diffusion.common import build_policy_states
    from mmrl.diffusion.grpo_update import train_on_rollout
    from mmrl.diffusion.loop import TrainingParts
    from mmrl.diffusion.models import load_flow_model
    from mmrl.distributed import DistContext
    from mmrl.runtime import seed_everything

    model = load_flow_model(model_path)
    seed_everything(0)
    states = build_policy_states(model, cfg.model, old=False, ref=False)
    params = states.trainable_parameters()
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    traj = traj_fn(model)
    adv = torch.tensor([1.0, -0.5, 0.0, 0.7, -1.2, 0.4]) * adv_scale
    keep = torch.tensor([0, 1, 3, 4, 5]) if keep is None else keep
    torch.manual_seed(1)
    metrics = train_on_rollout(TrainingParts(cfg, DistContext(), model, states, opt, sched, params), 0, traj, adv, keep)
    return [p.detach() - b for p, b in zip(params, before)], metrics


def test_tis_weight_multiplies_the_update_and_mis_drops_pairs(tmp_path, tiny_sd3_path):
    """A constant importance ratio 1.5 (cap 2) must scale the SGD update by exactly 1.5; rejecting whole
    trajectories must give the update of training on the others only."""
    def shifted(by):
        def make(model):
            traj = _rollout(model, torch.bfloat16)
            steps = traj.train_steps.tolist()
            traj.log_probs[:, steps] = _trainer_logp(model, traj)[:, steps] - by[:, None]
            return traj
        return make

    plain = _cfg(tmp_path, tiny_sd3_path, algo={"old_logprobs": "recompute"})
    base, m0 = _one_update(plain, tiny_sd3_path, shifted(torch.zeros(6)))
    tis = _cfg(tmp_path, tiny_sd3_path, algo={"old_logprobs": "recompute",
                                               "rollout_correction": {"is_level": "token", "is_threshold": 2.0}})
    scaled, m1 = _one_update(tis, tiny_sd3_path, shifted(torch.full((6,), math.log(1.5))))
    assert m0["diag/logprob_drift"] < 1e-6 and m1["diag/logprob_drift"] < 1e-6  # ratio starts at 1: recomputed
    norm = sum(float(d.norm()) for d in base)
    assert norm > 0
    for d0, d1 in zip(base, scaled):
        assert torch.allclose(d1, 1.5 * d0, atol=1e-6 * norm, rtol=1e-4)
    # rows 1 and 4 get ratio e^2 > rs_threshold 3 at every step -> rejected; the rest ratio 1
    mis = _cfg(tmp_path, tiny_sd3_path, algo={"old_logprobs": "recompute",
                                               "rollout_correction": {"rs_level": "sequence", "rs_threshold": 3.0}})
    rejected, m2 = _one_update(mis, tiny_sd3_path, shifted(torch.tensor([0, 1.0, 0, 0, 1.0, 0])))
    only, _ = _one_update(plain, tiny_sd3_path, shifted(torch.zeros(6)), keep=torch.tensor([0, 3, 5]))
    for d2, d3 in zip(rejected, only):
        assert torch.allclose(d2, d3, atol=1e-6 * norm, rtol=1e-4)
    assert sum(float((d2 - d0).norm()) for d2, d0 in zip(rejected, base)) > 0.05 * norm  # rejection changed it
    assert any(k.startswith("rollout/correction/") for k in m2)


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="needs algo.old_logprobs=recompute"):
        _cfg(tmp_path, "m", algo={"rollout_correction": {"is_level": "token"}})
    with pytest.raises(ValueError, match="precision"):
        _cfg(tmp_path, "m", rollout={"precision": "fp8"})
    # the command-line path: dotted overrides of the nested section
    with pytest.raises(ValueError, match="needs algo.old_logprobs=recompute"):
        load_config({"algorithm": "flow_grpo"}, ["algo.rollout_correction.is_level=token"])
    ok = load_config({"algorithm": "flow_grpo"}, ["algo.rollout_correction.is_level=token",
                                                  "algo.old_logprobs=recompute"])
    assert ok.algo.rollout_correction.enabled and ok.algo.old_logprobs == "recompute"


def test_bf16_rollout_runs_clipped_unless_recomputed(tmp_path, tiny_sd3_path):
    """The recipe end to end: a bf16 rollout with the rollout's log-probs starts clipped (ratio != 1 before any
    update); recomputing pi_old makes the ratio start at 1; TIS logs its weights."""
    naive = train(_cfg(tmp_path / "a", tiny_sd3_path, rollout={"precision": "bf16"}))
    rows_a = metrics_rows(tmp_path / "a")
    fixed = train(_cfg(tmp_path / "b", tiny_sd3_path, rollout={"precision": "bf16"}, algo={
        "old_logprobs": "recompute", "rollout_correction": {"is_level": "sequence", "rs_level": "token",
                                                            "rs_threshold": 2.0}}))
    rows_b = metrics_rows(tmp_path / "b")
    assert min(r["diag/logprob_drift"] for r in rows_a) > 1e-6
    assert max(r["diag/logprob_drift"] for r in rows_b) < 1e-6
    assert naive["max_logprob_drift"] > 1e-6 and fixed["max_logprob_drift"] < 1e-6
    for r in rows_b:
        assert r["time/old_logprobs_s"] > 0
        ws = [k for k in r if k.startswith("rollout/correction/")]
        assert ws and all(math.isfinite(r[k]) for k in ws), r
    assert not any(k.startswith("rollout/correction/") for k in rows_a[0])


def test_bf16_recompute_and_correction_resume_exactly(tmp_path, tiny_sd3_path):
    """A bf16 rollout with recomputed pi_old and TIS/MIS: 2 steps straight equal 1 step + a resume to 2 (every metric
    but wall-clock times)."""
    from mmrl.testing import RESUMED_RUN, assert_same_path, without_time

    extra = dict(rollout={"precision": "bf16"}, algo={"old_logprobs": "recompute", "rollout_correction": {
        "is_level": "sequence", "is_threshold": 2.0, "rs_level": "token", "rs_threshold": 2.0}})
    train(_cfg(tmp_path / "full", tiny_sd3_path, **extra))
    train(_cfg(tmp_path / "split", tiny_sd3_path, train={"max_steps": 1, "save_every": 1}, **extra))
    train(_cfg(tmp_path / "split", tiny_sd3_path, train={"max_steps": 2, "save_every": 1}, **extra))
    full, split = metrics_rows(tmp_path / "full"), metrics_rows(tmp_path / "split")
    assert [r["step"] for r in split] == [1, 2] and "rollout/correction/rollout_is_mean" in split[1]
    assert_same_path([without_time(r) for r in split], [without_time(r) for r in full], why=RESUMED_RUN)
