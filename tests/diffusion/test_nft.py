"""DiffusionNFT recipe: EMA schedules by hand, v = v_old symmetry, configs, exact resume, reward rise."""

import glob
import json
import math
import os
from pathlib import Path

import pytest
import torch

from mmrl.config import ConfigError, load_config
from mmrl.core.losses import nft_loss
from mmrl.diffusion.nft import EMA_SCHEDULES, Config, ema_decay, train

REPO = Path(__file__).resolve().parents[2]
PROMPTS = str(REPO / "assets" / "prompts" / "shapes_train.txt")
EVAL_PROMPTS = str(REPO / "assets" / "prompts" / "shapes_eval.txt")
SHAPES_MODEL = Path(os.environ.get("MMRL_SHAPES_MODEL", REPO / "assets" / "tiny_sd3_shapes"))  # data-trained tiny SD3


def _cfg(out, model_path, overrides=(), **sections) -> Config:
    d = {
        "algorithm": "nft", "output_dir": str(out), "seed": 5, "device": "cpu",
        "model": {"path": str(model_path), "lora_rank": 4, "lora_alpha": 8},
        "data": {"train_prompts": PROMPTS, "prompts_per_step": 2},
        "sample": {"height": 64, "width": 64, "num_steps": 3, "group_size": 3, "eval_num_steps": 2},
        "nft": {"guidance_beta": 0.5, "ema_schedule": "linear", "timestep_fraction": 0.7},
        "train": {"max_steps": 2, "save_every": 0, "micro_batch_size": 4, "updates_per_step": 2, "kl_beta": 0.1,
                  "lr": 1e-3},
        "reward": {"components": {"jpeg_compressibility": 1.0}},
        "log": {"sample_every": 0},
    }
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return load_config(d, list(overrides))


def _rows(out):
    return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _no_time(row):
    return {k: v for k, v in row.items() if not k.startswith("time/")}


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
    # v = v_old: v+ = v- = v_old, so both x0 losses are the same number (and r does not matter)
    g = torch.Generator().manual_seed(0)
    v = torch.randn(3, 4, 2, 2, generator=g)
    x0, xt = torch.randn(3, 4, 2, 2, generator=g), torch.randn(3, 4, 2, 2, generator=g)
    t = torch.tensor([0.2, 0.5, 0.9])
    for beta in (0.1, 1.0):
        _, m = nft_loss(v.clone(), v.clone(), x0, xt, t, torch.tensor([0.0, 0.5, 1.0]), beta)
        assert m["pos_loss"] == m["neg_loss"] and m["old_deviate"] == 0.0


def test_recipe_first_step_has_v_equal_v_old(tmp_path, tiny_sd3_path):
    """Before the first optimizer update "old" == "default" (copied at init): pos and neg losses are equal."""
    cfg = _cfg(tmp_path / "run", tiny_sd3_path, ["train.max_steps=1", "train.updates_per_step=1"])
    train(cfg)
    row = _rows(tmp_path / "run")[0]
    assert row["nft/pos_loss"] == row["nft/neg_loss"]
    assert row["nft/old_deviate"] == 0.0
    assert row["nft/old_decay"] == pytest.approx(0.001)  # 1 update done -> min(0.001 * 1, 0.5)
    assert row["train/updates"] == 1
    # 6 images x 3 ODE steps (rollout) + 6 images x 2 timesteps x 3 passes (policy, old, ref)
    assert row["cost/transformer_evals"] == 6 * 3 + 6 * 2 * 3
    for key in ("reward/mean", "reward/std", "time/step_s", "nft/kl", "nft/loss"):
        assert key in row and math.isfinite(row[key])


# ---------------------------------------------------------------------------------------- configs, errors


@pytest.mark.parametrize("path", sorted(glob.glob(str(REPO / "configs" / "diffusion" / "nft_*.yaml"))))
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.algorithm == "nft" and cfg.sample.group_size >= 2
    ema_decay(cfg.nft.ema_schedule, 0)


