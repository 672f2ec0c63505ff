import random

import numpy as np
import pytest
import torch

from mmrl.config import RunConfig, TrainConfig
from mmrl.runtime import (
    Run, Timer, checkpoint_step, get_rng_state, list_checkpoints, resolve_device, resolve_dtype,
    save_image_grid, set_rng_state,
)


def make_cfg(tmp_path, **train):
    return RunConfig(algorithm="toy", output_dir=str(tmp_path / "run"), train=TrainConfig(**train))


def test_device_dtype():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type in ("cpu", "cuda")
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        resolve_dtype("float8")
    with pytest.raises(ValueError, match="device: unknown device 'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def test_rng_state_round_trip():
    state = get_rng_state()
    a = (random.random(), np.random.rand(), torch.rand(3))
    set_rng_state(state)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_run_dir_metrics_and_truncate(tmp_path):
    run = Run(make_cfg(tmp_path))
    assert (run.dir / "config.yaml").is_file() and run.samples_dir.is_dir() and run.plots_dir.is_dir()
    for s in range(1, 6):
        run.log(s, {"reward/mean": float(s), "reward/std": 0.5, "t": torch.tensor(2.0)})
    rows = run.read_metrics()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[0]["t"] == 2.0
    run.truncate_metrics(3)
    assert [r["step"] for r in run.read_metrics()] == [1, 2, 3]
    summary = run.finish()
    assert (run.plots_dir / "reward_curve.png").is_file()
    assert summary["reward_first"] == pytest.approx(2.0) and summary["steps_logged"] == 3


def test_checkpoint_atomic_resume_and_prune(tmp_path):
    run = Run(make_cfg(tmp_path, keep_last=2))
    assert run.find_resume() is None
    for step in (1, 2, 3):
        with run.checkpoint(step) as d:
            run.save_state(d, step=step, opt={"x": torch.tensor([float(step)])})
    assert [s for s, _ in list_checkpoints(run.ckpt_dir)] == [2, 3]  # pruned to keep_last
    # a failure while writing leaves nothing behind and does not hide the error
    with pytest.raises(RuntimeError, match="boom"):
        with run.checkpoint(4) as d:
            (d / "partial.bin").write_bytes(b"x")
            raise RuntimeError("boom")
    assert not (run.ckpt_dir / "step_4").exists() and not list(run.ckpt_dir.glob(".tmp-*"))
    # a directory without the COMPLETE marker (killed mid-write) is ignored by auto-resume
    (run.ckpt_dir / "step_9").mkdir()
    latest = run.find_resume()
    assert latest.name == "step_3" and checkpoint_step(latest) == 3
    assert run.load_state(latest)["opt"]["x"].item() == 3.0
    with pytest.raises(FileNotFoundError, match="incomplete"):
        checkpoint_step(run.ckpt_dir / "step_9")
    # explicit path and never
    run.cfg.train.resume = str(run.ckpt_dir / "step_2")
    assert run.find_resume().name == "step_2"
    run.cfg.train.resume = "never"
    assert run.find_resume() is None
    run.cfg.train.resume = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        run.find_resume()
    # a stale temp dir from a killed run is cleaned on the next start
    (run.ckpt_dir / ".tmp-step_5-123").mkdir()
    Run(run.cfg)
    assert not list(run.ckpt_dir.glob(".tmp-*"))


def test_image_grid_and_timer(tmp_path):
    imgs = torch.rand(5, 3, 16, 16)
    p = save_image_grid(imgs, [f"p{i} r=0.1" for i in range(5)], tmp_path / "g.png")
    from PIL import Image

    im = Image.open(p)
    assert im.size[0] == 5 * 128  # 16px cells scaled up to 128
    t = Timer()
    with t("a"):
        sum(range(1000))
    with t("a"):
        pass
    out = t.pop()
    assert set(out) == {"time/a_s"} and out["time/a_s"] >= 0 and t.pop() == {}


@pytest.mark.parametrize("key", ["max_steps", "save_every", "keep_last"])
def test_negative_train_counts_are_rejected(tmp_path, key):
    with pytest.raises(ValueError, match=f"train.{key} must be >= 0, got -1"):
        Run(make_cfg(tmp_path, **{key: -1}))


def test_output_dir_that_is_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(ValueError, match="output_dir: .*run' exists and is not a directory"):
        Run(make_cfg(tmp_path))


def test_fresh_run_in_an_old_directory_keeps_its_own_checkpoints(tmp_path):
    """A restart with resume=never must not lose its new checkpoint to pruning, nor auto-resume into the
    abandoned run's later steps."""
    old = Run(make_cfg(tmp_path, keep_last=2))
    for step in (50, 100):
        with old.checkpoint(step) as d:
            old.save_state(d, step=step)
    fresh = Run(make_cfg(tmp_path, keep_last=2, resume="never"))
    with fresh.checkpoint(10) as d:
        fresh.save_state(d, step=10)
    assert [s for s, _ in list_checkpoints(fresh.ckpt_dir)] == [10]
    fresh.cfg.train.resume = "auto"
    assert fresh.find_resume().name == "step_10" and fresh.load_state(fresh.find_resume())["step"] == 10


def test_image_grid_bad_input(tmp_path):
    with pytest.raises(ValueError, match="2 images but 1 captions"):
        save_image_grid(torch.rand(2, 3, 4, 4), ["a"], tmp_path / "g.png")
    with pytest.raises(ValueError, match=r"expected images \[N, 3 or 1, H, W\]"):
        save_image_grid(torch.rand(2, 2, 4, 4), None, tmp_path / "g.png")
    p = save_image_grid(torch.rand(2, 1, 4, 4), None, tmp_path / "gray.png")  # grey images are expanded
    assert p.is_file()
