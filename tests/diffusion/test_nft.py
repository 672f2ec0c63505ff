"""DiffusionNFT recipe: EMA schedules by hand, v = v_old symmetry, configs, exact resume, reward rise."""

import glob
import math
import os
from pathlib import Path

import pytest
import torch

from mmrl.config import ConfigError, load_config
from mmrl.core.losses import nft_loss
from mmrl.diffusion.nft import EMA_SCHEDULES, Config, ema_decay, train
from mmrl.testing import (RESUMED_RUN, assert_close_across_paths, assert_same_path, child_env, metrics_rows,
                          run_torchrun, spawn_ranks, without_time)

REPO = Path(__file__).resolve().parents[2]
PROMPTS = str(REPO / "assets" / "prompts" / "shapes_train.txt")
EVAL_PROMPTS = str(REPO / "assets" / "prompts" / "shapes_eval.txt")
SHAPES_MODEL = Path(os.environ.get("MMRL_SHAPES_MODEL", REPO / "assets" / "tiny_sd3_shapes"))  # data-trained tiny SD3


def _cfg(out, model_path, overrides=(), **sections) -> Config:
    d = {
        "algorithm": "nft", "output_dir": str(out), "seed": 5, "device": "cpu",
        "model": {"path": str(model_path), "lora": {"rank": 4, "alpha": 8}},
        "data": {"train_prompts": PROMPTS},
        "rollout": {"prompts_per_step": 2, "height": 64, "width": 64, "num_steps": 3, "group_size": 3,
                    "eval_num_steps": 2},
        "algo": {"guidance_beta": 0.5, "ema_schedule": "linear", "timestep_fraction": 0.7, "kl": {"coef": 0.1}},
        "train": {"max_steps": 2, "save_every": 0},
        "optim": {"lr": 1e-3},
        "update": {"micro_batch_size": 4, "mini_batch_size": 3},  # 2 updates per epoch over 2 x 3 samples
        "reward": {"components": {"jpeg_compressibility": 1.0}},
        "log": {"sample_every": 0},
    }
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return load_config(d, list(overrides))




# ---------------------------------------------------------------------------------------- EMA schedules


def test_ema_schedules_by_hand():
    # copy (official decay_type 0): always 0 -> old <- new
    assert [ema_decay("copy", n) for n in (0, 1, 75, 10_000)] == [0.0, 0.0, 0.0, 0.0]
    # linear (decay_type 1): min(0.001 n, 0.5)
    assert ema_decay("linear", 0) == 0.0
    assert ema_decay("linear", 1) == pytest.approx(0.001, abs=1e-15)
    assert ema_decay("linear", 250) == pytest.approx(0.25, abs=1e-15)
    assert ema_decay("linear", 500) == 0.5 and ema_decay("linear", 5000) == 0.5
    # delayed_linear (decay_type 2): 0 for n < 75, then min(0.0075 (n - 75), 0.999)
    assert [ema_decay("delayed_linear", n) for n in (0, 1, 74, 75)] == [0.0, 0.0, 0.0, 0.0]
    assert ema_decay("delayed_linear", 76) == pytest.approx(0.0075, abs=1e-15)
    assert ema_decay("delayed_linear", 100) == pytest.approx(0.1875, abs=1e-15)  # 25 * 0.0075
    assert ema_decay("delayed_linear", 208) == pytest.approx(0.9975, abs=1e-12)  # 133 * 0.0075
    assert ema_decay("delayed_linear", 209) == 0.999  # 134 * 0.0075 = 1.005 -> capped
    assert sorted(EMA_SCHEDULES) == ["copy", "delayed_linear", "linear"]
    with pytest.raises(ValueError, match="valid"):
        ema_decay("cosine", 3)


def test_v_equal_v_old_gives_equal_pos_and_neg_losses():
    # v = v_old: v+ = v- = v_old, so both x0 losses are the same number (and r does not matter). Only in exact
    # arithmetic: v+ = beta v + (1 - beta) v and v- = (1 + beta) v - beta v round differently (for beta 0.1 about
    # 30% of the elements differ from v in the last bit), so the two losses get a float32 tolerance
    g = torch.Generator().manual_seed(0)
    v = torch.randn(3, 4, 2, 2, generator=g)
    x0, xt = torch.randn(3, 4, 2, 2, generator=g), torch.randn(3, 4, 2, 2, generator=g)
    t = torch.tensor([0.2, 0.5, 0.9])
    for beta in (0.1, 1.0):
        _, m = nft_loss(v.clone(), v.clone(), x0, xt, t, torch.tensor([0.0, 0.5, 1.0]), beta)
        assert_close_across_paths(m["pos_loss"], m["neg_loss"], what="v+ and v- formulas")
        assert m["old_deviate"] == 0.0  # the same tensor twice


