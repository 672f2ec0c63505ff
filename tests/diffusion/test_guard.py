"""The reward-hacking guard and the multi-reward options in the diffusion recipes: GRPO-Guard's ratio in Flow-GRPO,
the velocity-norm diagnostic and penalty, sample statistics, judges (baseline, resume, stop), reward aggregation
(GDPO) and group rewards in every recipe. The hacking demo on the shapes-pretrained tiny SD3 is the slow test at
the end (its numbers are in docs/reward-hacking.md)."""

from pathlib import Path

import pytest
import torch

from mmrl.config import load_config
from mmrl.core.multi_reward import multi_reward_advantages
from mmrl.core.prompt_stats import PerPromptStatTracker, group_normalize
from mmrl.distributed import DistContext
from mmrl.testing import metrics_rows

REPO = Path(__file__).resolve().parents[2]
PROMPTS = str(REPO / "assets" / "prompts" / "shapes_train.txt")
EVAL = str(REPO / "assets" / "prompts" / "shapes_eval.txt")
TWO_REWARDS = {"jpeg_compressibility": 1.0, "prompt_color": {"weight": 2.0}}


def _cfg(algorithm, out, model_path, overrides=(), **sections):
    d = {
        "algorithm": algorithm, "output_dir": str(out), "seed": 3, "device": "cpu",
        "model": {"path": str(model_path), "lora": {"rank": 4, "alpha": 8}},
        "data": {"train_prompts": PROMPTS},
        "rollout": {"prompts_per_step": 2, "height": 64, "width": 64, "num_steps": 3, "group_size": 3,
                    "guidance_scale": 1.0, "eval_num_steps": 2, "eval_guidance_scale": 1.0},
        "train": {"max_steps": 2, "save_every": 0},
        "optim": {"lr": 1e-3},
        "update": {"micro_batch_size": 4, "mini_batch_size": 0},
        "reward": {"components": {"jpeg_compressibility": 1.0}},
        "log": {"sample_every": 0},
    }
    if algorithm == "flow_grpo":
        d["algo"] = {"kl": {"coef": 0.0}, "ema": False}
    if algorithm == "dpo":
        d["algo"] = {"mode": "online", "beta": 100.0, "pairing": "all_pairs", "sigma_shift": 1.0}
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return load_config(d, list(overrides))


def _train(cfg):
    from mmrl.config import recipe_module

    return recipe_module(cfg.algorithm).train(cfg)


# ---------------------------------------------------------------------------------------- GRPO-Guard


def test_grpo_guard_ratio_starts_at_one_and_trains(tmp_path, tiny_sd3_path):
    out = tmp_path / "guard"
    _train(_cfg("flow_grpo", out, tiny_sd3_path, ["algo.ratio_norm=grpo_guard", "update.epochs=2"],
                optim={"lr": 3e-2}))
    rows = metrics_rows(out)
    # the recorded means and log-probs agree with the trainer's: two computation paths (the rollout's batch and a
    # training micro-batch), equal up to float rounding (0 on some CPUs, 1.2e-7 on an AVX-512/AMX Xeon)
    assert all(r["diag/logprob_drift"] < 1e-5 for r in rows)
    assert all(r["train/updates"] == 2 and r["policy/clipfrac_ratio"] >= 0.0 for r in rows)
    # with recomputed pi_old the means come from the recompute pass; the run gives the same first step
    out2 = tmp_path / "guard_recompute"
    _train(_cfg("flow_grpo", out2, tiny_sd3_path, ["algo.ratio_norm=grpo_guard", "update.epochs=2",
                                                    "algo.old_logprobs=recompute", "train.max_steps=1"],
                optim={"lr": 3e-2}))
    r1, r2 = metrics_rows(out)[0], metrics_rows(out2)[0]
    assert r2["policy/loss"] == pytest.approx(r1["policy/loss"], rel=1e-4, abs=1e-7)
    with pytest.raises(ValueError, match="needs rollout.sde_type=sde"):
        _train(_cfg("flow_grpo", tmp_path / "cps", tiny_sd3_path, ["algo.ratio_norm=grpo_guard",
                                                                   "rollout.sde_type=cps"]))


