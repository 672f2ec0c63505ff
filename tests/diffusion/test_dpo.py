"""Diffusion-DPO recipe: pairing by hand, log 2 at init, latent cache, exact resume, accuracy / reward rise."""

import glob
import math
import os
from pathlib import Path

import pytest
import torch

from mmrl.config import load_config
from mmrl.core.pairing import build_pairs
from mmrl.diffusion.common import LatentCache, flow_matching_mse, noise_latents, sample_sigmas
from mmrl.diffusion.dpo import Config, make_shapes_preference_file, train
from mmrl.testing import (RESUMED_RUN, assert_close_across_paths, assert_same_path, child_env, metrics_rows,
                          run_torchrun, spawn_ranks, without_time)

REPO = Path(__file__).resolve().parents[2]
PROMPTS = str(REPO / "assets" / "prompts" / "shapes_train.txt")
EVAL_PROMPTS = str(REPO / "assets" / "prompts" / "shapes_eval.txt")
SHAPES_MODEL = Path(os.environ.get("MMRL_SHAPES_MODEL", REPO / "assets" / "tiny_sd3_shapes"))  # data-trained tiny SD3


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return make_shapes_preference_file(tmp_path_factory.mktemp("pairs"), n_pairs=12, seed=1)


def _cfg(out, model_path, overrides=(), **sections) -> Config:
    d = {
        "algorithm": "dpo", "output_dir": str(out), "seed": 7, "device": "cpu",
        "model": {"path": str(model_path), "lora": {"rank": 4, "alpha": 8}},
        "data": {"train_prompts": PROMPTS, "pairs_per_step": 4},
        "rollout": {"prompts_per_step": 2, "height": 64, "width": 64, "num_steps": 3, "group_size": 3,
                    "guidance_scale": 1.0, "eval_num_steps": 2},
        "algo": {"mode": "online", "beta": 100.0, "pairing": "all_pairs", "sigma_shift": 1.0},
        "train": {"max_steps": 2, "save_every": 0},
        "optim": {"lr": 1e-3},
        "update": {"micro_batch_size": 2},
        "reward": {"components": {"jpeg_compressibility": 1.0}},
        "log": {"sample_every": 0},
    }
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return load_config(d, list(overrides))




# ---------------------------------------------------------------------------------------- pairing