def test_recipe_first_step_has_v_equal_v_old(tmp_path, tiny_sd3_path):
    """Before the first optimizer update "old" == "default" (copied at init): pos and neg losses are equal (to float32
    rounding: the v+ / v- formulas round differently, and v comes from a forward under autograd, v_old from one
    without), and v_old deviates from v by rounding at most (a wrong "old" would deviate by ~1)."""
    cfg = _cfg(tmp_path / "run", tiny_sd3_path, ["train.max_steps=1", "update.mini_batch_size=0"])
    train(cfg)
    row = metrics_rows(tmp_path / "run")[0]
    assert_close_across_paths(row["policy/pos_loss"], row["policy/neg_loss"], what="v+ / v- formulas, two forwards")
    assert row["policy/old_deviate"] < 1e-12
    assert row["policy/old_decay"] == pytest.approx(0.001)  # 1 update done -> min(0.001 * 1, 0.5)
    assert row["train/updates"] == 1
    # 6 images x 3 ODE steps (rollout) + 6 images x 2 timesteps x 3 passes (policy, old, ref)
    assert row["cost/transformer_evals"] == 6 * 3 + 6 * 2 * 3
    for key in ("reward/mean", "reward/std", "time/step_s", "kl/ref", "policy/loss"):
        assert key in row and math.isfinite(row[key])


# ---------------------------------------------------------------------------------------- configs, errors


@pytest.mark.parametrize("path", sorted(glob.glob(str(REPO / "configs" / "diffusion" / "nft_*.yaml"))))
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.algorithm == "nft" and cfg.rollout.group_size >= 2
    ema_decay(cfg.algo.ema_schedule, 0)


def test_published_hyperparameters():
    """NVlabs/DiffusionNFT config/nft.py: sd3_pickscore / sd3_ocr (+ base.py)."""
    pick = load_config(REPO / "configs" / "diffusion" / "nft_sd35_pickscore.yaml")
    assert (pick.algo.guidance_beta, pick.algo.ema_schedule, pick.algo.kl.coef) == (1.0, "linear", 1e-4)
    assert (pick.rollout.num_steps, pick.rollout.group_size, pick.rollout.prompts_per_step) == (10, 24, 48)
    assert (pick.rollout.guidance_scale, pick.optim.lr, pick.algo.adv_clip_max) == (1.0, 3e-4, 5.0)
    updates = lambda c: c.update.updates_per_epoch(c.rollout.batch)  # noqa: E731  (gradient_step_per_epoch)
    assert (pick.model.lora.rank, pick.model.lora.alpha, updates(pick)) == (32, 64, 1)
    ocr = load_config(REPO / "configs" / "diffusion" / "nft_sd35_ocr.yaml")
    assert (ocr.algo.guidance_beta, ocr.algo.ema_schedule, updates(ocr)) == (0.1, "delayed_linear", 2)


def test_metric_names(tmp_path, tiny_sd3_path, check_metric_names):
    out = tmp_path / "run"
    train(_cfg(out, tiny_sd3_path, ["train.max_steps=1", f"data.eval_prompts={EVAL_PROMPTS}", "log.eval_every=1",
                                    "log.eval_max_prompts=2"]))
    keys = check_metric_names(metrics_rows(out))
    for key in ("policy/loss", "policy/old_decay", "policy/r_mean", "kl/ref", "eval/reward/mean", "train/updates"):
        assert key in keys, key


def test_bad_config_errors(tmp_path, tiny_sd3_path):
    with pytest.raises(ValueError, match="ema_schedule"):
        train(_cfg(tmp_path / "a", tiny_sd3_path, ["algo.ema_schedule=cosine"]))
    with pytest.raises(ValueError, match="guidance_beta"):
        train(_cfg(tmp_path / "b", tiny_sd3_path, ["algo.guidance_beta=0"]))
    with pytest.raises(ConfigError, match="kl_beta"):  # the KL weight is algo.kl.coef
        _cfg(tmp_path / "c", tiny_sd3_path, ["algo.kl_beta=0.1"])


