"""AWM recipe (mmrl.diffusion.awm): on-policy ratio, the pre-pass for several updates, the "old" sampler, EMA
schedules, configs and errors, exact resume, metric names, reward rise, two processes."""

import glob
import math
import os
from pathlib import Path

import pytest
import torch

from mmrl.config import ConfigError, load_config
from mmrl.diffusion.awm import EMA_SCHEDULES, Config, ema_decay, train
from mmrl.testing import (RESUMED_RUN, assert_close_across_paths, assert_same_path, child_env, metrics_rows,
                          run_torchrun, without_time)

REPO = Path(__file__).resolve().parents[2]
PROMPTS = str(REPO / "assets" / "prompts" / "shapes_train.txt")
EVAL_PROMPTS = str(REPO / "assets" / "prompts" / "shapes_eval.txt")
SHAPES_MODEL = Path(os.environ.get("MMRL_SHAPES_MODEL", REPO / "assets" / "tiny_sd3_shapes"))  # data-trained tiny SD3


def _cfg(out, model_path, overrides=(), **sections) -> Config:
    d = {
        "algorithm": "awm", "output_dir": str(out), "seed": 5, "device": "cpu",
        "model": {"path": str(model_path), "lora": {"rank": 4, "alpha": 8}},
        "data": {"train_prompts": PROMPTS},
        "rollout": {"prompts_per_step": 2, "height": 64, "width": 64, "num_steps": 3, "group_size": 3,
                    "eval_num_steps": 2},
        "algo": {"num_train_timesteps": 2, "timestep_fraction": 0.9, "kl": {"coef": 0.1}},  # steps [0, 2)
        "train": {"max_steps": 2, "save_every": 0},
        "optim": {"lr": 1e-3},
        "update": {"micro_batch_size": 4, "mini_batch_size": 0},
        "reward": {"components": {"jpeg_compressibility": 1.0}},
        "log": {"sample_every": 0},
    }
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return load_config(d, list(overrides))


def test_ema_schedules_by_hand():
    # awm_linear (train_sd3_awm.py kl_ema_decay_type linear, kl_ema_decay 0.3): min(0.001 n, 0.3)
    assert ema_decay("awm_linear", 0) == 0.0
    assert ema_decay("awm_linear", 100) == pytest.approx(0.1, abs=1e-15)
    assert ema_decay("awm_linear", 300) == pytest.approx(0.3) and ema_decay("awm_linear", 10_000) == 0.3
    assert ema_decay("linear", 1000) == 0.5 and ema_decay("copy", 7) == 0.0  # DiffusionNFT's, shared
    assert sorted(EMA_SCHEDULES) == ["awm_linear", "copy", "delayed_linear", "linear"]
    with pytest.raises(ValueError, match="valid"):
        ema_decay("cosine", 3)


# ---------------------------------------------------------------------------------------- one step


def test_first_step_on_policy(tmp_path, tiny_sd3_path):
    """One update per step, rollout by "default": r = 1 exactly (no clipping), "old" == "default" before the update."""
    train(_cfg(tmp_path / "run", tiny_sd3_path, ["train.max_steps=1"]))
    row = metrics_rows(tmp_path / "run")[0]
    assert row["policy/ratio_max"] == 1.0 and row["policy/clipfrac"] == 0.0 and row["policy/approx_kl"] == 0.0
    # LoRA B = 0 at init: default == old == ref; v (autograd forward) vs v_old / v_ref (no-grad forwards): two
    # forwards, equal up to float32 rounding (a wrong state would give ~1)
    assert row["kl/old"] < 1e-12 and row["kl/ref"] < 1e-12
    assert row["train/updates"] == 1 and row["policy/old_decay"] == pytest.approx(0.001)
    # 6 images x 3 ODE steps (rollout) + 6 images x K=2 points x 3 passes (policy, old, ref)
    assert row["cost/transformer_evals"] == 6 * 3 + 6 * 2 * 3
    assert "diag/logprob_drift" not in row  # no pre-pass: log p_rollout is the detached current log p
    for key in ("reward/mean", "policy/loss", "policy/pg_loss", "policy/matching_loss", "policy/grad_norm"):
        assert math.isfinite(row[key]), key


def test_several_updates_use_a_pre_pass(tmp_path, tiny_sd3_path):
    """Two updates per step: log p_rollout comes from a no-grad pass before the first update; it agrees with the
    training pass (drift ~0) and the second update sees r != 1."""
    train(_cfg(tmp_path / "run", tiny_sd3_path, ["train.max_steps=1", "update.mini_batch_size=3",
                                                  "algo.kl.coef=0", "algo.old_kl_coef=0", "algo.clip_range=1e-6"]))
    row = metrics_rows(tmp_path / "run")[0]
    assert row["train/updates"] == 2
    assert row["diag/logprob_drift"] < 1e-6
    assert row["policy/ratio_max"] != 1.0 and row["policy/clipfrac"] > 0  # the second update is off the rollout policy
    assert row["cost/transformer_evals"] == 6 * 3 + 6 * 2 * 2  # rollout + pre-pass + policy (no old, no ref)