def test_grpo_guard_changes_the_update_only_after_the_first_one(tmp_path, tiny_sd3_path):
    """At the rollout's weights both ratios are exactly 1 (the guard's log-ratio is mean(delta * eps) = 0), so the
    first update of a step is the same; the second epoch's ratios differ."""
    rows = {}
    for mode in ("none", "grpo_guard"):
        out = tmp_path / mode
        _train(_cfg("flow_grpo", out, tiny_sd3_path, [f"algo.ratio_norm={mode}", "update.epochs=2",
                                                      "update.mini_batch_size=0", "train.max_steps=1"],
                    optim={"lr": 3e-2}))
        rows[mode] = metrics_rows(out)[0]
    assert rows["none"]["policy/ratio_max"] != rows["grpo_guard"]["policy/ratio_max"]
    assert rows["none"]["reward/mean"] == rows["grpo_guard"]["reward/mean"]  # the same rollout


def test_grpo_guard_reweight_divides_the_step_gradient_by_its_dt(tmp_path, tiny_sd3_path):
    """algo.grpo_guard_reweight (verl-omni's grpo_guard loss): one trained step (window [1, 2) of 3), one update,
    no KL: the gradient norm is the plain guard's divided by sigma_1 - sigma_2."""
    from mmrl.diffusion.models import load_flow_model

    rows = {}
    for on in (False, True):
        out = tmp_path / str(on)
        _train(_cfg("flow_grpo", out, tiny_sd3_path, ["algo.ratio_norm=grpo_guard", f"algo.grpo_guard_reweight={on}",
                                                      "rollout.window_size=1", "rollout.window_range=[1,2]",
                                                      "update.mini_batch_size=0", "train.max_steps=1"]))
        rows[on] = metrics_rows(out)[0]
    sigmas = load_flow_model(tiny_sd3_path).sigmas(3, 64, 64)
    assert rows[True]["reward/mean"] == rows[False]["reward/mean"]  # the same rollout
    assert rows[True]["policy/grad_norm"] == pytest.approx(rows[False]["policy/grad_norm"]
                                                           / float(sigmas[1] - sigmas[2]), rel=1e-4)
    with pytest.raises(ValueError, match="algo.grpo_guard_reweight balances .* needs algo.ratio_norm=grpo_guard, "
                                         "got 'none'"):
        _train(_cfg("flow_grpo", tmp_path / "bad", tiny_sd3_path, ["algo.grpo_guard_reweight=true"]))


# ---------------------------------------------------------------------------------------- velocity norm


def test_velocity_norm_penalty_by_hand_in_flow_grpo(tmp_path, tiny_sd3_path):
    """One update per step: the loss with algo.velocity_norm.coef = c is the loss without it plus c times the mean
    penalty of the same micro-steps (same weights), and step 1 (policy = reference: ratio 1, penalty 0) is equal."""
    runs = {}
    for coef in (0.0, 50.0):
        out = tmp_path / f"c{coef}"
        _train(_cfg("flow_grpo", out, tiny_sd3_path, [f"algo.velocity_norm.coef={coef}", "update.mini_batch_size=0",
                                                      "algo.velocity_norm.reference_pass=true"],
                    optim={"lr": 0.2}, train={"max_steps": 2},  # (a large step: the norm grows past the ref's)
                    reward={"components": {"jpeg_incompressibility": 1.0}}))
        runs[coef] = metrics_rows(out)
    a, b = runs[0.0], runs[50.0]
    assert a[0]["diag/velocity_norm_ratio"] == pytest.approx(1.0, abs=1e-6) and a[0]["policy/norm_penalty"] == 0
    assert b[0]["policy/loss"] == pytest.approx(a[0]["policy/loss"], rel=1e-6, abs=1e-9)
    pen = a[1]["policy/norm_penalty"]
    assert a[1]["diag/velocity_norm_ratio_max"] > 1.0 and pen > 0  # the update moved the norm past the reference's
    assert b[1]["policy/norm_penalty"] == pytest.approx(pen, rel=1e-5)
    assert b[1]["policy/loss"] - a[1]["policy/loss"] == pytest.approx(50.0 * pen, rel=1e-4)
    # without a reference pass (kl 0, coef 0, no reference_pass) the diagnostic is not logged: nothing to compare to
    out = tmp_path / "noref"
    _train(_cfg("flow_grpo", out, tiny_sd3_path, ["train.max_steps=1"]))
    assert "diag/velocity_norm_ratio" not in metrics_rows(out)[0]