# ---------------------------------------------------------------------------------------- resume, EMA


def test_resume_equals_uninterrupted_run(tmp_path, tiny_sd3_path):
    full = _cfg(tmp_path / "full", tiny_sd3_path, ["train.max_steps=4", "train.save_every=2"])
    train(full)
    half = _cfg(tmp_path / "half", tiny_sd3_path, ["train.max_steps=2", "train.save_every=2"])
    train(half)
    resumed = _cfg(tmp_path / "half", tiny_sd3_path, ["train.max_steps=4", "train.save_every=2"])
    train(resumed)
    a, b = metrics_rows(tmp_path / "full"), metrics_rows(tmp_path / "half")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert_same_path([without_time(r) for r in a], [without_time(r) for r in b], why=RESUMED_RUN)
    # the old adapter (EMA state) and the default adapter are identical too
    from safetensors.torch import load_file

    for state in ("default", "old"):
        fa = load_file(str(tmp_path / "full/checkpoints/step_4/adapters" / state / "adapter_model.safetensors"))
        fb = load_file(str(tmp_path / "half/checkpoints/step_4/adapters" / state / "adapter_model.safetensors"))
        assert_same_path(fa, fb, why=RESUMED_RUN)


def test_old_follows_the_schedule(tmp_path, tiny_sd3_path):
    """copy: old == default after a step; linear with one update: old = 0.001 old0 + 0.999 new."""
    from safetensors.torch import load_file

    train(_cfg(tmp_path / "copy", tiny_sd3_path, ["train.max_steps=1", "algo.ema_schedule=copy"]))
    ad = tmp_path / "copy/checkpoints/step_1/adapters"
    d, o = (load_file(str(ad / s / "adapter_model.safetensors")) for s in ("default", "old"))
    assert all(torch.equal(d[k], o[k]) for k in d)
    assert any(not torch.equal(d[k], torch.zeros_like(d[k])) for k in d if "lora_B" in k)  # it did train

    train(_cfg(tmp_path / "lin", tiny_sd3_path, ["train.max_steps=1", "update.mini_batch_size=0"]))
    ad = tmp_path / "lin/checkpoints/step_1/adapters"
    d, o = (load_file(str(ad / s / "adapter_model.safetensors")) for s in ("default", "old"))
    # lora_B starts at 0 in both states (gaussian init), so old_B = 0.999 * default_B after one update
    for k in d:
        if "lora_B" in k:
            assert torch.allclose(o[k], 0.999 * d[k], atol=1e-7, rtol=1e-6)


def test_full_finetuning_runs(tmp_path, tiny_sd3_path):
    train(_cfg(tmp_path / "full", tiny_sd3_path, ["train.max_steps=1", "model.lora.rank=0",
                                                   "update.mini_batch_size=0"]))
    row = metrics_rows(tmp_path / "full")[0]
    assert_close_across_paths(row["policy/pos_loss"], row["policy/neg_loss"], what="v+ / v- formulas, two forwards")
    assert row["policy/old_deviate"] < 1e-12


# ---------------------------------------------------------------------------------------- reward rises


@pytest.mark.slow
def test_nft_tiny_raises_reward(tmp_path):
    torch.set_num_threads(1)
    cfg = load_config(REPO / "configs" / "diffusion" / "nft_tiny.yaml",
                      [f"output_dir={tmp_path / 'run'}", f"model.path={SHAPES_MODEL}",
                       f"data.train_prompts={PROMPTS}", f"data.eval_prompts={EVAL_PROMPTS}",
                       "train.max_steps=25", "log.sample_every=0",
                       "train.resume=never"])
    summary = train(cfg)
    print("nft_tiny first-5 vs last-5 mean reward:", summary["reward_first5"], summary["reward_last5"])
    assert summary["reward_last5"] > summary["reward_first5"]