def test_rollout_from_old(tmp_path, tiny_sd3_path):
    """rollout_state old: "old" samples and gives log p_rollout (its pass runs even with old_kl_coef 0)."""
    train(_cfg(tmp_path / "run", tiny_sd3_path, ["train.max_steps=2", "algo.rollout_state=old", "algo.old_kl_coef=0",
                                                  "algo.kl.coef=0", "algo.ema_schedule=linear"]))
    rows = metrics_rows(tmp_path / "run")
    assert [r["cost/transformer_evals"] for r in rows] == [18 + 24, 2 * (18 + 24)]  # rollout + (policy, old)
    # step 1: old == default; log p_rollout from the no-grad "old" forward, log p from the autograd one
    assert_close_across_paths(rows[0]["policy/ratio_max"], 1.0, what="two forwards of equal weights")
    assert rows[1]["policy/approx_kl"] > 0  # step 2: old = 0.001 old0 + 0.999 new != default after step 1
    assert "kl/old" not in rows[0]


def test_old_follows_the_schedule(tmp_path, tiny_sd3_path):
    from safetensors.torch import load_file

    train(_cfg(tmp_path / "lin", tiny_sd3_path, ["train.max_steps=1", "train.save_every=1"]))
    ad = tmp_path / "lin/checkpoints/step_1/adapters"
    d, o = (load_file(str(ad / s / "adapter_model.safetensors")) for s in ("default", "old"))
    # lora_B starts at 0 in both states, so old_B = 0.999 * default_B after one update (awm_linear: decay 0.001)
    assert any(not torch.equal(d[k], torch.zeros_like(d[k])) for k in d if "lora_B" in k)  # it did train
    for k in d:
        if "lora_B" in k:
            assert torch.allclose(o[k], 0.999 * d[k], atol=1e-7, rtol=1e-6)


# ---------------------------------------------------------------------------------------- configs, errors


@pytest.mark.parametrize("path", sorted(glob.glob(str(REPO / "configs" / "diffusion" / "awm_*.yaml"))))
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.algorithm == "awm" and cfg.rollout.group_size >= 2
    ema_decay(cfg.algo.ema_schedule, 0)


def test_defaults_are_the_published_setting():
    """scxue/advantage_weighted_matching config/dgx_awm.py (SD3.5-M, PickScore) + base_awm.py."""
    a, c = Config().algo, Config()
    assert (a.num_train_timesteps, a.timestep_fraction, a.weighting, a.ghuber_power) == (6, 0.9, "ghuber", 0.25)
    assert (a.clip_range, a.adv_clip_max, a.advantage_max, a.old_kl_coef, a.kl.coef) == (1.0, 5.0, 1.0, 1.0, 1e-4)
    assert (a.rollout_state, a.ema_schedule, c.reward.std_mode, c.reward.drop_zero_advantage) == \
        ("default", "awm_linear", "global", False)
    assert (c.optim.lr, c.optim.weight_decay, c.rollout.guidance_scale) == (3e-4, 1e-4, 1.0)
    assert c.update.mini_batch_size == 0  # one optimizer update per step


def test_partial_sections_keep_the_recipe_defaults(tmp_path, tiny_sd3_path):
    """A YAML that sets one key of `optim` / `algo.kl` keeps AWM's other defaults (weight decay 1e-4, KL 1e-4)."""
    cfg = _cfg(tmp_path, tiny_sd3_path, algo={"kl": {"estimator": "k1"}})
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.algo.kl.coef) == (1e-3, 1e-4, 1e-4)