@pytest.mark.parametrize("algorithm", ["nft", "awm", "dpo"])
def test_velocity_norm_and_sample_statistics_in_every_recipe(tmp_path, tiny_sd3_path, algorithm):
    out = tmp_path / algorithm
    extra = ["algo.kl.coef=0.0"] if algorithm != "dpo" else []
    _train(_cfg(algorithm, out, tiny_sd3_path, extra + ["algo.velocity_norm.coef=1.0", "train.max_steps=1"]))
    (row,) = metrics_rows(out)
    assert row["diag/velocity_norm_ratio"] == pytest.approx(1.0, abs=1e-5)  # step 1: policy = reference
    assert row["diag/velocity_norm_ratio_max"] >= row["diag/velocity_norm_ratio"] - 1e-6
    assert row["diag/velocity_norm"] > 0 and "policy/norm_penalty" in row
    for key in ("latent_rms", "brightness", "contrast", "saturation", "detail"):
        assert 0 <= row[f"diag/sample/{key}"] < 10


def test_sample_statistics_by_hand():
    from mmrl.diffusion.diagnostics import sample_statistics

    img = torch.zeros(1, 3, 2, 2)
    img[0, 0, :, 1] = 1.0  # left column black, right column red
    s = sample_statistics(img, torch.full((1, 4, 1, 1), 2.0))
    assert s["diag/sample/latent_rms"] == pytest.approx(2.0)
    assert s["diag/sample/brightness"] == pytest.approx(0.299 / 2)
    assert s["diag/sample/contrast"] == pytest.approx(0.299 / 2)  # luma 0, .299: population std .1495
    assert s["diag/sample/saturation"] == pytest.approx(0.5)
    assert s["diag/sample/detail"] == pytest.approx(0.5 * (1 / 3 + 0.0))  # red channel steps once per row
    video = sample_statistics(torch.stack([img[0], img[0]])[None], prefix="x/")  # [1, F=2, 3, 2, 2]: frames pooled
    assert video == {k.replace("diag/sample/", "x/"): v for k, v in s.items() if "latent" not in k}


# ---------------------------------------------------------------------------------------- aggregation


def test_global_advantages_normalise_then_sum_by_hand():
    from mmrl.diffusion.scoring import global_advantages

    prompts = ["a", "a", "a", "b", "b", "b"]
    comps = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [2.0, 2.0], [2.0, 2.0], [2.0, 2.0]])
    scores = comps @ torch.tensor([1.0, 3.0])
    adv, keep, _ = global_advantages(DistContext(), PerPromptStatTracker(), prompts, scores, 5.0, True,
                                     components=comps, weights=[1.0, 3.0], aggregation="normalise_then_sum")
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    per = torch.stack([group_normalize(comps[:, k], ids) for k in range(2)], 1)  # population std + 1e-4 per prompt
    s = per @ torch.tensor([1.0, 3.0])
    want = torch.where((per == 0).all(1), torch.zeros(()), (s - s.mean()) / (s.std() + 1e-4))
    torch.testing.assert_close(adv, want)
    # row 2 sits exactly at its prompt's mean in both rewards, prompt b is constant: every per-reward advantage 0
    # -> exactly 0 after the whitening -> dropped (reward.drop_zero_advantage)
    assert keep.tolist() == [0, 1]
    assert torch.equal(multi_reward_advantages(comps, [1.0, 3.0], lambda r: group_normalize(r, ids),
                                               "normalise_then_sum"), adv)
    with pytest.raises(ValueError, match="needs the reward components"):
        global_advantages(DistContext(), PerPromptStatTracker(history=2), prompts, scores, 5.0, True,
                          components=comps, weights=[1.0, 3.0], aggregation="normalise_then_sum")


