"""Experiment trackers: TensorBoard event files and W&B offline runs receive the config, every metrics row and the
sample images with their captions; jsonl stays on; a resumed run continues the same W&B run."""

import glob
import struct
from dataclasses import dataclass, field

import pytest
import torch

from mmrl.config import ConfigError, RunConfig, TrainConfig, from_dict
from mmrl.run.directory import Run
from mmrl.training import TrackersConfig


@dataclass
class _Cfg(RunConfig):
    log: TrackersConfig = field(default_factory=TrackersConfig)


def _cfg(tmp_path, trackers):
    return _Cfg(algorithm="toy", output_dir=str(tmp_path / "run"), train=TrainConfig(),
                log=TrackersConfig(trackers=trackers))


def _wandb_records(run_dir):
    """(history rows, config keys) of the W&B offline run files under run_dir (LevelDB-style log of protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    history, config = [], set()
    for f in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        data, pos, cur, block = open(f, "rb").read(), 7, b"", 32768
        while pos + 7 <= len(data):
            left = block - pos % block
            if left < 7:
                pos += left
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if length == 0 and kind == 0:
                pos += left
                continue
            payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            cur = payload if kind in (1, 2) else cur + payload
            if kind in (1, 4):
                rec = pb.Record()
                rec.ParseFromString(cur)
                which = rec.WhichOneof("record_type")
                if which == "history":
                    history.append({(i.key or "/".join(i.nested_key)): i.value_json for i in rec.history.item})
                elif which == "config":
                    config |= {i.key for i in rec.config.update}
                elif which == "run":  # wandb.init(config=...) travels with the run record
                    config |= {i.key for i in rec.run.config.update}
    return history, config


def test_tensorboard_and_wandb_get_metrics_images_and_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = Run(_cfg(tmp_path, ["jsonl", "tensorboard", "wandb"]))
    for step in (1, 2, 3):
        run.log(step, {"reward/mean": float(step), "reward/std": 0.5, "diag/x": float("nan")})
    run.save_samples(2, torch.rand(2, 3, 8, 8), ["r=0.5 a red circle", "r=0.4 a blue square"])
    run.save_samples(3, torch.rand(2, 3, 8, 8), ["r=0.1 a red circle", "r=0.9 a blue square"])
    run.finish()
    assert [r["reward/mean"] for r in run.read_metrics()] == [1.0, 2.0, 3.0]  # jsonl is always on
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run.dir / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert "diag/x" not in acc.Tags()["scalars"]  # a null (non-finite) value is not a point
    # one grid per step under one tag (not one tag per sample), the same grid the run directory holds
    assert acc.Tags()["images"] == ["samples/rollout"]
    grids = acc.Images("samples/rollout")
    assert [g.step for g in grids] == [2, 3]
    import io

    from PIL import Image
    saved = Image.open(run.samples_dir / "step_000003.png")
    assert Image.open(io.BytesIO(grids[-1].encoded_image_string)).size == saved.size
    assert "config/text_summary" in acc.Tags()["tensors"] and "samples/rollout/text_summary" in acc.Tags()["tensors"]
    history, config = _wandb_records(run.dir)
    assert [h["reward/mean"] for h in history if "reward/mean" in h] == ["1", "2", "3"]
    assert any('"r=0.1 a red circle"' in h.get("samples/rollout/captions", "") for h in history)
    assert {"algorithm", "train", "log"} <= config


def test_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = Run(_cfg(tmp_path, ["wandb"]))
    run.log(1, {"reward/mean": 1.0})
    with run.checkpoint(1) as d:
        run.save_state(d, x=torch.zeros(1))
    run.finish()
    first_id = (run.dir / "wandb_id.txt").read_text()
    again = Run(_cfg(tmp_path, ["wandb"]))
    again.log(2, {"reward/mean": 2.0})
    again.finish()
    assert (run.dir / "wandb_id.txt").read_text() == first_id
    runs = glob.glob(str(run.dir / "wandb" / "offline-run-*"))
    assert runs and all(first_id.strip() in r.rsplit("/", 1)[-1] for r in runs)  # one W&B run id for both
    history, _ = _wandb_records(run.dir)
    assert sorted(h["reward/mean"] for h in history if "reward/mean" in h) == ["1", "2"]


def test_unknown_tracker_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"expected one of \['jsonl', 'tensorboard', 'wandb'\], got 'mlflow'"):
        from_dict(_Cfg, {"algorithm": "toy", "log": {"trackers": ["mlflow"]}})
    assert Run(_cfg(tmp_path, ["jsonl"])).trackers == []