def test_build_pairs_by_hand():
    scores = torch.tensor([0.1, 0.9, 0.5, 2.0, 2.0, 1.0, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    w, l = build_pairs(scores, groups, "best_worst")
    # group 0: best 1 (0.9), worst 0 (0.1); group 1: best 3 (first of the tie 2.0, 2.0), worst 5;
    # group 2 has one member: no pair
    assert list(zip(w.tolist(), l.tolist())) == [(1, 0), (3, 5)]
    w, l = build_pairs(scores, groups, "best_worst", margin=0.9)  # group 0 gap 0.8 <= 0.9 -> dropped
    assert list(zip(w.tolist(), l.tolist())) == [(3, 5)]
    w, l = build_pairs(scores, groups, "all_pairs")
    # every ordered pair inside a group with a positive gap (ties give none), row-major order
    assert list(zip(w.tolist(), l.tolist())) == [(1, 0), (1, 2), (2, 0), (3, 5), (4, 5)]
    w, l = build_pairs(scores, groups, "all_pairs", margin=0.35)  # gaps: 0.8, 0.4, 0.4, 1.0, 1.0
    assert list(zip(w.tolist(), l.tolist())) == [(1, 0), (1, 2), (2, 0), (3, 5), (4, 5)]
    w, l = build_pairs(scores, groups, "all_pairs", margin=0.5)
    assert list(zip(w.tolist(), l.tolist())) == [(1, 0), (3, 5), (4, 5)]
    w, l = build_pairs(scores, groups, "all_pairs", max_pairs=2)  # two largest gaps (1.0, 1.0), in order
    assert list(zip(w.tolist(), l.tolist())) == [(3, 5), (4, 5)]
    w, l = build_pairs(torch.ones(4), torch.tensor([0, 0, 1, 1]), "best_worst")  # all equal: no pairs
    assert len(w) == 0 and len(l) == 0
    with pytest.raises(ValueError, match="pairing"):
        build_pairs(scores, groups, "random")


def test_training_points_by_hand():
    x0, eps = torch.full((2, 1, 1, 1), 2.0), torch.full((2, 1, 1, 1), -1.0)
    xt = noise_latents(x0, torch.tensor([0.25, 1.0]), eps)
    assert xt.flatten().tolist() == [0.75 * 2.0 - 0.25, -1.0]
    # target velocity eps - x0 = -3: v = -1 -> error 4
    assert flow_matching_mse(torch.full((2, 1, 1, 1), -1.0), x0, eps).tolist() == [4.0, 4.0]
    g = torch.Generator().manual_seed(0)
    u = torch.rand(5, generator=g)
    s = sample_sigmas(5, "uniform", shift=3.0, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(s, 3 * u / (1 + 2 * u))
    with pytest.raises(ValueError, match="logit_normal"):
        sample_sigmas(2, "cosine")


# ---------------------------------------------------------------------------------------- recipe


def test_log2_at_init_offline(tmp_path, tiny_sd3_path, pairs_file):
    """LoRA B starts at 0, so the policy equals the reference (adapters off): zero margin, loss log 2. The policy
    forward runs under autograd, the reference's without: equal up to float32 rounding, so the margin is ~0, not
    exactly 0 (so implicit_acc, which counts exact ties as wrong, is checked on the pure loss instead:
    tests/core/test_losses.py::test_dpo_policy_equals_reference_is_log2)."""
    cfg = _cfg(tmp_path / "run", tiny_sd3_path, ["train.max_steps=1", "algo.mode=offline",
                                                 f"data.preference_file={pairs_file}"])
    train(cfg)
    row = metrics_rows(tmp_path / "run")[0]
    for key in ("policy/reward_margin", "kl/ref_proxy", "reward/mean", "reward/std"):  # offline reward = margin
        assert_close_across_paths(row[key], 0.0, what=f"{key}: policy and reference forwards")
    assert row["policy/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert row["cost/transformer_evals"] == 4 * 2 * 2  # 4 pairs x (chosen, rejected) x (policy, ref)


def test_log2_at_init_full_finetuning(tmp_path, tiny_sd3_path):
    cfg = _cfg(tmp_path / "run", tiny_sd3_path, ["train.max_steps=1", "model.lora.rank=0"])
    train(cfg)
    row = metrics_rows(tmp_path / "run")[0]
    assert_close_across_paths(row["policy/reward_margin"], 0.0, what="policy and reference forwards")
    assert row["policy/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert row["rollout/pairs"] == row["train/pairs"] > 0
    for key in ("reward/mean", "reward/std", "reward/jpeg_compressibility", "time/step_s", "rollout/pair_gap"):
        assert key in row


@pytest.mark.parametrize("mode", ["online", "offline"])
def test_metric_names(tmp_path, tiny_sd3_path, pairs_file, mode, check_metric_names):
    out = tmp_path / mode
    train(_cfg(out, tiny_sd3_path, ["train.max_steps=1", f"algo.mode={mode}", f"data.preference_file={pairs_file}",
                                    f"data.eval_prompts={PROMPTS}", "log.eval_every=1", "log.eval_max_prompts=2"]))
    keys = check_metric_names(metrics_rows(out))
    for key in ("policy/loss", "policy/implicit_acc", "kl/ref_proxy", "policy/lr", "train/pairs", "eval/reward/mean"):
        assert key in keys, key
    assert ("rollout/pairs" in keys) == (mode == "online") and ("eval/policy/implicit_acc" in keys) == (mode != "online")


@pytest.mark.parametrize("path", sorted(glob.glob(str(REPO / "configs" / "diffusion" / "dpo_*.yaml"))))
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.algorithm == "dpo" and cfg.algo.mode in ("offline", "online")


def test_published_hyperparameters():
    """SalesforceAIResearch/DiffusionDPO: beta_dpo 5000, lr 1e-8 x batch 2048, warm-up 500, 2000 steps."""
    cfg = load_config(REPO / "configs" / "diffusion" / "dpo_sd35_pickapic.yaml")
    assert (cfg.algo.beta, cfg.data.pairs_per_step, cfg.train.max_steps, cfg.optim.warmup_steps) == (5000.0, 2048, 2000, 500)
    assert cfg.optim.lr == pytest.approx(1e-8 * 2048)


def test_bad_config_errors(tmp_path, tiny_sd3_path):
    with pytest.raises(ValueError, match="preference_file"):
        train(_cfg(tmp_path / "a", tiny_sd3_path, ["algo.mode=offline"]))
    with pytest.raises(ValueError, match="algo.mode"):
        train(_cfg(tmp_path / "b", tiny_sd3_path, ["algo.mode=replay"]))
    with pytest.raises(FileNotFoundError):
        train(_cfg(tmp_path / "c", tiny_sd3_path, ["algo.mode=offline", f"data.preference_file={tmp_path}/none.jsonl"]))


@pytest.mark.parametrize("mode", ["online", "offline"])
def test_resume_equals_uninterrupted_run(tmp_path, tiny_sd3_path, pairs_file, mode):
    extra = ["algo.mode=" + mode, f"data.preference_file={pairs_file}", "train.save_every=2", "log.eval_every=2",
             "log.eval_max_prompts=4"]
    train(_cfg(tmp_path / "full", tiny_sd3_path, ["train.max_steps=4"] + extra))
    train(_cfg(tmp_path / "half", tiny_sd3_path, ["train.max_steps=2"] + extra))
    train(_cfg(tmp_path / "half", tiny_sd3_path, ["train.max_steps=4"] + extra))
    a, b = metrics_rows(tmp_path / "full"), metrics_rows(tmp_path / "half")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert_same_path([without_time(r) for r in a], [without_time(r) for r in b], why=RESUMED_RUN)
    if mode == "offline":
        # the latents encoded before the interruption were read back, not encoded again
        cache = LatentCache(tmp_path / "half" / "latent_cache", 64, 64)
        assert cache.loaded_from_disk >= b[-1]["diag/latents_cached"] > 0


def test_latent_cache_reuse(tmp_path, tiny_sd3, pairs_file):
    from mmrl.pipelines.data import load_preference_pairs

    pairs = load_preference_pairs(pairs_file)
    refs = [pairs[0].chosen, pairs[1].rejected]
    cache = LatentCache(tmp_path / "c", 64, 64)
    z = cache.get(tiny_sd3, refs)
    assert z.shape == (2, 4, 16, 16) and cache.encoded == 2
    assert torch.equal(cache.get(tiny_sd3, refs[::-1]), z.flip(0)) and cache.encoded == 2  # no re-encoding
    again = LatentCache(tmp_path / "c", 64, 64)
    assert again.loaded_from_disk == 2 and torch.equal(again.get(tiny_sd3, refs), z) and again.encoded == 0
    other_size = LatentCache(tmp_path / "c", 32, 32)  # a new size is a new key
    assert other_size.get(tiny_sd3, refs[:1]).shape == (1, 4, 8, 8) and other_size.encoded == 1
    off = LatentCache(tmp_path / "off", 64, 64, enabled=False)
    assert torch.equal(off.get(tiny_sd3, refs), z) and not (tmp_path / "off").exists()


# ---------------------------------------------------------------------------------------- learning


@pytest.mark.slow
def test_offline_dpo_raises_implicit_accuracy(tmp_path, tiny_sd3_path):
    """Chosen = the shape in the prompt's colour, rejected = a wrong colour: the policy learns to prefer it."""
    torch.set_num_threads(1)
    model = SHAPES_MODEL if (SHAPES_MODEL / "model_index.json").is_file() else tiny_sd3_path
    pairs = make_shapes_preference_file(tmp_path / "pairs", n_pairs=16, seed=0)
    cfg = load_config(REPO / "configs" / "diffusion" / "dpo_tiny_offline.yaml",
                      [f"output_dir={tmp_path / 'run'}", f"model.path={model}", f"data.preference_file={pairs}",
                       "train.max_steps=40", "log.eval_every=20", "log.eval_max_prompts=16", "train.resume=never",
                       "train.save_every=0"])
    train(cfg)
    evals = [r["eval/policy/implicit_acc"] for r in metrics_rows(tmp_path / "run") if "eval/policy/implicit_acc" in r]
    print("offline DPO eval implicit accuracy (16 pairs x 4 fixed draws):", evals)
    assert evals[-1] > 0.5


@pytest.mark.slow
def test_online_dpo_tiny_raises_reward(tmp_path):
    torch.set_num_threads(1)
    cfg = load_config(REPO / "configs" / "diffusion" / "dpo_tiny_online.yaml",
                      [f"output_dir={tmp_path / 'run'}", f"model.path={SHAPES_MODEL}",
                       f"data.train_prompts={PROMPTS}", f"data.eval_prompts={EVAL_PROMPTS}",
                       "train.max_steps=30", "log.sample_every=0",
                       "train.resume=never"])
    summary = train(cfg)
    print("dpo_tiny_online first-5 vs last-5 mean reward:", summary["reward_first5"], summary["reward_last5"])
    assert summary["reward_last5"] > summary["reward_first5"]


def test_evaluation_does_not_change_training(tmp_path, tiny_sd3_path, pairs_file):
    """Offline evaluation draws its noise from its own generator: the training metrics are identical."""
    extra = ["algo.mode=offline", f"data.preference_file={pairs_file}", "train.max_steps=3", "log.eval_max_prompts=6"]
    train(_cfg(tmp_path / "a", tiny_sd3_path, extra + ["log.eval_every=1"]))
    train(_cfg(tmp_path / "b", tiny_sd3_path, extra + ["log.eval_every=0"]))
    a, b = metrics_rows(tmp_path / "a"), metrics_rows(tmp_path / "b")
    assert all("eval/policy/implicit_acc" in r for r in a) and not any("eval/policy/implicit_acc" in r for r in b)
    drop = lambda r: {k: v for k, v in without_time(r).items()  # noqa: E731
                      if not k.startswith(("eval/", "perf/")) and k not in ("diag/latents_cached", "cost/transformer_evals")}
    assert_same_path([drop(r) for r in a], [drop(r) for r in b],
                     why="evaluation draws from its own generator and changes no training tensor")


# ---------------------------------------------------------------------------------------- several processes


def test_latent_cache_shards_of_several_ranks(tmp_path, tiny_sd3, pairs_file):
    """Ranks share one cache directory with their own shard series; a later run (any world size) loads all."""
    from mmrl.pipelines.data import load_preference_pairs

    pairs = load_preference_pairs(pairs_file)
    caches = [LatentCache(tmp_path / "c", 64, 64, shard_suffix=f"_r{r}") for r in range(2)]
    a = caches[0].get(tiny_sd3, [pairs[0].chosen, pairs[1].chosen])
    b = caches[1].get(tiny_sd3, [pairs[2].chosen])  # both write their first shard: distinct files
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["shard_000000_r0.pt", "shard_000000_r1.pt"]
    one = LatentCache(tmp_path / "c", 64, 64)  # e.g. a 1-process resume
    assert one.loaded_from_disk == 3
    assert_same_path(one.get(tiny_sd3, [pairs[0].chosen, pairs[1].chosen, pairs[2].chosen]), torch.cat([a, b]),
                     why="latents read back from the shards the ranks wrote")
    assert one.encoded == 0
    one.get(tiny_sd3, [pairs[3].chosen])  # its next shard follows every loaded one: no file is overwritten
    assert (tmp_path / "c" / "shard_000002.pt").is_file() and len(list((tmp_path / "c").iterdir())) == 3


@pytest.mark.slow
def test_torchrun_online_two_processes_then_resume_with_one(tmp_path):
    import subprocess
    import sys

    if not (SHAPES_MODEL / "model_index.json").is_file():
        pytest.skip("assets/tiny_sd3_shapes not built")
    out = tmp_path / "ddp"
    args = ["configs/diffusion/dpo_tiny_online.yaml", f"output_dir={out}", f"model.path={SHAPES_MODEL}",
            "train.save_every=1", "rollout.prompts_per_step=2", "rollout.group_size=3", "rollout.num_steps=3",
            "update.micro_batch_size=2", "log.sample_every=1", "log.eval_every=0", "dist.backend=gloo"]
    env = child_env()
    bad = run_torchrun(["-m", "mmrl.cli", "train", *args, "rollout.prompts_per_step=3", "dist.strategy=ddp"], cwd=REPO,
                       env=env)
    assert bad.returncode != 0
    assert "rollout.prompts_per_step=3 (global, over all processes) must be divisible by the number of processes (2)" in bad.stderr
    two = run_torchrun(["-m", "mmrl.cli", "train", *args, "train.max_steps=2", "dist.strategy=ddp"], cwd=REPO, env=env)
    assert two.returncode == 0, f"torchrun failed:\n{two.stdout[-2000:]}\n{two.stderr[-5000:]}"
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2]  # rank 0 alone logs
    for r in rows:  # all_pairs inside each of the 2 global groups of 3 images: at most 3 pairs per group
        assert 0 < r["rollout/pairs"] == r["train/pairs"] <= 6 and math.isfinite(r["policy/loss"])
    assert rows[0]["policy/implicit_acc"] == 0.0 and rows[0]["policy/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert sorted(os.listdir(out / "checkpoints")) == ["step_1", "step_2"]
    assert (out / "samples" / "step_000001.png").is_file()
    one = subprocess.run([sys.executable, "-m", "mmrl.cli", "train", *args, "train.max_steps=3"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, f"resume failed:\n{one.stdout[-2000:]}\n{one.stderr[-5000:]}"
    assert "resumed from" in one.stdout and "step_2 (step 2)" in one.stdout
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["cost/transformer_evals"] > rows[1]["cost/transformer_evals"] > rows[0]["cost/transformer_evals"]
    assert (out / "checkpoints" / "step_3" / "COMPLETE").is_file()


# One optimizer update of `dpo_update`, 2 ranks (this file run as a script, torch.multiprocessing.spawn) vs one
# process on all pairs. The recipe draws a noise level and noise per micro-batch; the test fixes the level and
# makes the noise a function of the pair (seeded by its chosen latent), so both set-ups train on the same points.
N_PAIRS = 4
SPLITS = {"even": (2, 2), "idle": (4, 0)}  # pairs of rank 0 / rank 1; "idle": rank 1 runs zero-weight micro-steps


def _pair_noise(x):
    rows = []
    for row in x:
        g = torch.Generator().manual_seed(int(row.double().abs().sum().item() * 1e6) % (2**31))
        rows.append(torch.randn(row.shape, generator=g, dtype=row.dtype))
    return torch.stack(rows)


def _one_dpo_update(model_path, split, ctx):
    import mmrl.diffusion.dpo_update as dpo_mod
    from mmrl.diffusion.common import build_policy_states
    from mmrl.diffusion.loop import TrainingParts
    from mmrl.diffusion.models import load_flow_model
    from mmrl.runtime import seed_everything

    cfg = _cfg("/tmp/unused", model_path, update={"micro_batch_size": 2}, optim={"lr": 1e-3})
    model = load_flow_model(model_path)
    seed_everything(0)  # identical LoRA init everywhere
    states = build_policy_states(model, cfg.model, old=False, ref=True)
    params = states.trainable_parameters()
    model.transformer = ctx.wrap_model(states.model, "ddp")
    # plain SGD, lr 1: the weight change is the (clipped) gradient itself, so the comparison checks the gradient
    # (Adam's first step, lr * g / (|g| + eps), would hide gradient differences)
    opt = torch.optim.SGD(params, lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    g = torch.Generator().manual_seed(3)
    x_w, x_l = torch.randn(N_PAIRS, 4, 16, 16, generator=g), torch.randn(N_PAIRS, 4, 16, 16, generator=g)  # 64 px
    prompts = [x.strip() for x in open(PROMPTS).read().splitlines()[:N_PAIRS]]
    embeds = model.encode_prompts(prompts)
    sizes = SPLITS[split] if ctx.enabled else (N_PAIRS,)
    lo = sum(sizes[:ctx.rank])
    rows = torch.arange(lo, lo + sizes[ctx.rank])
    pad = (x_w[:1], x_l[:1], embeds.select([0]))
    names = {id(p): n for n, p in states.model.named_parameters()}
    before = {names[id(p)]: p.detach().clone() for p in params}
    randn_like, sigmas = torch.randn_like, dpo_mod.sample_sigmas
    torch.randn_like, dpo_mod.sample_sigmas = _pair_noise, lambda n, *a, **k: torch.full((n,), 0.6)
    try:
        m = dpo_mod.dpo_update(TrainingParts(cfg, ctx, model, states, opt, sched, params), 0, x_w[rows], x_l[rows],
                               embeds.select(rows), 1.0, pad)
    finally:
        torch.randn_like, dpo_mod.sample_sigmas = randn_like, sigmas
    after = {names[id(p)]: p.detach().clone() for p in params}
    return {"params": after, "moved": max((after[k] - v).abs().max().item() for k, v in before.items()),
            "metrics": m}


def _dpo_equality_worker(ctx, model_path, out_dir):
    res = {name: _one_dpo_update(model_path, name, ctx) for name in SPLITS}
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
    one = _one_dpo_update(tiny_sd3_path, "even", DistContext())
    assert one["moved"] > 1e-4 and one["metrics"]["train/pairs"] == N_PAIRS
    for name in SPLITS:
        r0, r1 = ranks[0][name], ranks[1][name]
        assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in r0["params"])  # same weights everywhere
        diff = max((r0["params"][k] - v).abs().max().item() for k, v in one["params"].items())
        print(f"[{name}] max |LoRA param diff| 2 ranks vs 1 process: {diff:.2e} (update {one['moved']:.2e})")
        assert diff < 1e-6
        for key in ("train/pairs", "policy/loss", "policy/implicit_acc", "policy/reward_margin", "policy/model_mse",
                    "policy/reward_margin_std", "policy/grad_norm"):
            assert r0["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7), key


# ---------------------------------------------------------------------------------------- non-finite rewards


def test_online_nan_reward_error_or_pairs_without_it(tmp_path, tiny_sd3_path, monkeypatch):
    """`_test_nan_at_1` (conftest): image 1 of each batch has a NaN reward: an error by default; with drop_sample it
    is in no pair (its group keeps its 2 other images) and training goes on."""
    import mmrl.diffusion.dpo as dpo_mod
    from mmrl.run.files import NonFiniteError

    reward = {"components": {"_test_nan_at_1": 1.0}}
    with pytest.raises(NonFiniteError, match=r"reward component '_test_nan_at_1' .* for sample 1 of 6"):
        train(_cfg(tmp_path / "err", tiny_sd3_path, ["train.max_steps=1"], reward=reward))
    seen, real = [], dpo_mod.build_pairs

    def spy(scores, gids, *args):  # the rewards the pairs are built from
        seen.append((scores, gids))
        return real(scores, gids, *args)

    monkeypatch.setattr(dpo_mod, "build_pairs", spy)
    train(_cfg(tmp_path / "drop", tiny_sd3_path, ["train.max_steps=1", "reward.on_nonfinite=drop_sample"],
               reward=reward))
    (scores, gids), = seen
    assert len(scores) == 5 and bool(torch.isfinite(scores).all()) and gids.tolist() == [0, 0, 1, 1, 1]
    (row,) = metrics_rows(tmp_path / "drop")
    assert row["reward/nonfinite_samples"] == 1 and row["rollout/pairs"] > 0 and math.isfinite(row["policy/loss"])


if __name__ == "__main__":  # 2 ranks for test_two_ranks_one_update_equals_one_process
    import sys

    spawn_ranks(_dpo_equality_worker, sys.argv[1], sys.argv[2])