def test_bad_config_errors(tmp_path, tiny_sd3_path):
    with pytest.raises(ValueError, match="leaves no step"):
        train(_cfg(tmp_path / "a", tiny_sd3_path, ["algo.timestep_fraction=0.3"]))  # int(3 * 0.3) = 0
    with pytest.raises(ValueError, match="leaves no step"):
        train(_cfg(tmp_path / "b", tiny_sd3_path, ["algo.timestep_fraction=0.4", "algo.skip_first_step=true"]))
    with pytest.raises(ValueError, match="mini_batch_size=4 must divide"):
        train(_cfg(tmp_path / "c", tiny_sd3_path, ["update.mini_batch_size=4"]))
    for override, match in [("algo.weighting=cosine", "weighting"), ("algo.ema_schedule=cosine", "ema_schedule"),
                            ("algo.rollout_state=ref", "rollout_state"), ("algo.ghuber_power=0", "ghuber_power"),
                            ("algo.num_train_timesteps=0", "num_train_timesteps"),
                            ("algo.timestep_fraction=1.5", "timestep_fraction"), ("algo.clip_range=-1", "clip_range"),
                            ("rollout.group_size=1", "group_size"), ("algo.adv_clip_max=0", "adv_clip_max")]:
        with pytest.raises(ValueError, match=match):
            _cfg(tmp_path / "d", tiny_sd3_path, [override])
    with pytest.raises(ConfigError, match="unknown config key 'sample.group_size'"):
        _cfg(tmp_path / "e", tiny_sd3_path, ["sample.group_size=4"])
    with pytest.raises(ConfigError, match="unknown config key 'algo.beta'"):
        _cfg(tmp_path / "f", tiny_sd3_path, ["algo.beta=0.1"])


def test_metric_names(tmp_path, tiny_sd3_path, check_metric_names):
    out = tmp_path / "run"
    train(_cfg(out, tiny_sd3_path, ["train.max_steps=1", f"data.eval_prompts={EVAL_PROMPTS}", "log.eval_every=1",
                                    "log.eval_max_prompts=2", "update.mini_batch_size=3"]))
    keys = check_metric_names(metrics_rows(out))
    for key in ("policy/loss", "policy/old_decay", "kl/ref", "kl/old", "eval/reward/mean", "train/updates",
                "diag/logprob_drift", "cost/transformer_evals", "time/step_s"):
        assert key in keys, key


def test_nan_reward_drop_sample_and_nan_loss_skipped(tmp_path, tiny_sd3_path, monkeypatch):
    """`_test_nan_at_1` (conftest): image 1 of each batch has a NaN reward; drop_sample trains without it. A NaN loss
    (every update) is skipped: the weights stay bit-identical and the "old" EMA is not applied."""
    import mmrl.diffusion.awm as awm_mod
    import mmrl.training as spine

    train(_cfg(tmp_path / "drop", tiny_sd3_path, ["reward.on_nonfinite=drop_sample", "train.max_steps=1"],
               reward={"components": {"_test_nan_at_1": 1.0}}))
    (row,) = metrics_rows(tmp_path / "drop")
    assert row["reward/nonfinite_samples"] == 1 and math.isfinite(row["reward/mean"]) and row["train/updates"] == 1
    assert math.isfinite(row["policy/loss"]) and row["train/kept_fraction"] == pytest.approx(5 / 6)

    real_loss, real_make, seen = awm_mod.awm_policy_loss, spine.build_optimizer, {}

    def nan_loss(*args, **kwargs):
        loss, m = real_loss(*args, **kwargs)
        return loss * float("nan"), m

    def spy(params, optim, **kw):  # the trainable tensors and their values before any update
        seen["params"], seen["init"] = list(params), [p.detach().clone() for p in params]
        return real_make(seen["params"], optim, **kw)

    monkeypatch.setattr(awm_mod, "awm_policy_loss", nan_loss)
    monkeypatch.setattr(spine, "build_optimizer", spy)
    train(_cfg(tmp_path / "nan", tiny_sd3_path, ["train.max_steps=1", "update.mini_batch_size=3"]))
    assert all(torch.equal(p.detach(), v) for p, v in zip(seen["params"], seen["init"]))
    (row,) = metrics_rows(tmp_path / "nan")
    assert row["train/skipped_updates"] == 2 and row["train/updates"] == 0 and row["policy/loss"] is None


# ---------------------------------------------------------------------------------------- resume


def test_resume_equals_uninterrupted_run(tmp_path, tiny_sd3_path):
    extra = ["train.save_every=2", "update.mini_batch_size=3"]  # 2 updates per step: pre-pass and r != 1 too
    train(_cfg(tmp_path / "full", tiny_sd3_path, ["train.max_steps=4", *extra]))
    train(_cfg(tmp_path / "half", tiny_sd3_path, ["train.max_steps=2", *extra]))
    train(_cfg(tmp_path / "half", tiny_sd3_path, ["train.max_steps=4", *extra]))
    a, b = metrics_rows(tmp_path / "full"), metrics_rows(tmp_path / "half")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert_same_path([without_time(r) for r in a], [without_time(r) for r in b], why=RESUMED_RUN)
    from safetensors.torch import load_file

    for state in ("default", "old"):
        fa = load_file(str(tmp_path / "full/checkpoints/step_4/adapters" / state / "adapter_model.safetensors"))
        fb = load_file(str(tmp_path / "half/checkpoints/step_4/adapters" / state / "adapter_model.safetensors"))
        assert_same_path(fa, fb, why=RESUMED_RUN)


