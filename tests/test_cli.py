import subprocess
import sys
import types
from dataclasses import dataclass, field

import pytest

from mmrl import cli
from mmrl import config as C
from mmrl.config import RunConfig, TrainConfig


@dataclass
class ToyTrain(TrainConfig):
    lr: float = 0.1
    """Learning rate."""


@dataclass
class ToyConfig(RunConfig):
    train: ToyTrain = field(default_factory=ToyTrain)
    """Train section."""


@pytest.fixture
def toy(monkeypatch, tmp_path):
    calls = []
    mod = types.ModuleType("mmrl_toy_cli")
    mod.Config = ToyConfig

    def train(cfg):
        calls.append(cfg)
        return {"lr": cfg.train.lr}

    mod.train = train
    monkeypatch.setitem(sys.modules, "mmrl_toy_cli", mod)
    monkeypatch.setitem(C.RECIPES, "toy", "mmrl_toy_cli")
    p = tmp_path / "toy.yaml"
    p.write_text(f"algorithm: toy\noutput_dir: {tmp_path / 'run'}\n")
    return p, calls


def test_train_dispatch_with_overrides(toy, capsys):
    path, calls = toy
    assert cli.main(["train", str(path), "train.lr=0.25", "train.max_steps=2"]) == 0
    assert calls[0].train.lr == 0.25 and calls[0].train.max_steps == 2
    assert '"lr": 0.25' in capsys.readouterr().out


def test_misspelled_key_is_a_clean_error(toy, capsys):
    path, calls = toy
    path.write_text("algorithm: toy\ntrain:\n  lrr: 1\n")
    assert cli.main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'train.lrr'" in err and "valid keys" in err and "Traceback" not in err
    assert not calls


def test_config_dump_and_check(toy, capsys, tmp_path):
    path, _ = toy
    assert cli.main(["config", "check", str(path), "seed=3"]) == 0
    assert "seed: 3" in capsys.readouterr().out
    # dump: commented YAML of a real recipe's defaults that loads back to the same config
    assert cli.main(["config", "dump", "toy"]) == 0
    dumped = capsys.readouterr().out
    assert "# Learning rate.\n  lr: 0.1\n" in dumped and "algorithm: toy" in dumped
    (tmp_path / "dumped.yaml").write_text(dumped)
    assert C.load_config(tmp_path / "dumped.yaml") == C.default_config("toy")


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "mmrl.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "train" in out.stdout and "config" in out.stdout


def test_tiny_into_a_file_is_a_clean_error(tmp_path, capsys):
    f = tmp_path / "not_a_dir.txt"
    f.write_text("x")
    assert cli.main(["tiny", str(f)]) == 2
    err = capsys.readouterr().err
    assert "exists and is not a directory" in err and "Traceback" not in err