def test_evaluation_does_not_change_training(tmp_path, tiny_sd3_path):
    """ODE evaluation uses its own seeded generator: the training metrics are identical with and without it."""
    extra = ["train.max_steps=2", f"data.eval_prompts={EVAL_PROMPTS}", "log.eval_max_prompts=3"]
    train(_cfg(tmp_path / "a", tiny_sd3_path, extra + ["log.eval_every=1"]))
    train(_cfg(tmp_path / "b", tiny_sd3_path, extra + ["log.eval_every=0"]))
    a, b = metrics_rows(tmp_path / "a"), metrics_rows(tmp_path / "b")
    assert all("eval/reward/mean" in r for r in a) and not any("eval/reward/mean" in r for r in b)
    drop = lambda r: {k: v for k, v in without_time(r).items()  # noqa: E731
                      if not k.startswith(("eval/", "perf/")) and k != "cost/transformer_evals"}
    assert_same_path([drop(r) for r in a], [drop(r) for r in b],
                     why="evaluation draws from its own generator and changes no training tensor")


# ---------------------------------------------------------------------------------------- several processes
#
# Real processes (gloo on CPU). The CLI test runs nft_tiny under torchrun and resumes with one process; the
# equality test runs this file as a script: 2 ranks (torch.multiprocessing.spawn) each run ONE optimizer update of
# the recipe's `_train_on_rollout` (+ the old-policy EMA) on their share of a fixed rollout batch, which must give
# the same weights as one process on the whole batch. NFT draws fresh forward noise per micro-batch, so the test
# makes that noise a function of the sample (seeded by its clean latent) and trains on K = 1 timestep: then both
# set-ups see the same training points and only the summation order differs.

P, G = 4, 3  # prompts, images per prompt: global batch of 12; ranks hold prompts 0-1 and 2-3
# scenario -> (per-prompt rewards, drop_zero_advantage); a constant group has advantage 0
SCENARIOS = {
    "all_rows": ([[0.1, 0.9, 0.4], [2.0, -1.0, 0.5], [0.3, 1.7, 1.1], [0.5, 0.5, 0.5]], False),  # 6 + 6 rows
    "idle": ([[0.1, 0.9, 0.4], [2.0, -1.0, 0.5], [0.7, 0.7, 0.7], [0.5, 0.5, 0.5]], True),  # 5 + 0: rank 1 idles
}


def _equality_cfg(model_path):
    return _cfg("/tmp/unused", model_path, rollout={"num_steps": 3, "group_size": G, "prompts_per_step": P},
                algo={"timestep_fraction": 0.34, "guidance_beta": 0.5, "kl": {"coef": 0.1}},  # K = int(3 * 0.34) = 1
                update={"micro_batch_size": 2, "mini_batch_size": 0}, optim={"lr": 1e-3})


def _sample_noise(x):
    """Noise for torch.randn_like(x0) that depends on each sample only (seeded by its clean latent)."""
    rows = []
    for row in x:
        g = torch.Generator().manual_seed(int(row.double().abs().sum().item() * 1e6) % (2**31))
        rows.append(torch.randn(row.shape, generator=g, dtype=row.dtype))
    return torch.stack(rows)