@pytest.mark.parametrize("algorithm", ["flow_grpo", "nft", "awm", "dpo"])
def test_aggregation_and_group_rewards_in_every_recipe(tmp_path, tiny_sd3_path, algorithm):
    """normalise_then_sum with two rewards, one of them a group reward (rank of JPEG size within the prompt's
    images): runs, logs each component; sum_then_normalise gives the same rollout (same seed) but other advantages."""
    rows = {}
    rewards = {**TWO_REWARDS, "group_rank": {"weight": 0.5, "scorer": "jpeg_incompressibility"}}
    for agg in ("sum_then_normalise", "normalise_then_sum"):
        out = tmp_path / agg
        _train(_cfg(algorithm, out, tiny_sd3_path, [f"reward.aggregation={agg}", "train.max_steps=1"],
                    reward={"components": rewards}))
        rows[agg] = metrics_rows(out)[0]
    a, b = rows["sum_then_normalise"], rows["normalise_then_sum"]
    assert a["reward/mean"] == b["reward/mean"] and 0 <= b["reward/group_rank"] <= 1
    assert b["reward/group_rank"] == pytest.approx(0.5)  # win rates of a group average to 1/2
    if algorithm != "dpo":
        assert a["policy/advantage_abs"] != b["policy/advantage_abs"]
    if algorithm in ("flow_grpo", "nft", "awm"):  # (DPO keeps no reward history)
        with pytest.raises(ValueError, match="reward.history=0"):
            _train(_cfg(algorithm, tmp_path / "h", tiny_sd3_path, ["reward.aggregation=normalise_then_sum",
                                                                   "reward.history=4"]))


# ---------------------------------------------------------------------------------------- judges


@pytest.mark.parametrize("algorithm", ["flow_grpo", "nft", "awm", "dpo"])
def test_judges_in_every_recipe_baseline_and_resume(tmp_path, tiny_sd3_path, algorithm):
    judges = ["log.eval_every=1", f"data.eval_prompts={EVAL}", "log.eval_max_prompts=8", "log.num_samples=4",
              "log.judges={colour: {reward: prompt_color}, jpeg_small: {reward: jpeg_compressibility}}"]
    full = tmp_path / "full"
    summary = _train(_cfg(algorithm, full, tiny_sd3_path, judges + ["train.max_steps=2"]))
    rows = metrics_rows(full)
    assert (full / "samples" / "eval_step_000000.png").is_file()  # the baseline evaluation, before any update
    for r in rows:
        for key in ("eval/judge/colour", "eval/judge/colour/delta", "eval/judge/colour/noise",
                    "eval/judge/jpeg_small/delta", "eval/judge/reward/delta", "eval/hacking", "eval/hacking_alarm"):
            assert key in r, key
    assert "hacking_alarm" in summary
    # a resumed run compares with the checkpointed baseline: the same judge numbers as the uninterrupted run
    split = tmp_path / "split"
    _train(_cfg(algorithm, split, tiny_sd3_path, judges + ["train.max_steps=1", "train.save_every=1"]))
    _train(_cfg(algorithm, split, tiny_sd3_path, judges + ["train.max_steps=2", "train.save_every=1"]))
    resumed = metrics_rows(split)[-1]
    for key in ("eval/judge/colour/delta", "eval/judge/jpeg_small/delta", "eval/judge/reward/delta"):
        assert resumed[key] == pytest.approx(rows[-1][key], rel=1e-5, abs=1e-7), key


