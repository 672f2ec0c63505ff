import random

import numpy as np
import pytest
import torch

from mmrl.config import ConfigError, RunConfig, TrainConfig
from mmrl.run.directory import Run
from mmrl.run.files import RunError, checkpoint_step, list_checkpoints, verify_checkpoint
from mmrl.run.plots import save_image_grid
from mmrl.run.resume import config_changes, is_frozen_on_resume
from mmrl.runtime import Timer, get_rng_state, resolve_device, resolve_dtype, set_rng_state


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
    # a bad resume path is refused when the run starts, before anything loads
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        Run(run.cfg)
    # a stale temp dir from a killed run is cleaned on the next start
    run.cfg.train.resume = "auto"
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
    fresh = Run(make_cfg(tmp_path, keep_last=2, resume="never", overwrite=True))
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


# ---------------------------------------------------------------------------------------------- resume safety


def _two_checkpoints(tmp_path, **train):
    run = Run(make_cfg(tmp_path, **train))
    for step in (1, 2):
        run.log(step, {"reward/mean": float(step)})
        with run.checkpoint(step) as d:
            run.save_state(d, step=step, x=torch.tensor([float(step)]))
    return run


def test_resume_never_into_a_used_run_dir_is_refused_unless_overwrite(tmp_path):
    run = _two_checkpoints(tmp_path)
    with pytest.raises(RunError, match=r"train.resume=never would discard 2 checkpoint\(s\) \(step_1, step_2\) "
                                       r"and 2 row\(s\) of metrics.jsonl .*train.overwrite=true"):
        Run(make_cfg(tmp_path, resume="never"))
    assert [s for s, _ in list_checkpoints(run.ckpt_dir)] == [1, 2] and len(run.read_metrics()) == 2  # nothing lost
    fresh = Run(make_cfg(tmp_path, resume="never", overwrite=True))
    assert list_checkpoints(fresh.ckpt_dir) == [] and fresh.read_metrics() == []
    # an empty run dir (or one without checkpoints and metrics) needs no overwrite
    Run(make_cfg(tmp_path, resume="never"))


def test_resume_from_an_older_checkpoint_is_refused_unless_overwrite(tmp_path):
    run = _two_checkpoints(tmp_path)
    older = str(run.ckpt_dir / "step_1")
    with pytest.raises(RunError, match=r"would discard the later checkpoint\(s\) step_2"):
        Run(make_cfg(tmp_path, resume=older))
    assert (run.ckpt_dir / "step_2").is_dir()
    again = Run(make_cfg(tmp_path, resume=older, overwrite=True))
    assert again.find_resume().name == "step_1" and not (run.ckpt_dir / "step_2").exists()


def test_resume_reports_changed_config_and_refuses_frozen_keys(tmp_path, capsys):
    run = _two_checkpoints(tmp_path, max_steps=4)
    saved = (run.dir / "config.yaml").read_text()
    assert (run.ckpt_dir / "step_2" / "config.yaml").read_text() == saved  # each checkpoint keeps its config
    capsys.readouterr()
    resumed = Run(make_cfg(tmp_path, max_steps=8))
    err = capsys.readouterr().err
    assert "train.max_steps: 4 -> 8" in err and "resuming" in err
    # config.yaml is replaced only once the resumed run has logged (the resume worked)
    assert (run.dir / "config.yaml").read_text() == saved
    resumed.log(3, {"reward/mean": 3.0})
    assert "max_steps: 8" in (run.dir / "config.yaml").read_text()
    # keys that cannot change mid-run: refused, and the run's config.yaml is left as it is
    before = (run.dir / "config.yaml").read_text()
    cfg = make_cfg(tmp_path, max_steps=8)
    cfg.seed = 7
    with pytest.raises(ConfigError, match=r"cannot resume .*step_2 with a changed seed: 0 -> 7"):
        Run(cfg)
    cfg = make_cfg(tmp_path, max_steps=8)
    cfg.algorithm = "other"
    with pytest.raises(ConfigError, match=r"changed algorithm: 'toy' -> 'other'"):
        Run(cfg)
    assert (run.dir / "config.yaml").read_text() == before