# ---------------------------------------------------------------------------------------- reward rises


@pytest.mark.slow
def test_awm_tiny_raises_reward(tmp_path):
    if not (SHAPES_MODEL / "model_index.json").is_file():
        pytest.skip("assets/tiny_sd3_shapes not built")
    torch.set_num_threads(1)
    cfg = load_config(REPO / "configs" / "diffusion" / "awm_tiny.yaml",
                      [f"output_dir={tmp_path / 'run'}", f"model.path={SHAPES_MODEL}", f"data.train_prompts={PROMPTS}",
                       "data.eval_prompts=", "train.max_steps=25", "log.sample_every=0", "train.resume=never"])
    summary = train(cfg)
    print("awm_tiny first-5 vs last-5 mean reward:", summary["reward_first5"], summary["reward_last5"])
    # measured: -1.538 -> -1.217 = +0.94 first-steps std (60 steps: -1.018)
    assert summary["reward_last5"] > summary["reward_first5"] + 0.5 * summary["reward_first_std"]


# ---------------------------------------------------------------------------------------- several processes


@pytest.mark.slow
def test_torchrun_cli_two_processes_then_resume_with_one(tmp_path):
    import subprocess
    import sys

    if not (SHAPES_MODEL / "model_index.json").is_file():
        pytest.skip("assets/tiny_sd3_shapes not built")
    out = tmp_path / "ddp"
    args = ["configs/diffusion/awm_tiny.yaml", f"output_dir={out}", f"model.path={SHAPES_MODEL}",
            "train.save_every=1", "rollout.prompts_per_step=2", "rollout.group_size=3", "rollout.num_steps=4",
            "update.micro_batch_size=2", "update.mini_batch_size=3", "algo.num_train_timesteps=2",
            "algo.rollout_state=default",  # on-policy with 2 updates per step: the pre-pass runs on every rank
            "log.sample_every=1", "log.eval_every=0", "dist.backend=gloo"]
    env = child_env()
    two = run_torchrun(["-m", "mmrl.cli", "train", *args, "train.max_steps=2", "dist.strategy=ddp"], cwd=REPO, env=env)
    assert two.returncode == 0, f"torchrun failed:\n{two.stdout[-2000:]}\n{two.stderr[-5000:]}"
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2]  # rank 0 alone logs
    # 2 ranks x (3 images x 4 ODE steps + 3 images x K=2 points x (pre-pass, policy, old))
    assert [r["cost/transformer_evals"] for r in rows] == [60, 120]
    assert all(r["train/updates"] == 2 and r["diag/logprob_drift"] < 1e-5 for r in rows)
    assert [r["policy/old_decay"] for r in rows] == [0.002, 0.004]
    one = subprocess.run([sys.executable, "-m", "mmrl.cli", "train", *args, "train.max_steps=3"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, f"resume failed:\n{one.stdout[-2000:]}\n{one.stderr[-5000:]}"
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["cost/transformer_evals"] == 120 + 60  # the same global batch, now in one process
    assert rows[2]["policy/old_decay"] == 0.006  # the update counter was restored


@pytest.mark.slow
def test_torchrun_fsdp_full_finetuning(tmp_path):
    """FSDP (full fine-tuning, awm_tiny's rank 0): the pre-pass, "old" and evaluation forwards run on every rank."""
    if not (SHAPES_MODEL / "model_index.json").is_file():
        pytest.skip("assets/tiny_sd3_shapes not built")
    out = tmp_path / "fsdp"
    args = ["configs/diffusion/awm_tiny.yaml", f"output_dir={out}", f"model.path={SHAPES_MODEL}", "train.max_steps=2",
            "rollout.prompts_per_step=2", "rollout.group_size=3", "rollout.num_steps=4", "update.micro_batch_size=2",
            "update.mini_batch_size=3", "algo.num_train_timesteps=2", "algo.rollout_state=default",
            "log.sample_every=0", "log.eval_every=1", "log.eval_max_prompts=3", "dist.backend=gloo",
            "dist.strategy=fsdp"]
    proc = run_torchrun(["-m", "mmrl.cli", "train", *args], cwd=REPO, env=child_env())
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/updates"] == 2 and r["diag/logprob_drift"] < 1e-5 for r in rows)
    assert all(math.isfinite(r["eval/reward/mean"]) for r in rows)
    # per step: 60 rows as under DDP + evaluation of 3 prompts x 8 ODE steps (eval_num_steps) on both ranks
    assert [r["cost/transformer_evals"] for r in rows] == [60 + 48, 2 * (60 + 48)]
