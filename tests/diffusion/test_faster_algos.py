"""The faster-training options in the recipes: MixGRPO in flow_grpo (progressive window, DPM-Solver++ after it,
compressed schedule; exact resume), training at a lower resolution than evaluation, and evaluation that leaves
training bit-identical (it never draws from the training RNG)."""

from pathlib import Path

import pytest

from mmrl.config import load_config, recipe_module
from mmrl.testing import RESUMED_RUN, assert_same_path, metrics_rows, without_time

REPO = Path(__file__).resolve().parents[2]
PROMPTS = str(REPO / "assets" / "prompts" / "shapes_train.txt")
EVAL_PROMPTS = str(REPO / "assets" / "prompts" / "shapes_eval.txt")

COMMON = {
    "seed": 3, "device": "cpu",
    "data": {"train_prompts": PROMPTS},
    "rollout": {"prompts_per_step": 2, "height": 32, "width": 32, "num_steps": 4, "group_size": 3,
                "guidance_scale": 1.0, "eval_num_steps": 2, "eval_guidance_scale": 1.0},
    "train": {"max_steps": 3, "save_every": 0},
    "optim": {"lr": 1e-3},
    "reward": {"components": {"jpeg_compressibility": 1.0}},
    "log": {"sample_every": 0},
}
RECIPE = {
    "flow_grpo": {"update": {"micro_batch_size": 4, "mini_batch_size": 3}, "algo": {"kl": {"coef": 0.01}}},
    "dgpo": {"update": {"micro_batch_size": 3}, "algo": {"num_train_timesteps": 2, "trunc_steps": 2}},
    "nft": {"update": {"micro_batch_size": 4}},
    "awm": {"update": {"micro_batch_size": 4}, "algo": {"num_train_timesteps": 2}},
}
MIXGRPO = {"window_size": 2, "window_range": [0, 3], "window_schedule": "progressive", "window_move_every": 1,
           "window_move_by": 1}


def _cfg(algorithm, out, model_path, overrides=(), **sections):
    d = {"algorithm": algorithm, "output_dir": str(out), "model": {"path": str(model_path), "lora": {"rank": 4,
                                                                                                       "alpha": 8}}}
    for part in (COMMON, RECIPE[algorithm], sections):
        for k, v in part.items():
            d[k] = {**d[k], **v} if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    return load_config(d, list(overrides))


def test_mixgrpo_window_moves_and_flash_compresses(tmp_path, tiny_sd3_path):
    """Window positions 0, 1, 2 of [0, 3) one step each; DPM-Solver++ after the window on a compressed schedule: 4 - 1
    = 3 points left at window [0, 2) x 0.5 -> 2 points (3 steps in all); at [2, 3) the window ends 1 point before
    sigma 0 (2 points kept: 4 steps, no compression)."""
    cfg = _cfg("flow_grpo", tmp_path / "run", tiny_sd3_path, ["train.max_steps=4"],
               rollout={**MIXGRPO, "ode_solver": "dpm2", "ode_compress": 0.5})
    summary = recipe_module("flow_grpo").train(cfg)
    rows = metrics_rows(tmp_path / "run")
    assert [r["rollout/window_start"] for r in rows] == [0, 1, 2, 0]
    assert [r["rollout/num_steps"] for r in rows] == [3, 4, 4, 3]
    assert all(r["diag/logprob_drift"] < 1e-4 for r in rows) and summary["max_logprob_drift"] < 1e-4
    # 6 images: rollout (3 steps) + 2 window steps x 6 samples x (policy + reference) = 18 + 24 at step 1
    assert rows[0]["cost/transformer_evals"] == 6 * 3 + 2 * 6 * 2


def test_mixgrpo_config_errors(tmp_path, tiny_sd3_path):
    with pytest.raises(ValueError, match="need an SDE window"):
        _cfg("flow_grpo", tmp_path / "a", tiny_sd3_path, rollout={"window_schedule": "progressive"})
    with pytest.raises(ValueError, match="need an SDE window"):
        _cfg("flow_grpo", tmp_path / "b", tiny_sd3_path, rollout={"ode_compress": 0.4})
    with pytest.raises(ValueError, match="ode_compress in"):
        _cfg("flow_grpo", tmp_path / "c", tiny_sd3_path, rollout={**MIXGRPO, "ode_compress": 0.0})
    with pytest.raises(ValueError, match="ode_solver"):
        _cfg("flow_grpo", tmp_path / "d", tiny_sd3_path, rollout={"ode_solver": "heun"})