def test_judges_added_when_resuming_start_fresh(tmp_path, tiny_sd3_path):
    """Also the alarm's minimum in a recipe: 3 held-out prompts (< 8) warn at the start and give no verdict."""
    out = tmp_path / "run"
    judged = ["log.eval_every=1", f"data.eval_prompts={EVAL}", "log.eval_max_prompts=3", "log.num_samples=3",
              "log.judges={colour: {reward: prompt_color}}", "train.save_every=1"]
    _train(_cfg("flow_grpo", out, tiny_sd3_path, ["train.max_steps=1", "train.save_every=1"]))  # no judges
    with pytest.warns(UserWarning, match=r"the evaluation has 3 held-out prompts, fewer than the 8 .*"
                                         r"\(log.eval_max_prompts\)"):
        _train(_cfg("flow_grpo", out, tiny_sd3_path, judged + ["train.max_steps=3"]))
    rows = metrics_rows(out)
    # step 2: the first evaluation with judges is their baseline (no rule yet); step 3 compares with it
    assert "eval/judge/colour" in rows[1] and "eval/hacking_alarm" not in rows[1]
    assert "eval/judge/colour/delta" in rows[2] and rows[2]["eval/hacking_no_verdict"] == 1.0
    assert "eval/hacking" not in rows[2] and "eval/judge/colour/noise" not in rows[2]


# ---------------------------------------------------------------------------------------- the hacking demo

SHAPES = REPO / "assets" / "tiny_sd3_shapes"
DEMO = REPO / "configs" / "diffusion" / "flow_grpo_tiny_judges.yaml"


@pytest.mark.slow
def test_hacking_demo_fires_on_jpeg_and_stays_quiet_when_regularised(tmp_path):
    """docs/reward-hacking.md: the shapes-pretrained tiny SD3 trained on JPEG incompressibility turns flat shapes
    into textures; the colour judge (prompt_color on the 24 held-out prompts) falls while the reward rises, the
    alarm fires at an evaluation (step 5 on this machine) and `log.hacking.stop` ends the run there with a
    checkpoint. The same reward with the KL to the reference at 1.0 still rises, while the colour moves by less
    than the judge's noise: no alarm in 10 steps."""
    if not (SHAPES / "model_index.json").is_file():
        pytest.skip("assets/tiny_sd3_shapes not built (python -m mmrl.diffusion.pretrain_tiny assets/tiny_sd3_shapes)")
    hack = tmp_path / "hack"
    summary = _train(load_config(DEMO, [f"output_dir={hack}", f"model.path={SHAPES}", "log.hacking.stop=true"]))
    rows = metrics_rows(hack)
    fired = summary["hacking_alarm_step"]
    assert summary["hacking_alarm"] and fired in (5, 10) and rows[-1]["step"] == fired  # stopped at the alarm
    last = rows[-1]
    assert last["eval/judge/reward/delta"] > last["eval/judge/reward/noise"] > 0
    assert last["eval/judge/prompt_color/delta"] < -last["eval/judge/prompt_color/noise"] < 0
    assert (hack / "checkpoints" / f"step_{fired}").is_dir()  # the alarm's step is checkpointed
    quiet = tmp_path / "quiet"
    summary = _train(load_config(DEMO, [f"output_dir={quiet}", f"model.path={SHAPES}", "algo.kl.coef=1.0"]))
    evals = [r for r in metrics_rows(quiet) if "eval/hacking" in r]
    assert not summary["hacking_alarm"] and [r["step"] for r in evals] == [1, 5, 10]  # after step 1, every 5, last
    assert evals[-1]["eval/judge/reward/delta"] > evals[-1]["eval/judge/reward/noise"]  # the reward did rise
    assert all(r["eval/judge/prompt_color/delta"] > -r["eval/judge/prompt_color/noise"] for r in evals)