def test_published_hyperparameters():
    """NVlabs/DiffusionNFT config/nft.py: sd3_pickscore / sd3_ocr (+ base.py)."""
    pick = load_config(REPO / "configs" / "diffusion" / "nft_sd35_pickscore.yaml")
    assert (pick.nft.guidance_beta, pick.nft.ema_schedule, pick.train.kl_beta) == (1.0, "linear", 1e-4)
    assert (pick.sample.num_steps, pick.sample.group_size, pick.data.prompts_per_step) == (10, 24, 48)
    assert (pick.sample.guidance_scale, pick.train.lr, pick.train.adv_clip_max) == (1.0, 3e-4, 5.0)
    assert (pick.model.lora_rank, pick.model.lora_alpha, pick.train.updates_per_step) == (32, 64, 1)
    ocr = load_config(REPO / "configs" / "diffusion" / "nft_sd35_ocr.yaml")
    assert (ocr.nft.guidance_beta, ocr.nft.ema_schedule, ocr.train.updates_per_step) == (0.1, "delayed_linear", 2)


def test_bad_config_errors(tmp_path, tiny_sd3_path):
    with pytest.raises(ValueError, match="ema_schedule"):
        train(_cfg(tmp_path / "a", tiny_sd3_path, ["nft.ema_schedule=cosine"]))
    with pytest.raises(ValueError, match="guidance_beta"):
        train(_cfg(tmp_path / "b", tiny_sd3_path, ["nft.guidance_beta=0"]))
    with pytest.raises(ConfigError, match="kl_beta"):  # the KL weight lives in train:, not nft:
        _cfg(tmp_path / "c", tiny_sd3_path, ["nft.kl_beta=0.1"])


# ---------------------------------------------------------------------------------------- resume, EMA


def test_resume_equals_uninterrupted_run(tmp_path, tiny_sd3_path):
    full = _cfg(tmp_path / "full", tiny_sd3_path, ["train.max_steps=4", "train.save_every=2"])
    train(full)
    half = _cfg(tmp_path / "half", tiny_sd3_path, ["train.max_steps=2", "train.save_every=2"])
    train(half)
    resumed = _cfg(tmp_path / "half", tiny_sd3_path, ["train.max_steps=4", "train.save_every=2"])
    train(resumed)
    a, b = _rows(tmp_path / "full"), _rows(tmp_path / "half")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [_no_time(r) for r in a] == [_no_time(r) for r in b]
    # the old adapter (EMA state) and the default adapter are identical too
    from safetensors.torch import load_file

    for state in ("default", "old"):
        fa = load_file(str(tmp_path / "full/checkpoints/step_4/adapters" / state / "adapter_model.safetensors"))
        fb = load_file(str(tmp_path / "half/checkpoints/step_4/adapters" / state / "adapter_model.safetensors"))
        assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def test_old_follows_the_schedule(tmp_path, tiny_sd3_path):
    """copy: old == default after a step; linear with one update: old = 0.001 old0 + 0.999 new."""
    from safetensors.torch import load_file

    train(_cfg(tmp_path / "copy", tiny_sd3_path, ["train.max_steps=1", "nft.ema_schedule=copy"]))
    ad = tmp_path / "copy/checkpoints/step_1/adapters"
    d, o = (load_file(str(ad / s / "adapter_model.safetensors")) for s in ("default", "old"))
    assert all(torch.equal(d[k], o[k]) for k in d)
    assert any(not torch.equal(d[k], torch.zeros_like(d[k])) for k in d if "lora_B" in k)  # it did train

    train(_cfg(tmp_path / "lin", tiny_sd3_path, ["train.max_steps=1", "train.updates_per_step=1"]))
    ad = tmp_path / "lin/checkpoints/step_1/adapters"
    d, o = (load_file(str(ad / s / "adapter_model.safetensors")) for s in ("default", "old"))
    # lora_B starts at 0 in both states (gaussian init), so old_B = 0.999 * default_B after one update
    for k in d:
        if "lora_B" in k:
            assert torch.allclose(o[k], 0.999 * d[k], atol=1e-7, rtol=1e-6)


def test_full_finetuning_runs(tmp_path, tiny_sd3_path):
    train(_cfg(tmp_path / "full", tiny_sd3_path, ["train.max_steps=1", "model.lora=false",
                                                   "train.updates_per_step=1"]))
    assert _rows(tmp_path / "full")[0]["nft/pos_loss"] == _rows(tmp_path / "full")[0]["nft/neg_loss"]


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
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert all("eval/reward/mean" in r for r in a) and not any("eval/reward/mean" in r for r in b)
    drop = lambda r: {k: v for k, v in _no_time(r).items()  # noqa: E731
                      if not k.startswith("eval/") and k != "cost/transformer_evals"}
    assert [drop(r) for r in a] == [drop(r) for r in b]