def test_frozen_key_rules():
    assert is_frozen_on_resume("model.lora_rank") and is_frozen_on_resume("algorithm")
    assert is_frozen_on_resume("data.train_prompts") and not is_frozen_on_resume("data.prompts_per_step")
    assert not is_frozen_on_resume("model.gradient_checkpointing") and not is_frozen_on_resume("train.lr")
    assert config_changes({"a": {"b": 1, "c": [1]}, "gone": 1}, {"a": {"b": 2, "c": [1]}, "new": 3}) == [("a.b", 1, 2)]


def test_corrupt_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    run = _two_checkpoints(tmp_path)
    state = run.ckpt_dir / "step_2" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])  # truncated
    with pytest.warns(RuntimeWarning, match=r"step_2/state.pt has 100 bytes, \d+ were written"):
        resumed = Run(make_cfg(tmp_path))
    assert resumed.find_resume().name == "step_1"
    assert resumed.load_state(resumed.find_resume())["step"] == 1
    # an explicit path is an error naming the file, never a silent fallback
    with pytest.raises(RunError, match=r"train.resume=.*step_2: checkpoint .* is corrupt: .*state.pt has 100 bytes"):
        Run(make_cfg(tmp_path, resume=str(run.ckpt_dir / "step_2"), overwrite=True))
    # same size, changed content: caught by the crc
    s1 = run.ckpt_dir / "step_1" / "state.pt"
    data = bytearray(s1.read_bytes())
    data[-30] ^= 0xFF
    s1.write_bytes(bytes(data))
    with pytest.raises(RunError, match="crc32 mismatch"):
        verify_checkpoint(run.ckpt_dir / "step_1")


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # would create the marker file when unpickled


def test_state_files_load_with_weights_only(tmp_path):
    run = _two_checkpoints(tmp_path)
    state = run.load_state(run.ckpt_dir / "step_2")
    assert state["x"].item() == 2.0
    # numpy arrays of the RNG state are allowed: a full RNG state round-trips
    d = tmp_path / "rng"
    d.mkdir()
    Run.save_state(d, rng=get_rng_state())
    set_rng_state(Run.load_state(d)["rng"])
    # a foreign state.pt that would run code is refused, and the code does not run
    marker = tmp_path / "pwned"
    torch.save({"evil": _RunsCode(str(marker))}, d / "state.pt")
    with pytest.raises(RunError, match=r"state.pt was refused for safety: it holds io.open, which "
                                       r"torch.load\(weights_only=True\) does not load .*nothing of it ran"):
        Run.load_state(d)
    assert not marker.exists()
    (d / "state.pt").write_bytes(b"not a zip file at all")
    with pytest.raises(RunError, match=r"state.pt is corrupt or truncated"):
        Run.load_state(d)


@pytest.mark.parametrize("failure", ["oserror", "torch_runtime"])
def test_disk_full_while_writing_a_checkpoint(tmp_path, monkeypatch, failure):
    import errno

    import mmrl.run.files as checkpoint_files

    run = _two_checkpoints(tmp_path, keep_last=5)
    with pytest.raises(RunError, match=r"no space left on the device of .*checkpoints while writing checkpoint step_3 "
                                       r".*newest complete checkpoint is .*step_2: free space, then rerun to resume"):
        with run.checkpoint(3) as d:
            (d / "half.bin").write_bytes(b"x" * 10)
            if failure == "oserror":
                raise OSError(errno.ENOSPC, "No space left on device")
            monkeypatch.setattr(checkpoint_files, "_free_bytes", lambda path: 0)  # torch.save's message does not say ENOSPC
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert not (run.ckpt_dir / "step_3").exists() and not list(run.ckpt_dir.glob(".tmp-*"))
    assert [s for s, _ in list_checkpoints(run.ckpt_dir)] == [1, 2]
    # an ordinary error is not mistaken for a full disk
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="^boom$"):
        with run.checkpoint(3):
            raise RuntimeError("boom")


def test_disk_full_on_a_real_full_file_system(tmp_path):
    """A 256 KiB tmpfs filled by a real checkpoint write (needs root to mount; CI and the dev machines run as root)."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        cfg = RunConfig(algorithm="toy", output_dir=str(mnt / "run"), train=TrainConfig())
        run = Run(cfg)
        with pytest.raises(RunError, match=r"no space left on the device .* step_1 .*no complete checkpoint exists yet"):
            with run.checkpoint(1) as d:
                run.save_state(d, big=torch.zeros(200_000))
        assert list_checkpoints(run.ckpt_dir) == [] and not list(run.ckpt_dir.glob(".tmp-*"))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