def _one_update(model_path, scenario, ctx):
    """One NFT update + EMA on this rank's share of a fixed global rollout batch: (default, old) weights, adv."""
    import math as _math

    from mmrl.core.losses import nft_optimality_prob
    from mmrl.diffusion.common import build_policy_states
    from mmrl.core.prompt_stats import PerPromptStatTracker
    from mmrl.diffusion.scoring import global_advantages
    from mmrl.diffusion.models import load_flow_model
    from mmrl.diffusion.loop import TrainingParts
    from mmrl.diffusion.nft import _train_on_rollout
    from mmrl.diffusion.old_policy import UpdateCounter
    from mmrl.diffusion.sampling import Trajectory, sample_groups
    from mmrl.runtime import seed_everything

    cfg = _equality_cfg(model_path)
    s, t = cfg.rollout, cfg.algo
    scores_pp, drop_zero = SCENARIOS[scenario]
    model = load_flow_model(model_path)
    seed_everything(0)  # identical LoRA init everywhere
    states = build_policy_states(model, cfg.model, old=True, ref=True)
    params = states.trainable_parameters()
    model.transformer = ctx.wrap_model(states.model, "ddp")
    # plain SGD, lr 1: the weight change is the (clipped) gradient itself, so the comparison checks the gradient
    # (Adam's first step, lr * g / (|g| + eps), would hide gradient differences)
    opt = torch.optim.SGD(params, lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    prompts_all = [x.strip() for x in open(PROMPTS).read().splitlines()[:P]]
    with torch.no_grad():  # the fixed rollout: every process computes the global batch, then keeps its rows
        full = sample_groups(model, model.encode_prompts(prompts_all), G, num_steps=s.num_steps, height=s.height,
                             width=s.width, guidance_scale=1.0, noise_level=0.0,
                             generator=torch.Generator().manual_seed(7))
    k = P // ctx.world_size
    pi = torch.arange(ctx.rank * k, (ctx.rank + 1) * k)
    rows = torch.arange(ctx.rank * k * G, (ctx.rank + 1) * k * G)
    traj = Trajectory(latents=full.latents[rows], log_probs=full.log_probs[rows], sigmas=full.sigmas,
                      sde_mask=full.sde_mask, train_steps=full.train_steps,
                      prompt_index=full.prompt_index[rows] - ctx.rank * k, embeds=full.embeds.select(pi))
    scores = torch.tensor(scores_pp).flatten()[rows]
    prompts = [prompts_all[i] for i in full.prompt_index[rows].tolist()]
    tracker = PerPromptStatTracker("group")
    adv, keep, _ = global_advantages(ctx, tracker, prompts, scores, _math.inf, drop_zero)
    r = nft_optimality_prob(adv, t.adv_clip_max)
    counters = UpdateCounter()
    names = {id(p): n for n, p in states.model.named_parameters()}
    before = {names[id(p)]: p.detach().clone() for p in params}
    randn_like = torch.randn_like
    torch.randn_like = _sample_noise
    try:
        torch.manual_seed(100 + ctx.rank)  # the sample order inside a chunk does not matter for one update
        out = _train_on_rollout(TrainingParts(cfg, ctx, model, states, opt, sched, params, counters=counters), 0, traj,
                                r, keep)
    finally:
        torch.randn_like = randn_like
    states.ema("default", "old", 0.25)
    default = {names[id(p)]: p.detach().clone() for p in params}
    old = {n: p.detach().clone() for n, p in states.model.named_parameters() if ".old." in n}  # the old adapter
    moved = max((default[k] - v).abs().max().item() for k, v in before.items())
    return {"default": default, "old": old, "adv": adv, "n_keep": len(keep), "updates": counters.updates,
            "moved": moved, "metrics": out}


def _equality_worker(ctx, model_path, out_dir):
    res = {name: _one_update(model_path, name, ctx) for name in SCENARIOS}
    torch.save(res, Path(out_dir) / f"rank{ctx.rank}.pt")


@pytest.mark.slow
def test_two_ranks_one_update_equals_one_process(tmp_path, tiny_sd3_path):
    import subprocess
    import sys

    from mmrl.distributed import DistContext

    env = child_env()
    proc = subprocess.run([sys.executable, __file__, str(tiny_sd3_path), str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"2-rank run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for name in SCENARIOS:
        one = _one_update(tiny_sd3_path, name, DistContext())
        r0, r1 = ranks[0][name], ranks[1][name]
        # advantages from the all-gathered rewards = one process's
        assert_close_across_paths(torch.cat([r0["adv"], r1["adv"]]), one["adv"], what="2 processes vs 1")
        # (the 0.5 of [2.0, -1.0, 0.5] is its group mean: advantage 0, dropped too in "idle")
        assert (r0["n_keep"], r1["n_keep"]) == ((6, 6) if name == "all_rows" else (5, 0))
        assert r0["updates"] == r1["updates"] == one["updates"] == 1
        # both ranks hold the same weights (default and EMA "old") after the update
        for state in ("default", "old"):
            assert r0[state].keys() == r1[state].keys() == one[state].keys() and len(one[state]) > 0
            assert all(torch.equal(r0[state][k], r1[state][k]) for k in r0[state])
        assert one["moved"] > 1e-4  # the update is not trivially zero
        for state in ("default", "old"):
            diff = max((r0[state][k] - v).abs().max().item() for k, v in one[state].items())
            print(f"[{name}] max |{state} param diff| 2 ranks vs 1 process: {diff:.2e}")
            assert diff < 1e-6
        for key in ("policy/loss", "kl/ref", "policy/grad_norm", "policy/r_mean"):
            assert r0["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7), key


@pytest.mark.slow
def test_torchrun_cli_two_processes_then_resume_with_one(tmp_path):
    import subprocess
    import sys

    if not (SHAPES_MODEL / "model_index.json").is_file():
        pytest.skip("assets/tiny_sd3_shapes not built")
    out = tmp_path / "ddp"
    args = ["configs/diffusion/nft_tiny.yaml", f"output_dir={out}", f"model.path={SHAPES_MODEL}",
            "train.save_every=1", "rollout.prompts_per_step=2", "rollout.group_size=3", "rollout.num_steps=4",
            "update.micro_batch_size=2", "log.sample_every=1", "log.eval_every=0", "dist.backend=gloo"]
    env = child_env()
    two = run_torchrun(["-m", "mmrl.cli", "train", *args, "train.max_steps=2", "dist.strategy=ddp"], cwd=REPO, env=env)
    assert two.returncode == 0, f"torchrun failed:\n{two.stdout[-2000:]}\n{two.stderr[-5000:]}"
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2]  # rank 0 alone logs
    # 2 ranks x (3 images x 4 ODE steps + 3 images x K=2 timesteps x (policy + old)) per step
    assert [r["cost/transformer_evals"] for r in rows] == [48, 96]
    assert all(r["train/updates"] == 1 and r["train/kept_fraction"] == 1.0 for r in rows)
    assert [r["policy/old_decay"] for r in rows] == [0.001, 0.002]
    assert sorted(os.listdir(out / "checkpoints")) == ["step_1", "step_2"]
    assert (out / "samples" / "step_000001.png").is_file()
    one = subprocess.run([sys.executable, "-m", "mmrl.cli", "train", *args, "train.max_steps=3"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, f"resume failed:\n{one.stdout[-2000:]}\n{one.stderr[-5000:]}"
    assert "resumed from" in one.stdout and "step_2 (step 2)" in one.stdout
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["cost/transformer_evals"] == 96 + 48  # the same global batch (6 images), now in one process
    assert rows[2]["policy/old_decay"] == 0.003  # the update counter (EMA schedule position) was restored
    assert (out / "checkpoints" / "step_3" / "COMPLETE").is_file()


# ---------------------------------------------------------------------------------------- non-finite rewards, updates


def test_nan_reward_drop_sample_and_nan_loss_skipped(tmp_path, tiny_sd3_path, monkeypatch):
    """`_test_nan_at_1` (conftest): image 1 of each batch has a NaN reward. drop_sample trains on without it; then a
    NaN loss (every update) is skipped: weights bit-identical, metrics strict JSON."""
    import json

    import mmrl.diffusion.nft as nft_mod

    train(_cfg(tmp_path / "drop", tiny_sd3_path, ["reward.on_nonfinite=drop_sample", "train.max_steps=1"],
               reward={"components": {"_test_nan_at_1": 1.0}}))
    (row,) = metrics_rows(tmp_path / "drop")
    assert row["reward/nonfinite_samples"] == 1 and math.isfinite(row["reward/mean"]) and row["train/updates"] == 2
    assert math.isfinite(row["policy/loss"]) and row["train/skipped_updates"] == 0

    import mmrl.training as spine

    real_loss, real_make, seen = nft_mod.nft_loss, spine.build_optimizer, {}

    def nan_loss(*args, **kwargs):
        loss, m = real_loss(*args, **kwargs)
        return loss * float("nan"), m

    def spy(params, optim, **kw):  # the trainable tensors and their values before any update
        seen["params"], seen["init"] = list(params), [p.detach().clone() for p in params]
        return real_make(seen["params"], optim, **kw)

    monkeypatch.setattr(nft_mod, "nft_loss", nan_loss)
    monkeypatch.setattr(spine, "build_optimizer", spy)
    train(_cfg(tmp_path / "nan", tiny_sd3_path, ["train.max_steps=1", "update.max_skipped_updates=3"]))
    assert all(torch.equal(p.detach(), v) for p, v in zip(seen["params"], seen["init"]))
    lines = (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()
    (row,) = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl")) for line in lines]
    assert row["train/skipped_updates"] == 2 and row["train/updates"] == 0 and row["policy/loss"] is None


if __name__ == "__main__":  # 2 ranks for test_two_ranks_one_update_equals_one_process
    import sys

    spawn_ranks(_equality_worker, sys.argv[1], sys.argv[2])