def test_mixgrpo_resume_equals_uninterrupted_run(tmp_path, tiny_sd3_path):
    kw = dict(rollout={**MIXGRPO, "window_move_every": 2, "ode_solver": "dpm2", "ode_compress": 0.5},
              train={"save_every": 2})
    mod = recipe_module("flow_grpo")
    mod.train(_cfg("flow_grpo", tmp_path / "full", tiny_sd3_path, ["train.max_steps=5"], **kw))
    mod.train(_cfg("flow_grpo", tmp_path / "half", tiny_sd3_path, ["train.max_steps=2"], **kw))
    mod.train(_cfg("flow_grpo", tmp_path / "half", tiny_sd3_path, ["train.max_steps=5"], **kw))
    a, b = metrics_rows(tmp_path / "full"), metrics_rows(tmp_path / "half")
    assert [r["rollout/window_start"] for r in b] == [0, 0, 1, 1, 2]
    assert_same_path([without_time(r) for r in a], [without_time(r) for r in b], why=RESUMED_RUN)


@pytest.mark.parametrize("algorithm", ["flow_grpo", "dgpo"])
def test_lower_training_resolution_than_evaluation(tmp_path, tiny_sd3_path, algorithm):
    cfg = _cfg(algorithm, tmp_path / "run", tiny_sd3_path, ["train.max_steps=1", "log.eval_every=1",
                                                             "log.num_samples=2", "log.eval_max_prompts=2"],
               data={"eval_prompts": EVAL_PROMPTS}, rollout={"eval_height": 64, "eval_width": 48})
    assert cfg.rollout.eval_hw == (64, 48) and (cfg.rollout.height, cfg.rollout.width) == (32, 32)
    recipe_module(algorithm).train(cfg)
    from PIL import Image

    # plots.image_grid: 2 images of 64 x 48 scaled x2 side by side, 128 high (+ wrapped captions below); 32 x 32
    # ones would be 256 wide
    w, h = Image.open(tmp_path / "run" / "samples" / "eval_step_000001.png").size
    assert w == 2 * 96 and h > 128
    assert metrics_rows(tmp_path / "run")[0]["eval/reward/mean"] is not None


@pytest.mark.parametrize("algorithm", ["flow_grpo", "dgpo", "nft", "awm"])
def test_evaluation_leaves_training_bit_identical(tmp_path, tiny_sd3_path, algorithm):
    """The same run with an evaluation after every step and with none: every training metric and the final weights
    are identical (the evaluation's noise has its own generator and the global RNG is forked around it)."""
    runs = {}
    for name, every in (("eval", 1), ("noeval", 0)):
        cfg = _cfg(algorithm, tmp_path / name, tiny_sd3_path, [f"log.eval_every={every}", "log.eval_max_prompts=3",
                                                                 "train.save_every=3"],
                   data={"eval_prompts": EVAL_PROMPTS})
        recipe_module(algorithm).train(cfg)
        # (cost/transformer_evals and perf/tflops_per_step count the evaluation's forwards too)
        runs[name] = [{k: v for k, v in without_time(r).items() if not k.startswith(("eval/", "cost/", "perf/"))}
                      for r in metrics_rows(tmp_path / name)]
    assert "eval/reward/mean" in metrics_rows(tmp_path / "eval")[0]
    assert_same_path(runs["eval"], runs["noeval"], why="evaluating or not, same code path for training")
    from safetensors.torch import load_file

    fa = load_file(str(tmp_path / "eval/checkpoints/step_3/adapters/default/adapter_model.safetensors"))
    fb = load_file(str(tmp_path / "noeval/checkpoints/step_3/adapters/default/adapter_model.safetensors"))
    assert_same_path(fa, fb, why="evaluating or not, same code path for training")
